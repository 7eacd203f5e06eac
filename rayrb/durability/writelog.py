"""Where online writes go: slots, write counts and write identities. No Ray here.

The online side is ``k`` circular shards; shard ``s`` holds ``capacity_s`` rows at
global indices ``offset_s + [0, capacity_s)``, with ``offset_s`` the sum of the
capacities before it. Its ``w``-th row ever written goes to slot
``w mod capacity_s``, so a shard's cursor is never stored: it is ``written_s mod
capacity_s``, and its size is ``min(written_s, capacity_s)``.

A write of ``n`` rows is cut into contiguous pieces (``rayrb.core.allocation.cut_write``),
the largest pieces going to the least-written shards (``rayrb.core.allocation.assign_pieces``),
so fill levels stay balanced. ``WriteLog.plan`` computes a write's pieces,
slots and global indices without changing anything; ``WriteLog.commit``
applies it once the shards hold the rows.

A write may carry an identity, and a digest of its rows. A write whose identity was
committed before is not applied again: ``WriteLog.retry_of`` returns the indices it got
(and the receipt the caller kept with them, such as the shards' acknowledgements), so a
caller that retries after a timeout writes its rows once; other rows under a used
identity (another row count, or another digest) are refused (``WriteIdError``), never
answered as if they had landed. A write whose pieces
did not all land (a shard failed, or the coordinator died between sending its
pieces) is finished by ``WriteLog.resume``: the pieces the shards hold stay
where they are, and only the others are sent, so no row lands twice.

A piece that never lands leaves a hole in its shard's write stream; the rows
written after it there are held, but not counted (a shard counts contiguous rows
only: ``rayrb.durability.runs.held_runs``). ``WriteLog.reset`` takes both from the shards: the
log then plans after every row a shard holds, and the next writes fill the holes
first (``WriteLog.place``), so held rows are never planned over and the count
moves on past them. Until then the shard's size counts the rows before its first hole
only (``WriteLog.counted``), as the shard's own does.

Examples:
    >>> log = WriteLog([3, 2])
    >>> plan = log.plan([4])  # one piece of 4 rows, to the least-written shard
    >>> [(w.shard, w.slots.tolist()) for w in plan], log.indices(plan).tolist()
    ([(0, [0, 1, 2, 0])], [0, 1, 2, 0])
    >>> log.commit(plan, write_id="w1")
    >>> log.written.tolist(), log.sizes.tolist(), log.lookup("w1")[0].tolist()
    ([4, 0], [3, 0], [0, 1, 2, 0])
    >>> [(w.shard, log.indices([w]).tolist()) for w in log.plan([2])]  # shard 1 is behind: it gets the rows
    [(1, [3, 4])]
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from rayrb.core.allocation import assign_pieces, cut_write
from rayrb.durability.runs import cut_out, gaps, insert, overlaps
from rayrb.errors import InvalidArgumentError, InvalidStateError, WriteIdError


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


def rebuild(pieces: Sequence[Sequence[int]], capacity: Sequence[int]) -> list[Write]:
    """The plan of a journalled write, from its pieces ``[shard, start, stop, first]``.

    >>> [(w.shard, w.slots.tolist()) for w in rebuild([[1, 0, 3, 1]], [3, 2])]
    [(1, [1, 0, 1])]
    """
    return [Write(int(sh), int(a), int(b), int(f), slots(int(f), int(b) - int(a), capacity[int(sh)]))
            for sh, a, b, f in pieces]


class WriteLog:
    """The coordinator's record of online writes: per-shard write counts and recent write identities."""

    def __init__(self, capacities: Sequence[int], remember: int = 4096):
        self.capacity = np.asarray(capacities, dtype=np.int64)
        if self.capacity.ndim != 1 or np.any(self.capacity <= 0):
            raise InvalidArgumentError(f"expected positive shard capacities, got {list(capacities)!r}")
        self.offsets = np.concatenate([[0], np.cumsum(self.capacity)[:-1]]).astype(np.int64)
        self.written = np.zeros(self.capacity.size, dtype=np.int64)
        # per shard: rows [a, b) below ``written`` that no write holds (pieces that never landed)
        self.holes: list[list[tuple[int, int]]] = [[] for _ in range(self.capacity.size)]
        # write id -> (indices, receipt, plan, pieces missing, digest of its rows or None)
        self._ids: OrderedDict[Hashable, tuple[np.ndarray, Any, list[Write], set[int], str | None]] = OrderedDict()
        self._remember = int(remember)

    @property
    def counted(self) -> np.ndarray:
        """Rows each shard counts: up to its first hole (the rows written behind one are held, not counted)."""
        return np.array([h[0][0] if h else w for w, h in zip(self.written.tolist(), self.holes)], np.int64)

    @property
    def sizes(self) -> np.ndarray:
        """Rows each shard samples from: its counted rows, at most its capacity."""
        return np.minimum(self.counted, self.capacity)

    @property
    def slack(self) -> int:
        """How far (rows) a shard on the writer's node may run ahead of the others: an eighth of the smallest."""
        return int(self.capacity.min()) // 8

    def plan(self, piece_rows: Sequence[int], local: Collection[int] = ()) -> list[Write]:
        """Where each piece of a write goes, preferring the shards in ``local`` within ``slack``;
        changes nothing."""
        if len(piece_rows) > self.capacity.size:
            raise InvalidArgumentError(f"expected at most {self.capacity.size} pieces, one per online shard, "
                                       f"got {len(piece_rows)}")
        if any(int(r) <= 0 for r in piece_rows):
            raise InvalidArgumentError(f"expected positive piece sizes, got {list(piece_rows)!r}")
        out, start = [], 0
        for rows, shard in zip(piece_rows, assign_pieces(piece_rows, self.written, local, self.slack)):
            first = int(self.written[shard])
            out.append(Write(shard, start, start + int(rows), first, slots(first, int(rows), self.capacity[shard])))
            start += int(rows)
        return out

    def place(self, n: int, local: Collection[int] = ()) -> list[Write]:
        """Where a write of ``n`` rows goes: its first rows into holes, the rest ``cut`` and
        ``plan``-ned; changes nothing.

        >>> log = WriteLog([8, 8]); log.commit(log.plan([4, 4])); log.reset([1, 4], [[(3, 4)], []])
        >>> log.holes, log.written.tolist()  # shard 0 holds row 0 and row 3; rows 1-2 never landed
        ([[(1, 3)], []], [4, 4])
        >>> [(w.shard, w.start, w.stop, w.first) for w in log.place(5)]
        [(0, 0, 2, 1), (0, 2, 5, 4)]
        """
        out, start = [], 0
        for shard, holes in enumerate(self.holes):
            for a, b in holes:
                k = min(b - a, n - start)
                if k > 0:
                    out.append(Write(shard, start, start + k, a, slots(a, k, self.capacity[shard])))
                    start += k
        if start < n:
            out += [replace(w, start=w.start + start, stop=w.stop + start)
                    for w in self.plan(cut_write(n - start, self.capacity), local)]
        return out

    def _in_hole(self, w: Write) -> bool:
        return any(a <= w.first and w.first + w.rows <= b for a, b in self.holes[w.shard])

    def indices(self, plan: Sequence[Write]) -> np.ndarray:
        """Global online indices of a planned write's rows, in the write's order."""
        if not plan:
            return np.empty(0, np.int64)
        return np.concatenate([self.offsets[w.shard] + w.slots for w in plan])

    def commit(self, plan: Sequence[Write], write_id: Hashable | None = None, receipt: Any = None,
               digest: str | None = None) -> None:
        for w in plan:
            if self.written[w.shard] != w.first and not self._in_hole(w):
                raise InvalidStateError(f"write to online shard {w.shard} planned at row {w.first}, but the shard "
                                        f"is at row {int(self.written[w.shard])} with holes {self.holes[w.shard]}")
        for w in plan:
            if self._in_hole(w):
                self.holes[w.shard] = cut_out(self.holes[w.shard], w.first, w.first + w.rows)
            else:
                self.written[w.shard] += w.rows
        if write_id is not None:
            self.remember(write_id, plan, receipt, digest)

    def remember(self, write_id: Hashable, plan: Sequence[Write], receipt: Any = None,
                 digest: str | None = None) -> None:
        """Record a write (committed here, or found in a journal), so that a retry of it is not applied again.

        Its pieces that end beyond a shard's write count are not held by that shard: they
        are marked missing, for ``resume``. ``digest`` names its rows (kept from before when not given).
        """
        plan = list(plan)
        missing = {i for i, w in enumerate(plan) if not self._held(w)}
        if digest is None and write_id in self._ids:
            digest = self._ids[write_id][4]
        self._ids[write_id] = (self.indices(plan), receipt, plan, missing, digest)
        self._ids.move_to_end(write_id)
        while len(self._ids) > self._remember:
            self._ids.popitem(last=False)

    def recall(self, journal: Sequence[Sequence[Any]]) -> None:
        """Remember journalled writes ``(write_id, pieces[, digest])``, oldest first, after ``reset`` took the
        shards' counts.

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
        for write_id, pieces, *digest in reversed(journal):
            if write_id in ids:  # a resumed write is journalled again: its latest line is the one that holds
                continue
            ids.add(write_id)
            plan = rebuild(pieces, self.capacity)
            over = {i for i, w in enumerate(plan) if overlaps(later.get(w.shard), w.first, w.first + w.rows)}
            for w in plan:
                insert(later.setdefault(w.shard, ([], [])), w.first, w.first + w.rows)
            recalled.append((write_id, plan, over, digest[0] if digest else None))
        for write_id, plan, over, digest in reversed(recalled):
            self.remember(write_id, plan, digest=digest)
            self._ids[write_id][3].update(over)

    def lookup(self, write_id: Hashable | None) -> tuple[np.ndarray, Any] | None:
        """``(indices, receipt)`` of an earlier write with this identity, or None."""
        found = None if write_id is None else self._ids.get(write_id)
        return None if found is None else found[:2]

    def digest(self, write_id: Hashable) -> str | None:
        """The digest of the rows written under ``write_id`` (None: not known)."""
        found = self._ids.get(write_id)
        return None if found is None else found[4]

    def retry_of(self, write_id: Hashable | None, rows: int, digest: str | None = None
                 ) -> tuple[np.ndarray, Any] | None:
        """``lookup``, for a write of ``rows`` rows whose digest is ``digest``: None for an identity not seen,
        the earlier write's ``(indices, receipt)`` for its retry; another write under a used identity raises.

        >>> log = WriteLog([8]); log.commit(log.plan([2]), "w", digest="aa")
        >>> log.retry_of("w", 2, "aa")[0].tolist(), log.retry_of("new", 2, "bb")
        ([0, 1], None)
        >>> log.retry_of("w", 2, "bb")
        Traceback (most recent call last):
        rayrb.errors.WriteIdError: write_id 'w' names a write of other rows (digest aa, got bb): a retry must send the same rows; other rows need a new write_id
        """
        found = self.lookup(write_id)
        if found is None:
            return None
        if len(found[0]) != rows:  # its pieces would be cut from other rows
            raise WriteIdError(f"write_id {write_id!r} names a write of {len(found[0])} rows, got a retry of {rows} "
                               "rows: a retry must send the same rows (or use a new write_id)")
        known = self.digest(write_id)
        if digest is not None and known is not None and digest != known:
            raise WriteIdError(f"write_id {write_id!r} names a write of other rows (digest {known}, got {digest}): "
                               "a retry must send the same rows; other rows need a new write_id")
        return found

    def resume(self, write_id: Hashable) -> tuple[list[Write], list[Write]]:
        """Finish an earlier write; return its whole plan and the pieces to send now (committed here).

        The pieces missing (see ``reset``) are sent again to the rows first planned
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
        _, _, plan, missing, _ = self._ids[write_id]
        again = set()
        for i in sorted(missing):  # one by one: two pieces of a write may share a shard
            if self.written[plan[i].shard] == plan[i].first or self._in_hole(plan[i]):
                self.commit([plan[i]])
                again.add(i)
        send = [plan[i] for i in sorted(again)]
        for i in sorted(missing - again):
            w = plan[i]
            placed = [replace(n, start=n.start + w.start, stop=n.stop + w.start) for n in self.place(w.rows)]
            self.commit(placed)
            send += placed
        send.sort(key=lambda w: w.start)
        whole = sorted([w for i, w in enumerate(plan) if i not in missing] + send, key=lambda w: w.start)
        self.remember(write_id, whole)
        return whole, send

    def reset(self, written: Sequence[int], held: Sequence[Sequence[tuple[int, int]]] | None = None) -> None:
        """Take the shards' own write counts (after a failure or a restore), and the runs of rows each holds
        beyond its count (``held``, see ``held_runs``).

        Rows planned beyond what a shard holds are free again: the gaps below its last
        held row become holes, which the next writes fill, and a remembered write's
        pieces that the shard does not hold are marked missing, so that ``resume``
        sends them again.

        >>> log = WriteLog([8]); log.commit(log.plan([2]), "a"); log.commit(log.plan([2]), "b")
        >>> log.reset([0], [[(2, 4)]])  # "a" never landed, "b" did
        >>> log.holes, log.written.tolist()
        ([[(0, 2)]], [4])
        >>> log.resume("b")[1], [w.first for w in log.resume("a")[1]], log.holes  # "a" goes back into its hole
        ([], [0], [[]])
        """
        written = np.asarray(written, dtype=np.int64)
        if written.shape != self.written.shape or np.any(written < 0):
            raise InvalidArgumentError(
                f"expected {self.written.size} non-negative write counts, got {written.tolist()}")
        bad = InvalidArgumentError(f"expected per shard runs [a, b) of rows at or beyond its count {written.tolist()}, "
                                   f"got {held!r}")
        try:
            held = [sorted((int(a), int(b)) for a, b in runs) for runs in (held or [[] for _ in written])]
        except (TypeError, ValueError):  # a run that is not a pair of integers
            raise bad from None
        if len(held) != written.size or any(a < c or b <= a for runs, c in zip(held, written) for a, b in runs):
            raise bad
        self.written = np.array([max([int(c)] + [b for _, b in runs]) for c, runs in zip(written, held)], np.int64)
        self.holes = [gaps(int(c), runs) for c, runs in zip(written, held)]
        for _, _, plan, missing, _ in self._ids.values():
            missing.update(i for i, w in enumerate(plan) if not self._held(w))

    def _held(self, w: Write) -> bool:
        """Whether the shard holds piece ``w``'s rows: below its count, and in no hole."""
        return w.first + w.rows <= self.written[w.shard] and not any(
            a < w.first + w.rows and w.first < b for a, b in self.holes[w.shard])

    def state_dict(self) -> dict:
        return {"written": self.written.tolist(), "capacity": self.capacity.tolist()}
