"""The Coordinator actor: plans batches over shards and sequences writes. A thin shell over pure parts.

It holds shard handles and shard sizes, never rows. For a sample its
:class:`~rayrb.core.planner.Planner` draws a :class:`~rayrb.core.plans.BatchPlan` (the exact
split, the rate limiter's say, per-shard counts), the coordinator submits one read
per contributing shard and returns the refs: the rows go from the shards to the
caller once, without passing through the coordinator. A call the rate limiter
holds back returns :class:`~rayrb.core.plans.Blocked` and changes nothing; the client
asks again.

Writes are sequenced here too. The writer ``ray.put``s its rows and hands the ref
over; the :class:`~rayrb.durability.writelog.WriteLog` picks shards and slots, and the
coordinator submits the shards' copies. A sync actor runs one caller's tasks in
submission order, so a shard has applied every write the coordinator sent before
any later read reaches it: the sizes used for allocation are exact.

A draw that raises leaves the planner's state as it was.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

from rayrb.actors.metrics import ActorMetrics
from rayrb.core.planner import MAX_AHEAD, AheadLog, Planner, Reads, Refused
from rayrb.core.plans import OFFLINE, ONLINE, SIDES, BatchPlan, Blocked, Dispatch, GroupDispatch, assemble_slice
from rayrb.core.plans import route_priorities
from rayrb.durability.storage import CoordinatorState
from rayrb.core.validation import BETA, positive_int
from rayrb.durability.writelog import WriteLog


ANSWERS_KEPT = 4  # calls whose reply a crash can lose: the one running, and replies not yet flushed


def _persists(method):
    """Save the coordinator's state after ``method`` returns (it changed the stream, settings or version)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        out = method(self, *args, **kwargs)
        self._save()
        return out

    return wrapper


