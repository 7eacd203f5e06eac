"""A write where the online shards place writes: from the handle to the rows in a shard, and what happens when
something dies on the way. The write path of every buffer without a rate limiter that bounds samples per insert
(``BufferSettings.shards_place``); the coordinator is off it.

1. **Placement, at the writer.** A write is one piece unless it would overflow a shard (``cut_write``). The piece
   goes to the least-written online shard as this handle knows the counts (the answers of its own writes, and
   the counts map on the coordinator's node, when this process is there), preferring a shard on this node while
   it is at most an eighth of a shard ahead (``assign_pieces``), so fill levels stay balanced.
2. **Appended here, with no call**, when that shard runs on this node and maps its files under ``storage_dir``,
   and the coordinator runs here too: this process takes the shard's write lock and appends the rows to its
   files itself, exactly as the shard would (``rayrb.durability.appends``: journal line, undo record, rows,
   count, published count). Not for a caller-named ``write_id`` (it may have landed in any shard: step 3 asks
   them), prioritized sampling (the shard's sum tree must see the row), rows kept on a GPU, a shard with
   replicas (it sends them the rows), or more than ``UNDO_ROWS`` rows.
3. **Otherwise one call**: the piece goes to its shard (``OnlineShard.append``; rows up to a MiB in the call
   itself, cut in parts under Ray's inline size: ``rayrb.actors.inline``), which appends it the same way and
   answers the slots, its count and whether it (or a replica beside the coordinator) published the count; a shard
   with replicas copies the piece in, then sends it on (over a stream of its own to each live replica) and
   answers once every live replica holds it (``rayrb.actors.replication``). A write under a ``write_id`` the caller named
   asks every shard first which pieces of it they hold (``pieces_of``): those are answered, not written again.
   A write too large for one shard goes to the coordinator, which holds its rows before it sends the pieces to
   the shards (``Coordinator.relay``): a writer that dies meanwhile leaves it whole or not at all.
4. **Seen by every reader.** An append published in the coordinator's counts map (``rayrb.durability.published``)
   is seen by the coordinator's next plan and by every handle on its node before their next batch, without a
   call. An append it could not publish (a shard on another node) is told to the coordinator
   (``Coordinator.wrote``), and ``extend`` returns once it answered. So a sample that starts after ``extend``
   returned, in any process, plans over the rows (contract 2).

**Recovery.** A process killed during a local append leaves an undo record that the next holder of the shard's
write lock puts back (nothing half applied); a shard killed during its append is restarted and sent the call again
by Ray, and its journal answers it if the rows counted, else it places them anew (they land once). A call that
fails for good raises ``BufferUnavailableError`` naming the ``write_id``: retried with it, the write lands once. A
tell lost with the coordinator is not needed: a restarted coordinator takes every shard's count.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Collection
from typing import Any, NamedTuple

import numpy as np

from rayrb.actors.inline import cut
from rayrb.core.allocation import assign_pieces, cut_write
from rayrb.core.episodes import per_step
from rayrb.core.layout import ShardLayout
from rayrb.core.plans import ONLINE
from rayrb.durability.appends import UNDO_ROWS, positions
from rayrb.errors import WriteIdError

Rows = dict[str, np.ndarray]
LOCAL_SAMPLERS = ("uniform", "without_replacement")  # samplers that keep no per-row state in the shard
SLACK = 8  # a shard on this node takes a write while at most capacity / SLACK rows ahead of the least-written
FORWARD_BYTES = 100 << 10  # rows for a shard with replicas put in the object store once, past Ray's inline size
PLACINGS = 4096  # writes whose shard a handle remembers (a write in flight is asked again with its id)


class Sent(NamedTuple):
    """A write on its way: its pieces ``(shard, start, ack)``, or the indices it was answered with."""

    rows: int
    pieces: list[tuple[int, int, Any]]
    answered: np.ndarray | None = None


class DirectWrites:
    """A handle's writes to shards that place them (see the module). ``layout``: the buffer's
    (``rayrb.core.layout.ShardLayout``); ``local``: appends in this process are allowed."""

    def __init__(self, rpc: Any, spec: Any, layout: ShardLayout | None = None, local: bool = True):
        self.rpc, self._spec = rpc, spec
        self._online = layout.online if layout is not None else ()
        self._local = local
        self._capacity: np.ndarray | None = None  # per online shard
        self._offsets: np.ndarray | None = None
        self._written: np.ndarray | None = None  # each shard's count as this handle knows it
        self._nodes: list[str | None] | None = None  # each online shard's node, asked once
        self._here: dict[int, Any] = {}  # online shard -> its files' appender in this process (None: not here)
        self._told: Any = None  # the latest tell: its answer is (version, every shard's count)
        # slices: an episode stays in one shard. Where each write begins and ends an episode (marked as it comes),
        # this handle's running episode (its shard, and its last id, or whether it ended) and the latest choice
        self._episodes = layout.episodes if layout is not None else None
        self._marks: OrderedDict[str, tuple[Any, Any]] = OrderedDict()
        self._running: tuple[int, Any] | None = None
        self._placing: OrderedDict[str, int] = OrderedDict()  # write id -> its shard, chosen once
        # writes by how they went, and rows placed in shards on this node
        self.stats = {"appended_here": 0, "sent": 0, "relayed": 0, "told": 0, "rows_local": 0}

    # 1. placement ----------------------------------------------------------------
    def _choose(self, n: int) -> int:
        """The shard a one-piece write of ``n`` rows goes to (step 1)."""
        return assign_pieces([n], self._known(), self._local_shards(), int(self._capacity.min()) // SLACK)[0]

    def mark(self, write_id: str, rows: Rows) -> None:
        """Note how a write's rows begin and end an episode, as it comes (slices only; see ``_place``)."""
        if self._episodes is None:
            return
        key, ends = self._episodes
        column = per_step(rows[key])
        self._marks[write_id] = (None, bool(column[-1].any())) if ends else (column[0, 0].item(), column[-1, 0].item())
        if len(self._marks) > PLACINGS:  # writes that failed before they were placed are not kept for ever
            self._marks.popitem(last=False)

    def _place(self, write_id: str, n: int) -> int:
        """The shard a one-piece write goes to: with slices, the one this handle's running episode is in when the
        write goes on with it (its first id is the last one written, or no end flag ended the last write), so an
        episode written over several calls stays whole in one shard; else the least written (``_choose``)."""
        if self._episodes is None:
            return self._choose(n)
        if write_id in self._placing:  # asked again (appended here failed; sent later; a retry)
            return self._placing[write_id]
        mark, shard = self._marks.pop(write_id, None), None
        if mark is not None and self._running is not None:
            at, last = self._running
            if (not last) if mark[0] is None else mark[0] == last:
                shard = at
        shard = self._choose(n) if shard is None else shard
        if mark is not None:
            self._running = (shard, mark[1])
        self._placing[write_id] = shard
        if len(self._placing) > PLACINGS:
            self._placing.popitem(last=False)
        return shard

    def _placed(self, shard: int, n: int, written: int | None = None) -> None:
        """``n`` rows went to ``shard``, whose count is ``written`` after, if known: the next write goes on."""
        self._written[shard] = max(int(self._written[shard]) + (n if written is None else 0), int(written or 0))

    def _landed(self, shard: int, n: int) -> None:
        if shard in self._local_shards():
            self.stats["rows_local"] += n

    def _known(self) -> np.ndarray:
        counts = self.rpc.counts_map()
        if counts is not None:
            self._written = np.maximum(self._written, counts.written()[:len(self._written)])
        return self._written

    def _local_shards(self) -> set[int]:
        if self._nodes is None:
            from rayrb.handle.rpc import node_id

            here, m, nodes = node_id(), len(self.rpc.by_side["offline"]), []
            for i in range(len(self._capacity)):
                try:
                    nodes.append(self.rpc.node_of(m + i))
                except Exception:  # restarting: a hint only, asked again by the next handle
                    nodes.append(None)
            # set whole, this node first: another thread writing through this handle reads both once _nodes is set
            self._node, self._nodes = here, nodes
        return {i for i, node in enumerate(self._nodes) if node is not None and node == self._node}

    # 2. appended here ---------------------------------------------------------------
    def here(self, rows: Rows, n: int, write_id: str, digest: str | None, look: bool,
             busy: Collection[int] = ()) -> np.ndarray | None:
        """The write's indices once appended by this process to a shard on its node (step 2), or None where it
        cannot be, or where its shard is in ``busy`` (writes on their way to it land first): the caller sends it
        instead."""
        if look or not self._local or not self._online or n > UNDO_ROWS:
            return None
        self._learn()
        if len(cut_write(n, self._capacity.tolist(), min_piece=int(self._capacity.max()))) > 1:
            return None
        shard = self._place(write_id, n)
        appender = None if shard in busy else self._appender(shard)
        if appender is None:
            return None
        done = appender.append(rows, write_id, 0, 0, digest)
        if done is None:  # the shard's process is gone from this node, or made its files afresh
            self._here.pop(shard, None)
            return None
        self._placed(shard, n, done.written)
        self._landed(shard, n)
        self.stats["appended_here"] += 1
        return self._offsets[shard] + done.slots

    def _appender(self, shard: int) -> Any:
        if shard not in self._here:
            self._here[shard] = self._attach(shard)
        return self._here[shard]

    def _attach(self, shard: int) -> Any:
        """An appender over online shard ``shard``'s files, where step 2 may append to them here, else None."""
        from rayrb.handle.local import ordered_stores

        d = self._online[shard] if shard < len(self._online) else None
        counts = self.rpc.counts_map()
        if (d is None or d.directory is None or d.sampler not in LOCAL_SAMPLERS or d.copies or counts is None
                or shard not in self._local_shards() or not ordered_stores()):
            return None
        return _Here.open(d.directory, self._spec, d.capacity, counts, shard)

    # 3. one call ---------------------------------------------------------------------
    def send(self, rows: Rows | Any, n: int, write_id: str, digest: str | None, look: bool) -> Sent:
        """Submit a write of ``n`` rows (inline arrays, or one object-store ref for a large one); ``look``: the
        caller named it, so ask the shards first what they hold of it."""
        self._learn()
        pieces = cut_write(n, self._capacity.tolist(), min_piece=int(self._capacity.max()))
        if len(pieces) > 1:
            out = self.rpc.get(self.rpc.coord.relay.remote([rows], n, write_id, digest, look))
            self.stats["relayed"] += 1
            return Sent(n, [(shard, start, ack) for shard, _, start, ack in out])
        if look:
            held = self._held(write_id)
            if held:
                return Sent(n, [], self._answer(held, write_id, n, digest))
        shard = self._place(write_id, n)
        self._placed(shard, n)
        actor, parts = self.rpc.by_side[ONLINE][shard], cut(rows) if isinstance(rows, dict) else None
        if parts is not None:  # in the call itself; the shard sends its replicas the same way
            ack = actor.append_parts.remote({"write_id": write_id, "digest": digest}, *parts)
        else:
            more = {}
            if shard < len(self._online) and self._online[shard].copies:
                import ray

                if isinstance(rows, dict) and sum(a.nbytes for a in rows.values()) > FORWARD_BYTES:
                    rows = ray.put(rows)
                if isinstance(rows, ray.ObjectRef):
                    more = {"forward": [rows]}  # each copy fetches the rows itself, not through the primary
            ack = actor.append.remote(rows, write_id, 0, 0, digest, **more)
        self.stats["sent"] += 1
        return Sent(n, [(shard, 0, ack)])

    def receive(self, sent: Sent) -> np.ndarray:
        """The write's global online indices once every piece's shard acknowledged it, and the coordinator took
        the counts no shard could publish (step 4)."""
        if sent.answered is not None:
            return sent.answered
        answers = self.rpc.get([ack for _, _, ack in sent.pieces])
        indices = np.empty(sent.rows, np.int64)
        untold = []
        for (shard, start, _), (pos, written, published) in zip(sent.pieces, answers):
            indices[start:start + len(pos)] = self._offsets[shard] + np.asarray(pos, np.int64)
            self._placed(shard, 0, int(written))
            self._landed(shard, len(pos))
            if not published:
                untold.append((shard, int(written)))
        if untold or self.rpc.counts_map() is None:  # the handle's own loop follows the tell's answer
            told = self.rpc.coord.wrote.remote(untold)
            self.rpc.told = self._told = told
            if untold:
                self.stats["told"] += 1
                try:
                    self.rpc.get(told)
                except Exception:  # the coordinator died with it: its restart takes every shard's count
                    pass
        return indices

    def land(self, rows: Rows | Any, n: int, write_id: str, digest: str | None, look: bool) -> np.ndarray:
        """The write's indices once it is kept and counted: appended here, or sent."""
        if isinstance(rows, dict):
            done = self.here(rows, n, write_id, digest, look)
            if done is not None:
                return done
        return self.receive(self.send(rows, n, write_id, digest, look))

    def online_rows(self) -> int | None:
        """Online rows held, read from the counts map where every online shard publishes there (a handle on the
        coordinator's node, shards there too), as the coordinator's next call counts them; else None (ask it)."""
        counts = self.rpc.counts_map()
        if counts is None:
            return None
        self._learn()
        k = len(self._capacity)
        changes = counts.changes()[:k]  # before the counts: a change seen is a count seen
        if len(changes) < k or not changes.all():  # a shard that never published here: the coordinator knows
            return None
        return int(np.minimum(counts.written()[:k], self._capacity).sum())

    def _learn(self) -> None:
        """The shards' capacities once, and their counts: from the coordinator at first, then from the answer
        to the latest tell once it came (never waits for it)."""
        import ray

        if self._capacity is None:
            sizes = self.rpc.get(self.rpc.coord.sizes.remote())
            capacity = np.asarray(sizes["online_capacity"], np.int64)
            self._offsets = np.concatenate([[0], np.cumsum(capacity)[:-1]]).astype(np.int64)
            self._written = np.asarray(sizes["online_written"], np.int64)
            self._capacity = capacity  # set last: another thread writing through this handle takes all three then
        elif self._told is not None and ray.wait([self._told], timeout=0)[0]:
            told, self._told = self._told, None
            try:
                self._written = np.maximum(self._written, np.asarray(ray.get(told)[1], np.int64))
            except Exception:  # a coordinator that died with the tell: the shards' answers still count
                pass

    def _held(self, write_id: str) -> dict[int, tuple[int, tuple]]:
        """The pieces the shards placed under ``write_id``: piece -> ``(shard, (first, rows, start, digest))``."""
        shards = self.rpc.by_side[ONLINE]
        found = self.rpc.get([s.pieces_of.remote(write_id) for s in shards])
        return {int(p): (shard, tuple(v)) for shard, held in enumerate(found) for p, v in held.items()}

    def _answer(self, held: dict[int, tuple[int, tuple]], write_id: str, n: int, digest: str | None
                ) -> np.ndarray:
        """The indices a retry of a one-piece write is answered with; other rows under its id are refused."""
        shard, (first, rows, start, seen) = held.get(0, (None, (0, 0, 0, None)))
        if set(held) != {0} or rows != n or start != 0 or None not in (seen, digest) and seen != digest:
            raise WriteIdError(f"write_id {write_id!r} was used for another write ({len(held)} pieces, "
                               f"{sum(v[1][1] for v in held.values())} rows), got {n} rows with digest {digest}: "
                               "a retry sends the same rows, other rows take a new id")
        return self._offsets[shard] + positions(first, rows, int(self._capacity[shard]))

    def close(self) -> None:
        for here in self._here.values():
            if here is not None:
                here.close()
        self._here = {}


