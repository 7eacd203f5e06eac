"""The Coordinator actor: plans batches over shards and sequences writes. A thin shell over pure parts.

It holds shard handles and shard sizes, never rows. For a sample it draws a
:class:`~rayrb.plans.BatchPlan` (the exact split by :func:`~rayrb.allocation.split_batch`,
per-shard counts by the sampler kind's :class:`~rayrb.allocators.Allocator`),
submits one read per contributing shard and returns the refs: the rows go from
the shards to the caller once, without passing through the coordinator.

Writes are sequenced here too. The writer ``ray.put``s its rows and hands the ref
over; the :class:`~rayrb.writelog.WriteLog` picks shards and slots, and the
coordinator submits the shards' copies. A sync actor runs one caller's tasks in
submission order, so a shard has applied every write the coordinator sent before
any later read reaches it: the sizes used for allocation are exact.

A draw that raises leaves the step, the RNG and the allocator as they were.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator, Sequence

import numpy as np

from rayrb.allocation import split_batch, split_slices
from rayrb.allocators import make_allocator
from rayrb.metrics import ActorMetrics
from rayrb.plans import OFFLINE, ONLINE, SIDES, BatchPlan, Dispatch, GroupDispatch, Part, assemble_slice
from rayrb.schedules import Constant, Linear, make_schedule
from rayrb.validation import BETA, non_negative_int, positive_int
from rayrb.writelog import WriteLog


class Coordinator:
    def __init__(
        self,
        offline_shards: Sequence[Any],
        offline_sizes: Sequence[int],
        online_shards: Sequence[Any],
        online_capacities: Sequence[int],
        *,
        offline_fraction: Any = 0.5,
        sampler: str = "uniform",
        drop_last: bool = False,
        seed: int | None = None,
        name: str = "rayrb",
        transport: str = "object_store",
        device: str = "cpu",
        beta: float = BETA,
    ):
        self._shards = {OFFLINE: list(offline_shards), ONLINE: list(online_shards)}
        self._offline_sizes = np.asarray(offline_sizes, np.int64)
        self._log = WriteLog(online_capacities) if online_shards else None
        self._schedule = make_schedule(offline_fraction)
        self._base_fraction = self._schedule.value if isinstance(self._schedule, Constant) else None
        self._sampler = sampler
        self._alloc = make_allocator(sampler, {s: len(self._shards[s]) for s in SIDES}, drop_last=drop_last,
                                     beta=beta)
        self._masses = {side: [None] * len(self._shards[side]) for side in SIDES}
        self._masses_stale = False
        for side in SIDES:
            self._requery_masses(side, range(len(self._shards[side])))
        self._seed = seed
        self._rng = np.random.default_rng(seed)
        self._step = 0
        self._name = name
        self._metrics = ActorMetrics("coordinator", {"buffer": name})
        self._transport, self._device = transport, device
        self._learners: list[Any] = []
        self._group = None

    # sizes ------------------------------------------------------------------
    def _sizes(self) -> dict[str, np.ndarray]:
        online = self._log.sizes if self._log is not None else np.zeros(0, np.int64)
        return {OFFLINE: self._offline_sizes, ONLINE: online}

    def sizes(self) -> dict[str, list[int]]:
        """Per-shard sizes as the next draw allocates with them."""
        sizes = self._sizes()
        log = self._log
        return {OFFLINE: sizes[OFFLINE].tolist(), ONLINE: sizes[ONLINE].tolist(),
                "online_written": [] if log is None else log.written.tolist(),
                "online_capacity": [] if log is None else log.capacity.tolist()}

    # fraction ---------------------------------------------------------------
    def offline_fraction(self) -> float:
        sizes = self._sizes()
        return float(self._schedule(self._step, int(sizes[OFFLINE].sum()), int(sizes[ONLINE].sum())))

    def set_offline_fraction(self, value: Any) -> float:
        self._schedule = make_schedule(value)
        self._base_fraction = self._schedule.value if isinstance(self._schedule, Constant) else None
        return self.offline_fraction()

    def anneal(self, step: int, total_steps: int) -> float:
        """TorchRL's ``anneal``: linear from the base fraction to 0 over ``total_steps``."""
        step, total_steps = non_negative_int("step", step), positive_int("total_steps", total_steps)
        base = self._base_fraction if self._base_fraction is not None else self.offline_fraction()
        value = Linear(base, 0.0, total_steps)(step, 0, 0)
        self._schedule = Constant(value)
        self._base_fraction = base
        return value

    def set_step(self, step: int) -> None:
        self._step = non_negative_int("step", step)

    # drawing ----------------------------------------------------------------
    def _requery_masses(self, side: str, shards: Any) -> None:
        """Ask these shards for their mass now, behind every write and update sent to them."""
        if self._alloc.uses_masses:
            for i in shards:
                self._masses[side][i] = self._shards[side][i].mass_stats.remote()
            self._masses_stale = True

    def _refresh_masses(self, sizes: dict[str, np.ndarray]) -> None:
        import ray

        if self._masses_stale:
            for side in SIDES:
                self._alloc.set_masses(side, ray.get(self._masses[side]), sizes[side])
            self._masses_stale = False

    @contextlib.contextmanager
    def _unchanged_on_error(self) -> Iterator[None]:
        saved = (self._rng.bit_generator.state, self._step, self._alloc.state_dict())
        try:
            yield
        except BaseException:
            self._rng.bit_generator.state, self._step = saved[0], saved[1]
            self._alloc.load_state_dict(saved[2])
            raise

    def _draw(self, batch_size: int, num_slices: int = 1) -> list[tuple[BatchPlan, list[tuple[int, dict]]]]:
        """Split and allocate one global batch as ``num_slices`` slices: ``(plan, [(seed, read kwargs)])``.

        Each slice is allocated on its own, so every slice and their union have the
        distribution of sampling the union of shards, and each slice's split is exact
        to within one row.
        """
        batch_size = positive_int("batch_size", batch_size)
        if not 1 <= num_slices <= batch_size:
            raise ValueError(f"num_slices must be in [1, batch_size={batch_size}], got {num_slices}")
        with self._unchanged_on_error():
            fraction = self.offline_fraction()
            sizes = self._sizes()
            need = dict(zip(SIDES, split_batch(batch_size, fraction, int(sizes[ONLINE].sum()))))
            if self._alloc.uses_masses:
                self._refresh_masses(sizes)
            for side, begin in self._alloc.check(need, sizes).items():  # raises before anything changes
                if begin:
                    self._alloc.begin_epoch(side, sizes[side], self._rng)
            out = []
            for n_off, n_on in split_slices(need[OFFLINE], need[ONLINE], num_slices):
                parts, reads = [], []
                for side, n in ((OFFLINE, n_off), (ONLINE, n_on)):
                    if n == 0:
                        continue
                    kwargs = [self._alloc.read_args(side, i) for i in range(len(self._shards[side]))]
                    counts = self._alloc.counts(side, n, sizes[side], self._rng)
                    seeds = self._rng.integers(0, 2**63 - 1, len(counts))
                    for i, (c, s) in enumerate(zip(counts, seeds)):
                        if c > 0:
                            parts.append(Part(side, i, int(c)))
                            reads.append((int(s), kwargs[i]))
                out.append((BatchPlan(parts, n_off, n_on, fraction, self._step, self._alloc.weights()), reads))
            self._step += 1
        self._metrics.count("batches")
        self._metrics.count("rows_sampled", batch_size)
        return out

    def _submit(self, plan: BatchPlan, reads: list[tuple[int, dict]], tensors: bool = False) -> list[Any]:
        refs = []
        for part, (seed, kwargs) in zip(plan.parts, reads):
            shard = self._shards[part.side][part.shard]
            if tensors:
                refs.append(shard.sample_tensors.options(tensor_transport=self._transport).remote(
                    part.count, seed, device=self._device, **kwargs))
            else:
                refs.append(shard.sample.remote(part.count, seed, **kwargs))
        return refs

    # sampling ---------------------------------------------------------------
    def sample(self, batch_size: int) -> Dispatch:
        """Plan one batch and submit its shard reads."""
        t0 = time.perf_counter()
        ((plan, reads),) = self._draw(batch_size)
        out = Dispatch(plan, self._submit(plan, reads))
        self._metrics.observe("plan_ms", (time.perf_counter() - t0) * 1e3)
        return out

    def sample_group(self, batch_size: int, num_batches: int) -> GroupDispatch:
        """Plan ``num_batches`` consecutive batches with one read task per shard.

        The batches are exactly those of as many :meth:`sample` calls; each shard
        returns the rows of all of them in one object, which cuts the per-object and
        per-call costs by ``num_batches``. Without replacement a group is one batch,
        so that a refused draw never follows one that was already taken.
        """
        t0 = time.perf_counter()
        num_batches = 1 if self._sampler == "without_replacement" else positive_int("num_batches", num_batches)
        drawn = [self._draw(batch_size)[0] for _ in range(num_batches)]
        by_shard: dict[tuple[str, int], list[tuple[int, int, dict]]] = {}
        for plan, reads in drawn:
            for part, (seed, kwargs) in zip(plan.parts, reads):
                by_shard.setdefault((part.side, part.shard), []).append((part.count, seed, kwargs.get("epoch")))
        group = GroupDispatch([plan for plan, _ in drawn])
        for (side, i), items in by_shard.items():
            counts, seeds, epochs = (list(x) for x in zip(*items))
            group.reads.append((side, i))
            group.refs.append(self._shards[side][i].sample_many.remote(counts, seeds, epochs))
        self._metrics.observe("plan_ms", (time.perf_counter() - t0) * 1e3)
        return group

    def sample_slices(self, batch_size: int, *, num_slices: int = 1, return_info: bool = False,
                      node_ids: Sequence[str | None] | None = None, postprocess: Any = None,
                      split_info: bool = False) -> list[Any]:
        """One global batch as ``num_slices`` refs, each to one slice's flat rows.

        A small task concatenates each slice's shard parts (on ``node_ids[j]`` when
        given, so the slice is assembled where it is consumed), applying
        ``postprocess`` if given. With ``split_info`` each slice is a pair of refs
        ``(rows, info)``.
        """
        t0 = time.perf_counter()
        out = []
        for j, (plan, reads) in enumerate(self._draw(batch_size, num_slices)):
            task = _assemble_task(node_ids[j] if node_ids else None, num_returns=2 if split_info else 1)
            out.append(task.remote(plan, return_info or split_info, postprocess, *self._submit(plan, reads)))
        self._metrics.observe("plan_ms", (time.perf_counter() - t0) * 1e3)
        return out

    # feeding learners ---------------------------------------------------------
    def connect_learners(self, learners: Sequence[Any]) -> int:
        """Make ``learners`` the targets of :meth:`feed`; with an RDT transport, create the group.

        The coordinator creates the collective group over shards and learners, since
        only a group's creator may pass its refs on.
        """
        from rayrb.transport import connect_group

        learners = list(learners)
        if not learners:
            raise ValueError("expected at least one learner actor handle, got none")
        self._group = connect_group(self._transport, self._shards[OFFLINE] + self._shards[ONLINE], learners,
                                    f"{self._name}-{self._transport}", previous=self._group)
        self._learners = learners
        return len(learners)

    def feed(self, method: str, batch_size: int, args: Sequence[Any] = ()) -> list[Any]:
        """Sample one global batch, slice it over the connected learners, call ``method`` on each.

        Learner ``j`` gets ``method(plan_j, *parts_j, *args)``: its shard parts arrive as
        resolved arguments (numpy rows, or tensors over RDT) straight from the shards.
        ``rayrb.transport.receive(plan, *parts)`` turns them into a TensorDict.
        """
        if not self._learners:
            raise RuntimeError("no learners connected: call connect_learners(learners) first")
        t0 = time.perf_counter()
        tensors = self._transport != "object_store"
        out = [getattr(learner, method).remote(plan, *self._submit(plan, reads, tensors), *args)
               for learner, (plan, reads) in zip(self._learners, self._draw(batch_size, len(self._learners)))]
        self._metrics.observe("plan_ms", (time.perf_counter() - t0) * 1e3)
        return out

    # writing ----------------------------------------------------------------
    def extend(self, rows_ref: Sequence[Any], rows: int, write_id: str | None = None
               ) -> tuple[np.ndarray, list[Any]]:
        """Send contiguous pieces of one batch of ``rows`` rows (``rows_ref[0]``, an ObjectRef) to shards.

        Returns the rows' global online indices and the shards' acknowledgements; the
        caller waits on those before it reports the write as done. A ``write_id`` seen
        before returns that write's indices and acknowledgements, and writes nothing.
        """
        if self._log is None:
            raise RuntimeError("this buffer has no online shards")
        seen = self._log.seen(write_id)
        if seen is not None and not _failed(seen[1]):
            return seen  # a retry: applied once, and its acknowledgements are the first call's
        plan = self._log.plan(self._log.cut(positive_int("rows", rows)))
        # The ref came nested in a list, so it is still unresolved: each shard fetches its piece itself.
        acks = [self._shards[ONLINE][w.shard].extend.remote(rows_ref[0], w.start, w.stop, first=w.first)
                for w in plan]
        self._log.commit(plan, write_id, acks)
        self._requery_masses(ONLINE, [w.shard for w in plan])
        self._metrics.count("rows_written", int(rows))
        return self._log.indices(plan), acks

    def update_priority(self, offline: np.ndarray, shard: np.ndarray, index: np.ndarray, generation: np.ndarray,
                        priority: np.ndarray) -> tuple[int, list[Any]]:
        """Route priority updates to the shards that own the rows; return the row count and the shards' acks.

        The whole call is checked before any shard gets its part. Each shard drops
        updates whose generation no longer matches the slot.
        """
        if not self._alloc.uses_masses:
            raise ValueError(f"update_priority needs sampler='prioritized', this buffer samples {self._sampler!r}")
        offline, shard = np.asarray(offline, bool).reshape(-1), np.asarray(shard, np.int64).reshape(-1)
        index, generation = np.asarray(index, np.int64).reshape(-1), np.asarray(generation, np.int64).reshape(-1)
        priority = np.asarray(priority, np.float64).reshape(-1)
        lengths = [len(offline), len(shard), len(index), len(generation), len(priority)]
        if len(set(lengths)) != 1:
            raise ValueError(f"expected offline, shard, index, generation and priority of the same length, got {lengths}")
        if not np.all(np.isfinite(priority)):
            raise ValueError(f"priorities must be finite numbers, got {priority[~np.isfinite(priority)][:3].tolist()}")
        sizes, routes = self._sizes(), []
        for side, on_side in ((OFFLINE, offline), (ONLINE, ~offline)):
            for i in np.unique(shard[on_side]):
                if not 0 <= i < len(self._shards[side]):
                    raise ValueError(f"no {side} shard {i}: the buffer has {len(self._shards[side])}")
                sel = on_side & (shard == i)
                bad = index[sel][(index[sel] < 0) | (index[sel] >= sizes[side][i])]
                if bad.size:
                    raise IndexError(f"{side} shard {i} holds {int(sizes[side][i])} rows, got index {int(bad[0])}")
                routes.append((side, int(i), sel))
        acks = [self._shards[side][i].update_priority.remote(index[sel], generation[sel], priority[sel])
                for side, i, sel in routes]
        for side, i, _ in routes:
            self._requery_masses(side, [i])
        return int(len(offline)), acks

    def resync(self) -> dict[str, list[int]]:
        """Take the online shards' own write counts (after a failed write or a restore)."""
        import ray

        if self._log is not None:
            self._log.reset(ray.get([s.written.remote() for s in self._shards[ONLINE]]))
        for side in SIDES:
            self._requery_masses(side, range(len(self._shards[side])))
        return self.sizes()

    # introspection ----------------------------------------------------------
    def stats(self, include_shards: bool = True) -> dict[str, Any]:
        import ray

        out = {"coordinator": {**self._metrics.snapshot(), "step": self._step, "offline_fraction": self.offline_fraction(),
                               "epochs": self._alloc.stats().get("epochs", {s: 0 for s in SIDES}), **self.sizes()}}
        if include_shards:
            out["shards"] = ray.get([s.stats.remote() for side in SIDES for s in self._shards[side]])
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"step": self._step, "schedule": self._schedule.config(), "base_fraction": self._base_fraction,
                "rng": self._rng.bit_generator.state, "sampler": self._sampler, "allocator": self._alloc.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the sampling state; checked whole before anything changes."""
        if state.get("sampler", self._sampler) != self._sampler:
            raise ValueError(f"state was saved by a buffer sampling {state['sampler']!r}, this one samples "
                             f"{self._sampler!r}")
        step, schedule = non_negative_int("step", state["step"]), make_schedule(state["schedule"])
        rng = np.random.default_rng()
        rng.bit_generator.state = state["rng"]
        alloc = make_allocator(self._sampler, self._alloc.num_shards, drop_last=getattr(self._alloc, "drop_last", False),
                               beta=getattr(self._alloc, "beta", BETA))
        if "allocator" in state:  # absent when restored onto another shard layout: epochs start afresh
            alloc.load_state_dict(state["allocator"])
        self._step, self._schedule, self._base_fraction = step, schedule, state.get("base_fraction")
        self._rng.bit_generator.state = rng.bit_generator.state
        self._alloc = alloc
        for side in SIDES:  # priorities may have changed under us: re-query every shard
            self._requery_masses(side, range(len(self._shards[side])))

    def checkpoint(self, path: str) -> dict[str, Any]:
        """Submit every shard's dump behind the writes sent so far, and take this state at the same cut."""
        shards = self._shards[OFFLINE] + self._shards[ONLINE]
        acks = [s.dump.remote(f"{path}/shard-{j}.npz") for j, s in enumerate(shards)]
        return {"acks": acks, "state": self.state_dict(), "sizes": self.sizes()}

    def ping(self) -> str:
        return self._name


def _failed(acks: list[Any]) -> bool:
    """Whether any of these shard acknowledgements has already come back as an error (never waits)."""
    import ray

    ready, _ = ray.wait(list(acks), num_returns=len(acks), timeout=0)
    for ref in ready:
        try:
            ray.get(ref)
        except Exception:
            return True
    return False


_TASKS: dict[Any, Any] = {}


def _assemble_task(node_id: str | None, num_returns: int = 1):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if None not in _TASKS:
        _TASKS[None] = ray.remote(num_cpus=0)(assemble_slice)
    opts: dict[str, Any] = {"num_returns": num_returns}
    if node_id is not None:
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=True)
    return _TASKS[None].options(**opts)
