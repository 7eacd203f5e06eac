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
The starts' tree follows the episodes: a write updates it at the slots near its rows (``PrioritizedEpisodeSlices._moved``),
anything else builds it again; priority updates change it in place.

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
from rayrb.core.episode_stream import Stream
from rayrb.core.episodes import Slices
from rayrb.core.plans import Epoch
from rayrb.core.priorities import MinTree, PrioritizedSampler, SumTree
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
        n = max(1, int(capacity))
        self._p = PrioritizedSampler(n, alpha=alpha, eps=eps)
        self._built: Any = None  # the slices the starts' tree holds
        self._starts = SumTree(n)  # p at the slots a valid slice starts at, 0 elsewhere
        self._start_low = MinTree(n)  # the same, +inf elsewhere: its root is min p
        self._valid = np.zeros(n, bool)  # slot -> whether a valid slice starts there

    def _start_tree(self, size: int) -> Any:
        """The valid slices of the first ``size`` slots, with the starts' tree built for them."""
        slices = self._slices(size)
        if self._built is not slices:
            self._set_starts(self._slots(slices.first_steps()), None)
            self._built = slices
        return slices

    def _set_starts(self, slots: np.ndarray, valid: np.ndarray | None) -> None:
        """``slots`` start a valid slice where ``valid`` says; None: they are all the valid starts there are."""
        p = self._p.tree.values(slots)
        if valid is None:
            self._valid[:] = False
            self._valid[slots] = True
            at = np.zeros(self._valid.size)
            at[slots] = p
            self._starts.fill(at)
            at[:] = np.inf
            at[slots] = p
            self._start_low.fill(at)
        else:
            self._valid[slots] = valid
            self._starts.update(slots, np.where(valid, p, 0.0))
            self._start_low.update(slots, np.where(valid, p, np.inf))

    def _moved(self, before: tuple[Stream, Slices], after: tuple[Stream, Slices]) -> None:
        """Rows appended: only the starts near them change (the new rows, whose slots the overwritten rows held;
        the last ``slice_len`` rows before them, which may now start a slice; the first rows still held, which
        start an episode cut short), so the tree is updated there, not built again."""
        if self._built is not before[1]:
            return
        (old, _), (new, slices) = before, after
        rows = np.union1d(np.arange(max(new.low, old.high - self._len), new.high, dtype=np.int64),
                          np.arange(new.low, min(new.low + self._len, new.high), dtype=np.int64))
        self._set_starts(self._slots(rows), slices.starts_at(rows)[0])
        self._built = slices

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
        starts = idx[self._valid[idx]]  # steps that start a valid slice: their tree entry follows
        self._set_starts(starts, np.ones(starts.size, bool))

    set_priority = update_priority

    # what a read answers ---------------------------------------------------------------------------------
    def info(self, idx: np.ndarray, generation: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Each step's episode (``EpisodeSlices.info``) and its slice's ``p``: a read is whole slices of
        ``slice_len`` steps (short ones padded), each first step the start it was drawn by."""
        idx = np.asarray(idx, np.int64)
        if idx.size % self._len:
            return {**super().info(idx, generation), "priority": self._p.tree.values(idx)}
        return {**super().info(idx, generation),
                "priority": np.repeat(self._p.tree.values(idx.reshape(-1, self._len)[:, 0]), self._len)}

    def mass(self, size: int) -> tuple[float, float]:
        """``(sum of p over the valid starts, smallest of them)``; ``(0, 1)`` without a valid slice."""
        slices = self._start_tree(size)
        if slices.total == 0:
            return 0.0, 1.0
        return self._starts.total(), self._start_low.min()

    def sample(self, count: int, size: int, rng: np.random.Generator | None, epoch: Epoch | None = None) -> np.ndarray:
        size = self._over(size, count)
        self._start_tree(size)
        return super().sample(count, size, rng, epoch)

    def _items(self, k: int, total: int, rng: np.random.Generator | None, epoch: Epoch | None) -> np.ndarray:
        """Which valid slices a read of ``k`` draws: by the ``p`` of their first step, with replacement."""
        mass = self._starts.total()
        if k and not mass > 0:
            raise DrawError(f"cannot draw {k} slices by priority: the {total} valid slices here have no priority mass")
        slots = np.minimum(self._starts.find(rng.uniform(0.0, mass, k) * (1.0 - 1e-12)), self._valid.size - 1)
        off = ~self._valid[slots]
        if off.any():  # a float edge landed past the last start: the start before it
            valid = np.flatnonzero(self._valid)
            slots[off] = valid[np.clip(np.searchsorted(valid, slots[off], side="right") - 1, 0, valid.size - 1)]
        return self._drawn[1].starts_at(self._rows(slots))[1]