class _Here:
    """An online shard's files on this node, appended to by this process while the shard's process lives here
    and its files are the ones mapped (both checked under the shard's write lock, before each append)."""

    def __init__(self, layout: str, identity: Any, lease_fd: int, appender: Any):
        self._layout, self._identity, self._lease_fd, self._appender = layout, identity, lease_fd, appender

    @classmethod
    def open(cls, directory: str, spec: Any, capacity: int, counts: Any, shard: int) -> _Here | None:
        """The shard's files in ``directory`` mapped for appending, or None where this node cannot (not its
        files, none yet, another layout): the shard appends."""
        from rayrb.durability.appends import attach
        from rayrb.durability.lease import FILE
        from rayrb.durability.storage import identity, layout_path

        try:
            lease_fd = os.open(os.path.join(directory, FILE), os.O_RDONLY)
        except OSError:
            return None
        known = identity(layout_path(directory))
        try:
            appender = attach(spec, capacity, directory, publish=lambda written: counts.publish(shard, written))
        except OSError:
            appender = None
        if appender is None or known is None:
            os.close(lease_fd)
            return None
        return cls(layout_path(directory), known, lease_fd, appender)

    def append(self, rows: Rows, write_id: str, piece: int, start: int, digest: str | None) -> Any:
        """``Appender.append``, or None where the shard's process is gone or its files were made afresh."""
        from rayrb.durability.lease import held
        from rayrb.durability.storage import identity

        def current() -> bool:
            return held(None, self._lease_fd) and identity(self._layout) == self._identity

        return self._appender.append(rows, write_id, piece, start, digest, check=current)

    def close(self) -> None:
        self._appender.close()
        os.close(self._lease_fd)
