"""Pure math for splitting a batch: offline/online, then across shards.

Sampling the union of shards and sampling shard by shard give the same
distribution when the per-shard counts are drawn right:

* uniform with replacement: counts ~ Multinomial(n, size_i / sum(size));
* without replacement: counts ~ multivariate hypergeometric over the rows each
  shard has left in the epoch;
* prioritized: counts ~ Multinomial(n, mass_i / sum(mass)).

Each shard then draws its count locally with its own sampler.

Examples:
    >>> split_batch(10, 0.25, online_size=100)
    (3, 7)
    >>> split_batch(10, 0.25, online_size=0)  # nothing online yet: all offline
    (10, 0)
    >>> split_evenly(10, 3).tolist()
    [4, 3, 3]
"""
from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import numpy as np

from rayrb.core.validation import fraction, positive_int
from rayrb.errors import DrawError, InvalidArgumentError


def check_batch_size(batch_size: object) -> int:
    return positive_int("batch_size", batch_size)


def check_fraction(offline_fraction: object) -> float:
    return fraction("offline_fraction", offline_fraction)


def offline_count(batch_size: int, offline_fraction: float) -> int:
    """``floor(f * B + 1/2)``: rounds half up (Python's ``round`` rounds half to even).

    Evaluated in double precision, exactly as the formula reads in Python: where
    ``f * B`` is a decimal half that doubles cannot hold (``0.29 * 50`` is
    ``14.499999999999998``) the count is that of the double.
    """
    return min(batch_size, max(0, math.floor(offline_fraction * batch_size + 0.5)))


def split_batch(batch_size: int, offline_fraction: float, online_size: int) -> tuple[int, int]:
    """``(n_off, n_on)`` for one batch; all offline while the online side is empty."""
    return split_checked(check_batch_size(batch_size), check_fraction(offline_fraction), online_size)


def split_checked(batch_size: int, offline_fraction: float, online_size: int) -> tuple[int, int]:
    """``split_batch`` for a batch size and a fraction already checked (the planner's: the batch size once per
    group, the fraction where its schedule gives it)."""
    n_off = offline_count(batch_size, offline_fraction)
    if online_size <= 0:
        return batch_size, 0
    return n_off, batch_size - n_off


def whole_items(batch_size: int, unit: int) -> int:
    """Items of ``unit`` rows a batch of ``batch_size`` rows holds (a slice sampler's slices); it must be whole.

    >>> whole_items(12, 4), whole_items(7, 1)
    (3, 7)
    """
    if batch_size % unit:
        raise InvalidArgumentError(f"expected a batch_size that is a multiple of slice_len={unit}, got {batch_size}")
    return batch_size // unit


