"""Per-shard samplers: which local rows a shard returns for a count the coordinator gave it.

They are plain numpy objects that shard actors hold; the coordinator decides
*how many* rows each shard draws (:mod:`rayrb.allocation`), a sampler decides
*which*.

Examples:
    >>> import numpy as np
    >>> s = make_sampler("without_replacement")
    >>> s.begin_epoch(5, np.random.default_rng(0))
    >>> sorted(np.concatenate([s.sample(2, 5, None), s.sample(3, 5, None)]).tolist())
    [0, 1, 2, 3, 4]
"""
from __future__ import annotations

import numpy as np

SAMPLERS = ("uniform", "without_replacement", "prioritized")


class UniformSampler:
    """Rows drawn uniformly with replacement from ``[0, size)``."""

    name = "uniform"

    def sample(self, count: int, size: int, rng: np.random.Generator | None) -> np.ndarray:
        if count > 0 and size <= 0:
            raise ValueError(f"cannot draw {count} rows from an empty shard")
        return rng.integers(0, size, count, dtype=np.int64)

    def remaining(self) -> int | None:
        return None


class WithoutReplacementSampler:
    """One random permutation per epoch; each row of the epoch is drawn exactly once.

    The epoch covers the rows present when it began; rows written later join the next one.
    """

    name = "without_replacement"

    def __init__(self) -> None:
        self._perm = np.empty(0, dtype=np.int64)
        self._cursor = 0
        self.epoch = 0

    def begin_epoch(self, size: int, rng: np.random.Generator) -> None:
        self._perm = rng.permutation(size).astype(np.int64)
        self._cursor = 0
        self.epoch += 1

    def remaining(self) -> int:
        return int(self._perm.size - self._cursor)

    def sample(self, count: int, size: int, rng: np.random.Generator | None) -> np.ndarray:
        if count > self.remaining():
            raise ValueError(f"cannot draw {count} rows without replacement: {self.remaining()} left in the epoch")
        out = self._perm[self._cursor:self._cursor + count]
        self._cursor += count
        return out


class SumTree:
    """Prefix sums over ``capacity`` non-negative values: O(log n) vectorized updates and lookups.

    Examples:
        >>> t = SumTree(4)
        >>> t.update(np.array([0, 1, 2, 3]), np.array([1.0, 0.0, 2.0, 1.0]))
        >>> t.total(), t.find(np.array([0.5, 1.5, 3.5])).tolist()
        (4.0, [0, 2, 3])
    """

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError(f"capacity must be a positive integer, got {capacity}")
        self.capacity = int(capacity)
        self._n = 1 << (self.capacity - 1).bit_length()
        self._tree = np.zeros(2 * self._n, dtype=np.float64)

    def update(self, idx: np.ndarray, values: np.ndarray) -> None:
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size == 0:
            return
        self._tree[idx + self._n] = values  # with repeated indices the last value wins
        pos = np.unique((idx + self._n) // 2)
        while pos.size:
            self._tree[pos] = self._tree[2 * pos] + self._tree[2 * pos + 1]
            pos = np.unique(pos[pos > 1] // 2)

    def total(self) -> float:
        return float(self._tree[1])

    def values(self, idx: np.ndarray) -> np.ndarray:
        return self._tree[np.asarray(idx, dtype=np.int64) + self._n]

    def min(self, size: int) -> float:
        return float(self._tree[self._n:self._n + size].min()) if size else 0.0

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


class PrioritizedSampler:
    """Rows drawn with probability ``p_i / sum(p)``, where ``p_i = (|priority_i| + eps) ** alpha``.

    New rows get the largest priority seen so far, so each is likely to be drawn once
    (Schaul et al.'s prioritized replay, as TorchRL's ``PrioritizedSampler``).
    """

    name = "prioritized"

    def __init__(self, capacity: int, alpha: float = 0.6, eps: float = 1e-8):
        if alpha < 0 or eps <= 0:
            raise ValueError(f"expected alpha >= 0 and eps > 0, got alpha={alpha}, eps={eps}")
        self.tree = SumTree(capacity)
        self.alpha, self.eps = float(alpha), float(eps)
        self.max_priority = 1.0

    def add(self, idx: np.ndarray) -> None:
        self.tree.update(idx, np.full(len(idx), self.max_priority ** self.alpha))

    def set_priority(self, idx: np.ndarray, priority: np.ndarray) -> None:
        priority = np.abs(np.asarray(priority, dtype=np.float64)) + self.eps
        if priority.size:
            self.max_priority = max(self.max_priority, float(priority.max()))
        self.tree.update(idx, priority ** self.alpha)

    def mass(self, size: int) -> tuple[float, float]:
        """Total and smallest ``p_i`` over the first ``size`` rows."""
        return self.tree.total(), self.tree.min(size)

    def sample(self, count: int, size: int, rng: np.random.Generator) -> np.ndarray:
        total = self.tree.total()
        if count > 0 and (size <= 0 or total <= 0):
            raise ValueError(f"cannot draw {count} rows from a shard with no priority mass")
        u = rng.uniform(0.0, total, count) * (1.0 - 1e-12)
        return np.minimum(self.tree.find(u), size - 1)

    def remaining(self) -> None:
        return None


def make_sampler(name: str, capacity: int = 0, alpha: float = 0.6, eps: float = 1e-8):
    if name == "uniform":
        return UniformSampler()
    if name == "without_replacement":
        return WithoutReplacementSampler()
    if name == "prioritized":
        return PrioritizedSampler(capacity, alpha, eps)
    raise ValueError(f"sampler must be one of {SAMPLERS}, got {name!r}")
