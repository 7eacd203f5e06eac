"""Writes the online shards place themselves: one round trip from the writer to a shard.

With ``write_path="shards"`` (experimental; not with a rate limiter or replicas)
(``BufferSettings.shards_place``), a buffer's online shards place every write themselves, at their own write
count, and the coordinator is off the write's path:

1. **Placement, at the writer.** A write is cut as the coordinator would cut it (``cut_write``: one piece unless
   it would overflow a shard). One piece goes to the least-written shard as this handle knows the counts (the
   answers of its own writes, and of the coordinator to its tells), so fill levels stay balanced within a few
   writes of each other.
2. **One call.** The piece goes straight to its shard (``OnlineShard.append``), which journals ``(write id,
   piece)`` before it stores the rows and moves its count past them (``rayrb.durability.write_ids``), and
   answers the rows' slots and its count. A shard that dies meanwhile is restarted and sent the call again by
   Ray; the journal answers it if the rows counted, else it places them anew: they land once.
3. **The tell.** Acknowledged, the writer tells the coordinator the shard's count (``Coordinator.wrote``), without
   waiting. Its own later calls reach the coordinator after the tell (Ray keeps one caller's calls to an actor in
   order), so its next sample plans over the rows; the answer (the coordinator's version) makes a draw this
   handle planned before it given back (``Loop.before``). Another process's sample sees the rows once the
   coordinator took the tell, which left before ``extend`` returned. A tell that never arrives (a writer killed
   right after) leaves rows in their shard, kept and counted at the next tell or resync.

A write too large for one shard goes to the coordinator, which holds its rows before it sends the pieces to the
shards that place them (``Coordinator.relay``): a writer that dies meanwhile leaves it whole or not at all.

A write under a ``write_id`` the caller gave may be a retry from another handle, which cannot know where the first
attempt went: the shards are asked first which pieces they placed under it (one call more), and those are
answered, not written again. An id this handle made up is retried by this handle alone, which knows its shard.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from rayrb.core.allocation import assign_pieces, cut_write
from rayrb.durability.writelog import slots
from rayrb.errors import WriteIdError

Rows = dict[str, np.ndarray]


class Sent(NamedTuple):
    """A write on its way: its pieces ``(shard, start, ack)``, or the indices a retry was answered with."""

    rows: int
    pieces: list[tuple[int, int, Any]]
    answered: np.ndarray | None = None


class DirectWrites:
    """A handle's writes to shards that place them (see the module)."""

    def __init__(self, rpc: Any):
        self.rpc = rpc
        self._capacity: np.ndarray | None = None  # per online shard
        self._offsets: np.ndarray | None = None
        self._written: np.ndarray | None = None  # each shard's count as this handle knows it
        self._told: Any = None  # the latest tell: its answer is (version, every shard's count)

    def send(self, rows: Rows | Any, n: int, write_id: str, digest: str | None, look: bool) -> Sent:
        """Submit a write of ``n`` rows (inline arrays, or one object-store ref for a large one); ``look``: the
        caller named it, so ask the shards first what they hold of it."""
        self._learn()
        pieces = cut_write(n, self._capacity.tolist())
        if len(pieces) > 1:
            out = self.rpc.get(self.rpc.coord.relay.remote([rows], n, write_id, digest, look))
            return Sent(n, [(shard, start, ack) for shard, _, start, ack in out])
        if look:
            held = self._held(write_id)
            if held:
                return Sent(n, [], self._answer(held, write_id, n, digest))
        shard = assign_pieces([n], self._written)[0]
        self._written[shard] += n  # this handle's next write goes on to the next least-written shard
        ack = self.rpc.by_side["online"][shard].append.remote(rows, write_id, 0, 0, digest)
        return Sent(n, [(shard, 0, ack)])

    def receive(self, sent: Sent) -> np.ndarray:
        """The write's global online indices once every piece's shard acknowledged it; tells the coordinator."""
        if sent.answered is not None:
            return sent.answered
        answers = self.rpc.get([ack for _, _, ack in sent.pieces])
        indices = np.empty(sent.rows, np.int64)
        counts = []
        for (shard, start, _), (pos, written) in zip(sent.pieces, answers):
            indices[start:start + len(pos)] = self._offsets[shard] + np.asarray(pos, np.int64)
            self._written[shard] = max(int(self._written[shard]), int(written))
            counts.append((shard, int(written)))
        self._told = self.rpc.coord.wrote.remote(counts)
        self.rpc.told = self._told
        return indices

    def land(self, rows: Rows | Any, n: int, write_id: str, digest: str | None, look: bool) -> np.ndarray:
        return self.receive(self.send(rows, n, write_id, digest, look))

    def _learn(self) -> None:
        """The shards' capacities once, and their counts: from the coordinator at first, then from the answer
        to the latest tell once it came (never waits for it)."""
        import ray

        if self._capacity is None:
            sizes = self.rpc.get(self.rpc.coord.sizes.remote())
            self._capacity = np.asarray(sizes["online_capacity"], np.int64)
            self._offsets = np.concatenate([[0], np.cumsum(self._capacity)[:-1]]).astype(np.int64)
            self._written = np.asarray(sizes["online_written"], np.int64)
        elif self._told is not None and ray.wait([self._told], timeout=0)[0]:
            told, self._told = self._told, None
            try:
                self._written = np.maximum(self._written, np.asarray(ray.get(told)[1], np.int64))
            except Exception:  # a coordinator that died with the tell: the shards' answers still count
                pass

    def _held(self, write_id: str) -> dict[int, tuple[int, tuple]]:
        """The pieces the shards placed under ``write_id``: piece -> ``(shard, (first, rows, start, digest))``."""
        shards = self.rpc.by_side["online"]
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
        return self._offsets[shard] + slots(first, rows, int(self._capacity[shard]))