def _weights(name: str, values: Sequence[float]) -> np.ndarray:
    w = np.asarray(values, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or np.any(w < 0) or not np.all(np.isfinite(w)):
        raise InvalidArgumentError(f"expected a non-empty list of non-negative finite {name}, got {list(values)!r}")
    return w


def multinomial_counts(n: int, weights: Sequence[float], rng: np.random.Generator) -> np.ndarray:
    """Per-shard counts ~ Multinomial(n, w / sum(w)): uniform (w = sizes) or prioritized (w = masses)."""
    if isinstance(weights, np.ndarray) and weights.dtype.kind in "iu" and weights.ndim == 1 and weights.size:
        # Shard sizes change only with writes, so the planner asks with the same sizes batch after batch:
        # their probabilities are kept (the same values the division gives, so the same draws).
        key = (weights.dtype.char, weights.tobytes())
        p = _SIZE_PROBS.get(key)
        if p is None:
            if weights.min() < 0:  # integer sizes are finite; the division gives the float path's values
                raise InvalidArgumentError(f"expected a non-empty list of non-negative finite weights, "
                                           f"got {weights.tolist()!r}")
            total = weights.sum()
            p = weights / total if total > 0 else None
            if len(_SIZE_PROBS) >= 64:
                _SIZE_PROBS.clear()
            _SIZE_PROBS[key] = p
        if n == 0:
            return np.zeros(weights.size, dtype=np.int64)
        if p is None:
            raise DrawError(f"cannot draw {n} rows from shards whose weights sum to 0: {weights.tolist()}")
        if weights.size == 1:  # what multinomial returns for one shard, and it draws nothing from rng then
            return np.array([n], dtype=np.int64)
        if weights.size == 2:  # Multinomial over two is Binomial: half the cost of numpy's multinomial call
            k = int(rng.binomial(n, p[0]))
            return np.array([k, n - k], dtype=np.int64)
        return rng.multinomial(n, p)
    w = _weights("weights", weights)
    total = w.sum()
    if n == 0:
        return np.zeros(w.size, dtype=np.int64)
    if total <= 0:
        raise DrawError(f"cannot draw {n} rows from shards whose weights sum to 0: {w.tolist()}")
    return rng.multinomial(n, w / total).astype(np.int64)


_SIZE_PROBS: dict[tuple[str, bytes], np.ndarray | None] = {}  # integer sizes -> their probabilities


def hypergeometric_counts(n: int, remaining: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    """Per-shard counts without replacement: multivariate hypergeometric over rows left per shard."""
    left = np.asarray(remaining, dtype=np.int64)
    if left.ndim != 1 or left.size == 0 or np.any(left < 0):
        raise InvalidArgumentError(f"expected non-negative rows left per shard, got {list(remaining)!r}")
    if n > left.sum():
        raise DrawError(f"cannot draw {n} rows without replacement: only {int(left.sum())} left in the epoch")
    if n == 0:
        return np.zeros(left.size, dtype=np.int64)
    return rng.multivariate_hypergeometric(left, n).astype(np.int64)


def split_evenly(total: int, parts: int) -> np.ndarray:
    """``total`` split into ``parts`` integers that differ by at most one, larger ones first."""
    parts = positive_int("parts", parts)
    base, extra = divmod(int(total), parts)
    return np.array([base + (i < extra) for i in range(parts)], dtype=np.int64)


def row_ranges(total: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` ranges covering ``range(total)``, sizes as even as possible."""
    sizes = split_evenly(total, parts)
    stops = np.cumsum(sizes)
    return [(int(s - n), int(s)) for s, n in zip(stops, sizes)]


def write_pieces(n: int, num_shards: int, min_piece: int = 1024) -> np.ndarray:
    """Sizes of the contiguous pieces one ``extend`` of ``n`` rows is cut into.

    Small writes stay whole (one shard task, which is most of a write's cost);
    large ones are cut in up to ``num_shards`` pieces so that no shard takes a whole
    large batch. Fill levels stay balanced either way (see ``assign_pieces``).
    """
    pieces = int(min(num_shards, max(1, n // min_piece)))
    return split_evenly(n, pieces)


def cut_write(n: int, capacities: Sequence[int], min_piece: int = 1024) -> list[int]:
    """Piece sizes for a write of ``n`` rows to circular shards of ``capacities``: ``write_pieces``, in more
    pieces where one would overflow the smallest shard while the buffer as a whole has room.

    A write larger than the whole buffer is cut so that the newest rows are the ones kept
    (a shard keeps the tail of its piece): the first piece carries the rows evicted at once.

    >>> cut_write(300, [100] * 4), cut_write(50, [100] * 4), cut_write(4096, [10_000] * 4)
    ([100, 100, 100], [50], [1024, 1024, 1024, 1024])
    >>> cut_write(70, [25, 25])
    [45, 25]
    """
    capacities = [int(c) for c in capacities]
    if n > sum(capacities):
        return [n - sum(capacities) + capacities[0], *capacities[1:]]
    pieces = len(write_pieces(n, len(capacities), min_piece))
    while pieces < len(capacities) and -(-n // pieces) > min(capacities):
        pieces += 1
    return split_evenly(n, pieces).tolist()


def assign_pieces(pieces: Sequence[int], written: Sequence[int], local: Collection[int] = (),
                  slack: int = 0) -> list[int]:
    """Shard for each piece: largest pieces to the least-written shards, each shard at most once.

    Keeps shard fill levels within one piece of each other over a stream of writes.
    A shard in ``local`` (one on the writer's node) takes the piece instead while it is
    at most ``slack`` rows ahead of the least-written shard left, so levels stay within
    ``slack`` plus one piece of each other.

    >>> assign_pieces([10], [0, 0, 0]), assign_pieces([10], [0, 0, 0], local={2}, slack=5)
    ([0], [2])
    >>> assign_pieces([10], [0, 0, 6], local={2}, slack=5)  # too far ahead: the least-written shard
    [0]
    >>> assign_pieces([10, 5], [0, 3, 4], local={2}, slack=5)  # the largest piece goes local
    [2, 0]
    """
    written = np.asarray(written, dtype=np.int64)
    free = [int(s) for s in np.argsort(written, kind="stable")]
    out = [0] * len(pieces)
    for piece in np.argsort(-np.asarray(pieces, dtype=np.int64), kind="stable"):
        near = [s for s in free if s in local and written[s] <= written[free[0]] + slack]
        shard = near[0] if near else free[0]
        free.remove(shard)
        out[int(piece)] = shard
    return out


def split_slices(n_off: int, n_on: int, parts: int) -> list[tuple[int, int]]:
    """``(n_off_j, n_on_j)`` for ``parts`` learner slices of one global batch.

    Slice sizes differ by at most one, and so does each slice's offline count
    from its exact share, while the totals stay ``n_off`` and ``n_on``.
    """
    sizes = split_evenly(n_off + n_on, parts)
    offs = split_evenly(n_off, parts)
    # Give the larger offline counts to the larger slices, then clip so no slice overflows.
    offs = np.minimum(offs, sizes)
    short = n_off - int(offs.sum())
    for j in range(parts):
        if short == 0:
            break
        take = min(short, int(sizes[j] - offs[j]))
        offs[j] += take
        short -= take
    return [(int(o), int(s - o)) for o, s in zip(offs, sizes)]
