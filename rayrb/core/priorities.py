"""Prioritized replay's shard half: ``p_i = (|priority_i| + eps) ** alpha`` per slot in a sum tree (``SumTree``),
rows drawn with probability ``p_i / sum(p)`` (``PrioritizedSampler``), and the bound that keeps every sum finite
(``stored_priorities``). ``rayrb.core.samplers`` registers the kind; slices by priority build on both
(``rayrb.core.prioritized_slices``)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from rayrb.core.allocators import PrioritizedAllocator
from rayrb.core.plans import Epoch
from rayrb.core.sampler_base import Sampler
from rayrb.core.validation import ALPHA, EPS, positive_int, priority_options
from rayrb.errors import DrawError, InvalidArgumentError, SavedStateError


class _Tree:
    """A complete binary tree over ``capacity`` values, each inner node ``combine`` of its two children (leaves
    past ``capacity``, and values never set, hold ``empty``): O(log n) vectorized updates, O(n) rebuilds."""

    combine: Any = None
    empty = 0.0

    def __init__(self, capacity: int):
        self.capacity = positive_int("capacity", capacity)
        self._n = 1 << (self.capacity - 1).bit_length()
        self._tree = np.full(2 * self._n, self.empty, dtype=np.float64)

    def update(self, idx: np.ndarray, values: np.ndarray) -> None:
        """Set ``v[idx] = values`` (with repeated indices the last value wins) and the nodes above them. A write's
        slots are one run: its parents at each level are one run too, combined with slices; scattered indices
        (a batch's priorities) walk up their sorted distinct parents."""
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size == 0:
            return
        self._tree[idx + self._n] = values
        lo, hi = int(idx.min()) + self._n, int(idx.max()) + self._n
        if hi - lo < 4 * idx.size + 64:  # one run (or close): every parent between, level by level
            while hi > 1:
                lo, hi = lo // 2, hi // 2
                self.combine(self._tree[2 * lo:2 * hi + 2:2], self._tree[2 * lo + 1:2 * hi + 2:2],
                             out=self._tree[lo:hi + 1])
            return
        pos = np.unique((idx + self._n) // 2)
        while True:
            self._tree[pos] = self.combine(self._tree[2 * pos], self._tree[2 * pos + 1])
            if pos[0] <= 1:
                return
            pos //= 2
            pos = pos[np.concatenate(([True], pos[1:] != pos[:-1]))]  # sorted, so repeats are neighbours

    def fill(self, values: np.ndarray) -> None:
        """Every value at once (``empty`` past ``len(values)``), level by level in O(n): a rebuild, not ``n``
        updates."""
        self._tree[:] = self.empty
        self._tree[self._n:self._n + len(values)] = values
        level = self._n
        while level > 1:
            self.combine(self._tree[level:2 * level:2], self._tree[level + 1:2 * level:2],
                         out=self._tree[level // 2:level])
            level //= 2

    def _range(self, start: int, stop: int) -> float:
        """``combine`` over ``v[start:stop]`` (``empty`` if none) in O(log n)."""
        lo, hi, out = self._n + max(0, start), self._n + min(stop, self._n), self.empty
        while lo < hi:
            if lo & 1:
                out = self.combine(out, self._tree[lo])
                lo += 1
            if hi & 1:
                hi -= 1
                out = self.combine(out, self._tree[hi])
            lo, hi = lo // 2, hi // 2
        return float(out)

    def values(self, idx: np.ndarray) -> np.ndarray:
        return self._tree[np.asarray(idx, dtype=np.int64) + self._n]


class SumTree(_Tree):
    """Prefix sums over ``capacity`` non-negative values: O(log n) vectorized updates and lookups.

    Examples:
        >>> t = SumTree(4)
        >>> t.update(np.array([0, 1, 2, 3]), np.array([1.0, 0.0, 2.0, 1.0]))
        >>> t.total(), t.find(np.array([0.5, 1.5, 3.5])).tolist()
        (4.0, [0, 2, 3])
        >>> t = SumTree(3); t.fill(np.array([1.0, 2.0, 4.0])); t.total(), t.range_sum(1, 3)
        (7.0, 6.0)
    """

    combine = np.add

    def total(self) -> float:
        return float(self._tree[1])

    def range_sum(self, start: int, stop: int) -> float:
        """``sum(v[start:stop])`` in O(log n).

        >>> t = SumTree(5); t.update(np.arange(5), np.array([1.0, 2.0, 3.0, 4.0, 5.0]))
        >>> t.range_sum(0, 2), t.range_sum(1, 4), t.range_sum(3, 3)
        (3.0, 9.0, 0.0)
        """
        return self._range(start, stop)

    def find(self, prefix: np.ndarray) -> np.ndarray:
        """Index ``i`` with ``sum(v[:i]) <= u < sum(v[:i+1])`` for each ``u`` in ``prefix``."""
        u = np.asarray(prefix, dtype=np.float64).copy()
        pos = np.ones(u.size, dtype=np.int64)
        while self._n > 1 and pos.size and pos[0] < self._n:
            left = 2 * pos
            lv = self._tree[left]
            right = u >= lv
            u = np.where(right, u - lv, u)
            pos = np.where(right, left + 1, left)
        return pos - self._n


class MinTree(_Tree):
    """Range minima over ``capacity`` values, ``+inf`` where none was set: the smallest ``p`` a shard holds, read
    in O(log n) after each write instead of a pass over every slot.

    >>> t = MinTree(5); t.update(np.array([0, 1, 2]), np.array([3.0, 1.0, 2.0]))
    >>> t.min(), t.range_min(0, 1), t.range_min(2, 5), t.range_min(3, 5)
    (1.0, 3.0, 2.0, inf)
    """

    combine = np.minimum
    empty = np.inf

    def min(self) -> float:
        return float(self._tree[1])

    def range_min(self, start: int, stop: int) -> float:
        return self._range(start, stop)


# The largest p_i = (|priority| + eps) ** alpha a shard stores. A sum of 2**63 of them stays under float64's
# largest number (about 2**1024), so no shard's total, no side's total over its shards and no draw overflows; a
# priority past it is refused whole rather than stored as inf or as a mass that makes every later sum inf.
MAX_STORED_PRIORITY = 2.0 ** 960


def stored_priorities(priority: Any, alpha: float, eps: float) -> np.ndarray:
    """``p_i = (|priority| + eps) ** alpha``, refused whole, naming the first value, where one is not a finite
    number or its ``p_i`` is past ``MAX_STORED_PRIORITY`` (so that its sum over any buffer stays finite).

    >>> stored_priorities([0.0, -3.0], alpha=1.0, eps=1.0).tolist()
    [1.0, 4.0]
    >>> stored_priorities([2.0, 1e308], alpha=1.0, eps=1e-8)
    Traceback (most recent call last):
    rayrb.errors.InvalidArgumentError: priority 1e+308 (at position 1) cannot be held: (|p| + eps) ** alpha = 1e+308 \
with alpha=1.0, eps=1e-08, expected at most 9.75e+288 (2**960) so that sums over the buffer stay finite
    """
    q = np.asarray(priority, dtype=np.float64).reshape(-1)
    finite = np.isfinite(q)
    if not finite.all():
        raise InvalidArgumentError(f"priorities must be finite numbers, got {q[~finite][:3].tolist()}")
    with np.errstate(over="ignore"):
        p = (np.abs(q) + eps) ** alpha
    bad = np.flatnonzero(~(p <= MAX_STORED_PRIORITY))
    if bad.size:
        i = int(bad[0])
        raise InvalidArgumentError(
            f"priority {float(q[i])!r} (at position {i}) cannot be held: (|p| + eps) ** alpha = {float(p[i])!r} with "
            f"alpha={alpha!r}, eps={eps!r}, expected at most {MAX_STORED_PRIORITY:.3g} (2**960) so that sums over "
            "the buffer stay finite")
    return p


class PrioritizedSampler(Sampler):
    """Rows drawn with probability ``p_i / sum(p)``, where ``p_i = (|priority_i| + eps) ** alpha``.

    New rows get the largest priority seen so far, so each is likely to be drawn once
    (Schaul et al.'s prioritized replay, as TorchRL's ``PrioritizedSampler``).
    """

    name = "prioritized"
    allocator = PrioritizedAllocator
    per_slot_state = True

    def __init__(self, capacity: int, alpha: float = ALPHA, eps: float = EPS, **options: Any):
        opts = priority_options(alpha=alpha, eps=eps)
        self.tree = SumTree(capacity)
        self._low: MinTree | None = None  # the same values' minima, made at the first ``mass`` (slices never ask)
        self.alpha, self.eps = opts["alpha"], opts["eps"]
        self.max_priority = 1.0
        self._mirror: tuple[np.ndarray, np.ndarray] | None = None

    def _set(self, idx: np.ndarray, values: np.ndarray) -> None:
        self.tree.update(idx, values)
        if self._low is not None:
            self._low.update(idx, values)
        if self._mirror is not None:  # the mapped copy that a restarted shard reloads
            self._mirror[0][np.asarray(idx, dtype=np.int64)] = values
            self._mirror[1][0] = self.max_priority

    def attach(self, priority: np.ndarray, max_priority: np.ndarray, reopened: bool) -> None:
        everything = np.arange(self.tree.capacity)
        if reopened:
            self.tree.update(everything, np.asarray(priority[:self.tree.capacity]))
            self._low = None  # made again from the tree when asked
            self.max_priority = float(max_priority[0])
        else:
            priority[:self.tree.capacity] = self.tree.values(everything)
            max_priority[0] = self.max_priority
        self._mirror = (priority, max_priority)

    def add(self, idx: np.ndarray) -> None:
        self._set(idx, np.full(len(idx), self.max_priority ** self.alpha))

    on_write = add

    def info(self, idx: np.ndarray, generation: np.ndarray | None = None) -> dict[str, np.ndarray]:
        return {"priority": self.tree.values(idx)}  # p_i, for importance weights

    def check_priority(self, idx: np.ndarray, priority: np.ndarray) -> None:
        stored_priorities(priority, self.alpha, self.eps)

    def set_priority(self, idx: np.ndarray, priority: np.ndarray) -> None:
        stored = stored_priorities(priority, self.alpha, self.eps)  # refused whole before anything changes
        if stored.size:
            self.max_priority = max(self.max_priority, float(np.abs(np.asarray(priority, np.float64)).max() + self.eps))
        self._set(idx, stored)

    update_priority = set_priority

    def _total(self, size: int) -> float:
        """``sum(p[:size])``: rows a shard holds past a hole have priorities but are not counted yet, so they
        neither add to its mass nor lend theirs to the last counted row."""
        if size < self.tree.capacity and self.tree.range_sum(size, self.tree.capacity) > 0:
            return self.tree.range_sum(0, size)
        return self.tree.total()  # the same sum, added in the tree's order

    def mass(self, size: int) -> tuple[float, float]:
        """Total and smallest ``p_i`` over the first ``size`` rows."""
        if size <= 0:
            return self._total(size), 0.0
        if self._low is None:
            self._low = MinTree(self.tree.capacity)
            self._low.fill(self.tree.values(np.arange(self.tree.capacity)))
        return self._total(size), self._low.range_min(0, size)

    def sample(self, count: int, size: int, rng: np.random.Generator, epoch: Epoch | None = None) -> np.ndarray:
        total = self._total(size)
        if count > 0 and (size <= 0 or total <= 0):
            raise DrawError(f"cannot draw {count} rows from a shard with no priority mass")
        u = rng.uniform(0.0, total, count) * (1.0 - 1e-12)
        return np.minimum(self.tree.find(u), size - 1)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {"priority": self.tree.values(np.arange(self.tree.capacity)),
                "max_priority": np.float64(self.max_priority)}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        priority = np.asarray(state["priority"], dtype=np.float64)
        if priority.shape != (self.tree.capacity,) or not np.all(np.isfinite(priority)) or np.any(priority < 0):
            raise SavedStateError(f"expected {self.tree.capacity} finite non-negative priorities, got shape "
                                  f"{priority.shape}")
        max_p = float(state["max_priority"])
        with np.errstate(over="ignore"):
            new_row = np.float64(max_p) ** self.alpha  # what the next written row gets
        if priority.max(initial=0.0) > MAX_STORED_PRIORITY or not (max_p >= 0 and new_row <= MAX_STORED_PRIORITY):
            raise SavedStateError(f"expected stored priorities and max_priority ** alpha in [0, "
                                  f"{MAX_STORED_PRIORITY:.3g}], got {priority.max(initial=0.0)!r} and "
                                  f"{max_p!r} ** {self.alpha!r}: sums over them would not stay finite")
        self.max_priority = max_p
        self._set(np.arange(self.tree.capacity), priority)
