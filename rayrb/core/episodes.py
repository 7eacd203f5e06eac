"""Episodes in a shard's rows, and the slices of them a sequence learner draws. Pure math, no Ray.

A shard's rows are steps in order: its offline rows ``0 .. n - 1``, or its online write stream, whose ``w``-th row
sits in slot ``w mod capacity`` and is held while ``written - capacity <= w < written``. An **episode** is a
maximal run of consecutive steps of one trajectory: marked by a trajectory id per step (a run ends where the id
changes) or by an end flag (a run ends after a step whose flag is set; a run with no end yet is an episode still
being written). Online, the steps the capacity overwrote are cut off the oldest episode, and only steps already
written count: a slice never reads a step that is not there.

A **slice** of length ``L`` is ``L`` consecutive steps of one episode, named by its first step. With
``strict_length`` (TorchRL's ``SliceSampler`` default) an episode of ``n`` steps has ``max(0, n - L + 1)`` slices;
without it an episode shorter than ``L`` has one, the whole episode, and the slice is short. So a shard holds
``V_i`` valid slices, and drawing ``k`` slices uniformly over every valid slice of every shard is drawing the
shards' counts ~ Multinomial(k, V_i / sum V) (``rayrb.core.allocation.multinomial_counts``, as rows are drawn
with ``V_i`` the shard's size), then each shard ``count`` of its own slices uniformly; without replacement the
counts are multivariate hypergeometric over the slices each shard has left in the epoch. The offline share
counts slices: ``floor(f * num_slices + 1/2)`` of them offline (``rayrb.core.allocation.offline_count``).

A batch is flat, the slices one after another (TorchRL's layout): ``steps`` gives each slice's rows in order,
with the first step of each slice marked (``is_init``) and its last (``("next", "truncated")``).

Examples:
    >>> eps = from_ids(np.array([7, 7, 7, 7, 3, 3, 9, 9, 9]))
    >>> eps.starts.tolist(), eps.stops.tolist()
    ([0, 4, 6], [4, 6, 9])
    >>> s = Slices(eps, slice_len=3)
    >>> s.counts.tolist(), s.total
    ([2, 0, 1], 3)
    >>> s.locate(np.array([0, 1, 2]))[0].tolist()
    [0, 1, 6]
    >>> Slices(eps, slice_len=3, strict_length=False).locate(np.array([2]))  # the short episode, whole
    (array([4]), array([2]))
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from rayrb.core.allocation import multinomial_counts, split_batch
from rayrb.core.validation import positive_int
from rayrb.errors import InvalidArgumentError


@dataclass(frozen=True)
class Episodes:
    """Episodes as ``[starts[e], stops[e])`` runs of step positions, in order and disjoint."""

    starts: np.ndarray
    stops: np.ndarray

    def __post_init__(self) -> None:
        a, b = np.asarray(self.starts, np.int64), np.asarray(self.stops, np.int64)
        if a.shape != b.shape or a.ndim != 1 or np.any(b <= a) or np.any(a[1:] < b[:-1]):
            raise InvalidArgumentError(f"expected disjoint non-empty runs in order, got starts {a.tolist()[:8]} "
                                       f"and stops {b.tolist()[:8]}")
        object.__setattr__(self, "starts", a)
        object.__setattr__(self, "stops", b)

    @property
    def lengths(self) -> np.ndarray:
        return self.stops - self.starts

    def window(self, low: int, high: int) -> Episodes:
        """The steps in ``[low, high)`` only: an online shard's steps still held (the capacity overwrote those
        below ``low``) and already written (none at ``high`` or after). Episodes left empty are dropped.

        >>> Episodes(np.array([0, 5]), np.array([5, 12])).window(3, 10)
        Episodes(starts=array([3, 5]), stops=array([ 5, 10]))
        """
        a, b = np.maximum(self.starts, int(low)), np.minimum(self.stops, int(high))
        keep = b > a
        return Episodes(a[keep], b[keep])


def per_step(column: np.ndarray) -> np.ndarray:
    """``column`` as ``[steps, values]``: a flag or id of shape ``[steps, 1]`` (TorchRL's done keys) is one value
    a step. No steps is ``[0, values]`` (``reshape(0, -1)`` cannot tell ``-1``).

    >>> per_step(np.zeros((0, 1), bool)).shape, per_step(np.array([[1], [2]])).tolist()
    ((0, 1), [[1], [2]])
    """
    column = np.asarray(column)
    return column.reshape(len(column), int(np.prod(column.shape[1:], dtype=np.int64)))


def from_ids(ids: np.ndarray, first: int = 0) -> Episodes:
    """Episodes of steps ``first, first + 1, ...`` with trajectory ids ``ids`` (a run ends where the id changes)."""
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise InvalidArgumentError(f"expected one trajectory id per step, got an array of shape {ids.shape}")
    if ids.size == 0:
        return Episodes(np.zeros(0, np.int64), np.zeros(0, np.int64))
    cuts = np.flatnonzero(ids[1:] != ids[:-1]) + 1
    starts = np.concatenate([[0], cuts]).astype(np.int64)
    return Episodes(starts + first, np.concatenate([cuts, [ids.size]]).astype(np.int64) + first)


def from_ends(ends: np.ndarray, first: int = 0) -> Episodes:
    """Episodes of steps ``first, first + 1, ...`` whose end flags are ``ends`` (a run ends after a set flag; the
    steps after the last set flag are an episode still being written)."""
    ends = np.asarray(ends, bool)
    if ends.ndim > 1:  # a flag per step of shape [steps, 1] (TorchRL's done keys)
        ends = per_step(ends).any(axis=1)
    stops = np.flatnonzero(ends).astype(np.int64) + 1
    if ends.size and (stops.size == 0 or stops[-1] != ends.size):
        stops = np.concatenate([stops, [ends.size]]).astype(np.int64)
    starts = np.concatenate([[0], stops[:-1]]).astype(np.int64)[:stops.size]
    return Episodes(starts + first, stops + first)


def episodes_of(column: np.ndarray, ends: bool, first: int = 0) -> Episodes:
    """Episodes of the steps in ``column``: end flags with ``ends``, else trajectory ids (one per step: a
    ``[steps, 1]`` column is read as ``[steps]``)."""
    column = np.asarray(column)
    if ends:
        return from_ends(column, first)
    return from_ids(per_step(column)[:, 0] if column.ndim > 1 else column, first)


@dataclass(frozen=True)
class Slices:
    """The valid slices of length ``slice_len`` of ``episodes`` (see the module), numbered ``0 .. total - 1`` in
    step order."""

    episodes: Episodes
    slice_len: int
    strict_length: bool = True
    counts: np.ndarray = field(init=False, repr=False)  # valid slices per episode
    _ends: np.ndarray = field(init=False, repr=False)  # cumulative counts

    def __post_init__(self) -> None:
        length = positive_int("slice_len", self.slice_len)
        n = self.episodes.lengths
        counts = np.maximum(n - length + 1, 0 if self.strict_length else 1)
        object.__setattr__(self, "counts", counts.astype(np.int64))
        object.__setattr__(self, "_ends", np.cumsum(counts, dtype=np.int64))

    @property
    def total(self) -> int:
        return int(self._ends[-1]) if self._ends.size else 0

    def first_steps(self) -> np.ndarray:
        """The first step of every valid slice, by slice number: ``locate(arange(total))[0]`` in one pass.

        >>> Slices(Episodes(np.array([0, 5]), np.array([5, 12])), 3).first_steps().tolist()
        [0, 1, 2, 5, 6, 7, 8, 9]
        """
        before = self._ends - self.counts  # slices in the episodes before each
        return np.arange(self.total, dtype=np.int64) + np.repeat(self.episodes.starts - before, self.counts)

    def starts_at(self, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Whether a valid slice starts at each of ``steps`` (held steps), and its number where one does.

        >>> s = Slices(Episodes(np.array([0, 5]), np.array([5, 12])), 3)
        >>> valid, number = s.starts_at(np.array([2, 3, 5, 9, 10]))
        >>> valid.tolist(), number[valid].tolist()
        ([True, False, True, True, False], [2, 3, 7])
        """
        steps = np.asarray(steps, np.int64)
        if not self.episodes.starts.size:
            return np.zeros(steps.size, bool), np.zeros(steps.size, np.int64)
        e = np.maximum(np.searchsorted(self.episodes.starts, steps, side="right") - 1, 0)
        first, stop = self.episodes.starts[e], self.episodes.stops[e]
        valid = (steps >= first) & (steps < stop) & (stop - steps >= self.slice_len)
        if not self.strict_length:  # an episode shorter than a slice: one slice, at its first step
            valid |= (steps == first) & (stop - first < self.slice_len)
        return valid, self._ends[e] - self.counts[e] + (steps - first)

    def locate(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(first step, length)`` of each slice numbered in ``items``."""
        items = np.asarray(items, np.int64)
        if items.size and (items.min() < 0 or items.max() >= self.total):
            raise InvalidArgumentError(f"expected slice numbers in [0, {self.total}), got {items.min()} .. "
                                       f"{items.max()}")
        e = np.searchsorted(self._ends, items, side="right")
        before = self._ends[e] - self.counts[e]
        starts = self.episodes.starts[e] + (items - before)
        return starts, np.minimum(self.episodes.lengths[e], self.slice_len)


def whole_ranges(ranges: Sequence[tuple[int, int]], starts: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous row ranges (offline shards') with each cut moved to an episode's first row (``starts``, sorted),
    so that every shard holds whole episodes: the nearest one between the cuts around it (the previous cut as
    moved, and the next as given; at equal distance the later), so no shard is left empty and no cut runs off to a
    far episode, leaving the ones after it no room. Where no episode begins there (one longer than the shards
    around it), the cut stays: slices never cross it.

    >>> whole_ranges([(0, 5), (5, 10), (10, 15)], [0, 4, 7, 12])
    [(0, 4), (4, 12), (12, 15)]
    >>> whole_ranges([(0, 5), (5, 10)], [0])  # one episode over both: the cut stays
    [(0, 5), (5, 10)]
    >>> whole_ranges([(0, 250), (250, 500), (500, 750), (750, 1000)], [0, 100, 990])  # the last episode kept whole
    [(0, 100), (100, 500), (500, 990), (990, 1000)]
    """
    starts = np.asarray(starts, np.int64)
    bounds = [ranges[0][0], *(cut for _, cut in ranges[:-1]), ranges[-1][1]]
    moved = [bounds[0]]
    for i in range(1, len(bounds) - 1):
        low, high, cut = max(moved[-1], bounds[i - 1]), bounds[i + 1], bounds[i]
        inside = starts[(starts > low) & (starts < high)]  # every choice leaves both shards around it rows
        moved.append(int(inside[np.argmin(np.abs(inside - cut) * 2 - (inside >= cut))]) if inside.size else cut)
    moved.append(bounds[-1])
    return list(zip(moved[:-1], moved[1:]))


def slice_counts(num_slices: int, offline_fraction: float, offline: Sequence[int], online: Sequence[int],
                 rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Per-shard slice counts of one batch of ``num_slices`` slices: ``floor(f * num_slices + 1/2)`` offline, the
    rest online (all offline while no online shard holds a valid slice, as rows go), each side's drawn uniformly
    over the valid slices of its shards (``offline[i]``, ``online[j]``: each shard's ``Slices.total``).

    >>> off, on = slice_counts(10, 0.25, [5, 0], [3, 3], np.random.default_rng(0))
    >>> int(off.sum()), int(on.sum()), int(off[1])
    (3, 7, 0)
    """
    n_off, n_on = split_batch(num_slices, offline_fraction, int(np.sum(online)))
    return multinomial_counts(n_off, np.asarray(offline, np.int64), rng), (
        multinomial_counts(n_on, np.asarray(online, np.int64), rng) if n_on else np.zeros(len(online), np.int64))


def steps(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The slices' steps one after another, with each slice's first step and last step marked:
    ``(positions, is_init, truncated)``.

    >>> pos, init, trunc = steps(np.array([4, 10]), np.array([3, 2]))
    >>> pos.tolist(), init.astype(int).tolist(), trunc.astype(int).tolist()
    ([4, 5, 6, 10, 11], [1, 0, 0, 1, 0], [0, 0, 1, 0, 1])
    """
    starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
    total = int(lengths.sum())
    first = np.cumsum(lengths) - lengths  # where each slice begins in the batch
    pos = np.arange(total, dtype=np.int64) - np.repeat(first, lengths) + np.repeat(starts, lengths)
    init = np.zeros(total, bool)
    init[first[lengths > 0]] = True
    truncated = np.zeros(total, bool)
    truncated[(first + lengths - 1)[lengths > 0]] = True
    return pos, init, truncated


def padded_steps(starts: np.ndarray, lengths: np.ndarray, slice_len: int) -> np.ndarray:
    """The slices' steps one after another, each slice ``slice_len`` rows: a short slice (a whole episode shorter
    than ``slice_len``, without ``strict_length``) padded with copies of its last step, which ``short_slices``
    finds and drops again. A read so keeps the rows it was planned (``slice_len`` a slice), wherever it runs.

    >>> padded_steps(np.array([4, 10]), np.array([3, 1]), 3).tolist()
    [4, 5, 6, 10, 10, 10]
    """
    starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
    at = np.minimum(np.arange(slice_len, dtype=np.int64)[None, :], lengths[:, None] - 1)
    return (starts[:, None] + at).reshape(-1)


def short_slices(index: np.ndarray, slice_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows to keep of a batch of padded slices (``padded_steps``) read from shards, by each row's place in its
    shard (``index``), and each kept row's marks: ``(keep, first, last)``, ``first`` and ``last`` over the kept
    rows. A padding row is one at the same place as the row before it in its slice: the steps of a slice are at
    distinct places, and every slice begins at a multiple of ``slice_len`` (each shard's part is whole slices).

    >>> keep, first, last = short_slices(np.array([4, 5, 6, 10, 10, 10, 6, 7, 8]), 3)
    >>> keep.astype(int).tolist(), first.astype(int).tolist(), last.astype(int).tolist()
    ([1, 1, 1, 1, 0, 0, 1, 1, 1], [1, 0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0, 1])
    """
    index = np.asarray(index).reshape(-1)
    at = np.arange(index.size) % slice_len
    pad = np.zeros(index.size, bool)
    pad[1:] = (index[1:] == index[:-1]) & (at[1:] != 0)
    ends = np.ones(index.size, bool)  # a row followed by a padding row or by the next slice's first row
    ends[:-1] = pad[1:] | (at[1:] == 0)
    keep = ~pad
    return keep, at[keep] == 0, ends[keep]


def whole_slices(rows: np.ndarray, column: np.ndarray, slice_len: int, ends: bool, padded: bool = False) -> bool:
    """Whether steps laid out in slices of ``slice_len`` one after another are whole slices: each slice's rows
    (their places in the write stream) consecutive, and of one episode by ``column`` (trajectory ids all equal,
    or no end flag before the slice's last step). With ``padded`` (short slices, ``padded_steps``), a slice may
    end in copies of its last step.

    >>> whole_slices(np.array([4, 5, 9, 10]), np.array([1, 1, 2, 2]), 2, ends=False)
    True
    >>> whole_slices(np.array([4, 5, 9, 11]), np.array([1, 1, 2, 2]), 2, ends=False)  # a step overwritten
    False
    >>> whole_slices(np.array([4, 5]), np.array([True, False]), 2, ends=True)  # an episode ends inside
    False
    >>> whole_slices(np.array([7, 8, 8, 8]), np.array([False, True, True, True]), 4, ends=True, padded=True)
    True
    """
    rows = np.asarray(rows, np.int64).reshape(-1, slice_len)
    step = np.diff(rows, axis=1)  # 1 within a slice's steps; padded, 0 from its last step on
    if not (step == 1).all() and not (padded and (step >= 0).all() and (step <= 1).all()
                                      and (step[:, 1:] <= step[:, :-1]).all()):
        return False
    column = per_step(column)
    if ends:  # no end flag on a step another step of the slice follows
        return not (column.any(axis=1).reshape(-1, slice_len)[:, :-1] & (step == 1)).any()
    ids = column[:, 0].reshape(-1, slice_len)
    return bool((ids == ids[:, :1]).all())


def slice_count(batch_size: int, slice_len: int | None = None, num_slices: int | None = None) -> tuple[int, int]:
    """``(num_slices, slice_len)`` of a batch of ``batch_size`` steps given one of them, as TorchRL's
    ``SliceSampler`` takes them; the batch size must be a multiple.

    >>> slice_count(64, slice_len=8), slice_count(64, num_slices=4)
    ((8, 8), (4, 16))
    """
    batch_size = positive_int("batch_size", batch_size)
    if (slice_len is None) == (num_slices is None):
        raise InvalidArgumentError(f"expected one of slice_len and num_slices, got slice_len={slice_len} and "
                                   f"num_slices={num_slices}")
    given = positive_int("slice_len" if num_slices is None else "num_slices",
                         slice_len if num_slices is None else num_slices)
    if batch_size % given:
        raise InvalidArgumentError(f"expected a batch_size that is a multiple of "
                                   f"{'slice_len' if num_slices is None else 'num_slices'}={given}, got {batch_size}")
    return (batch_size // given, given) if num_slices is None else (given, batch_size // given)
