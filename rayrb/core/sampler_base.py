"""The base of a shard's sampler: what every sampling kind's shard half answers (``rayrb.core.samplers`` holds the
kinds and their registry). No Ray here."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from rayrb.core.allocators import Allocator
from rayrb.core.plans import Epoch
from rayrb.errors import InvalidArgumentError


class Sampler:
    """The shard side of a sampling kind. Subclasses set ``name`` and ``allocator`` and override what differs."""

    name: ClassVar[str] = "sampler"
    allocator: ClassVar[type[Allocator]] = Allocator
    per_slot_state: ClassVar[bool] = False  # whether ``attach`` has anything to keep

    def __init__(self, capacity: int = 0, **options: Any):
        pass

    def sample(self, count: int, size: int, rng: np.random.Generator | None, epoch: Epoch | None = None) -> np.ndarray:
        raise NotImplementedError

    def on_write(self, idx: np.ndarray) -> None:
        """Slots ``idx`` now hold new rows."""

    def info(self, idx: np.ndarray, generation: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Per-row provenance beyond index and generation; ``generation``: the slots' generations as the read
        found them (a reader copying while another process writes), else read now."""
        return {}

    def mass(self, size: int) -> tuple[float, float]:
        """``(total mass, smallest p_i)`` that the allocator weighs this shard by."""
        return float(size), 1.0

    def update_priority(self, idx: np.ndarray, priority: np.ndarray) -> None:
        raise InvalidArgumentError(f"update_priority needs sampler='prioritized', this shard samples {self.name!r}")

    def check_priority(self, idx: np.ndarray, priority: np.ndarray) -> None:
        """Raise before anything changes if ``update_priority`` would refuse these values."""
        self.update_priority(idx[:0], priority[:0])

    def state_dict(self) -> dict[str, np.ndarray]:
        return {}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        pass

    def attach(self, priority: np.ndarray, max_priority: np.ndarray, reopened: bool) -> None:
        """Keep per-slot state in these (memory-mapped) arrays, reloading it from them if ``reopened``."""

    def bind(self, rows: Mapping[str, np.ndarray], generation: np.ndarray | None, written: np.ndarray | None = None,
             count: np.ndarray | None = None) -> None:
        """The shard's rows by key and (online) its slots' generations, for a kind that draws by what rows hold;
        its write count's one-element array, as ``written`` where another process writes (a handle reading the
        shard's files) or as ``count`` in the shard itself."""
