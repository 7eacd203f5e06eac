"""Slice sampling: batches of consecutive steps of one episode, for learners with memory (recurrent policies, world
models, sequence models), as TorchRL's ``SliceSampler`` draws them, over shards, with an exact offline share.

``sampler=SliceSampler(slice_len=L)`` (or ``num_slices=``, with the buffer's ``batch_size``) makes a batch of
``B`` steps out of ``B / L`` slices of ``L`` steps each, one after another (TorchRL's flat layout). The math is in
``rayrb.core.episodes``; here are its two halves, registered as the sampling kind ``"slice"``:

* ``SliceAllocator`` (the coordinator's): a batch is planned in slices, ``floor(f * B / L + 1/2)`` of them offline
  and the rest online (all offline while no online shard holds a whole slice), each side's slices spread over its
  shards ~ Multinomial over the valid slices each shard holds (its *mass*, asked of the shard after its writes),
  and every count then multiplied by ``L``: so the plan's parts are rows, as for every kind;
* ``EpisodeSlices`` (each shard's): a read of ``k * L`` rows draws ``k`` valid slices uniformly among the shard's
  and returns their steps in order. Episodes come from the rows' trajectory ids (``traj_key``) or end flags
  (``end_key``, TorchRL's default ``("next", "done")``), in write order: an online shard orders its slots by the
  row each holds (its generation), so a slice never reads an overwritten step, a step not yet written, or across
  the wrap of the circular buffer.

A handle on a shard's node reads the shard's files itself for slices as for rows (``rayrb.handle.local``): it
finds the episodes in the mapped column and, after its copy, checks that every slice it copied is still whole
(``whole``), else the shard reads them.

``replacement=False`` draws the offline side's slices without replacement (``SlicesWithoutReplacementAllocator``,
``EpisodeSlicesWithoutReplacement``: each valid slice once an epoch), the online side's with replacement.

``strict_length=False`` (TorchRL's): an episode shorter than ``L`` is one more valid slice, drawn whole (the
shards' mass and the epochs count it once). The plan is unchanged, ``L`` rows a slice: a shard's read pads each
short slice with copies of its last step (``rayrb.core.episodes.padded_steps``), so every read moves the rows it
was planned, wherever it runs; the handle drops the copies by each row's place in its shard and marks each slice's
edges (``rayrb.core.episodes.short_slices``, ``rayrb.handle.output``). A batch of ``B / L`` slices may so hold
fewer than ``B`` steps, as TorchRL's does.

``prioritized=True`` draws each slice by the priority of its first step, on both sides
(``rayrb.core.prioritized_slices``: TorchRL's ``PrioritizedSliceSampler``).

Examples:
    >>> s = SliceSampler(slice_len=4, traj_key="episode")
    >>> s.resolve(["episode", "obs"], batch_size=None)
    {'slice_len': 4, 'slice_key': 'episode', 'slice_ends': False}
    >>> SliceSampler(num_slices=8).resolve(["next/done", "obs"], batch_size=64)
    {'slice_len': 8, 'slice_key': 'next/done', 'slice_ends': True}
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rayrb.core.allocation import multinomial_counts
from rayrb.core.allocators import Allocator, WithoutReplacementAllocator
from rayrb.core.episode_stream import ShardEpisodes, Stream
from rayrb.core.episodes import Slices, padded_steps, slice_count, steps, whole_slices
from rayrb.core.plans import OFFLINE, ONLINE, SIDES, Epoch
from rayrb.core.sampler_base import Sampler
from rayrb.core.schema import SEP
from rayrb.core.validation import positive_int
from rayrb.errors import DrawError, InvalidArgumentError, SchemaError

NAME = "slice"
NAME_WITHOUT_REPLACEMENT = "slice_without_replacement"  # the offline side's, with SliceSampler(replacement=False)
NAME_PRIORITIZED = "prioritized_slice"  # both sides', with SliceSampler(prioritized=True): rayrb.core.prioritized_slices
NAMES = (NAME, NAME_WITHOUT_REPLACEMENT, NAME_PRIORITIZED)
DEFAULT_END_KEY = ("next", "done")  # TorchRL's
DEFAULT_TRAJ_KEY = "episode"  # TorchRL's, looked for when no end key is stored


def flat_key(key: str | Sequence[str]) -> str:
    """A nested key as the row spec names it: ``("next", "done")`` -> ``"next/done"``."""
    return key if isinstance(key, str) else SEP.join(key)


@dataclass(frozen=True)
class SliceSampler:
    """How a buffer draws slices (see the module); TorchRL's ``SliceSampler`` arguments, checked here.

    Args:
        slice_len: steps per slice; the batch size must be a multiple. Exclusive with ``num_slices``.
        num_slices: slices per batch, with the buffer's ``batch_size`` (``slice_len = batch_size / num_slices``).
        traj_key: the key of each step's trajectory id (a run of one id is an episode). Exclusive with
            ``end_key``.
        end_key: the key of each step's end flag (an episode ends after a step whose flag is set). Without either,
            ``("next", "done")`` where the rows hold it, else ``"episode"``.
        strict_length: ``True`` (TorchRL's default): episodes shorter than a slice are never drawn. ``False``: each
            such episode is one more valid slice, drawn whole, so a batch may hold fewer than ``batch_size``
            steps (see the module).
        replacement: ``False`` draws the offline side's slices without replacement, each valid slice once an
            epoch (TorchRL's ``SliceSamplerWithoutReplacement`` draws each episode once instead); the online side
            is drawn with replacement, as TorchRL's offline-to-online buffer draws it.
        prioritized: draw each slice by the priority of its first step, on both sides, with the buffer's
            ``alpha``, ``beta`` and ``eps`` (TorchRL's ``PrioritizedSliceSampler``); with replacement only.
    """

    slice_len: int | None = None
    num_slices: int | None = None
    traj_key: str | tuple[str, ...] | None = None
    end_key: str | tuple[str, ...] | None = None
    strict_length: bool = True
    replacement: bool = True
    prioritized: bool = False

    def __post_init__(self) -> None:
        for name in ("strict_length", "replacement", "prioritized"):  # numpy's booleans as Python's
            if isinstance(getattr(self, name), np.bool_):
                object.__setattr__(self, name, bool(getattr(self, name)))
        for name in ("traj_key", "end_key"):  # a nested key as a list: a tuple, so the sampler hashes and compares
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.prioritized is not False and (self.prioritized is not True or not self.replacement):
            raise InvalidArgumentError(f"expected prioritized=True with replacement=True, or prioritized=False, got "
                                       f"prioritized={self.prioritized!r}, replacement={self.replacement!r}")
        if (self.slice_len is None) == (self.num_slices is None):
            raise InvalidArgumentError(f"expected one of slice_len and num_slices, got slice_len={self.slice_len} "
                                       f"and num_slices={self.num_slices}")
        if self.num_slices is None:
            positive_int("slice_len", self.slice_len)
        else:
            positive_int("num_slices", self.num_slices)
        if self.traj_key is not None and self.end_key is not None:
            raise InvalidArgumentError(f"expected one of traj_key and end_key, got traj_key={self.traj_key!r} and "
                                       f"end_key={self.end_key!r}")
        for name, key in (("traj_key", self.traj_key), ("end_key", self.end_key)):
            names = [key] if isinstance(key, str) else key
            if key is not None and not (isinstance(names, (tuple, list)) and names
                                        and all(isinstance(n, str) and n for n in names)):
                raise InvalidArgumentError(f"expected {name} a key name or a tuple of names (none empty), got "
                                           f"{key!r}")
        if not isinstance(self.replacement, bool):
            raise InvalidArgumentError(f"expected replacement True or False, got {self.replacement!r}")
        if not isinstance(self.strict_length, bool):
            raise InvalidArgumentError(f"expected strict_length True or False, got {self.strict_length!r}")

    def kinds(self) -> dict[str, str]:
        """The sampling kind of each side."""
        if self.prioritized:
            return {OFFLINE: NAME_PRIORITIZED, ONLINE: NAME_PRIORITIZED}
        return {OFFLINE: NAME if self.replacement else NAME_WITHOUT_REPLACEMENT, ONLINE: NAME}

    def resolve(self, keys: Sequence[str] | Mapping[str, Sequence[int]], batch_size: int | None) -> dict[str, Any]:
        """The shards' and the coordinator's options for rows with these (flat) ``keys`` and the buffer's
        ``batch_size``: ``slice_len``, the flat key episodes come from and whether it holds end flags; without
        ``strict_length``, ``slice_strict=False`` too. Given as a mapping, ``keys`` names each key's trailing shape,
        and a trajectory id must be one value a step: ids of several values (``[steps, 2]``) would be cut by
        their first only.

        >>> SliceSampler(slice_len=2, traj_key="traj").resolve({"traj": (2,)}, None)
        Traceback (most recent call last):
        rayrb.errors.SchemaError: expected one trajectory id a step in 'traj' (shape [] or [1]), got shape [2]...
        """
        if self.num_slices is not None:
            if batch_size is None:
                raise InvalidArgumentError(f"expected a buffer batch_size with num_slices={self.num_slices} (the "
                                           "slice length is batch_size / num_slices), got none: give slice_len")
            length = slice_count(batch_size, num_slices=self.num_slices)[1]
        else:
            length = int(self.slice_len)
        if self.traj_key is not None:
            key, ends = flat_key(self.traj_key), False
        elif self.end_key is not None:
            key, ends = flat_key(self.end_key), True
        else:
            ends = flat_key(DEFAULT_END_KEY) in keys
            key = flat_key(DEFAULT_END_KEY) if ends else DEFAULT_TRAJ_KEY
        if key not in keys:
            raise SchemaError(f"expected the rows to hold {key!r} to find episodes by (traj_key / end_key), got "
                              f"keys {sorted(keys)}")
        shape = None if not isinstance(keys, Mapping) or ends else tuple(keys[key])
        if shape is not None and math.prod(shape) != 1:
            raise SchemaError(f"expected one trajectory id a step in {key!r} (shape [] or [1]), got shape "
                              f"{list(shape)}: give an end_key, or ids of one value a step")
        strict = {} if self.strict_length else {"slice_strict": False}  # strict: the options as they always were
        return {"slice_len": length, "slice_key": key, "slice_ends": ends, **strict}


class SliceAllocator(Allocator):
    """A batch planned in slices of ``slice_len`` rows, each side's spread over its shards by the valid slices
    each holds (see the module)."""

    uses_masses = True

    def __init__(self, num_shards: Mapping[str, int], *, slice_len: int = 1, **options: Any):
        super().__init__(num_shards)
        self.unit = positive_int("slice_len", slice_len)
        self._mass = {side: np.zeros(self.num_shards[side]) for side in SIDES}

    def set_masses(self, side: str, stats: list[tuple[float, float]], sizes: np.ndarray) -> None:
        self._mass[side] = np.asarray([m for m, _ in stats], dtype=np.float64)

    def drawable(self, side: str, sizes: np.ndarray) -> int:
        return int(self._mass[side].sum())

    def counts(self, side: str, n: int, sizes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return multinomial_counts(n, self._mass[side], rng)


class EpisodeSlices(Sampler):
    """A shard's half of slice sampling (see the module): ``bind`` gives it the shard's column episodes come from
    and, online, the slots' generations."""

    name = NAME
    allocator = SliceAllocator

    def __init__(self, capacity: int = 0, slice_len: int = 1, slice_key: str | None = None,
                 slice_ends: bool = False, slice_strict: bool = True, **options: Any):
        self._len, self._key, self._ends = positive_int("slice_len", slice_len), slice_key, bool(slice_ends)
        self._strict = bool(slice_strict)  # False: short episodes are slices too, read padded (``padded_steps``)
        self._held = ShardEpisodes(int(capacity), self._len, self._strict, self._ends, moved=self._moved)
        self._drawn: tuple[int, Slices] | None = None  # the size and slices of the last draw, for ``info``

    @property
    def key(self) -> str | None:
        """The key of the rows episodes are found by."""
        return self._key

    def bind(self, rows: Mapping[str, np.ndarray], generation: np.ndarray | None,
             written: np.ndarray | None = None, count: np.ndarray | None = None) -> None:
        """The shard's rows and (online) generations; ``written``, its write count's one-element map, where
        another process writes them (a handle reading the shard's files): the rows up to it are appended to the
        episodes as it moves, as the shard appends the rows of each write (``on_write``; ``ShardEpisodes``);
        ``count``, the shard's own: no slice reads a row at or past it (not acknowledged)."""
        if self._key not in rows:
            raise SchemaError(f"expected rows holding {self._key!r} to find episodes by, got keys {sorted(rows)}")
        self._held.bind(rows[self._key], generation, written, count)

    def whole(self, rows: np.ndarray, column: np.ndarray) -> bool:
        """Whether a read's steps, copied by another process than the shard's while it may write (each step's
        row in the write stream, and its copied episode column), are still whole slices (``whole_slices``)."""
        return whole_slices(rows, column, self._len, self._ends, padded=not self._strict)

    def on_write(self, idx: np.ndarray) -> None:
        """Slots this shard wrote: the next read appends their rows to the episodes held, if they follow them."""
        self._held.wrote(idx)

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """A restore (or a copy taken whole) replaced the rows: their episodes are found again."""
        self.forget()

    def forget(self) -> None:
        """The rows changed in a way no write said (a reader found a row stored ahead of the write count where
        its episodes held an older one): their episodes are found again at the next read."""
        self._held.forget()

    def info(self, idx: np.ndarray, generation: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Each drawn step's ``episode_start``: the row number, in this shard's write stream, of its episode's first
        step still held (offline: that step's index in the shard), by the episodes the draw was made over and the
        rows the read found in the slots (``generation``, else the slots' now). The steps of one slice share it;
        two episodes held at once never do.

        >>> s = EpisodeSlices(capacity=6, slice_len=2, slice_key="e")
        >>> s.bind({"e": np.array([0, 0, 0, 1, 1, 2])}, None)
        >>> steps = s.sample(4, 6, np.random.default_rng(0))  # two slices of 2 steps
        >>> s.info(np.array([1, 2, 3, 4]))["episode_start"].tolist()  # episode 0 begins at step 0, 1 at step 3
        [0, 0, 3, 3]
        """
        idx = np.asarray(idx, np.int64)
        if self._drawn is None or (idx.size and int(idx.max()) >= self._drawn[0]):
            return {}  # not steps of a draw (a gather by index): no episodes were found over them
        starts = self._drawn[1].episodes.starts
        if not starts.size:
            return {"episode_start": np.zeros(idx.size, np.int64)}
        at = np.searchsorted(starts, self._held.rows(idx, generation), side="right") - 1
        return {"episode_start": starts[np.maximum(at, 0)]}

    def _rows(self, slots: np.ndarray) -> np.ndarray:
        return self._held.rows(slots)

    def _slots(self, rows: np.ndarray) -> np.ndarray:
        return self._held.slots(rows)

    def _slices(self, size: int) -> Slices:
        return self._held.slices(size)

    def _moved(self, before: tuple[Stream, Slices], after: tuple[Stream, Slices]) -> None:
        """The episodes held went from ``before`` to ``after`` by an append: what is built on them may follow."""

    def _over(self, size: int, count: int) -> int:
        """The slots a read of ``count`` rows draws over: the ``size`` it was planned over or, where a read planned
        before the shard had filled its slots finds no whole slice left among them (rows written since overwrote
        them), every slot the shard holds now. The plan's count of slices stands; only the shard they come from
        was chosen by the slices it held then."""
        if count and size < self._held.capacity and self._slices(size).total == 0:
            now = self._held.held_size()
            if now > size:
                return now
        return size

    def sample(self, count: int, size: int, rng: np.random.Generator | None, epoch: Epoch | None = None) -> np.ndarray:
        if count % self._len:
            raise DrawError(f"expected a read of whole slices ({self._len} rows each), got {count} rows")
        k = count // self._len
        size = self._over(size, count)
        slices = self._slices(size)
        self._drawn = (size, slices)
        if k and slices.total == 0:
            raise DrawError(f"cannot draw {k} slices of {self._len} steps: no episode here holds "
                            f"{'that many' if self._strict else 'a step'}")
        starts, lengths = slices.locate(self._items(k, slices.total, rng, epoch))
        return self._slots(steps(starts, lengths)[0] if self._strict else padded_steps(starts, lengths, self._len))

    def _items(self, k: int, total: int, rng: np.random.Generator | None, epoch: Epoch | None) -> np.ndarray:
        """Which of the ``total`` valid slices a read of ``k`` draws: uniformly, with replacement."""
        return np.minimum((rng.random(k) * total).astype(np.int64), total - 1)

    def mass(self, size: int) -> tuple[float, float]:
        """The valid slices this shard holds: what the allocator spreads a side's slices by."""
        return float(self._slices(size).total), 1.0


class SlicesWithoutReplacementAllocator(WithoutReplacementAllocator):
    """Epochs over the valid slices of a side's shards: counts ~ multivariate hypergeometric over the slices each
    shard has left (its valid slices when the epoch began: its mass), so each slice comes once an epoch; the
    epoch's end as ``epoch_end`` says, in slices."""

    uses_masses = True

    def __init__(self, num_shards: Mapping[str, int], *, slice_len: int = 1, **options: Any):
        super().__init__(num_shards, **options)
        self.unit = positive_int("slice_len", slice_len)
        self._slices = {side: np.zeros(self.num_shards[side], np.int64) for side in SIDES}

    def set_masses(self, side: str, stats: list[tuple[float, float]], sizes: np.ndarray) -> None:
        self._slices[side] = np.asarray([int(m) for m, _ in stats], np.int64)

    def drawable(self, side: str, sizes: np.ndarray) -> int:
        return int(self._slices[side].sum())

    def check(self, need: Mapping[str, int], sizes: Mapping[str, np.ndarray]) -> dict[str, bool]:
        return super().check({side: need[side] // self.unit for side in SIDES}, self._slices)

    def begin_epoch(self, side: str, sizes: np.ndarray, rng: np.random.Generator) -> None:
        super().begin_epoch(side, self._slices[side], rng)


class EpisodeSlicesWithoutReplacement(EpisodeSlices):
    """A shard's slices without replacement: one permutation of its valid slices per epoch, rebuilt from the
    epoch's seed (as rows are, ``rayrb.core.samplers.WithoutReplacementSampler``), read where the epoch says."""

    name = NAME_WITHOUT_REPLACEMENT
    allocator = SlicesWithoutReplacementAllocator

    def __init__(self, capacity: int = 0, **options: Any):
        super().__init__(capacity, **options)
        self._perm, self._perm_of = np.empty(0, np.int64), None

    def _items(self, k: int, total: int, rng: np.random.Generator | None, epoch: Epoch | None) -> np.ndarray:
        if epoch is None:
            raise DrawError("expected the epoch a read of slices without replacement belongs to, got none")
        if self._perm_of != (epoch.number, epoch.seed, epoch.size):
            self._perm = np.random.default_rng(epoch.seed).permutation(epoch.size).astype(np.int64)
            self._perm_of = (epoch.number, epoch.seed, epoch.size)
        items = self._perm[epoch.start:epoch.start + k]
        if items.size < k or (items.size and int(items.max()) >= total):
            raise DrawError(f"expected {k} of the epoch's {epoch.size} slices from {epoch.start} on, among the "
                            f"{total} this shard holds now")
        return items
