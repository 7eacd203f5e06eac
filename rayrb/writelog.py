"""Where online writes go: slots, write counts and write identities. No Ray here.

The online side is ``k`` circular shards; shard ``s`` holds ``capacity_s`` rows at
global indices ``offset_s + [0, capacity_s)``, with ``offset_s`` the sum of the
capacities before it. Its ``w``-th row ever written goes to slot
``w mod capacity_s``, so a shard's cursor is never stored: it is ``written_s mod
capacity_s``, and its size is ``min(written_s, capacity_s)``.

A write of ``n`` rows is cut into contiguous pieces (:func:`rayrb.allocation.write_pieces`),
the largest pieces going to the least-written shards (:func:`rayrb.allocation.assign_pieces`),
so fill levels stay balanced. :meth:`WriteLog.plan` computes a write's pieces,
slots and global indices without changing anything; :meth:`WriteLog.commit`
applies it once the shards hold the rows.

A write may carry an identity. A write whose identity was committed before is
not applied again: :meth:`WriteLog.seen` returns the indices it got (and the
receipt the caller kept with them, such as the shards' acknowledgements), so a
caller that retries after a timeout writes its rows once. A write whose pieces
did not all land (a shard failed, or the coordinator died between sending its
pieces) is finished by :meth:`WriteLog.resume`: the pieces the shards hold stay
where they are, and only the others are sent, so no row lands twice.

Examples:
    >>> log = WriteLog([3, 2])
    >>> plan = log.plan([4])  # one piece of 4 rows, to the least-written shard
    >>> [(w.shard, w.slots.tolist()) for w in plan], log.indices(plan).tolist()
    ([(0, [0, 1, 2, 0])], [0, 1, 2, 0])
    >>> log.commit(plan, write_id="w1")
    >>> log.written.tolist(), log.sizes.tolist(), log.seen("w1")[0].tolist()
    ([4, 0], [3, 0], [0, 1, 2, 0])
    >>> [(w.shard, log.indices([w]).tolist()) for w in log.plan([2])]  # shard 1 is behind: it gets the rows
    [(1, [3, 4])]
"""
from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Collection, Hashable, Sequence

import numpy as np

from rayrb.allocation import assign_pieces, split_evenly, write_pieces


def slots(first: int, n: int, capacity: int) -> np.ndarray:
    """Slots of the ``first``-th to ``first + n - 1``-th rows ever written to a circular shard."""
    return (int(first) + np.arange(n, dtype=np.int64)) % int(capacity)


@dataclass(frozen=True)
class Write:
    """Rows ``[start, stop)`` of one write, going to ``shard`` at ``slots`` (its ``first``-th row on)."""

    shard: int
    start: int
    stop: int
    first: int
    slots: np.ndarray

    @property
    def rows(self) -> int:
        return self.stop - self.start


