"""The coordinator's planning part: it draws groups of batches and gives back draws; it submits no reads.

It holds the ``Planner``, the shards' masses (prioritized
sampling), the log of draws made ahead (``AheadLog``) and the
answers to recent plan calls (``ReplyCache``). A plan
names, per contributing shard, one read for the whole group: the caller submits it
(``docs/architecture.md``, "The draw path").
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rayrb.core.ahead import AheadLog, GiveBack
from rayrb.core.planner import Planner, parts_checked
from rayrb.core.plans import OFFLINE, ONLINE, SIDES, BatchPlan, GroupPlan, Part, route_priorities
from rayrb.core.rate_limiter import CALLS
from rayrb.core.samplers import stored_priorities
from rayrb.core.sampling_state import checked_orphans
from rayrb.core.validation import ALPHA, EPS, finite_number, one_of, positive_int
from rayrb.durability.replies import ReplyCache
from rayrb.errors import DrawError, HeldBack, InvalidArgumentError

Sizes = Mapping[str, np.ndarray]


class Drawing:
    """Plans for one buffer: groups of batches, their give-backs, and the side views' draws."""

    def __init__(self, planner: Planner, shards: Mapping[str, Sequence[Any]], metrics: Any, seed: int | None, *,
                 exponents: tuple[float, float] = (ALPHA, EPS)):
        self.planner, self._shards, self._metrics = planner, shards, metrics
        self._exponents = exponents  # the shards' (alpha, eps): an update is checked whole before any shard has it
        self.ahead = AheadLog()
        self.replies = ReplyCache()
        self.side_rng = np.random.default_rng(None if seed is None else [seed, 1])
        self._masses: dict[str, list[Any]] = {side: [None] * len(shards[side]) for side in SIDES}
        self._masses_stale = False
        for side in SIDES:
            self.requery_masses(side, range(len(shards[side])))

    # masses ---------------------------------------------------------------------
    def update_priority(self, update: tuple, sizes: Mapping[str, np.ndarray]) -> tuple[int, list[Any]]:
        """Send ``update`` (``(offline, shard, index, generation, priority)`` per row) to the shards that own the
        rows, checked whole first; each shard drops updates whose slot's generation changed. The shards' masses
        are asked for again. Returns the row count and the shards' acks."""
        if not self.planner.alloc.uses_masses:
            raise InvalidArgumentError(f"update_priority needs sampler='prioritized', this buffer samples "
                                       f"{self.planner.sampler!r}")
        routes = route_priorities(*update, sizes)
        stored_priorities(update[4], *self._exponents)  # one priority that cannot be held refuses the whole call
        acks = [self._shards[side][i].update_priority.remote(*args) for side, i, args in routes]
        for side, i, _ in routes:
            self.requery_masses(side, [i])
        return sum(len(args[0]) for _, _, args in routes), acks

    def waited(self, call: str, seconds: float) -> None:
        """A ``call`` (``"sample"`` or ``"insert"``) went through after waiting ``seconds`` for the rate limiter."""
        if seconds > 0:
            self.planner.limiter.record_blocked(call, float(seconds))
            self._metrics.observe(f"{call}_blocked_ms", float(seconds) * 1e3)

    def gave_up(self, call: str, seconds: float) -> None:
        """A ``call`` gave up after ``seconds`` held back past its handle's timeout: it drew or wrote nothing, so
        the limiter's counters leave it out (they count calls that went through); ``stats()`` counts it here."""
        call, seconds = one_of("call", call, CALLS), finite_number("seconds", seconds, minimum=0.0)  # checked first
        self._metrics.count(f"{call}_timed_out_calls")
        self._metrics.observe(f"{call}_timed_out_ms", seconds * 1e3)

    def requery_masses(self, side: str, shards: Any) -> None:
        """Ask these shards for their mass now, behind every write and update sent to them."""
        if self.planner.alloc.uses_masses:
            for i in shards:
                self._masses[side][i] = self._shards[side][i].mass_stats.remote()
            self._masses_stale = True

    def _sync_masses(self, sizes: Sizes) -> None:
        if self.planner.alloc.uses_masses and self._masses_stale:
            import ray

            for side in SIDES:  # exact: the masses were asked for behind every earlier write and update
                self.planner.alloc.set_masses(side, ray.get(self._masses[side]), sizes[side])
            self._masses_stale = False

    # planning -------------------------------------------------------------------
    def plan(self, batch_size: int, num_batches: int, *, sizes: Sizes, counted: np.ndarray, version: int,
             stream: str | None = None, served: int | None = None, call: str | None = None,
             slices: int = 1, owing: int | None = None) -> GroupPlan | HeldBack:
        """Plan ``num_batches`` consecutive batches (or, with ``slices``, one batch cut in that many slices).

        The batches are exactly those of as many single calls. ``stream`` names a
        handle that draws ahead and can give back (``undo``); its group stops
        early, with what was drawn, where a draw would be refused (an epoch's end,
        the rate limiter). Without a stream, a sampler that cannot group batches
        plans one. ``served`` reports, as ``served`` does, the stream's last
        batch handed over. ``call`` names the call: made again (Ray re-sends it to a
        restarted coordinator when the reply was lost) it gets the same plan. ``owing``: the
        caller just served the batch that ended that offline epoch; it gets the epoch's
        orphans of its batch size (``_adopt``) and nothing new, an empty group if none.
        """
        request = (batch_size, num_batches, stream, slices) + (() if owing is None else (owing,))
        again = self.replies.get(call, request)
        if again is not None:
            self._metrics.count("calls_answered_again")
            return again
        t0 = time.perf_counter()
        if stream is not None and served is not None:
            self.ahead.served(stream, int(served))
        num_batches = positive_int("num_batches", num_batches)
        batch_size = parts_checked(batch_size, slices, self.planner.alloc.unit)
        if owing is not None or (self.ahead.orphans and slices == 1):  # batches no handle will serve go first
            adopted = self._adopt(batch_size, num_batches, stream, version, sizes, owing)
            if adopted is not None or owing is not None:
                adopted = adopted or GroupPlan([], version=version)
                self.replies.put(call, request, adopted)
                return adopted
        if stream is None and not self.planner.alloc.groups_batches:
            num_batches = 1
        self._sync_masses(sizes)
        drawn: list[tuple[BatchPlan, list]] = []
        totals = (int(sizes[OFFLINE].sum()), int(sizes[ONLINE].sum()))
        try:
            for _ in range(num_batches):
                drawn.extend(self._draw(batch_size, sizes, slices, stream, totals))
        except HeldBack as held:
            if not drawn:
                self._metrics.count(f"{held.call}_blocked_calls")
                return held
        except ValueError:
            if not drawn or stream is None:
                raise
        group = self._group(drawn, counted, version, stream, len(drawn) // slices)
        self.replies.put(call, request, group)
        self._metrics.count("batches", len(group.plans) // slices)
        self._metrics.count("rows_sampled", sum(p.batch_size for p in group.plans))
        ms = (time.perf_counter() - t0) * 1e3
        self._metrics.observe("plan_ms", ms)
        self._metrics.count("plan_ms_total", ms)
        return group

    def _draw(self, batch_size: int, sizes: Sizes, slices: int, stream: str | None,
              totals: tuple[int, int] | None = None) -> list[tuple[BatchPlan, list]]:
        out = self.planner.draw(batch_size, slices, sizes=sizes, totals=totals, checked=True)
        if stream is None:
            self.ahead.forget()
        elif len(out) == 1:
            plan = out[0][0]
            self.ahead.record(stream, self.planner.last_snapshot, plan.n_offline + plan.n_online, plan.n_online)
        else:
            self.ahead.record(stream, self.planner.last_snapshot, sum(p.batch_size for p, _ in out),
                              sum(p.n_online for p, _ in out))
        return out

    def _group(self, drawn: list[tuple[BatchPlan, list]], counted: np.ndarray, version: int, stream: str | None,
               batches: int) -> GroupPlan:
        by_shard: dict[tuple[str, int], list[tuple[int, int, Any]]] = {}
        for plan, reads in drawn:
            for part, (seed, kwargs) in zip(plan.parts, reads):
                by_shard.setdefault((part.side, part.shard), []).append((part.count, seed, kwargs.get("epoch")))
        first = self.ahead.next_number - batches if stream is not None else -1
        group = GroupPlan([plan for plan, _ in drawn], version=version, first=first)
        for (side, i), items in by_shard.items():
            counts, seeds, epochs = (list(x) for x in zip(*items))
            group.reads.append((side, i))
            # A shard counts no row past a hole; a read that reaches it later draws over these rows still.
            group.args.append((counts, seeds, epochs, int(counted[i]) if side == ONLINE else None))
        return group

    def _adopt(self, batch_size: int, k: int, stream: str | None, version: int, sizes: Sizes,
               owing: int | None = None) -> GroupPlan | None:
        """Orphans of this batch size as one group (``AheadLog.adopt``), or None."""
        group = self.ahead.adopt(stream, batch_size, k, owing=owing,
                                 ended=lambda epoch: self.planner.epoch_ended(epoch, batch_size, sizes))
        if group is not None:
            group.version = version
            self._metrics.count("batches_adopted", len(group.plans))
        return group

    def served(self, stream: str, number: int) -> None:
        self.ahead.served(stream, int(number))

    def undo(self, stream: str, count: int | None, discard: bool = False, batches: list | None = None) -> GiveBack:
        """Give back the last ``count`` batches that ``stream`` drew and did not serve (None: all of them).

        ``UNDONE`` when the stream is back where it was
        before them (no one else drew or changed a setting since). Otherwise they stand:
        ``KEEP`` them without replacement (each row of an epoch is served once), else
        ``DROP`` them. With ``discard`` (a closed iterator, another batch size) the
        handle will not serve them: without replacement they go to the next handle that
        asks for batches of their size (``ADOPT``; ``batches`` are the handle's unserved
        batches as planned: ``(batch size, encoded one-batch group, rows, online rows)``),
        with replacement they are dropped. Rows dropped unserved no longer count as sampled
        for the rate limiter.
        """
        count = self.ahead.unserved(stream) if count is None else max(0, int(count))
        if count == 0:
            return GiveBack.UNDONE
        taken = self.ahead.take_back(stream, count)
        if taken is not None:
            snapshot, rows, _ = taken
            self.planner.restore(snapshot)
            self._metrics.count("batches", -count)  # the counts say what was drawn for good
            self._metrics.count("rows_sampled", -rows)
            self._metrics.count("batches_undone", count)
            return GiveBack.UNDONE
        self._metrics.count("undo_refused")
        if getattr(self.planner.alloc, "epoch_end", None) is not None:
            if not discard:
                return GiveBack.KEEP
            if batches:
                self.ahead.orphan(stream, batches)
                self._metrics.count("batches_orphaned", len(batches))
                return GiveBack.ADOPT
        _, online = self.ahead.drop(stream, count)
        self.planner.unrecord_samples(online)
        return GiveBack.DROP

    def forget(self) -> None:
        """Every draw so far stands, and orphans are dropped (their plans are of the settings before a change)."""
        self.ahead.forget()
        self.planner.unrecord_samples(self.ahead.drop_orphans())

    def state_dict(self) -> dict[str, Any]:
        """The sampling state, as if the batches drawn ahead and not yet served were given back, with the draws
        the buffer owes (orphans: drawn, and no handle will serve them; the next caller of their size does)."""
        orphans = [list(o) for o in self.ahead.orphans]
        return {**self.planner.state_dict(at=self.ahead.first_unserved()), "orphans": orphans}

    def check_state_dict(self, state: Any, sizes: Sizes | None = None) -> list[list[Any]]:
        """Raise, naming what is wrong, unless ``load_state_dict`` takes ``state``; its orphans, checked."""
        self.planner.check_state_dict(state, sizes)
        return checked_orphans(state, self.planner.num_shards)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take ``state_dict``'s state whole (checked before anything changes): the planner's, and the orphans it
        owes in place of those owed now. Every draw made so far stands; the shards' masses are asked for again."""
        orphans = self.check_state_dict(state)
        self.forget()  # the orphans owed now go (a limiter the state leaves as it is stops counting them)
        self.planner.load_state_dict(state)
        self.ahead.orphans = orphans
        for side in SIDES:  # priorities may have changed under us
            self.requery_masses(side, range(len(self._shards[side])))

    def saved(self) -> dict[str, Any]:
        """What a restart needs (plain JSON data): the planner's state, the side views' RNG and the log of draws
        ahead, so that a restarted coordinator numbers draws on and counts the rows given back after it."""
        return {"planner": self.planner.state_dict(), "side_rng": self.side_rng.bit_generator.state,
                "ahead": self.ahead.state_dict()}

    def load_saved(self, saved: Mapping[str, Any]) -> None:
        """Take ``saved()``'s state (a state saved before the log of draws was kept starts that log empty, numbered
        past any number handed out before)."""
        self.planner.load_state_dict(saved["planner"])
        self.side_rng.bit_generator.state = saved["side_rng"]
        self.ahead.load_state_dict(saved.get("ahead"))

    # side views -------------------------------------------------------------------
    def plan_side(self, side: str, batch_size: int, sizes: np.ndarray) -> tuple[BatchPlan, list[np.ndarray]]:
        """``batch_size`` rows of one side, uniformly from the union of its shards: the plan and each part's
        local indices. Drawn from a stream of its own: the buffer's batches, epochs and limiter are untouched."""
        from rayrb.core.allocation import multinomial_counts

        if sizes.sum() == 0:
            raise DrawError(f"cannot sample {batch_size} rows from the {side} side: it holds no rows")
        counts = multinomial_counts(batch_size, sizes, self.side_rng)
        parts = [Part(side, i, int(c)) for i, c in enumerate(counts) if c > 0]
        indices = [self.side_rng.integers(0, sizes[p.shard], p.count) for p in parts]
        n = (batch_size, 0) if side == OFFLINE else (0, batch_size)
        return BatchPlan(parts, *n, fraction=float(side == OFFLINE)), indices
