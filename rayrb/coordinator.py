"""The Coordinator actor: splits each batch, allocates it over shards, sequences writes.

It holds shard handles and shard sizes, never rows. For a sample it draws the
offline/online split and the per-shard counts, submits one ``sample`` task per
shard and returns the resulting ObjectRefs: the rows go from the shards to the
caller once, without passing through the coordinator.

Writes are sequenced here too: the writer ``ray.put``s its rows and hands the
refs over; the coordinator picks the shards and submits ``extend`` tasks. Since
a sync actor runs one caller's tasks in submission order, a shard has applied
every write the coordinator sent before any later sample reaches it, so the
sizes used for allocation are exact, not merely recent.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from rayrb.allocation import (
    assign_pieces,
    check_batch_size,
    hypergeometric_counts,
    multinomial_counts,
    split_batch,
)
from rayrb.metrics import ActorMetrics
from rayrb.schedules import Constant, Linear, make_schedule

OFFLINE, ONLINE = "offline", "online"


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
        export_metrics: bool = True,
        transport: str = "object_store",
        device: str = "cpu",
        beta: float = 0.4,
    ):
        self._shards = {OFFLINE: list(offline_shards), ONLINE: list(online_shards)}
        self._sizes = {OFFLINE: np.asarray(offline_sizes, np.int64), ONLINE: np.zeros(len(online_shards), np.int64)}
        self._capacity = np.asarray(online_capacities, np.int64)
        self._written = np.zeros(len(online_shards), np.int64)
        self._schedule = make_schedule(offline_fraction)
        self._base_fraction = self._schedule(0, 0, 0) if isinstance(self._schedule, Constant) else None
        self._sampler, self._drop_last = sampler, bool(drop_last)
        self._seed = seed
        self._rng = np.random.default_rng(seed)
        self._step = 0
        self._left = {OFFLINE: None, ONLINE: None}  # rows left per shard in the epoch (without replacement)
        self._epochs = {OFFLINE: 0, ONLINE: 0}
        self._name = name
        self._metrics = ActorMetrics("coordinator", {"buffer": name}, export=export_metrics)
        self._transport, self._device = transport, device
        self._learners: list[Any] = []
        self._acks: list[tuple[int, Any]] = []  # writes not yet confirmed by their shard
        self._beta = float(beta)
        # Prioritized: each shard's (mass, min p) as of its last mutation, queried right after it (in order).
        self._mass_refs = {side: [s.mass_stats.remote() for s in self._shards[side]] for side in (OFFLINE, ONLINE)} \
            if sampler == "prioritized" else None
        self._mass = {OFFLINE: np.zeros(len(offline_shards)), ONLINE: np.zeros(len(online_shards))}
        self._masses_stale = True
        self._min_p = {OFFLINE: 1.0, ONLINE: 1.0}
        self._group = None

    # fraction ---------------------------------------------------------------
    def offline_fraction(self) -> float:
        return float(self._schedule(self._step, int(self._sizes[OFFLINE].sum()), int(self._sizes[ONLINE].sum())))

    def set_offline_fraction(self, value: Any) -> float:
        self._schedule = make_schedule(value)
        if isinstance(self._schedule, Constant):
            self._base_fraction = self._schedule.value
        return self.offline_fraction()

    def anneal(self, step: int, total_steps: int) -> float:
        """TorchRL's ``anneal``: linear from the base fraction to 0 over ``total_steps``."""
        base = self._base_fraction if self._base_fraction is not None else self.offline_fraction()
        value = Linear(base, 0.0, total_steps)(step, 0, 0)
        self._schedule = Constant(value)
        self._base_fraction = base
        return value

    def set_step(self, step: int) -> None:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self._step = int(step)

    # sampling ---------------------------------------------------------------
    def _epoch_plan(self, side: str, n: int) -> bool:
        """Whether ``side`` needs a new epoch before drawing ``n`` rows; raise if it cannot serve them."""
        sizes = self._sizes[side]
        if n > sizes.sum():
            raise ValueError(
                f"cannot draw {n} {side} rows without replacement: the {side} side holds {int(sizes.sum())} rows"
            )
        left = self._left[side]
        if left is None or left.sum() == 0:
            return True
        if n > left.sum():
            if not self._drop_last:
                raise ValueError(
                    f"cannot draw {n} {side} rows without replacement: {int(left.sum())} left in the epoch; "
                    f"pass drop_last=True to drop them and start the next epoch"
                )
            return True
        return False

    def _begin_epoch(self, side: str) -> None:
        seeds = self._rng.integers(0, 2**63 - 1, len(self._shards[side]))
        for shard, s in zip(self._shards[side], seeds):
            shard.begin_epoch.remote(int(s))
        self._left[side] = self._sizes[side].copy()
        self._epochs[side] += 1

    def _refresh_masses(self) -> None:
        """Resolve the shards' latest (mass, min p); only after a write or priority update changed them."""
        import ray

        if not self._masses_stale:
            return
        self._masses_stale = False
        for side in (OFFLINE, ONLINE):
            stats = ray.get(self._mass_refs[side])
            self._mass[side] = np.asarray([m for m, _ in stats], dtype=np.float64)
            mins = [p for (m, p), size in zip(stats, self._sizes[side]) if size > 0]
            self._min_p[side] = float(min(mins)) if mins else 1.0

    def _counts(self, side: str, n: int) -> np.ndarray:
        if self._sampler == "prioritized":
            return multinomial_counts(n, self._mass[side], self._rng)
        if self._sampler == "without_replacement":
            counts = hypergeometric_counts(n, self._left[side], self._rng)
            self._left[side] = self._left[side] - counts
            return counts
        return multinomial_counts(n, self._sizes[side], self._rng)

    def _read(self, shard: Any, count: int, seed: int, tensors: bool) -> Any:
        if not tensors:
            return shard.sample.remote(count, seed)
        return shard.sample_tensors.options(tensor_transport=self._transport).remote(count, seed, self._device)

    def _plan(self, batch_size: int, num_slices: int = 1, tensors: bool = False) -> list[dict[str, Any]]:
        """:meth:`_draw`, then submit each part's shard read; parts carry refs instead of seeds."""
        slices = self._draw(batch_size, num_slices)
        for plan in slices:
            plan["parts"] = [(side, i, c, self._read(self._shards[side][i], c, seed, tensors))
                             for side, i, c, seed in plan["parts"]]
        return slices

    def _draw(self, batch_size: int, num_slices: int = 1) -> list[dict[str, Any]]:
        """Split and allocate one global batch, as ``num_slices`` slices of ``(side, shard, count, seed)`` parts.

        Each slice is allocated on its own (its own multinomial or hypergeometric
        draw), so every slice and their union have the distribution of sampling the
        union of shards, and each slice's split is exact to within one row.
        """
        from rayrb.allocation import split_slices

        batch_size = check_batch_size(batch_size)
        if num_slices <= 0 or num_slices > batch_size:
            raise ValueError(f"num_slices must be in [1, batch_size={batch_size}], got {num_slices}")
        fraction = self.offline_fraction()
        n = dict(zip((OFFLINE, ONLINE), split_batch(batch_size, fraction, int(self._sizes[ONLINE].sum()))))
        if self._sampler == "prioritized":
            self._refresh_masses()  # exact: queried after every earlier write and priority update
        # Validate both sides before touching any state, so a refused call changes nothing.
        new_epoch = {s: self._sampler == "without_replacement" and n[s] > 0 and self._epoch_plan(s, n[s])
                     for s in (OFFLINE, ONLINE)}
        for side in (OFFLINE, ONLINE):
            if new_epoch[side]:
                self._begin_epoch(side)
        slices = []
        for n_off, n_on in split_slices(n[OFFLINE], n[ONLINE], num_slices):
            parts = []
            for side, count in ((OFFLINE, n_off), (ONLINE, n_on)):
                if count == 0:
                    continue
                counts = self._counts(side, count)
                seeds = self._rng.integers(0, 2**63 - 1, len(counts))
                for i, (c, s) in enumerate(zip(counts, seeds)):
                    if c > 0:
                        parts.append((side, i, int(c), int(s)))
            plan = {"parts": parts, "n_offline": n_off, "n_online": n_on, "fraction": fraction, "step": self._step}
            if self._sampler == "prioritized":
                # Importance weights use each side's global min p_i: w = (p_i / min p)^-beta, i.e. the
                # (N P(i))^-beta of the union of shards, normalized by its largest value.
                plan["weights"] = {"beta": self._beta, OFFLINE: self._min_p[OFFLINE], ONLINE: self._min_p[ONLINE]}
            slices.append(plan)
        self._step += 1
        self._metrics.count("batches")
        self._metrics.count("rows_sampled", batch_size)
        return slices

    def sample(self, batch_size: int) -> dict[str, Any]:
        """Plan one batch and submit its shard reads; return the refs and the plan."""
        t0 = time.perf_counter()
        (plan,) = self._plan(batch_size)
        self._metrics.observe("plan_ms", (time.perf_counter() - t0) * 1e3)
        return plan

    def sample_group(self, batch_size: int, num_batches: int) -> dict[str, Any]:
        """Plan ``num_batches`` consecutive batches with one read task per shard.

        The batches are exactly those of as many :meth:`sample` calls (same draws, same
        seeds); each shard returns the rows of all of them in one object, which cuts
        the per-object and per-call costs by ``num_batches``. Without replacement a
        group is one batch, since an epoch may begin between two batches.
        """
        t0 = time.perf_counter()
        if self._sampler == "without_replacement":
            num_batches = 1
        plans = [self._draw(batch_size)[0] for _ in range(int(num_batches))]
        by_shard: dict[tuple[str, int], list[tuple[int, int]]] = {}
        for plan in plans:
            for side, i, c, seed in plan["parts"]:
                by_shard.setdefault((side, i), []).append((c, seed))
            plan["parts"] = [p[:3] for p in plan["parts"]]
        reads = [(side, i, self._shards[side][i].sample_many.remote([c for c, _ in items], [s for _, s in items]))
                 for (side, i), items in by_shard.items()]
        self._metrics.observe("plan_ms", (time.perf_counter() - t0) * 1e3)
        return {"plans": plans, "reads": reads}

    def sample_refs(self, batch_size: int, num_slices: int = 1, return_info: bool = False,
                    node_ids: Sequence[str | None] | None = None, postprocess: Any = None,
                    split_info: bool = False) -> list[Any]:
        """Like :meth:`sample`, but each slice comes back as one ObjectRef to its flat rows.

        A small task concatenates each slice's shard parts (on ``node_ids[j]`` when
        given, so the slice is assembled where it is consumed), applying
        ``postprocess(rows)`` if given. With ``split_info`` each slice is a pair of
        refs ``(rows, info)``.
        """
        t0 = time.perf_counter()
        slices = self._plan(batch_size, num_slices)
        out = []
        for j, plan in enumerate(slices):
            node = node_ids[j] if node_ids else None
            task = _assemble_task(node, num_returns=2 if split_info else 1)
            out.append(task.remote(_plan_meta(plan), return_info or split_info, postprocess,
                                   *[p[3] for p in plan["parts"]]))
        self._metrics.observe("plan_ms", (time.perf_counter() - t0) * 1e3)
        return out

    # feeding learners ---------------------------------------------------------
    def connect_learners(self, learners: Sequence[Any]) -> int:
        """Make ``learners`` the targets of :meth:`feed`; with an RDT transport, create the group.

        The coordinator creates the collective group over shards and learners, since
        only a group's creator may pass its refs on.
        """
        learners = list(learners)
        if not learners:
            raise ValueError("expected at least one learner actor handle, got none")
        if self._transport != "object_store":
            missing = [i for i, a in enumerate(learners) if not getattr(a, "_ray_enable_tensor_transport", False)]
            if missing:
                raise ValueError(
                    f"transport={self._transport!r} needs learner classes declared with "
                    f"@ray.remote(enable_tensor_transport=True); learners {missing} are not (without it the "
                    "receive deadlocks until Ray's 60 s RDT timeout, ray-project/ray#66264)")
            from ray.experimental.collective import create_collective_group, destroy_collective_group

            if self._group is not None:
                destroy_collective_group(self._group)
                self._group = None
            members = self._shards[OFFLINE] + self._shards[ONLINE] + learners
            try:
                self._group = create_collective_group(members, backend=self._transport,
                                                      name=f"{self._name}-{self._transport}")
            except Exception as e:
                raise RuntimeError(
                    f"could not create a {self._transport} collective group over the shards and learners: {e}. "
                    "An actor can join one group per backend, and gloo RDT cannot share an actor with a "
                    "torch.distributed default group (DDP, RLlib remote learners): use transport='object_store' "
                    "or 'nccl' for those learners") from e
        self._learners = learners
        return len(learners)

    def feed(self, method: str, batch_size: int, args: Sequence[Any] = ()) -> list[Any]:
        """Sample one global batch, slice it over the connected learners, call ``method`` on each.

        Learner ``j`` gets ``method(meta_j, *parts_j, *args)``: its shard parts arrive as
        resolved arguments (numpy rows, or tensors over RDT) straight from the shards.
        ``rayrb.transport.receive(meta, *parts)`` turns them into a TensorDict. Returns
        the learners' result refs.
        """
        if not self._learners:
            raise RuntimeError("no learners connected: call connect_learners(learners) first")
        t0 = time.perf_counter()
        slices = self._plan(batch_size, len(self._learners), tensors=self._transport != "object_store")
        out = []
        for learner, plan in zip(self._learners, slices):
            out.append(getattr(learner, method).remote(_plan_meta(plan), *[p[3] for p in plan["parts"]], *args))
        self._metrics.observe("plan_ms", (time.perf_counter() - t0) * 1e3)
        return out

    # writing ----------------------------------------------------------------
    def extend(self, rows_ref: Sequence[Any], piece_rows: Sequence[int], return_acks: bool = False):
        """Send contiguous pieces of one batch (``rows_ref[0]``, an ObjectRef) to shards.

        Returns the rows' global online indices (and the shards' ack refs if asked).
        Slots are known here (a shard's cursor is its write count modulo its capacity),
        so a writer need not wait for the copies. Acks of earlier writes are checked
        first: a failed one resyncs sizes from the shards and raises.
        """
        if not self._shards[ONLINE]:
            raise RuntimeError("this buffer has no online shards")
        if len(piece_rows) > len(self._shards[ONLINE]):
            raise ValueError(f"expected at most {len(self._shards[ONLINE])} pieces, got {len(piece_rows)}")
        if len(self._acks) >= 32:  # checking costs a ray.wait; amortize it
            self._check_acks()
        targets = assign_pieces(piece_rows, self._written)
        offsets = np.concatenate([[0], np.cumsum(self._capacity)[:-1]])
        indices, acks, start = [], [], 0
        for rows, shard in zip(piece_rows, targets):
            slots = (int(self._written[shard]) + np.arange(rows, dtype=np.int64)) % int(self._capacity[shard])
            # The ref came nested in a list, so it is still unresolved: the shard fetches the rows itself.
            ack = self._shards[ONLINE][shard].extend.remote(rows_ref[0], start, start + rows)
            self._acks.append((shard, ack))
            if self._mass_refs is not None:
                self._mass_refs[ONLINE][shard] = self._shards[ONLINE][shard].mass_stats.remote()
                self._masses_stale = True
            acks.append(ack)
            indices.append(int(offsets[shard]) + slots)
            self._written[shard] += rows
            start += rows
        self._sizes[ONLINE] = np.minimum(self._written, self._capacity)
        self._metrics.count("rows_written", int(sum(piece_rows)))
        out = np.concatenate(indices)
        return (out, acks) if return_acks else out

    def update_priority(self, offline: np.ndarray, shard: np.ndarray, index: np.ndarray, generation: np.ndarray,
                        priority: np.ndarray) -> int:
        """Route priority updates to the shards that own the rows; return how many rows were sent.

        Each shard drops updates whose generation no longer matches the slot.
        """
        if self._sampler != "prioritized":
            raise ValueError(f"update_priority needs sampler='prioritized', this buffer samples {self._sampler!r}")
        offline, shard = np.asarray(offline, bool), np.asarray(shard, np.int64)
        arrays = [np.asarray(a) for a in (index, generation, priority)]
        if len({len(offline), len(shard), *map(len, arrays)}) != 1:
            raise ValueError("expected offline, shard, index, generation and priority of the same length, got "
                             f"{[len(offline), len(shard), *map(len, arrays)]}")
        if not np.all(np.isfinite(arrays[2].astype(np.float64))):
            raise ValueError("priorities must be finite numbers")
        for side, on_side in ((OFFLINE, offline), (ONLINE, ~offline)):
            for i in np.unique(shard[on_side]):
                if not 0 <= i < len(self._shards[side]):
                    raise ValueError(f"no {side} shard {i}: the buffer has {len(self._shards[side])}")
                sel = on_side & (shard == i)
                self._shards[side][i].update_priority.remote(*(a[sel] for a in arrays))
                self._mass_refs[side][i] = self._shards[side][i].mass_stats.remote()
                self._masses_stale = True
        return int(len(offline))

    def _check_acks(self) -> None:
        import ray

        if not self._acks:
            return
        refs = [a for _, a in self._acks]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done = set(done)
        failed = []
        for shard, ack in self._acks:
            if ack in done:
                try:
                    ray.get(ack)
                except Exception as e:
                    failed.append((shard, e))
        self._acks = [(s, a) for s, a in self._acks if a not in done]
        if failed:
            self.resync()
            shard, e = failed[0]
            raise RuntimeError(f"an earlier write to online shard {shard} failed ({type(e).__name__}: {e}); "
                               f"sizes were re-read from the shards: {self.sizes()}")

    def resync(self) -> dict[str, list[int]]:
        """Re-read sizes from the shards (after a failed write)."""
        import ray

        self._masses_stale = True  # the min-p filter depends on sizes
        sizes = ray.get([s.size.remote() for s in self._shards[OFFLINE]])
        self._sizes[OFFLINE] = np.asarray(sizes, np.int64)
        if self._shards[ONLINE]:
            self._written = np.asarray(ray.get([s.written.remote() for s in self._shards[ONLINE]]), np.int64)
            self._sizes[ONLINE] = np.minimum(self._written, self._capacity)
        return self.sizes()

    # introspection ----------------------------------------------------------
    def sizes(self) -> dict[str, list[int]]:
        self._check_acks()
        return {OFFLINE: self._sizes[OFFLINE].tolist(), ONLINE: self._sizes[ONLINE].tolist(),
                "online_written": self._written.tolist(), "online_capacity": self._capacity.tolist()}

    def stats(self, include_shards: bool = True) -> dict[str, Any]:
        import ray

        out = {"coordinator": {**self._metrics.snapshot(), "step": self._step, "offline_fraction": self.offline_fraction(),
                               "epochs": dict(self._epochs), **self.sizes()}}
        if include_shards:
            out["shards"] = ray.get([s.stats.remote() for side in (OFFLINE, ONLINE) for s in self._shards[side]])
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"step": self._step, "schedule": self._schedule.config(), "base_fraction": self._base_fraction,
                "rng": self._rng.bit_generator.state, "sampler": self._sampler}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._mass_refs is not None:  # priorities may have changed under us: re-query every shard
            self._mass_refs = {side: [s.mass_stats.remote() for s in self._shards[side]] for side in (OFFLINE, ONLINE)}
            self._masses_stale = True
        self._step = int(state["step"])
        self._schedule = make_schedule(state["schedule"])
        self._base_fraction = state.get("base_fraction")
        self._rng.bit_generator.state = state["rng"]

    def ping(self) -> str:
        return self._name


