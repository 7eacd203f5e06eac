"""Slices drawn by priority: TorchRL's ``PrioritizedSliceSampler`` over shards, with an exact offline share.

``SliceSampler(slice_len=L, prioritized=True)`` (or ``sampler="prioritized_slice"``) draws each slice's first step
by priority among the steps a valid slice starts at, as TorchRL's ``PrioritizedSliceSampler`` does:

* each step ``i`` holds ``p_i = (|priority_i| + eps) ** alpha`` (new steps the largest priority seen, so each is
  likely drawn once), set with ``update_priority`` for each step of a batch as for rows (to weigh a whole slice,
  give each of its steps the slice's priority: R2D2 gives ``eta * max + (1 - eta) * mean`` of its TD errors);
* a slice starting at step ``s`` is drawn with probability ``p_s / sum(p over valid starts)`` of its side: each
  shard's *mass* is the sum of ``p`` over the starts of its valid slices (a step with fewer than ``L`` steps after
  it in its episode starts none, unless its episode is shorter than ``L`` and ``strict_length=False``), each side's
  slices are spread over its shards ~ Multinomial over their masses (``PrioritizedSliceAllocator``), and each
  shard draws its count from a sum tree holding ``p`` at its valid starts only (``PrioritizedEpisodeSlices``);
* every step of a slice carries the slice's importance weight ``(p_s / min p) ** -beta``, ``min p`` over the valid
  starts of the side (TorchRL's ``(N * P(s)) ** -beta`` normalized by its largest value), in ``info["weight"]``.

The split is planned in slices as for uniform slices: ``floor(f * num_slices + 1/2)`` offline, the rest online.
The starts' tree is built again after each write (the valid starts move with the episodes, as the uniform slices'
count does) and updated in place by priority updates.

Examples:
    >>> import numpy as np
    >>> s = PrioritizedEpisodeSlices(capacity=8, slice_len=2, slice_key="episode", alpha=1.0, eps=1e-9)
    >>> s.bind({"episode": np.array([0, 0, 0, 1, 1, 2, 3, 3])}, None)
    >>> s.on_write(np.arange(8))
    >>> s.update_priority(np.arange(8), np.array([1.0, 2.0, 9.0, 4.0, 9.0, 9.0, 8.0, 9.0]))
    >>> [round(m, 6) for m in s.mass(8)]  # valid starts: steps 0, 1, 3 and 6 (2 and 4 end an episode; 5 is alone)
    [15.0, 1.0]
    >>> steps = s.sample(2 * 4000, 8, np.random.default_rng(0)).reshape(-1, 2)
    >>> (np.bincount(steps[:, 0], minlength=8)[[0, 1, 3, 6]] / 4000 * 15).round().tolist()  # p of each start
    [1.0, 2.0, 4.0, 8.0]
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from rayrb.core.allocators import PrioritizedAllocator
from rayrb.core.plans import Epoch
from rayrb.core.priorities import PrioritizedSampler, SumTree
from rayrb.core.slice_sampling import NAME_PRIORITIZED, EpisodeSlices
from rayrb.core.validation import ALPHA, BETA, EPS, positive_int
from rayrb.errors import DrawError


class PrioritizedSliceAllocator(PrioritizedAllocator):
    """A batch planned in slices of ``slice_len`` rows, each side's spread over its shards by their masses (the
    sum of ``p`` over their valid starts); weights against the smallest ``p`` of a valid start on the side."""

    def __init__(self, num_shards: Mapping[str, int], *, slice_len: int = 1, beta: float = BETA, **options: Any):
        super().__init__(num_shards, beta=beta)
        self.unit = positive_int("slice_len", slice_len)

    def set_masses(self, side: str, stats: list[tuple[float, float]], sizes: np.ndarray) -> None:
        """Each shard's ``(mass, smallest p of a valid start)``; a shard without a valid slice has no mass and
        does not count towards ``min p``."""
        self._mass[side] = np.asarray([m for m, _ in stats], dtype=np.float64)
        mins = [p for m, p in stats if m > 0]
        self._min_p[side] = float(min(mins)) if mins else 1.0

    def drawable(self, side: str, sizes: np.ndarray) -> int:
        """Shards of ``side`` holding a slice that can be drawn (none: the batch is all offline)."""
        return int((self._mass[side] > 0).sum())


class PrioritizedEpisodeSlices(EpisodeSlices):
    """A shard's slices by the priority of their first step (see the module): the slices of ``EpisodeSlices`` and
    the per-step priorities of ``PrioritizedSampler`` (kept and restored as for rows), with a second sum tree that
    holds ``p`` at the valid starts only."""

    name = NAME_PRIORITIZED
    allocator = PrioritizedSliceAllocator
    per_slot_state = True

    def __init__(self, capacity: int = 0, alpha: float = ALPHA, eps: float = EPS, **options: Any):
        super().__init__(capacity, **options)
        self._p = PrioritizedSampler(max(1, int(capacity)), alpha=alpha, eps=eps)
        self._built: Any = None  # the slices the starts' tree was built for
        self._starts = SumTree(max(1, int(capacity)))
        self._start_slots = np.empty(0, np.int64)  # each valid slice's first slot, by slice number
        self._item_of = np.full(max(1, int(capacity)), -1, np.int64)  # slot -> the slice it starts, or -1
        self._min_p: float | None = None  # the smallest p of a valid start (None: to be found again)

    def _start_tree(self, size: int) -> Any:
        """The valid slices of the first ``size`` slots, with the starts' tree built for them."""
        order, slices = self._slices(size)
        if self._built is not slices:
            self._start_slots = order[slices.first_steps()]
            self._item_of = np.full(self._p.tree.capacity, -1, np.int64)
            self._item_of[self._start_slots] = np.arange(slices.total, dtype=np.int64)
            at_starts, p = np.zeros(self._p.tree.capacity), self._p.tree.values(self._start_slots)
            at_starts[self._start_slots] = p
            self._starts.fill(at_starts)
            self._min_p = float(p.min()) if p.size else None
            self._built = slices
        return slices

    # what a write, a restore or an update changes ---------------------------------------------------------
    def on_write(self, idx: np.ndarray) -> None:
        super().on_write(idx)
        self._p.add(np.asarray(idx, np.int64))

    def attach(self, priority: np.ndarray, max_priority: np.ndarray, reopened: bool) -> None:
        self._p.attach(priority, max_priority, reopened)
        self._built = None

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        self._p.load_state_dict(state)
        super().load_state_dict(state)
        self._built = None

    def state_dict(self) -> dict[str, np.ndarray]:
        return self._p.state_dict()

    def check_priority(self, idx: np.ndarray, priority: np.ndarray) -> None:
        self._p.check_priority(idx, priority)

    def update_priority(self, idx: np.ndarray, priority: np.ndarray) -> None:
        idx = np.asarray(idx, np.int64)
        self._p.set_priority(idx, priority)  # refused whole before anything changes
        starts = idx[self._item_of[idx] >= 0]  # steps that start a valid slice: their tree entry follows
        self._starts.update(starts, self._p.tree.values(starts))
        self._min_p = None

    set_priority = update_priority

    # what a read answers ---------------------------------------------------------------------------------
    def info(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Each step's episode (``EpisodeSlices.info``) and its slice's ``p``: a read is whole slices of
        ``slice_len`` steps (short ones padded), each first step the start it was drawn by."""
        idx = np.asarray(idx, np.int64)
        if idx.size % self._len:
            return {**super().info(idx), "priority": self._p.tree.values(idx)}
        return {**super().info(idx),
                "priority": np.repeat(self._p.tree.values(idx.reshape(-1, self._len)[:, 0]), self._len)}

    def mass(self, size: int) -> tuple[float, float]:
        """``(sum of p over the valid starts, smallest of them)``; ``(0, 1)`` without a valid slice."""
        slices = self._start_tree(size)
        if slices.total == 0:
            return 0.0, 1.0
        if self._min_p is None:
            self._min_p = float(self._p.tree.values(self._start_slots).min())
        return self._starts.total(), self._min_p

    def sample(self, count: int, size: int, rng: np.random.Generator | None, epoch: Epoch | None = None) -> np.ndarray:
        self._start_tree(size)
        return super().sample(count, size, rng, epoch)

    def _items(self, k: int, total: int, rng: np.random.Generator | None, epoch: Epoch | None) -> np.ndarray:
        """Which valid slices a read of ``k`` draws: by the ``p`` of their first step, with replacement."""
        mass = self._starts.total()
        if k and not mass > 0:
            raise DrawError(f"cannot draw {k} slices by priority: the {total} valid slices here have no priority mass")
        slots = self._starts.find(rng.uniform(0.0, mass, k) * (1.0 - 1e-12))
        items = self._item_of[np.minimum(slots, self._item_of.size - 1)]
        off = items < 0  # a float edge landed past the last start: the start before it
        if off.any():
            by_slot = np.argsort(self._start_slots)
            at = np.searchsorted(self._start_slots[by_slot], slots[off], side="right") - 1
            items[off] = by_slot[np.clip(at, 0, by_slot.size - 1)]
        return items

