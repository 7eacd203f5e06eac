"""Runs of rows: ``[a, b)`` ranges of a circular shard's write stream, as the write log keeps its holes and the
rows held beyond a shard's count (``rayrb.durability.writelog``). No Ray here.

>>> gaps(0, [(2, 4), (6, 7)]), cut_out([(0, 10)], 3, 5)
([(0, 2), (4, 6)], [(0, 3), (5, 10)])
>>> runs = ([], []); insert(runs, 0, 2); insert(runs, 5, 6); insert(runs, 2, 3); runs
([0, 5], [3, 6])
>>> overlaps(runs, 3, 5), overlaps(runs, 2, 4), overlaps(None, 0, 1)
(False, True, False)
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np


def held_runs(generation: np.ndarray, written: int) -> list[tuple[int, int]]:
    """Runs ``[a, b)`` of rows a circular shard holds beyond its count ``written``.

    The ``w``-th row ever written sits in slot ``w mod capacity`` with generation
    ``w // capacity + 1``, so a slot's generation says which row it holds, however many
    laps beyond the count (rows written behind a hole may wrap over the hole's slots).

    >>> gen = np.array([1, 1, 0, 1, 0])  # capacity 5; rows 0 and 1 counted, row 3 written after a gap
    >>> held_runs(gen, 2)
    [(3, 4)]
    >>> held_runs(np.array([2, 2, 1, 1]), 1)  # rows 2-5 written behind row 1: rows 4-5 wrapped over slots 0-1
    [(2, 6)]
    """
    gen = np.asarray(generation, dtype=np.int64)
    rows = (gen - 1) * len(gen) + np.arange(len(gen), dtype=np.int64)
    rows = np.sort(rows[(gen > 0) & (rows >= int(written))])
    cuts = np.flatnonzero(np.diff(rows) != 1) + 1
    return [(int(r[0]), int(r[-1]) + 1) for r in np.split(rows, cuts) if r.size]


def advance(held: dict[int, int], written: int, first: int, end: int) -> int:
    """A shard's write count after rows ``[first, end)`` landed, given the runs ``held`` beyond it (first row ->
    end, updated in place): the count moves over contiguous rows only, so a restart still finds every write that
    completed; a write past the count is held until the rows before it land.

    >>> held = {}
    >>> advance(held, 0, 5, 8), held  # rows 5-7 land before 0-4: held
    (0, {5: 8})
    >>> advance(held, 0, 0, 5), held  # the count reaches them and passes over them
    (8, {})
    >>> advance({2: 9}, 0, 0, 4)  # a run that starts inside the rows passed counts too
    9
    """
    if first > written:  # an earlier write is still to come (a retry out of order)
        held[first] = end
        return written
    written = max(written, end)
    # Every run the count reaches, also one that starts inside the rows it passed: a write wider than the
    # shard keeps only its tail, and a restarted shard (or the log, after a resync) knows just that.
    for a in sorted(held):
        if a > written:
            break
        written = max(written, held.pop(a))
    return written


def gaps(start: int, runs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The rows from ``start`` to the end of ``runs`` that no run covers."""
    out, cursor = [], start
    for a, b in runs:
        if a > cursor:
            out.append((cursor, a))
        cursor = max(cursor, b)
    return out


def cut_out(holes: list[tuple[int, int]], a: int, b: int) -> list[tuple[int, int]]:
    """``holes`` less rows ``[a, b)``, which lie inside one of them."""
    out = []
    for x, y in holes:
        if x <= a and b <= y:
            out += [r for r in ((x, a), (b, y)) if r[1] > r[0]]
        else:
            out.append((x, y))
    return out


def overlaps(runs: tuple[list[int], list[int]] | None, a: int, b: int) -> bool:
    """Whether rows ``[a, b)`` meet one of ``runs`` (sorted disjoint ``[start, end)``, as two lists)."""
    if runs is None:
        return False
    starts, ends = runs
    j = bisect.bisect_left(starts, b) - 1  # the last run that starts before b
    return j >= 0 and ends[j] > a


def insert(runs: tuple[list[int], list[int]], a: int, b: int) -> None:
    """Add rows ``[a, b)`` to ``runs``, merging the runs it meets."""
    starts, ends = runs
    lo, hi = bisect.bisect_left(ends, a), bisect.bisect_right(starts, b)
    if lo < hi:
        a, b = min(a, starts[lo]), max(b, ends[hi - 1])
    starts[lo:hi], ends[lo:hi] = [a], [b]
