"""The coordinator's sampling state and its one decision: what the next batch is made of. No Ray here.

A ``Planner`` holds the offline-fraction schedule, the step, the seeded RNG,
the sampler kind's ``Allocator`` and the
``RateLimiter``. Given the shard sizes, ``Planner.draw``
turns a batch size into ``BatchPlan`` s:

1. ``f`` from the schedule at this step and these sizes;
2. the exact split ``n_off = floor(f * B + 1/2)``, ``n_on = B - n_off``
   (``split_batch``), all offline while the online side is empty;
3. the rate limiter's say on ``n_on``: as planned, all offline, or wait
   (``HeldBack``);
4. the allocator's check of both sides, epochs begun where needed;
5. per slice, per side: each shard's read arguments, then per-shard counts, then
   one seed per shard.

A draw that raises, ``HeldBack`` included, leaves the step, the RNG, the
allocator and the limiter as they were, so the seeded stream goes on as if it
had not been asked.

At the end of a without-replacement epoch the batch may come back short (TorchRL's
default, ``epoch_end="short"``): step 2 above uses the largest batch size whose
exact split fits in the rows each side has left.

Examples:
    >>> import numpy as np
    >>> p = Planner({"offline": 2, "online": 1}, offline_fraction=0.25, seed=0)
    >>> sizes = {"offline": np.array([60, 40]), "online": np.array([10])}
    >>> ((plan, reads),) = p.draw(10, sizes=sizes)
    >>> plan.n_offline, plan.n_online, sum(part.count for part in plan.parts), p.step
    (3, 7, 10, 1)
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from rayrb.core.allocation import split_checked, split_slices, whole_items
from rayrb.core.plans import OFFLINE, ONLINE, SIDES, BatchPlan, Part
from rayrb.core.rate_limiter import ALL_OFFLINE, WAIT, make_rate_limiter
from rayrb.core.samplers import make_allocator  # with every kind registered (both halves: rayrb.core.samplers)
from rayrb.core.sampling_state import checked_state
from rayrb.core.schedules import Constant, Linear, make_schedule, value_at
from rayrb.core.validation import BETA, non_negative_int, positive_int
from rayrb.errors import HeldBack, InvalidArgumentError, SavedStateError

Sizes = Mapping[str, np.ndarray]
Reads = list[tuple[int, dict]]
_NO_ARGS: dict = {}  # a read's keyword arguments when its kind needs none (never changed)


class Planner:
    """Sampling state and batch plans for one buffer (see the module)."""

    def __init__(self, num_shards: Mapping[str, int], *, offline_fraction: Any = 0.5,
                 sampler: str | Mapping[str, str] = "uniform",
                 drop_last: bool | None = None, epoch_end: str | None = None, seed: int | None = None,
                 beta: float = BETA, rate_limiter: Any = None, online_capacity: int | None = None,
                 slice_len: int | None = None):
        self.num_shards = {side: int(num_shards[side]) for side in SIDES}
        if isinstance(sampler, Mapping) and sampler[OFFLINE] == sampler[ONLINE]:
            sampler = sampler[OFFLINE]
        self.sampler = dict(sampler) if isinstance(sampler, Mapping) else sampler
        self._alloc_options = {"drop_last": drop_last, "epoch_end": epoch_end, "beta": beta,
                               **({} if slice_len is None else {"slice_len": slice_len})}
        self.alloc = make_allocator(sampler, self.num_shards, **self._alloc_options)
        self._online_capacity = online_capacity
        self.limiter = make_rate_limiter(rate_limiter)
        self.limiter.validate(online_capacity=online_capacity)
        self.schedule = make_schedule(offline_fraction)
        self._base = self.schedule.value if isinstance(self.schedule, Constant) else None
        self.rng = np.random.default_rng(seed)
        self.step = 0
        self.last_snapshot: tuple | None = None
        # online rows ever taken out of the limiter's count (drawn ahead, dropped unserved): a snapshot taken
        # before such a drop must not bring those rows back when it is restored
        self._unrecorded = 0
        self._splits: dict[tuple, dict[str, int]] = {}  # (batch size, fraction, online rows?) -> the split

    # the fraction -----------------------------------------------------------
    def fraction(self, sizes: Sizes) -> float:
        return self._fraction(int(sizes[OFFLINE].sum()), int(sizes[ONLINE].sum()))

    def _fraction(self, offline: int, online: int) -> float:
        return value_at(self.schedule, self.step, offline, online)  # a user's schedule checked here, once

    def set_fraction(self, value: Any) -> None:
        """The fraction from the next batch on; ``base_fraction`` stays (as TorchRL's when it is assigned)."""
        self.schedule = make_schedule(value)

    def base_fraction(self, sizes: Sizes) -> float:
        """The fraction ``anneal`` decays from: the constant fraction the planner was made with, or the one
        ``set_base_fraction`` (or a loaded state) gave; without either (made with a schedule), the fraction now."""
        return self._base if self._base is not None else self.fraction(sizes)

    def set_base_fraction(self, value: Any) -> None:
        from rayrb.core.validation import fraction

        self._base = fraction("base_offline_fraction", value)

    def anneal(self, step: int, total_steps: int, sizes: Sizes) -> float:
        """TorchRL's ``anneal``: linear from ``base_fraction`` (kept from then on) to 0 over ``total_steps``."""
        step, total_steps = non_negative_int("step", step), positive_int("total_steps", total_steps)
        base = self.base_fraction(sizes)
        value = Linear(base, 0.0, total_steps)(step, 0, 0)
        self.schedule, self._base = Constant(value), base
        return value

    def set_step(self, step: int) -> None:
        self.step = non_negative_int("step", step)

    # drawing ----------------------------------------------------------------
    def snapshot(self) -> tuple:
        """What ``restore`` needs to put the stream back here: RNG, step, allocator, sampled rows (and the rows
        taken out of that count so far)."""
        return (self.rng.bit_generator.state, self.step, self.alloc.state_dict(), self.limiter.state_dict()["samples"],
                self._unrecorded)

    def restore(self, saved: tuple) -> None:
        """Go back to a ``snapshot``, as if no draw had been made since.

        Settings are kept, and so are the limiter's inserts and waits: writes since the
        snapshot still count; only the draws' sampled rows are taken back. Rows dropped
        since the snapshot (another handle's draws from before it, ``unrecord_samples``)
        stay out of the count.
        """
        self.rng.bit_generator.state, self.step = saved[0], saved[1]
        self.alloc.load_state_dict(saved[2])
        self.limiter.load_state_dict(self._limiter_state(saved))

    def _limiter_state(self, saved: tuple) -> dict[str, Any]:
        return {**self.limiter.state_dict(), "samples": max(0, saved[3] - (self._unrecorded - saved[4]))}

    def draw(self, batch_size: int, num_slices: int = 1, *, sizes: Sizes,
             totals: tuple[int, int] | None = None, checked: bool = False) -> list[tuple[BatchPlan, Reads]]:
        """One global batch as ``num_slices`` slices: ``(plan, [(seed, read kwargs) per part])``.

        Each slice is allocated on its own, so every slice and their union have the
        distribution of sampling the union of shards, and each slice's split is exact
        to within one row. Raises ``HeldBack`` when the rate limiter holds it back.
        ``totals`` are ``sizes``' two sums when the caller has them (a group draws many batches at one size);
        ``checked``: the caller checked ``batch_size`` and ``num_slices`` (once for a group).
        """
        if not checked:
            batch_size = parts_checked(batch_size, num_slices, self.alloc.unit)
        saved = self.snapshot()
        try:
            out = self._draw(batch_size, num_slices, sizes, totals)
        except BaseException:  # the stream goes on as if this draw had not been asked for
            self.restore(saved)
            raise
        self.last_snapshot = saved  # the state before the draw that just succeeded
        return out

    def _draw(self, batch_size: int, num_slices: int, sizes: Sizes,
              totals: tuple[int, int] | None) -> list[tuple[BatchPlan, Reads]]:
        offline, online = totals if totals is not None else (int(sizes[OFFLINE].sum()), int(sizes[ONLINE].sum()))
        fraction = self._fraction(offline, online)
        unit = self.alloc.unit  # planned in items of ``unit`` rows (slices), over the items each side holds
        need = self._shorten(*items(self.alloc, batch_size, sizes, online, fraction), sizes)
        need = need if unit == 1 else {side: n * unit for side, n in need.items()}
        decision = self.limiter.decide(need[ONLINE], online)
        if decision == WAIT:
            raise HeldBack("sample", f"the rate limiter holds back {need[ONLINE]} online rows "
                                     f"(online size {online}, {self.limiter!r}, {self.limiter.stats()})")
        if decision == ALL_OFFLINE:
            need = {OFFLINE: batch_size, ONLINE: 0}
        for side, begin in self.alloc.check(need, sizes).items():  # raises before anything changes
            if begin:
                self.alloc.begin_epoch(side, sizes[side], self.rng)
        cuts = [(need[OFFLINE], need[ONLINE])] if num_slices == 1 else \
            [(a * unit, b * unit) for a, b in split_slices(need[OFFLINE] // unit, need[ONLINE] // unit, num_slices)]
        out = [self._slice(n_off, n_on, fraction, sizes) for n_off, n_on in cuts]
        self.limiter.record_sample(need[ONLINE])
        self.step += 1
        if need[OFFLINE] and self._ends_epoch(batch_size, sizes, online):
            out[-1][0].last_of_epoch = True
        return out

    def _ends_epoch(self, batch_size: int, sizes: Sizes, online: int) -> bool:
        """Whether the offline epoch is over after this batch: no items left, or (dropping or raising at the end)
        fewer than the next batch of this size would need."""
        if self.alloc.epoch_over(OFFLINE):
            return True
        room = self.alloc.room(OFFLINE)
        if room is None or self.alloc.epoch_end == "short":
            return False
        return room < split_checked(*items(self.alloc, batch_size, sizes, online, self.fraction(sizes)))[0]

    def epoch_ended(self, epoch: int, batch_size: int, sizes: Sizes) -> bool:
        """Whether offline epoch ``epoch`` (its number) has had its last batch drawn, at ``batch_size`` rows."""
        now = self.alloc.stats().get("epochs", {}).get(OFFLINE, 0)
        return now > epoch or (now == epoch and self._ends_epoch(batch_size, sizes, int(sizes[ONLINE].sum())))

    def _shorten(self, batch_size: int, fraction: float, online: int, sizes: Sizes) -> dict[str, int]:
        """The split of this batch, or, at the end of an epoch that serves short batches (or for a batch larger
        than a side's whole epoch, as TorchRL's), of the largest shorter batch whose exact split fits in what each
        side has left."""
        if self.alloc.epoch_end != "short":  # no epochs, or not short batches at their end; batch_size checked
            key = (batch_size, fraction, online > 0)  # the same for every batch of a group: computed once
            if key not in self._splits:
                if len(self._splits) > 256:
                    self._splits.clear()
                self._splits[key] = dict(zip(SIDES, split_checked(batch_size, fraction, online)))
            return dict(self._splits[key])
        need = dict(zip(SIDES, split_checked(batch_size, fraction, online)))
        room = {side: self.alloc.epoch_room(side, sizes[side]) for side in SIDES}
        for b in range(batch_size, 0, -1):
            if b < batch_size:
                need = dict(zip(SIDES, split_checked(b, fraction, online)))
            if all(room[s] is None or need[s] <= room[s] for s in SIDES):
                return need
        return need

    def _slice(self, n_off: int, n_on: int, fraction: float, sizes: Sizes) -> tuple[BatchPlan, Reads]:
        parts, reads = [], []
        alloc, rng = self.alloc, self.rng
        with_args = alloc.reads_with_args
        for side, n in ((OFFLINE, n_off), (ONLINE, n_on)):
            if n == 0:
                continue
            # asked before the counts, which move an epoch's cursor
            kwargs = [alloc.read_args(side, i) for i in range(self.num_shards[side])] if with_args else None
            counts = (alloc.counts(side, n // alloc.unit, sizes[side], rng) * alloc.unit).tolist()
            # 63 of 64 raw bits: a seed per read in [0, 2**63), without integers()' bounds checks per call
            seeds = rng.bit_generator.random_raw(len(counts)).tolist()
            for i, c in enumerate(counts):
                if c:
                    parts.append(Part(side, i, c))
                    reads.append((seeds[i] >> 1, kwargs[i] if with_args else _NO_ARGS))
        return BatchPlan(parts, n_off, n_on, fraction, alloc.weights()), reads

    # writes -----------------------------------------------------------------
    def admit_insert(self, rows: int, online_size: int, *, prefill: bool = False, unserved: int = 0) -> None:
        """Raise ``HeldBack`` if the rate limiter holds a write of ``rows`` back (never for a
        prefill). ``unserved`` online rows were drawn ahead and not served yet: the write is judged against
        the rows served, as it would be if nothing had been drawn ahead."""
        if not prefill and not self.limiter.can_insert(rows, online_size, unserved=unserved):
            raise HeldBack("insert", f"the rate limiter holds back {rows} rows "
                                     f"({self.limiter!r}, {self.limiter.stats()})")

    def unrecord_samples(self, rows: int) -> None:
        """Online rows drawn ahead and dropped unserved: the limiter counts rows served."""
        self.limiter.unrecord_sample(rows)
        self._unrecorded += int(rows)

    def record_insert(self, rows: int, online_size: int, *, prefill: bool = False) -> None:
        if prefill:
            self.limiter.record_prefill(rows, online_size)
        else:
            self.limiter.record_insert(rows)

    # state ------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {"step": self.step, "epochs": self.alloc.stats().get("epochs", {s: 0 for s in SIDES}),
                "rate_limiter": self.limiter.stats()}

    def state_dict(self, at: tuple | None = None) -> dict[str, Any]:
        """The sampling state; ``at`` a ``snapshot``, the state as if the draws since it were given back."""
        rng, step, alloc = (at[0], at[1], at[2]) if at is not None else (
            self.rng.bit_generator.state, self.step, self.alloc.state_dict())
        limiter = self._limiter_state(at) if at is not None else self.limiter.state_dict()
        return {"step": step, "schedule": self.schedule.config(), "base_fraction": self._base,
                "rng": rng, "sampler": self.sampler, "allocator": alloc,
                "rate_limiter": {"config": self.limiter.config(), "state": limiter}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict``; checked whole before anything changes (``check_state_dict``).

        Without ``allocator`` (a checkpoint restored onto another shard layout) epochs
        start afresh; without ``rate_limiter`` the limiter is kept.
        """
        step, schedule, base, rng, alloc, limiter = self._checked(state)
        self.step, self.schedule, self._base = step, schedule, base
        self.rng.bit_generator.state = rng.bit_generator.state
        self.alloc, self.limiter = alloc, limiter

    def check_state_dict(self, state: Any, sizes: Sizes | None = None) -> None:
        """Raise ``ValueError`` naming the key, the value and what was expected unless ``load_state_dict``
        takes ``state`` and the stream can go on from it (a draw is tried on a copy); change nothing."""
        import copy

        _, _, _, rng, alloc, limiter = self._checked(state)
        if sizes is None:
            return
        scratch = copy.copy(self)
        scratch.rng, scratch.alloc, scratch.limiter = rng, copy.deepcopy(alloc), copy.deepcopy(limiter)
        scratch.step, scratch.schedule = int(state["step"]), make_schedule(state["schedule"])
        try:
            scratch.draw(1, sizes=sizes)
        except (HeldBack, ValueError):
            pass  # a state may be held back or at an epoch's end; it is not damaged for that
        except Exception as e:
            raise SavedStateError(f"the sampling state cannot draw a batch: {type(e).__name__}: {e}") from None

    def _checked(self, state: Any) -> tuple:
        return checked_state(state, sampler=self.sampler, num_shards=self.num_shards,
                             alloc_options=self._alloc_options, limiter=self.limiter,
                             online_capacity=self._online_capacity)


def items(alloc: Any, batch_size: int, sizes: Sizes, online: int, fraction: float) -> tuple[int, float, int]:
    """``(items, fraction, online items)`` of a batch of ``batch_size`` rows: the items ``alloc`` draws (rows, or a
    slice sampler's slices of ``alloc.unit`` rows) and those the online side holds (its ``online`` rows, or
    slices)."""
    if alloc.unit == 1:
        return batch_size, fraction, online
    return whole_items(batch_size, alloc.unit), fraction, alloc.drawable(ONLINE, sizes[ONLINE])


def parts_checked(batch_size: Any, num_slices: int, unit: int = 1) -> int:
    """``batch_size``, checked, for a batch cut into ``num_slices`` parts (learners' shares): each part holds at
    least one row, or with slices of ``unit`` steps one slice.

    >>> parts_checked(8, 3, unit=4)
    Traceback (most recent call last):
    rayrb.errors.InvalidArgumentError: num_slices must be in [1, 2] (a part of at least one of the batch's 2 slices of 4 steps), got 3
    """
    batch_size = positive_int("batch_size", batch_size)
    if unit == 1 and not 1 <= num_slices <= batch_size:
        raise InvalidArgumentError(f"num_slices must be in [1, batch_size={batch_size}], got {num_slices}")
    if unit > 1 and not 1 <= num_slices <= batch_size // unit:
        raise InvalidArgumentError(f"num_slices must be in [1, {batch_size // unit}] (a part of at least one of the "
                                   f"batch's {batch_size // unit} slices of {unit} steps), got {num_slices}")
    return batch_size
