"""The coordinator's half of a sampling kind: per-shard counts for one side of a batch. No Ray here.

An allocator turns "``n`` rows from this side" into per-shard counts whose
distribution is that of sampling the union of shards (``rayrb.core.allocation``
has the math):

* ``UniformAllocator``: ``Multinomial(n, size_i / sum(size))``;
* ``WithoutReplacementAllocator``: multivariate hypergeometric over the rows
  each shard has left in the epoch; it owns the epochs and ``drop_last``;
* ``PrioritizedAllocator``: ``Multinomial(n, mass_i / sum(mass))``, and the
  importance weights' global ``min p`` per side.

A draw is two steps, so that a refused call changes nothing: ``Allocator.check``
validates both sides and reports which need a new epoch, touching no state; only
then ``Allocator.begin_epoch`` and ``Allocator.counts`` mutate.

Examples:
    >>> import numpy as np
    >>> a = WithoutReplacementAllocator({"offline": 2, "online": 1})
    >>> sizes = {"offline": np.array([3, 2]), "online": np.array([0])}
    >>> a.check({"offline": 4, "online": 0}, sizes)  # no epoch yet: one begins
    {'offline': True, 'online': False}
    >>> rng = np.random.default_rng(0)
    >>> a.begin_epoch("offline", sizes["offline"], rng)
    >>> int(a.counts("offline", 4, sizes["offline"], rng).sum()), int(a.left("offline").sum())
    (4, 1)
    >>> a.check({"offline": 2, "online": 0}, sizes)
    Traceback (most recent call last):
    rayrb.errors.DrawError: cannot draw 2 offline rows without replacement: 1 left in the epoch; ...
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from rayrb.core.allocation import hypergeometric_counts, multinomial_counts
from rayrb.core.plans import OFFLINE, ONLINE, SIDES, Epoch, ImportanceWeights
from rayrb.core.validation import BETA, finite_number
from rayrb.errors import DrawError, InvalidArgumentError, SavedStateError

Sizes = Mapping[str, np.ndarray]


class Allocator:
    """Per-shard counts for one kind of sampling. The base allocates by size (uniform with replacement)."""

    uses_masses = False  # the coordinator feeds ``set_masses`` before each draw
    reads_with_args = False  # whether ``read_args`` can return anything
    groups_batches = True  # several batches may be drawn ahead in one group of reads
    # What a batch does when a side has fewer rows left in its epoch than it needs ("short", "drop", "raise"):
    # None for a kind without epochs. The planner reads it rather than guessing from the kind.
    epoch_end: str | None = None
    unit = 1  # rows per drawn item: a batch is planned in items (a slice sampler's slices), its parts in rows

    def __init__(self, num_shards: Mapping[str, int], **options: Any):
        self.num_shards = {side: int(num_shards[side]) for side in SIDES}

    def drawable(self, side: str, sizes: np.ndarray) -> int:
        """Items ``side`` can draw from now (its rows, unless a kind draws other items): none means all offline."""
        return int(sizes.sum())

    def check(self, need: Mapping[str, int], sizes: Sizes) -> dict[str, bool]:
        """Raise if ``need[side]`` rows cannot be drawn; else say which sides begin an epoch. Changes nothing."""
        return {side: False for side in SIDES}

    def begin_epoch(self, side: str, sizes: np.ndarray, rng: np.random.Generator) -> None:
        pass

    def counts(self, side: str, n: int, sizes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return multinomial_counts(n, sizes, rng)

    def read_args(self, side: str, shard: int) -> dict[str, Any]:
        """Extra keyword arguments for shard ``shard``'s next read (its place in the epoch)."""
        return {}

    def room(self, side: str) -> int | None:
        """Rows ``side`` can give before its epoch ends (None: no limit, or a fresh epoch begins)."""
        return None

    def epoch_room(self, side: str, sizes: np.ndarray) -> int | None:
        """Items a batch of ``side`` may take in its epoch: what is left, or, where the next epoch begins with this
        batch, every item the side holds; None: no epochs, no bound."""
        left = self.room(side)
        return left if left is not None or self.epoch_end is None else self.drawable(side, sizes)

    def epoch_over(self, side: str) -> bool:
        """Whether ``side``'s epoch has just served its last row."""
        return False

    def weights(self) -> ImportanceWeights | None:
        return None

    def stats(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


class UniformAllocator(Allocator):
    """Uniform with replacement: counts ~ Multinomial(n, size_i / sum(size))."""


EPOCH_ENDS = ("short", "drop", "raise")


def epoch_end_option(epoch_end: str | None, drop_last: bool | None) -> str:
    """``epoch_end`` from it and TorchRL's ``drop_last`` (True: ``"drop"``, False: ``"short"``); default ``"short"``."""
    from rayrb.core.validation import one_of

    if drop_last is not None:
        implied = "drop" if drop_last else "short"
        if epoch_end is not None and epoch_end != implied:
            raise InvalidArgumentError(
                f"drop_last={drop_last!r} means epoch_end={implied!r}, got epoch_end={epoch_end!r}")
        return implied
    return one_of("epoch_end", "short" if epoch_end is None else epoch_end, EPOCH_ENDS)


class WithoutReplacementAllocator(Allocator):
    """Epochs over the union of shards: counts ~ multivariate hypergeometric over the rows left per shard.

    An epoch of a side begins with that side's first draw, and again when its rows
    run out. When a side has fewer rows left than a batch needs, ``epoch_end`` says
    what happens: ``"short"`` (TorchRL's default) serves a short final batch with
    what is left, split exactly (the planner shrinks it, see ``room``);
    ``"drop"`` (TorchRL's ``drop_last=True``) drops the rows left and begins the next
    epoch; ``"raise"`` refuses the call.
    """

    groups_batches = False  # a refused draw must never follow one already taken

    def __init__(self, num_shards: Mapping[str, int], *, epoch_end: str | None = None, drop_last: bool | None = None,
                 **options: Any):
        super().__init__(num_shards)
        self.epoch_end = epoch_end_option(epoch_end, drop_last)
        self._left: dict[str, np.ndarray | None] = {side: None for side in SIDES}
        self._epoch: dict[str, dict[str, Any] | None] = {side: None for side in SIDES}
        self.epochs = {side: 0 for side in SIDES}

    def left(self, side: str) -> np.ndarray:
        """Rows each shard of ``side`` has left in the current epoch."""
        left = self._left[side]
        return np.zeros(self.num_shards[side], np.int64) if left is None else left.copy()

    def _needs_epoch(self, side: str, n: int, sizes: np.ndarray) -> bool:
        if n > sizes.sum():
            raise DrawError(f"cannot draw {n} {side} rows without replacement: "
                            f"the {side} side holds {int(sizes.sum())} rows")
        left = self._left[side]
        if left is None or left.sum() == 0:
            return True
        if n > left.sum():
            if self.epoch_end != "drop":
                raise DrawError(
                    f"cannot draw {n} {side} rows without replacement: {int(left.sum())} left in the epoch; "
                    f"pass drop_last=True (epoch_end='drop') to drop them and start the next epoch, or "
                    f"epoch_end='short' for a short final batch")
            return True
        return False

    def room(self, side: str) -> int | None:
        left = self._left[side]
        return None if left is None or left.sum() == 0 else int(left.sum())

    def epoch_over(self, side: str) -> bool:
        left = self._left[side]
        return left is not None and left.sum() == 0

    def check(self, need: Mapping[str, int], sizes: Sizes) -> dict[str, bool]:
        return {side: need[side] > 0 and self._needs_epoch(side, need[side], sizes[side]) for side in SIDES}

    def begin_epoch(self, side: str, sizes: np.ndarray, rng: np.random.Generator) -> None:
        seeds = rng.integers(0, 2**63 - 1, self.num_shards[side])
        self.epochs[side] += 1
        self._epoch[side] = {"number": self.epochs[side], "seeds": seeds.astype(np.int64),
                             "sizes": np.asarray(sizes, np.int64).copy()}
        self._left[side] = np.asarray(sizes, np.int64).copy()

    def counts(self, side: str, n: int, sizes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        counts = hypergeometric_counts(n, self._left[side], rng)
        self._left[side] = self._left[side] - counts
        return counts

    reads_with_args = True

    def read_args(self, side: str, shard: int) -> dict[str, Any]:
        """The epoch a read belongs to and where it starts, so a shard can rebuild its place exactly."""
        e = self._epoch[side]
        if e is None:
            return {}
        start = int(e["sizes"][shard] - self._left[side][shard])
        return {"epoch": Epoch(int(e["number"]), int(e["seeds"][shard]), int(e["sizes"][shard]), start)}

    def stats(self) -> dict[str, Any]:
        return {"epochs": dict(self.epochs)}

    def state_dict(self) -> dict[str, Any]:
        return {"epochs": dict(self.epochs),
                "left": {s: None if v is None else v.tolist() for s, v in self._left.items()},
                "epoch": {s: None if e is None else {"number": e["number"], "seeds": e["seeds"].tolist(),
                                                     "sizes": e["sizes"].tolist()}
                          for s, e in self._epoch.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        left, epoch = {}, {}
        for side in SIDES:
            v, e = state["left"][side], state["epoch"][side]
            left[side] = None if v is None else np.asarray(v, np.int64)
            epoch[side] = None if e is None else {"number": int(e["number"]), "seeds": np.asarray(e["seeds"], np.int64),
                                                  "sizes": np.asarray(e["sizes"], np.int64)}
            for arr in (left[side], None if e is None else epoch[side]["sizes"]):
                if arr is not None and arr.shape != (self.num_shards[side],):
                    raise SavedStateError(f"saved {side} epoch has {arr.shape[0]} shards, this buffer has "
                                          f"{self.num_shards[side]}")
        self._left, self._epoch = left, epoch
        self.epochs = {side: int(state["epochs"][side]) for side in SIDES}


class PrioritizedAllocator(Allocator):
    """Counts ~ Multinomial(n, mass_i / sum(mass)); importance weights against each side's global ``min p``."""

    uses_masses = True

    def __init__(self, num_shards: Mapping[str, int], *, beta: float = BETA, **options: Any):
        super().__init__(num_shards)
        self.beta = finite_number("beta", beta, minimum=0.0)
        self._mass = {side: np.zeros(self.num_shards[side]) for side in SIDES}
        self._min_p = {side: 1.0 for side in SIDES}

    def set_masses(self, side: str, stats: list[tuple[float, float]], sizes: np.ndarray) -> None:
        """Each shard's ``(total mass, smallest p)``; empty shards do not count towards ``min p``."""
        self._mass[side] = np.asarray([m for m, _ in stats], dtype=np.float64)
        mins = [p for (_, p), size in zip(stats, sizes) if size > 0]
        self._min_p[side] = float(min(mins)) if mins else 1.0

    def counts(self, side: str, n: int, sizes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return multinomial_counts(n, self._mass[side], rng)

    def weights(self) -> ImportanceWeights:
        # w = (p_i / min p)^-beta: the (N P(i))^-beta of the union of shards, normalized by its largest value.
        return ImportanceWeights(self.beta, {OFFLINE: self._min_p[OFFLINE], ONLINE: self._min_p[ONLINE]})


class PerSide(Allocator):
    """Each side allocated by its own kind (TorchRL's O2O samples its online side with replacement,
    whatever the offline side does)."""

    def __init__(self, parts: Mapping[str, Allocator], num_shards: Mapping[str, int]):
        super().__init__(num_shards)
        self.parts = {side: parts[side] for side in SIDES}
        self.uses_masses = any(a.uses_masses for a in self.parts.values())
        self.unit = self.parts[OFFLINE].unit  # the sides draw items of one size (settings refuse others)
        self.groups_batches = all(a.groups_batches for a in self.parts.values())
        self.epoch_end = next((a.epoch_end for a in self.parts.values() if a.epoch_end is not None), None)

    def check(self, need: Mapping[str, int], sizes: Sizes) -> dict[str, bool]:
        return {side: self.parts[side].check({s: need[s] if s == side else 0 for s in SIDES}, sizes)[side]
                for side in SIDES}

    def drawable(self, side: str, sizes: np.ndarray) -> int:
        return self.parts[side].drawable(side, sizes)

    def begin_epoch(self, side: str, sizes: np.ndarray, rng: np.random.Generator) -> None:
        self.parts[side].begin_epoch(side, sizes, rng)

    def counts(self, side: str, n: int, sizes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return self.parts[side].counts(side, n, sizes, rng)

    @property
    def reads_with_args(self) -> bool:
        return any(a.reads_with_args for a in self.parts.values())

    def read_args(self, side: str, shard: int) -> dict[str, Any]:
        return self.parts[side].read_args(side, shard)

    def room(self, side: str) -> int | None:
        return self.parts[side].room(side)

    def epoch_room(self, side: str, sizes: np.ndarray) -> int | None:
        return self.parts[side].epoch_room(side, sizes)

    def epoch_over(self, side: str) -> bool:
        return self.parts[side].epoch_over(side)

    def set_masses(self, side: str, stats: list[tuple[float, float]], sizes: np.ndarray) -> None:
        if self.parts[side].uses_masses:
            self.parts[side].set_masses(side, stats, sizes)

    def weights(self) -> ImportanceWeights | None:
        found = [a.weights() for a in self.parts.values() if a.weights() is not None]
        if not found:
            return None
        min_p = {side: a.weights().min_p[side] for side, a in self.parts.items() if a.weights() is not None}
        return ImportanceWeights(found[0].beta, min_p)

    def stats(self) -> dict[str, Any]:
        return {"epochs": {side: a.stats().get("epochs", {}).get(side, 0) for side, a in self.parts.items()}}

    def state_dict(self) -> dict[str, Any]:
        return {side: a.state_dict() for side, a in self.parts.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for side, a in self.parts.items():
            a.load_state_dict(state[side])


ALLOCATORS: dict[str, type[Allocator]] = {
    "uniform": UniformAllocator,
    "without_replacement": WithoutReplacementAllocator,
    "prioritized": PrioritizedAllocator,
}


def register_allocator(name: str, cls: type[Allocator]) -> None:
    """Make ``cls`` the coordinator's half of sampling kind ``name`` (``rayrb.core.samplers.register_sampler``
    registers both halves)."""
    ALLOCATORS[name] = cls


def allocator_class(name: str) -> type[Allocator]:
    if not isinstance(name, str) or name not in ALLOCATORS:
        raise InvalidArgumentError(f"sampler must be one of {tuple(ALLOCATORS)}, got {name!r}")
    return ALLOCATORS[name]


def make_allocator(sampler: str | Mapping[str, str], num_shards: Mapping[str, int], **options: Any) -> Allocator:
    """The allocator registered for sampling kind ``sampler``, or for ``{"offline": kind, "online": kind}``,
    one per side.

    >>> type(make_allocator({"offline": "without_replacement", "online": "uniform"}, {"offline": 1, "online": 1}))
    <class 'rayrb.core.allocators.PerSide'>
    """
    if isinstance(sampler, Mapping):
        if sampler[OFFLINE] != sampler[ONLINE]:
            return PerSide({side: allocator_class(kind)(num_shards, **options) for side, kind in sampler.items()},
                           num_shards)
        sampler = sampler[OFFLINE]
    return allocator_class(sampler)(num_shards, **options)
