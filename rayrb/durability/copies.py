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
    """Slots where the other copy's row comes later in one order of a slot's states, the same whichever copy
    merges the other (contract 12): ``... < whole g-2 < torn g < whole g-1 < torn g+1 < whole g < ...``, where
    a torn slot (a negative generation: its row was being written when a crash came,
    ``rayrb.durability.storage.whole``) sits between the row before it and the one before that. So a whole row
    wins over its own row torn, and over the next row torn (that write was never acknowledged: the row it would
    have evicted stays), but a torn row wins over one two rows older (that one was evicted before).

    >>> newer(np.array([2, -2, -2, 1, -3, 1]), np.array([2, 2, -2, 0, 2, -3])).tolist()
    [False, True, False, False, True, True]
    """
    mine, theirs = np.asarray(mine, np.int64), np.asarray(theirs, np.int64)
    if mine.shape != theirs.shape:
        raise InvalidArgumentError(
            f"expected two copies of one shard ({mine.shape[0]} slots), got {theirs.shape[0]} slots")
    return _order(theirs) > _order(mine)


def _order(generation: np.ndarray) -> np.ndarray:
    """A slot's place in the order ``newer`` follows: whole ``g`` at ``2g``, torn ``g`` at ``2g - 3``."""
    return np.where(generation >= 0, 2 * generation, -2 * generation - 3)


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
    for k, dst in rows.items():  # checked whole before a slot is marked or a row copied
        got = np.asarray(theirs[k])
        if got.shape != dst.shape or not np.can_cast(got.dtype, dst.dtype, casting="same_kind"):
            raise SchemaError(f"{what}: expected key {k!r} of the copy as {dst.dtype}{list(dst.shape)}, got "
                              f"{got.dtype}{list(got.shape)}")
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