class Coordinator:
    def __init__(
        self,
        offline_shards: Sequence[Any],
        offline_sizes: Sequence[int],
        online_shards: Sequence[Any],
        online_capacities: Sequence[int],
        *,
        offline_fraction: Any = 0.5,
        sampler: str | dict[str, str] = "uniform",
        drop_last: bool | None = None,
        epoch_end: str | None = None,
        seed: int | None = None,
        name: str = "rayrb",
        transport: str = "object_store",
        device: str | None = "cpu",
        beta: float = BETA,
        rate_limiter: Any = None,
        state_dir: str | None = None,
    ):
        self._shards = {OFFLINE: list(offline_shards), ONLINE: list(online_shards)}
        self._offline_sizes = np.asarray(offline_sizes, np.int64)
        self._log = WriteLog(online_capacities) if online_shards else None
        self._planner = Planner({s: len(self._shards[s]) for s in SIDES}, offline_fraction=offline_fraction,
                                sampler=sampler, drop_last=drop_last, epoch_end=epoch_end, seed=seed, beta=beta, rate_limiter=rate_limiter,
                                online_capacity=int(sum(online_capacities)) or None)
        self._masses = {side: [None] * len(self._shards[side]) for side in SIDES}
        self._masses_stale = False
        for side in SIDES:
            self._requery_masses(side, range(len(self._shards[side])))
        self._name = name
        self._side_rng = np.random.default_rng(None if seed is None else [seed, 1])
        self._metrics = ActorMetrics("coordinator", {"buffer": name})
        self._transport, self._device = transport, device
        self._learners: list[Any] = []
        self._routes = None  # rayrb.actors.transport.Routes to the connected learners
        # The handle whose draws are the latest, with the planner's state before each of them: while
        # no one else draws or steers, that handle can give back the batches it drew ahead (``undo``).
        self._ahead = AheadLog(limit=MAX_AHEAD)
        # Bumped by every write, priority update, restore and change of settings: a handle holding batches
        # drawn ahead at an older version gives them back (sizes no staler than the previous sample call).
        self._version = 0
        self._version_file = _VersionFile(name)
        self._online_nodes: list[str] | None = None  # each online shard's node, once a writer names its own
        # The last groups handed out, by the caller's call id: a call Ray re-sends after a restart (its reply
        # was lost with the old process) gets the same batches again, not the next ones.
        self._answers: OrderedDict[str, tuple[tuple, GroupDispatch]] = OrderedDict()  # call -> (its request, group)
        # With a state directory, a restarted coordinator (Ray re-runs this with the same arguments) picks up
        # its sampling state there and its write counts from the shards.
        self._state = None
        if state_dir is not None:
            import ray

            self._state = CoordinatorState(state_dir)
            if ray.get_runtime_context().was_current_actor_reconstructed:
                self._restart(self._state.load())
            else:
                self._state.clear()
                self._save()

    def _save(self) -> None:
        """Keep what a restart needs; called after every call that changes it.

        A save that fails (a full or broken disk) does not fail the call, which has already
        changed the stream or sent a write: the answer stays true, a restart resumes from the
        last save that succeeded, and ``stats()`` counts ``state_save_failed``.
        """
        if self._state is None:
            return
        try:
            self._state.save({"planner": self._planner.state_dict(), "side_rng": self._side_rng.bit_generator.state,
                              "version": self._version, "version_path": self._version_file.path,
                              "answers": list(self._answers.items())})
        except OSError:
            self._metrics.count("state_save_failed")

    def _restart(self, saved: dict[str, Any] | None) -> None:
        """Pick up where the previous process left off. Without its state (restarted on another node) the
        stream starts afresh from the seed, but the write counts still come from the shards."""
        if saved is not None:
            self._planner.load_state_dict(saved["planner"])
            self._side_rng.bit_generator.state = saved["side_rng"]
            self._version = int(saved["version"]) + 1  # handles give back what they drew before the restart
            self._version_file.reopen(saved.get("version_path"), self._version)
            self._answers = OrderedDict(saved.get("answers", ()))
        if self._log is not None:
            self._log.reset(*self._write_states())
            self._log.recall(self._state.writes())  # a retry is answered, and only missing pieces sent
        self._metrics.count("restarts")
        self._save()

    def _changed(self, settings: bool = False) -> None:
        self._version += 1
        self._version_file.write(self._version)
        if settings:  # a handle's draws ahead cannot be given back past a change of settings
            self._ahead.forget()

    def version_file(self) -> tuple[str, str | None]:
        """``(node id, path)`` of the memory-mapped version on this node, which handles there read without a call."""
        import ray

        return ray.get_runtime_context().get_node_id(), self._version_file.open(self._version)

    def close(self) -> None:
        """Remove the version file and the state files: the buffer is being shut down."""
        self._version_file.remove()
        if self._state is not None:
            self._state.remove()
            self._state = None

    def seen(self, ahead: str, served: int) -> int:
        """Handle ``ahead`` has served its draws up to number ``served``; returns the version (a counter of
        writes, priority updates, restores and settings changes)."""
        self._ahead.served(ahead, int(served))
        return self._version

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
        return self._planner.fraction(self._sizes())

    @_persists
    def set_offline_fraction(self, value: Any) -> float:
        self._changed(settings=True)
        self._planner.set_fraction(value)
        return self.offline_fraction()

    @_persists
    def anneal(self, step: int, total_steps: int) -> float:
        """TorchRL's ``anneal``: linear from the base fraction to 0 over ``total_steps``."""
        self._changed(settings=True)
        return self._planner.anneal(step, total_steps, self._sizes())

    @_persists
    def set_step(self, step: int) -> None:
        self._changed(settings=True)
        self._planner.set_step(step)

    @_persists
    def base_fraction(self, value: float | None = None) -> float:
        """The fraction ``anneal`` decays from; set it with ``value``."""
        if value is not None:
            self._changed(settings=True)
            self._planner.set_base_fraction(value)
        return self._planner.base_fraction(self._sizes())

    # drawing ----------------------------------------------------------------
    def _requery_masses(self, side: str, shards: Any) -> None:
        """Ask these shards for their mass now, behind every write and update sent to them."""
        if self._planner.alloc.uses_masses:
            for i in shards:
                self._masses[side][i] = self._shards[side][i].mass_stats.remote()
            self._masses_stale = True

    def _draw(self, batch_size: int, num_slices: int = 1, ahead: str | None = None) -> list[tuple[BatchPlan, Reads]]:
        sizes = self._sizes()
        if self._planner.alloc.uses_masses and self._masses_stale:
            import ray

            for side in SIDES:  # exact: the masses were asked for behind every earlier write and update
                self._planner.alloc.set_masses(side, ray.get(self._masses[side]), sizes[side])
            self._masses_stale = False
        out = self._planner.draw(batch_size, num_slices, sizes=sizes)
        rows = sum(plan.batch_size for plan, _ in out)
        if ahead is None:
            self._ahead.forget()
        else:
            self._ahead.record(ahead, self._planner.last_snapshot, rows)
        self._metrics.count("batches")
        self._metrics.count("rows_sampled", rows)
        return out

    def _submit(self, plan: BatchPlan, reads: list[tuple[int, dict]], learner: int | None = None) -> list[Any]:
        """One read per part; for learner ``learner``, over the route its connection chose for each shard."""
        refs = []
        m = len(self._shards[OFFLINE])
        for part, (seed, kwargs) in zip(plan.parts, reads):
            shard = self._shards[part.side][part.shard]
            route = "object_store"
            if learner is not None:
                route = self._routes.route[(part.shard + (m if part.side == ONLINE else 0), learner)]
            if route != "object_store":
                refs.append(shard.sample_tensors.options(tensor_transport=route).remote(
                    part.count, seed, device=self._device, **kwargs))
            else:
                refs.append(shard.sample.remote(part.count, seed, **kwargs))
        return refs

    # sampling ---------------------------------------------------------------
    @_persists
    def sample(self, batch_size: int, waited: float = 0.0) -> Dispatch | Blocked:
        """Plan one batch and submit its shard reads (or say that the rate limiter holds it back)."""
        t0 = time.perf_counter()
        try:
            ((plan, reads),) = self._draw(batch_size)
        except Refused as b:
            return self._blocked(b)
        self._waited("sample", waited)
        out = Dispatch(plan, self._submit(plan, reads))
        self._planned(t0)
        return out

    def _planned(self, t0: float) -> None:
        """Time one sampling call spent here: a latency, and a running total for the busy fraction."""
        ms = (time.perf_counter() - t0) * 1e3
        self._metrics.observe("plan_ms", ms)
        self._metrics.count("plan_ms_total", ms)

    def _blocked(self, b: Refused) -> Blocked:
        self._metrics.count(f"{b.blocked.side}_blocked_calls")
        return b.blocked

    def _waited(self, side: str, seconds: float) -> None:
        if seconds > 0:  # the call went through after waiting for the rate limiter
            self._planner.limiter.record_blocked(side, float(seconds))
            self._metrics.observe(f"{side}_blocked_ms", float(seconds) * 1e3)

    @_persists
    def sample_group(self, batch_size: int, num_batches: int, waited: float = 0.0,
                     ahead: str | None = None, submit: bool = True, served: int | None = None,
                     call: str | None = None) -> GroupDispatch | Blocked:
        """Plan ``num_batches`` consecutive batches with one read task per shard.

        The batches are exactly those of as many :meth:`sample` calls; each shard
        returns the rows of all of them in one object, which cuts the per-object and
        per-call costs by ``num_batches``. Without replacement a group is one batch,
        so that a refused draw never follows one that was already taken. A group the
        rate limiter cuts short holds the batches drawn before it.

        ``ahead`` names a handle that draws batches before they are asked for (its
        plain ``sample()`` loop) and can give back those it did not serve (:meth:`undo`).
        Its group stops early, with what was drawn, where a draw would be refused (an
        epoch's end, the rate limiter). ``served`` reports, as
        :meth:`seen` does, the last of its draws the handle has handed over.

        ``call`` names the call: the same call made again (Ray re-sends it to a restarted
        coordinator when the reply was lost) gets the same batches, read again.
        """
        request = (batch_size, num_batches, ahead)
        if call is not None and call in self._answers:
            asked, group = self._answers[call]
            if asked != request:  # not a re-sent call: its batches would be of another size or handle
                raise ValueError(f"call {call!r} was answered for (batch_size, num_batches, ahead)={asked}, got "
                                 f"{request}: a call id names one call; use a new id for a new call")
            return self._answer_again(group, submit)
        t0 = time.perf_counter()
        if ahead is not None and served is not None:
            self._ahead.served(ahead, int(served))
        if ahead is not None:  # stops early, below, rather than draw past a refusal
            num_batches = positive_int("num_batches", num_batches)
        else:
            num_batches = positive_int("num_batches", num_batches) if self._planner.alloc.groups_batches else 1
        drawn = []
        try:
            for _ in range(num_batches):
                drawn.append(self._draw(batch_size, ahead=ahead)[0])
        except Refused as b:
            if not drawn:
                return self._blocked(b)
        except ValueError:
            if not drawn or ahead is None:
                raise
        self._waited("sample", waited)
        by_shard: dict[tuple[str, int], list[tuple[int, int, dict]]] = {}
        for plan, reads in drawn:
            for part, (seed, kwargs) in zip(plan.parts, reads):
                by_shard.setdefault((part.side, part.shard), []).append((part.count, seed, kwargs.get("epoch")))
        group = GroupDispatch([plan for plan, _ in drawn], version=self._version,
                              first=self._ahead.next_number - len(drawn) if ahead is not None else -1)
        for (side, i), items in by_shard.items():
            counts, seeds, epochs = (list(x) for x in zip(*items))
            group.reads.append((side, i))
            # The caller's read may reach an online shard before a write planned with here; with the reads
            # submitted here, the caller reads again from these if this process dies owning the rows.
            written = int(self._log.counted[i]) if side == ONLINE else None  # a shard counts none past a hole
            group.args.append((counts, seeds, epochs, written))
            if submit:
                group.refs.append(self._shards[side][i].sample_many.remote(counts, seeds, epochs))
        if call is not None:
            self._answers[call] = (request, dataclasses.replace(group, refs=[]))
            while len(self._answers) > ANSWERS_KEPT:
                self._answers.popitem(last=False)
        self._planned(t0)
        return group

    def _answer_again(self, group: GroupDispatch, submit: bool) -> GroupDispatch:
        """A group handed out before, with its reads submitted again: the same counts and seeds, the same rows."""
        refs = [self._shards[side][i].sample_many.remote(counts, seeds, epochs, written)
                for (side, i), (counts, seeds, epochs, written) in zip(group.reads, group.args)] if submit else []
        self._metrics.count("calls_answered_again")
        return dataclasses.replace(group, refs=refs)

    @_persists
    def undo(self, ahead: str, count: int | None) -> str:
        """Give back the last ``count`` batches that handle ``ahead`` drew and did not serve (None: all of them,
        as an iterator that is closed does).

        Returns ``"undone"`` when the stream is back where it was before them (no one
        else drew or changed a setting since). Otherwise the draws stand, and the
        answer says what the handle does with its batches: ``"keep"`` them without
        replacement (each row of an epoch is served once), else ``"drop"`` them.
        """
        # None: all of them, -1 when another caller drew since (refused below); none left is "undone" too
        count = self._ahead.unserved(ahead) if count is None else max(0, int(count))
        if count == 0:
            return "undone"
        taken = self._ahead.take_back(ahead, count)
        if taken is None:
            self._metrics.count("undo_refused")
            return "keep" if getattr(self._planner.alloc, "epoch_end", None) is not None else "drop"
        saved, rows = taken
        self._planner.restore(saved)
        self._metrics.count("batches", -count)  # the counts say what was drawn for good
        self._metrics.count("rows_sampled", -rows)
        self._metrics.count("batches_undone", count)
        return "undone"

    @_persists
    def sample_side(self, side: str, batch_size: int) -> Dispatch:
        """``batch_size`` rows of one side, uniformly from the union of its shards, for buffer-like views.

        Drawn from a stream of its own: the buffer's batches, epochs and rate limiter are untouched.
        """
        from rayrb.core.allocation import multinomial_counts
        from rayrb.core.plans import Part
        from rayrb.core.validation import one_of

        side, batch_size = one_of("side", side, SIDES), positive_int("batch_size", batch_size)
        sizes = self._sizes()[side]
        if sizes.sum() == 0:
            raise ValueError(f"cannot sample {batch_size} rows from the {side} side: it holds no rows")
        counts = multinomial_counts(batch_size, sizes, self._side_rng)
        parts = [Part(side, i, int(c)) for i, c in enumerate(counts) if c > 0]
        refs = [self._shards[side][p.shard].gather.remote(self._side_rng.integers(0, sizes[p.shard], p.count))
                for p in parts]
        n = (batch_size, 0) if side == OFFLINE else (0, batch_size)
        return Dispatch(BatchPlan(parts, *n, fraction=float(side == OFFLINE), step=-1), refs)

    def shard_states(self, side: str) -> list[Any]:
        """Refs to each shard's state arrays, behind every write sent so far."""
        return [s.state.remote() for s in self._shards[side]]

    @_persists
    def load_shard_states(self, side: str, states: Sequence[dict]) -> list[Any]:
        """Give each shard of ``side`` its state; the acks, then :meth:`resync`, complete it.

        Every shard checks its state before any shard takes one, so a refused call changes nothing.
        """
        import ray

        if len(states) != len(self._shards[side]):
            raise ValueError(f"expected {len(self._shards[side])} {side} shard states, got {len(states)}")
        ray.get([s.check_state.remote(st) for s, st in zip(self._shards[side], states)])
        self._changed()
        return [s.load_state.remote(st) for s, st in zip(self._shards[side], states)]

    @_persists
    def sample_slices(self, batch_size: int, *, num_slices: int = 1, return_info: bool = False,
                      node_ids: Sequence[str | None] | None = None, postprocess: Any = None,
                      split_info: bool = False, waited: float = 0.0) -> list[Any] | Blocked:
        """One global batch as ``num_slices`` refs, each to one slice's flat rows.

        A small task concatenates each slice's shard parts (on ``node_ids[j]`` when
        given, so the slice is assembled where it is consumed), applying
        ``postprocess`` if given. With ``split_info`` each slice is a pair of refs
        ``(rows, info)``.
        """
        t0 = time.perf_counter()
        try:
            drawn = self._draw(batch_size, num_slices)
        except Refused as b:
            return self._blocked(b)
        self._waited("sample", waited)
        out = []
        for j, (plan, reads) in enumerate(drawn):
            task = _assemble_task(node_ids[j] if node_ids else None, num_returns=2 if split_info else 1)
            out.append(task.remote(plan, return_info or split_info, postprocess, *self._submit(plan, reads)))
        self._planned(t0)
        return out

    # feeding learners ---------------------------------------------------------
    def connect_learners(self, learners: Sequence[Any]) -> dict[str, int]:
        """Make ``learners`` the targets of :meth:`feed`; choose each shard-learner route, create any group.

        The coordinator creates the collective group over shards and learners, since
        only a group's creator may pass its refs on. Returns how many pairs take each route.
        """
        from rayrb.actors.transport import connect_group

        learners = list(learners)
        if not learners:
            raise ValueError("expected at least one learner actor handle, got none")
        shards = self._shards[OFFLINE] + self._shards[ONLINE]
        names = [f"{self._name}/off-{i}" for i in range(len(self._shards[OFFLINE]))] + \
                [f"{self._name}/on-{i}" for i in range(len(self._shards[ONLINE]))]
        self._routes = connect_group(self._transport, shards, learners, f"{self._name}-{self._transport}",
                                     previous=self._routes, shard_names=names)
        self._learners = learners
        counts: dict[str, int] = {}
        for t in self._routes.route.values():
            counts[t] = counts.get(t, 0) + 1
        return counts

    @_persists
    def feed(self, method: str, batch_size: int, args: Sequence[Any] = (), waited: float = 0.0) -> list[Any] | Blocked:
        """Sample one global batch, slice it over the connected learners, call ``method`` on each.

        Learner ``j`` gets ``method(plan_j, *parts_j, *args)``: its shard parts arrive as
        resolved arguments (numpy rows, or tensors over RDT) straight from the shards.
        ``rayrb.actors.transport.receive(plan, *parts)`` turns them into a TensorDict.
        """
        if not self._learners:
            raise RuntimeError("no learners connected: call connect_learners(learners) first")
        t0 = time.perf_counter()
        try:
            drawn = self._draw(batch_size, len(self._learners))
        except Refused as b:
            return self._blocked(b)
        self._waited("sample", waited)
        out = [getattr(learner, method).remote(plan, *self._submit(plan, reads, j), *args)
               for j, (learner, (plan, reads)) in enumerate(zip(self._learners, drawn))]
        self._planned(t0)
        return out

    # writing ----------------------------------------------------------------
    @_persists
    def extend(self, rows_ref: Sequence[Any], rows: int, write_id: str | None = None, prefill: bool = False,
               waited: float = 0.0, node: str | None = None) -> tuple[np.ndarray, list[Any]] | Blocked:
        """Send contiguous pieces of one batch of ``rows`` rows (``rows_ref[0]``, an ObjectRef) to shards.

        Returns the rows' global online indices and the shards' acknowledgements; the
        caller waits on those before it reports the write as done. A ``write_id`` seen
        before returns that write's indices and acknowledgements, and writes nothing.
        The rate limiter may hold a write back; ``prefill`` writes past it. A write
        from ``node`` (the writer's node id) prefers the online shards there, while
        they are at most :attr:`~rayrb.durability.writelog.WriteLog.slack` rows ahead of the rest.
        """
        if self._log is None:
            raise RuntimeError("this buffer has no online shards")
        rows, seen = positive_int("rows", rows), self._log.seen(write_id)
        if seen is not None and len(seen[0]) != rows:  # its pieces would be cut from other rows
            raise ValueError(f"write_id {write_id!r} names a write of {len(seen[0])} rows, got a retry of {rows} "
                             "rows: a retry must send the same rows (or use a new write_id)")
        if seen is not None and seen[1] is not None and not _failed(seen[1]):
            return seen  # a retry: applied once, and its acknowledgements are the first call's
        if seen is not None:  # journalled before a restart, or a shard failed its piece
            return self._resume(rows_ref, write_id, failed=seen[1] is not None)
        size = int(self._log.sizes.sum())
        try:
            self._planner.admit_insert(rows, size, prefill=prefill)
        except Refused as b:
            return self._blocked(b)
        local = self._local_shards(node)
        plan = self._log.place(rows, local)
        acks = self._send(rows_ref, write_id, plan, plan)
        self._log.commit(plan, write_id, acks)
        self._changed()
        self._planner.record_insert(rows, size, prefill=prefill)
        self._waited("insert", waited)
        self._requery_masses(ONLINE, [w.shard for w in plan])
        self._metrics.count("rows_written", int(rows))
        if local:
            self._metrics.count("rows_written_local", sum(w.rows for w in plan if w.shard in local))
        return self._log.indices(plan), acks

    def _send(self, rows_ref: Sequence[Any], write_id: str | None, whole: Sequence[Any], send: Sequence[Any]
              ) -> list[Any]:
        """Journal a write's ``whole`` plan under ``write_id``, then send the pieces in ``send``; their acks."""
        if self._state is not None and write_id is not None:  # before the shards get it: a restart must know
            self._state.journal(write_id, [(w.shard, w.start, w.stop, w.first) for w in whole])
        # The ref came nested in a list, so it is still unresolved: each shard fetches its piece itself.
        return [self._shards[ONLINE][w.shard].extend.remote(rows_ref[0], w.start, w.stop, first=w.first)
                for w in send]

    def _write_states(self) -> tuple[list[int], list[list[tuple[int, int]]]]:
        """Each online shard's write count, and the rows it holds beyond it (for :meth:`WriteLog.reset`)."""
        import ray

        states = ray.get([s.write_state.remote() for s in self._shards[ONLINE]])
        return [c for c, _ in states], [runs for _, runs in states]

    def _local_shards(self, node: str | None) -> set[int]:
        """The online shards on ``node`` (asked of the shards once; a restarted shard may have moved: a hint)."""
        if node is None:
            return set()
        if self._online_nodes is None:
            import ray

            self._online_nodes = [p["node"] for p in ray.get([s.place.remote() for s in self._shards[ONLINE]])]
        return {i for i, n in enumerate(self._online_nodes) if n == node}

    def _resume(self, rows_ref: Sequence[Any], write_id: str, failed: bool) -> tuple[np.ndarray, list[Any]]:
        """Finish a write whose pieces may not all have landed: send only those the shards lack."""
        if failed:  # the shards' own counts tell which pieces they hold
            self._log.reset(*self._write_states())
        whole, send = self._log.resume(write_id)
        if send:
            acks = self._send(rows_ref, write_id, whole, send)
            self._log.remember(write_id, whole, acks)
            self._changed()
            self._requery_masses(ONLINE, [w.shard for w in send])
            self._metrics.count("rows_written", sum(w.rows for w in send))
            self._metrics.count("writes_resumed")
            return self._log.indices(whole), acks
        return self._log.indices(whole), []

    @_persists
    def update_priority(self, offline: np.ndarray, shard: np.ndarray, index: np.ndarray, generation: np.ndarray,
                        priority: np.ndarray) -> tuple[int, list[Any]]:
        """Route priority updates to the shards that own the rows; return the row count and the shards' acks.

        The whole call is checked before any shard gets its part. Each shard drops
        updates whose generation no longer matches the slot.
        """
        if not self._planner.alloc.uses_masses:
            raise ValueError(f"update_priority needs sampler='prioritized', this buffer samples "
                             f"{self._planner.sampler!r}")
        routes = route_priorities(offline, shard, index, generation, priority, self._sizes())
        acks = [self._shards[side][i].update_priority.remote(*args) for side, i, args in routes]
        self._changed()
        for side, i, _ in routes:
            self._requery_masses(side, [i])
        return sum(len(args[0]) for _, _, args in routes), acks

    @_persists
    def resync(self) -> dict[str, list[int]]:
        """Take the online shards' own write counts (after a failed write or a restore)."""
        self._changed()
        self._online_nodes = None  # a shard that failed may run elsewhere now
        if self._log is not None:
            self._log.reset(*self._write_states())
        for side in SIDES:
            self._requery_masses(side, range(len(self._shards[side])))
        return self.sizes()

    # introspection ----------------------------------------------------------
    def stats(self, include_shards: bool = True) -> dict[str, Any]:
        import ray

        planner = self._planner.stats()
        self._metrics.gauge("rate_limiter_diff", planner["rate_limiter"]["diff"] or 0.0)
        out = {"coordinator": {**self._metrics.snapshot(), **planner, "offline_fraction": self.offline_fraction(),
                               **self.sizes()}}
        if include_shards:
            out["shards"] = ray.get([s.stats.remote() for side in SIDES for s in self._shards[side]])
        return out

    def state_dict(self) -> dict[str, Any]:
        """The sampling state, as if a handle's batches drawn ahead and not yet served were given back."""
        return self._planner.state_dict(at=self._ahead.first_unserved())

    @_persists
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the sampling state; checked whole before anything changes."""
        self._changed(settings=True)
        self._planner.load_state_dict(state)
        for side in SIDES:  # priorities may have changed under us: re-query every shard
            self._requery_masses(side, range(len(self._shards[side])))

    def checkpoint(self, path: str) -> dict[str, Any]:
        """Submit every shard's dump behind the writes sent so far, and take this state at the same cut."""
        shards = self._shards[OFFLINE] + self._shards[ONLINE]
        acks = [s.dump.remote(f"{path}/shard-{j}.npz") for j, s in enumerate(shards)]
        return {"acks": acks, "state": self.state_dict(), "sizes": self.sizes()}

    def ping(self) -> str:
        return self._name