def split_group(group: dict[str, Any], results: Sequence[tuple]) -> list[tuple[dict[str, Any], list[tuple]]]:
    """Cut :meth:`Coordinator.sample_group`'s per-shard results back into per-batch ``(plan, parts)``."""
    data = {(side, i): r for (side, i, _), r in zip(group["reads"], results)}
    cursor = {k: 0 for k in data}
    out = []
    for plan in group["plans"]:
        parts = []
        for side, i, c in plan["parts"]:
            rows, info = data[(side, i)]
            a = cursor[(side, i)]
            parts.append(({k: v[a:a + c] for k, v in rows.items()}, {k: v[a:a + c] for k, v in info.items()}))
            cursor[(side, i)] = a + c
        out.append((plan, parts))
    return out


def _plan_meta(plan: dict[str, Any]) -> dict[str, Any]:
    """A plan without its refs (the refs travel as task arguments, so Ray resolves them)."""
    return {**plan, "parts": [p[:3] for p in plan["parts"]]}


def provenance(plan: dict[str, Any], infos: Sequence[dict], cat: Any = np.concatenate,
               as_array: Any = np.asarray) -> dict[str, Any]:
    """Per-row provenance of a planned batch from its parts' shard infos (numpy, or torch via ``cat``/``as_array``).

    ``offline`` and ``shard`` come from the plan; ``index``, ``generation`` (and the
    prioritized ``weight = (p_i / min p)^-beta``) from the shards.
    """
    parts = plan["parts"]
    counts = [p[2] for p in parts]
    info = {
        "offline": as_array(np.repeat([p[0] == OFFLINE for p in parts], counts).astype(bool)),
        "shard": as_array(np.repeat([p[1] for p in parts], counts).astype(np.int64)),
        "index": cat([i["index"] for i in infos]),
        "generation": cat([i["generation"] for i in infos]),
    }
    if "weights" in plan:
        w = plan["weights"]
        info["weight"] = cat([(i["priority"] / w[p[0]]) ** -w["beta"] for p, i in zip(parts, infos)])
    return info


def assemble(plan: dict[str, Any], results: Sequence[tuple], return_info: bool = False):
    """Concatenate shard parts into one flat batch (offline parts first), with provenance if asked."""
    from rayrb.transport import concat

    rows = concat([r[0] for r in results])
    if not return_info:
        return rows
    info = provenance(plan, [r[1] for r in results])
    if "weight" in info:
        info["weight"] = info["weight"].astype(np.float32)
    return rows, info


def _assemble_remote(plan: dict[str, Any], return_info: bool, postprocess: Any, *results: tuple):
    out = assemble(plan, results, return_info)
    if postprocess is not None:  # called with the rows, and their provenance when it was asked for
        out = (postprocess(out[0], out[1]), out[1]) if return_info else postprocess(out)
    return out


_TASKS: dict[Any, Any] = {}


def _assemble_task(node_id: str | None, num_returns: int = 1):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if None not in _TASKS:
        _TASKS[None] = ray.remote(num_cpus=0)(_assemble_remote)
    opts: dict[str, Any] = {"num_returns": num_returns}
    if node_id is not None:
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=True)
    return _TASKS[None].options(**opts)