class WriteLog:
    """The coordinator's record of online writes: per-shard write counts and recent write identities."""

    def __init__(self, capacities: Sequence[int], remember: int = 4096):
        self.capacity = np.asarray(capacities, dtype=np.int64)
        if self.capacity.ndim != 1 or np.any(self.capacity <= 0):
            raise ValueError(f"expected positive shard capacities, got {list(capacities)!r}")
        self.offsets = np.concatenate([[0], np.cumsum(self.capacity)[:-1]]).astype(np.int64)
        self.written = np.zeros(self.capacity.size, dtype=np.int64)
        self._ids: OrderedDict[Hashable, tuple[np.ndarray, Any, list[Write]]] = OrderedDict()
        self._remember = int(remember)

    @property
    def sizes(self) -> np.ndarray:
        return np.minimum(self.written, self.capacity)

    def cut(self, n: int, min_piece: int = 1024) -> list[int]:
        """Piece sizes for a write of ``n`` rows: :func:`~rayrb.allocation.write_pieces`, in more pieces
        where one would overflow the smallest shard while the buffer as a whole has room.

        A write larger than the whole buffer is cut so that the newest rows are the ones kept
        (a shard keeps the tail of its piece): the first piece carries the rows evicted at once.

        >>> WriteLog([100] * 4).cut(300), WriteLog([100] * 4).cut(50), WriteLog([10_000] * 4).cut(4096)
        ([100, 100, 100], [50], [1024, 1024, 1024, 1024])
        >>> WriteLog([25, 25]).cut(70)
        [45, 25]
        """
        total = int(self.capacity.sum())
        if n > total:
            return [n - total + int(self.capacity[0]), *map(int, self.capacity[1:])]
        pieces = len(write_pieces(n, self.capacity.size, min_piece))
        smallest = int(self.capacity.min())
        while pieces < self.capacity.size and -(-n // pieces) > smallest:
            pieces += 1
        return split_evenly(n, pieces).tolist()

    @property
    def slack(self) -> int:
        """How far (rows) a shard on the writer's node may run ahead of the others: an eighth of the smallest."""
        return int(self.capacity.min()) // 8

    def plan(self, piece_rows: Sequence[int], local: Collection[int] = ()) -> list[Write]:
        """Where each piece of a write goes, preferring the shards in ``local`` within :attr:`slack`;
        changes nothing."""
        if len(piece_rows) > self.capacity.size:
            raise ValueError(f"expected at most {self.capacity.size} pieces, one per online shard, "
                             f"got {len(piece_rows)}")
        if any(int(r) <= 0 for r in piece_rows):
            raise ValueError(f"expected positive piece sizes, got {list(piece_rows)!r}")
        out, start = [], 0
        for rows, shard in zip(piece_rows, assign_pieces(piece_rows, self.written, local, self.slack)):
            first = int(self.written[shard])
            out.append(Write(shard, start, start + int(rows), first, slots(first, int(rows), self.capacity[shard])))
            start += int(rows)
        return out

    def indices(self, plan: Sequence[Write]) -> np.ndarray:
        """Global online indices of a planned write's rows, in the write's order."""
        if not plan:
            return np.empty(0, np.int64)
        return np.concatenate([self.offsets[w.shard] + w.slots for w in plan])

    def commit(self, plan: Sequence[Write], write_id: Hashable | None = None, receipt: Any = None) -> None:
        for w in plan:
            if self.written[w.shard] != w.first:
                raise RuntimeError(f"write to online shard {w.shard} planned at row {w.first}, but the shard "
                                   f"is at row {int(self.written[w.shard])}")
        for w in plan:
            self.written[w.shard] += w.rows
        if write_id is not None:
            self.remember(write_id, plan, receipt)

    def rebuild(self, pieces: Sequence[Sequence[int]]) -> list[Write]:
        """The plan of a journalled write, from its pieces ``[shard, start, stop, first]``.

        >>> log = WriteLog([3, 2])
        >>> [(w.shard, w.slots.tolist()) for w in log.rebuild([[1, 0, 3, 1]])]
        [(1, [1, 0, 1])]
        """
        return [Write(int(sh), int(a), int(b), int(f), slots(int(f), int(b) - int(a), self.capacity[int(sh)]))
                for sh, a, b, f in pieces]

    def remember(self, write_id: Hashable, plan: Sequence[Write], receipt: Any = None) -> None:
        """Record a write (committed here, or found in a journal), so that a retry of it is not applied again.

        Its pieces that end beyond a shard's write count are not held by that shard: they
        are marked missing, for :meth:`resume`.
        """
        plan = list(plan)
        missing = {i for i, w in enumerate(plan) if w.first + w.rows > self.written[w.shard]}
        self._ids[write_id] = (self.indices(plan), receipt, plan, missing)
        self._ids.move_to_end(write_id)
        while len(self._ids) > self._remember:
            self._ids.popitem(last=False)

    def recall(self, journal: Sequence[tuple[Hashable, Sequence[Sequence[int]]]]) -> None:
        """Remember journalled writes, oldest first, after :meth:`reset` took the shards' counts.

        A piece is missing where its shard's count falls short of it, and also where a later
        write was planned over its rows: the coordinator put that write there because the
        piece had not landed, so a count past those rows holds the later write's rows.

        >>> log = WriteLog([4, 4]); log.reset([2, 3])  # shard 1 holds 3 rows: the second write's, not the first's
        >>> log.recall([("a", [[0, 0, 2, 0], [1, 2, 4, 0]]), ("b", [[1, 0, 3, 0]])])
        >>> [(w.shard, w.first) for w in log.resume("a")[1]]
        [(0, 2)]
        """
        later: dict[int, tuple[list[int], list[int]]] = {}  # per shard: later pieces' rows, disjoint runs
        recalled, ids = [], set()
        for write_id, pieces in reversed(journal):
            if write_id in ids:  # a resumed write is journalled again: its latest line is the one that holds
                continue
            ids.add(write_id)
            plan = self.rebuild(pieces)
            over = {i for i, w in enumerate(plan) if _overlaps(later.get(w.shard), w.first, w.first + w.rows)}
            for w in plan:
                _insert(later.setdefault(w.shard, ([], [])), w.first, w.first + w.rows)
            recalled.append((write_id, plan, over))
        for write_id, plan, over in reversed(recalled):
            self.remember(write_id, plan)
            self._ids[write_id][3].update(over)

    def seen(self, write_id: Hashable | None) -> tuple[np.ndarray, Any] | None:
        """``(indices, receipt)`` of an earlier write with this identity, or None."""
        found = None if write_id is None else self._ids.get(write_id)
        return None if found is None else found[:2]

    def resume(self, write_id: Hashable) -> tuple[list[Write], list[Write]]:
        """Finish an earlier write; return its whole plan and the pieces to send now (committed here).

        The pieces missing (see :meth:`reset`) are sent again to the rows first planned
        for them when those are still their shard's next rows, and planned anew
        otherwise (another write took them since). The pieces the shards hold keep their
        indices, so no row lands twice.

        >>> log = WriteLog([4, 4])
        >>> plan = log.plan([2, 2]); log.commit(plan, "w")
        >>> log.reset([2, 0])  # shard 0 holds its piece, shard 1 never got its own
        >>> whole, send = log.resume("w")
        >>> [(w.shard, w.start, w.first) for w in send], log.indices(whole).tolist()
        ([(1, 2, 0)], [0, 1, 4, 5])
        >>> log.resume("w")[1]  # finished: nothing more to send
        []
        >>> log = WriteLog([4, 4]); log.commit(log.plan([2, 2]), "w"); log.reset([2, 0])
        >>> log.commit(log.plan([3]))  # another write took shard 1's rows since
        >>> whole, send = log.resume("w")
        >>> [(w.shard, w.start, w.first) for w in send], log.indices(whole).tolist()
        ([(0, 2, 2)], [0, 1, 2, 3])
        """
        _, _, plan, missing = self._ids[write_id]
        again = [w for i, w in enumerate(plan) if i in missing and self.written[w.shard] == w.first]
        self.commit(again)
        fresh = [w for i, w in enumerate(plan) if i in missing and not any(w is a for a in again)]
        new = [replace(n, start=f.start, stop=f.stop) for n, f in zip(self.plan([w.rows for w in fresh]), fresh)]
        self.commit(new)
        send = again + new
        whole = sorted([w for i, w in enumerate(plan) if i not in missing] + send, key=lambda w: w.start)
        self.remember(write_id, whole)
        return whole, send

    def reset(self, written: Sequence[int]) -> None:
        """Take the shards' own write counts (after a failure or a restore).

        Rows planned beyond them are free again: a remembered write's pieces there are
        marked missing, so that :meth:`resume` sends them again.
        """
        written = np.asarray(written, dtype=np.int64)
        if written.shape != self.written.shape or np.any(written < 0):
            raise ValueError(f"expected {self.written.size} non-negative write counts, got {written.tolist()}")
        self.written = written.copy()
        for _, _, plan, missing in self._ids.values():
            missing.update(i for i, w in enumerate(plan) if w.first + w.rows > written[w.shard])

    def state_dict(self) -> dict:
        return {"written": self.written.tolist(), "capacity": self.capacity.tolist()}


def _overlaps(runs: tuple[list[int], list[int]] | None, a: int, b: int) -> bool:
    """Whether rows ``[a, b)`` meet one of ``runs`` (sorted disjoint ``[start, end)``, as two lists)."""
    if runs is None:
        return False
    starts, ends = runs
    j = bisect.bisect_left(starts, b) - 1  # the last run that starts before b
    return j >= 0 and ends[j] > a


def _insert(runs: tuple[list[int], list[int]], a: int, b: int) -> None:
    """Add rows ``[a, b)`` to ``runs``, merging the runs it meets."""
    starts, ends = runs
    lo, hi = bisect.bisect_left(ends, a), bisect.bisect_right(starts, b)
    if lo < hi:
        a, b = min(a, starts[lo]), max(b, ends[hi - 1])
    starts[lo:hi], ends[lo:hi] = [a], [b]
