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

SAMPLERS = ("uniform", "without_replacement")


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


def make_sampler(name: str):
    if name == "uniform":
        return UniformSampler()
    if name == "without_replacement":
        return WithoutReplacementSampler()
    raise ValueError(f"sampler must be one of {SAMPLERS}, got {name!r}")
