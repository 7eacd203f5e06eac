"""The coordinator's write part: where each write's pieces go, the journal, resumed writes and resyncs.

The writer hands its rows over inline when small, else ``ray.put`` s them and hands the ref over; the
``WriteLog`` picks shards and slots, the piece list is
journalled, and the shards are sent their pieces (by value, or each fetches its own piece from the
ref). The protocol, end to end, is in ``docs/durability.md``.

Rows count for sampling once their shard has acknowledged them: a piece sent and not
yet acknowledged (or failed) holds its shard's count below it, as a hole does. So a
plan never names rows a shard has not applied, and a read the caller submits after
it always finds them, from whichever process it comes.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from rayrb.actors.inline import cut
from rayrb.core.allocation import assign_pieces, cut_write
from rayrb.core.validation import positive_int
from rayrb.durability.writelog import WriteLog
from rayrb.errors import InvalidArgumentError, InvalidStateError


class Writing:
    """Write sequencing over the online shards (``log`` is None when the buffer has none)."""

    def __init__(self, log: WriteLog | None, shards: Sequence[Any], state: Any, metrics: Any,
                 replicated: bool = False):
        self.log, self._shards, self._state, self._metrics = log, list(shards), state, metrics
        self._replicated = replicated  # shards pass the rows' ref on to their replicas
        self._nodes: list[str] | None = None  # each online shard's node, once a writer names its own
        self._unsettled: list[tuple[int, int, Any]] = []  # pieces sent, not acknowledged: (shard, first row, ack)

    def counted(self) -> np.ndarray:
        """Rows each shard counts and has acknowledged: up to its first hole or piece still on its way."""
        if self.log is None:
            return np.zeros(0, np.int64)
        if self._unsettled:
            self._settle()
        counted = self.log.counted
        if self._unsettled:
            counted = counted.copy()
            for shard, first, _ in self._unsettled:
                counted[shard] = min(counted[shard], first)
        return counted

    def sizes(self, counted: np.ndarray | None = None) -> np.ndarray:
        """Rows each shard is sampled from: its ``counted`` rows (asked for unless given), at most its capacity."""
        if self.log is None:
            return np.zeros(0, np.int64)
        return np.minimum(self.counted() if counted is None else counted, self.log.capacity)

    def _settle(self) -> None:
        """Drop the pieces whose acknowledgement came back (never waits); a failed one stays until a resync."""
        import ray

        acks = [a for _, _, a in self._unsettled]
        ready, _ = ray.wait(acks, num_returns=len(acks), timeout=0)
        if not ready:
            return
        done, failed = set(), False
        for ref in ready:
            try:
                ray.get(ref)
                done.add(ref)
            except Exception:
                failed = True
        self._unsettled = [u for u in self._unsettled if u[2] not in done]
        if failed:  # a piece that failed for good is a hole: the shards' counts say what landed behind it
            self.resync()

    def _sent(self, pieces: Sequence[Any], acks: Sequence[Any]) -> None:
        self._unsettled += [(w.shard, w.first, a) for w, a in zip(pieces, acks)]

    def check(self, rows: int, write_id: str | None, digest: str | None = None) -> tuple[int, Any]:
        """``(rows, what an earlier write with this id got)``; raises if this buffer cannot take the write, or if
        ``write_id`` named a write of other rows (``WriteLog.retry_of``)."""
        if self.log is None:
            raise InvalidStateError("this buffer has no online shards")
        rows = positive_int("rows", rows)
        return rows, self.log.retry_of(write_id, rows, digest)

    def write(self, rows_ref: Sequence[Any], rows: int, write_id: str | None, node: str | None,
              digest: str | None = None) -> tuple[np.ndarray, list[Any], list[int]]:
        """Place a new write, journal it and send its pieces: ``(indices, acks, shards written)``."""
        local = self._local_shards(node)
        plan = self.log.place(rows, local)
        acks = self._send(rows_ref, write_id, plan, plan, digest)
        self.log.commit(plan, write_id, acks, digest)
        self._sent(plan, acks)
        self._metrics.count("rows_written", int(rows))
        if local:
            self._metrics.count("rows_written_local", sum(w.rows for w in plan if w.shard in local))
        return self.log.indices(plan), acks, [w.shard for w in plan]

    def resume(self, rows_ref: Sequence[Any], write_id: str, failed: bool
               ) -> tuple[np.ndarray, list[Any], list[int]]:
        """Finish a write whose pieces may not all have landed: send only those the shards lack."""
        if failed:  # the shards' own counts tell which pieces they hold
            self._unsettled = []
            self.log.reset(*self.write_states())
        whole, send = self.log.resume(write_id)
        if not send:
            return self.log.indices(whole), [], []
        acks = self._send(rows_ref, write_id, whole, send, self.log.digest(write_id))
        self.log.remember(write_id, whole, acks)
        self._sent(send, acks)
        self._metrics.count("rows_written", sum(w.rows for w in send))
        self._metrics.count("writes_resumed")
        return self.log.indices(whole), acks, [w.shard for w in send]

    def _send(self, rows_ref: Sequence[Any], write_id: str | None, whole: Sequence[Any], send: Sequence[Any],
              digest: str | None = None) -> list[Any]:
        """Journal a write's ``whole`` plan under ``write_id``, then send the pieces in ``send``; their acks."""
        if self._state is not None and write_id is not None:  # before the shards get it: a restart must know
            self._state.journal(write_id, [(w.shard, w.start, w.stop, w.first) for w in whole], digest)
        # A ref came nested in a list, so it is still unresolved: each shard fetches its piece itself (a shard
        # with replicas is given it nested too, to pass on). Rows sent inline are here already: each shard is
        # sent only its piece, by value (in the call where it fits), for itself and its replicas.
        rows, acks = rows_ref[0], []
        for w in send:
            piece, start, stop = rows, w.start, w.stop
            if isinstance(rows, Mapping):
                piece, start, stop = {k: v[w.start:w.stop] for k, v in rows.items()}, 0, w.stop - w.start
                parts = cut(piece)
                if parts is not None:  # in the call itself (rayrb.actors.inline), and so on to the replicas
                    how = {"start": 0, "stop": stop, "first": w.first, "forward": self._replicated}
                    acks.append(self._shards[w.shard].extend_parts.remote(how, *parts))
                    continue
            more = {"forward": [piece] if isinstance(rows, Mapping) else rows_ref} if self._replicated else {}
            acks.append(self._shards[w.shard].extend.remote(piece, start, stop, first=w.first, **more))
        return acks

    def write_states(self) -> tuple[list[int], list[list[tuple[int, int]]]]:
        """Each online shard's write count, and the rows it holds beyond it (for ``WriteLog.reset``)."""
        import ray

        states = ray.get([s.write_state.remote() for s in self._shards])
        return [c for c, _ in states], [runs for _, runs in states]

    def resync(self) -> None:
        """Take the shards' own write counts (after a failed write, a restore or a restart)."""
        self._nodes = None  # a shard that failed may run elsewhere now
        if self.log is not None:
            self._unsettled = []  # the shards' counts say what landed
            self.log.reset(*self.write_states())

    def recall(self, journal: Any) -> None:
        """After a restart: the shards' counts, then the journalled writes, so a retry is answered once."""
        if self.log is not None:
            self.log.reset(*self.write_states())
            self.log.recall(journal)

    def _local_shards(self, node: str | None) -> Collection[int]:
        """The online shards on ``node`` (asked of the shards once; a restarted shard may have moved: a hint)."""
        if node is None:
            return set()
        if self._nodes is None:
            import ray

            self._nodes = [p["node"] for p in ray.get([s.place.remote() for s in self._shards])]
        return {i for i, n in enumerate(self._nodes) if n == node}

    # writes the shards place (rayrb.handle.direct) ---------------------------------
    def learned(self, counts: Sequence[Sequence[int]]) -> dict[int, int]:
        """Take write counts the shards answered to writes they placed themselves: ``(shard, written)`` pairs,
        the highest winning (an answer may come late); the rows each shard grew by."""
        if self.log is None:
            raise InvalidStateError("this buffer has no online shards")
        grown: dict[int, int] = {}
        for shard, written in counts:
            shard, written = int(shard), int(written)
            if not 0 <= shard < self.log.written.size or written < 0:
                raise InvalidArgumentError(f"expected (shard in [0, {self.log.written.size}), count >= 0) pairs, "
                                           f"got {list(counts)!r}")
            more = written - int(self.log.written[shard])
            if more > 0:
                self.log.written[shard] = written
                grown[shard] = grown.get(shard, 0) + more
        if grown:
            self._metrics.count("rows_written", sum(grown.values()))
        return grown

    def relay(self, rows_ref: Sequence[Any], rows: int, write_id: str, digest: str | None, look: bool
              ) -> list[tuple[int, int, int, Any]]:
        """Send a write too large for one shard to the shards, in the pieces ``cut_write`` gives, each placed by
        the shard it goes to: ``(shard, piece, start, ack)`` per piece. This process holds every piece's rows
        before it sends any, so a writer that dies meanwhile leaves the write whole or not at all.
        ``look``: ask the shards first for pieces they placed under ``write_id`` already (a retry from a handle
        that does not know where they went); those are answered, not sent again."""
        import ray

        pieces = cut_write(positive_int("rows", rows), self.log.capacity.tolist())
        placed: dict[int, tuple[int, Any]] = {}
        if look:
            for shard, held in enumerate(ray.get([s.pieces_of.remote(write_id) for s in self._shards])):
                placed.update({int(p): (shard, v) for p, v in held.items()})
        starts = np.concatenate([[0], np.cumsum(pieces)[:-1]]).tolist()
        todo = [p for p in range(len(pieces)) if p not in placed]
        free = [s for s in range(self.log.written.size) if s not in {shard for shard, _ in placed.values()}]
        chosen = assign_pieces([pieces[p] for p in todo], self.log.written[free]) if todo else []
        data, out = rows_ref[0], []
        if not isinstance(data, Mapping):  # held here before any piece leaves: pieces this process owns
            data = ray.get(data)
        for p, (start, n) in enumerate(zip(starts, pieces)):
            shard = placed[p][0] if p in placed else free[chosen[todo.index(p)]]
            ack = self._shards[shard].append.remote({k: v[start:start + n] for k, v in data.items()},
                                                    write_id, p, start, digest)
            out.append((shard, p, start, ack))
        return out

    def sizes_report(self) -> dict[str, list[int]]:
        log = self.log
        return {"online_written": [] if log is None else log.written.tolist(),
                "online_capacity": [] if log is None else log.capacity.tolist()}


def failed(acks: list[Any]) -> bool:
    """Whether any of these shard acknowledgements has already come back as an error (never waits)."""
    import ray

    ready, _ = ray.wait(list(acks), num_returns=len(acks), timeout=0)
    for ref in ready:
        try:
            ray.get(ref)
        except Exception:
            return True
    return False
