"""Two copies of one online shard made one: what a replica takes from another when it is rebuilt.

A shard's ``w``-th row ever written sits in slot ``w mod capacity`` with generation
``w // capacity + 1`` (``rayrb.durability.runs.held_runs``), so a slot's generation
says which row it holds, and a larger one is a newer row. Two copies of a shard that
took the same writes in whatever order, each missing some, are merged slot by slot:
each slot keeps the row with the larger generation. The merged copy holds every row
either held (unless a newer row overwrote it in either), and its write count is the
larger of the two counts, extended over the runs the merge completed: every row below
either count is in the copy that counted it.

>>> mine, theirs = np.array([1, 1, 0, 0]), np.array([1, 1, 1, 0])  # capacity 4: they hold row 2 too
>>> newer(mine, theirs).tolist()
[False, False, True, False]
>>> merged_count(np.array([1, 1, 1, 0]), 2, 3)
3
>>> merged_count(np.array([1, 1, 0, 1]), 2, 2)  # row 3 held beyond a hole at row 2: not counted
2
"""
from __future__ import annotations

import numpy as np

from rayrb.durability.runs import held_runs
from rayrb.errors import InvalidArgumentError, SchemaError


def newer(mine: np.ndarray, theirs: np.ndarray) -> np.ndarray:
    """Slots where the other copy holds a newer row than this one (a larger generation), or the same row whole
    where this copy's is marked as being written: a crash tore it (``rayrb.durability.storage.whole``).

    >>> newer(np.array([2, -2, -2, 1, -3]), np.array([2, 2, -2, 0, 2])).tolist()
    [False, True, False, False, False]
    """
    mine, theirs = np.asarray(mine, np.int64), np.asarray(theirs, np.int64)
    if mine.shape != theirs.shape:
        raise InvalidArgumentError(
            f"expected two copies of one shard ({mine.shape[0]} slots), got {theirs.shape[0]} slots")
    # a negative generation is a row being written, or torn: the row of the absolute value's, not yet whole
    return (theirs > np.abs(mine)) | ((mine < 0) & (theirs == -mine))


def merged_count(generation: np.ndarray, mine: int, theirs: int) -> int:
    """The write count of the merged copy: the larger count, carried over every held run that now joins it."""
    count = max(int(mine), int(theirs))
    for a, b in held_runs(generation, count):
        if a > count:
            break
        count = max(count, b)
    return count


def take_newer(rows: dict[str, np.ndarray], generation: np.ndarray, copy: dict[str, np.ndarray],
               what: str = "shard") -> np.ndarray:
    """Copy into ``rows`` and ``generation`` (a shard's arrays) the slots where ``copy`` (``state()`` of another
    copy of it) holds newer rows; the slots taken. A slot's generation is negative while its row is replaced, so
    readers in other processes leave it to the shard (``rayrb.handle.local``)."""
    gen = np.asarray(copy["generation"], np.int64)
    take = np.flatnonzero(newer(generation, gen))
    theirs = {k[len("rows/"):]: v for k, v in copy.items() if k.startswith("rows/")}
    if set(theirs) != set(rows):
        raise SchemaError(f"{what}: expected a copy with keys {sorted(rows)}, got {sorted(theirs)}")
    if take.size:
        generation[take] = -gen[take]
        for k, dst in rows.items():
            dst[take] = theirs[k][take]
        generation[take] = gen[take]
    return take


def copy_order(mine: int, theirs: int) -> str:
    """How a copy of a shard takes another copy, by their restore epochs (how many times a restore replaced the
    rows whole): ``"merge"`` slot by slot by generation (the same epoch), ``"keep"`` its own rows (the other's are
    from before a restore this copy took: it is rebuilt from this one) or ``"replace"`` its own by the other's
    whole (this copy's files are from before a restore the other took). Generations order rows within an epoch
    only: the rows written after a restore take the generations of the rows it removed.

    >>> copy_order(2, 2), copy_order(2, 1), copy_order(1, 2)
    ('merge', 'keep', 'replace')
    """
    return "merge" if mine == theirs else ("keep" if theirs < mine else "replace")