class _VersionFile:
    """The coordinator's version as 8 bytes in a node-local memory map (``/dev/shm`` where there is one).

    Made when a handle first asks for it; handles on this node then read it directly
    before each ``sample()``, elsewhere they ask.
    """

    def __init__(self, name: str):
        self._name, self._map, self.path = name, None, None

    def open(self, version: int) -> str | None:
        import os
        import tempfile
        import uuid

        if self.path is None:
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            path = os.path.join(folder, f"rayrb-{self._name.replace('/', '_')}-{uuid.uuid4().hex[:8]}.version")
            try:
                self._map = np.memmap(path, dtype=np.int64, mode="w+", shape=(1,))
                self.path = path
            except OSError:  # no shared folder to write: handles ask instead
                return None
        self.write(version)
        return self.path

    def reopen(self, path: str | None, version: int) -> None:
        """After a restart: the file handles on this node already map, if it is still there."""
        import os

        if path is not None and os.path.exists(path):
            try:
                self._map, self.path = np.memmap(path, dtype=np.int64, mode="r+", shape=(1,)), path
            except (OSError, ValueError):
                return
            self.write(version)

    def write(self, version: int) -> None:
        if self._map is not None:
            self._map[0] = version

    def remove(self) -> None:
        import os

        if self.path is not None:
            self._map = None
            try:
                os.remove(self.path)
            except OSError:
                pass
            self.path = None


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
