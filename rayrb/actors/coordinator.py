"""The Coordinator actor: a small router over the parts that plan batches, sequence writes and keep state.

It holds shard handles and shard sizes, never rows, and it submits no reads:

* ``Drawing`` plans groups of batches (the exact split,
  the rate limiter's say, per-shard counts and seeds) and gives back draws. The
  handle that asked submits the shard reads, so rows go shard -> consumer once.
* ``Writing`` places, journals and sends writes, and
  resumes those cut short.
* ``Version`` counts the changes handles must see.
* ``CoordinatorState`` keeps what a restart needs,
  saved after each call marked ``@saved``.

A call the rate limiter holds back returns ``HeldBack`` and changes
nothing; the handle asks again. ``docs/architecture.md`` draws the whole picture,
``docs/durability.md`` the write and restart protocol.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rayrb.actors.drawing import Drawing
from rayrb.actors.inline import joined
from rayrb.actors.lifecycle import begin
from rayrb.actors.metrics import ActorMetrics
from rayrb.actors.publishing import Target, Targets
from rayrb.actors.restoring import Restoring, saved
from rayrb.actors.steering import Steering
from rayrb.actors.version import Version
from rayrb.actors.writing import Writing, failed
from rayrb.core.ahead import GiveBack
from rayrb.core.planner import Planner
from rayrb.core.plans import OFFLINE, ONLINE, SIDES, BatchPlan, GroupPlan
from rayrb.core.validation import ALPHA, EPS, one_of, positive_int
from rayrb.durability.coordinator_state import CoordinatorState
from rayrb.durability.mirror import GcsMirror
from rayrb.durability.replies import saved_answers
from rayrb.durability.writelog import WriteLog
from rayrb.errors import HeldBack, InvalidStateError


class Coordinator(Restoring, Steering):
    def __init__(self, offline_shards: Sequence[Any], offline_sizes: Sequence[int], online_shards: Sequence[Any],
                 online_capacities: Sequence[int], *, name: str = "rayrb", seed: int | None = None,
                 state_dir: str | None = None, replicated: bool = False, shards_place: bool = False,
                 **planner: Any):
        """Shards by actor name (or handle); ``planner``: the ``Planner``'s options (``offline_fraction``, ``sampler``,
        ``drop_last``, ``epoch_end``, ``beta``, ``rate_limiter``) and the shards' ``alpha``, ``eps``, as the owner checked.
        ``shards_place``: the online shards place every write themselves (``rayrb.handle.direct``): handles send
        writes to them and tell this actor the counts (``wrote``); ``extend`` is refused."""
        self._name, self._offline_sizes = name, np.asarray(offline_sizes, np.int64)
        self._shards_place = bool(shards_place)
        self._shards = {OFFLINE: [_actor(s) for s in offline_shards], ONLINE: [_actor(s) for s in online_shards]}
        exponents = planner.pop("alpha", ALPHA), planner.pop("eps", EPS)  # the shards': updates are checked by them
        self._metrics = ActorMetrics("coordinator", {"buffer": name})
        self._planner = Planner({s: len(self._shards[s]) for s in SIDES}, seed=seed,
                                online_capacity=int(sum(online_capacities)) or None, **planner)
        self._drawing = Drawing(self._planner, self._shards, self._metrics, seed, exponents=exponents)
        self._version = Version(name, state_dir, shards=len(online_shards))
        # where each online shard publishes its count: this node's counts map (where the shards place writes)
        self._targets = Targets([s if isinstance(s, str) else None for s in online_shards] if shards_place else [],
                                lambda: self._version.file.path)
        # With a state directory, a restarted coordinator (Ray re-runs this with the same arguments) picks up
        # its sampling state there and its write counts from the shards.
        self._lives = begin(state_dir, f"the coordinator of buffer {name!r}")
        # With replicated online shards the coordinator's files are copied off its node too: a restart on
        # another node finds them there (rayrb.durability.mirror).
        self._state = None if state_dir is None else CoordinatorState(
            state_dir, mirror=GcsMirror() if replicated else None)
        log = WriteLog(online_capacities) if online_shards else None
        self._writing = Writing(log, self._shards[ONLINE], self._state, self._metrics, replicated=replicated)
        if self._state is not None and (self._lives.restarts or (self._lives.unsure and self._state.load() is not None)):
            self._restart(self._state.load())  # a copy kept
        else:
            self._version.open()
            self._targets.send(self._shards[ONLINE])
            if self._state is not None:
                self._state.clear()
                self._save()
        self._lives.ready()

    def _save(self) -> None:
        """Keep what a restart needs (after each call marked ``@saved``). A save that fails (a full or broken disk)
        does not fail the call, which already changed the stream or sent a write: the answer stays true, a restart
        resumes from the last save that succeeded, and ``stats()`` counts ``state_save_failed``."""
        if self._state is None:
            return
        try:
            replies = self._drawing.replies
            replies.save_changes(self._state.save_reply, self._state.drop_reply)
            self._state.save({**self._drawing.saved(), "version": self._version.value, "answers": replies.calls()})
        except OSError:
            self._metrics.count("state_save_failed")

    def _restart(self, saved: dict[str, Any] | None) -> None:
        """Pick up where the previous process left off. Without its state (restarted on another node) the
        stream starts afresh from the seed, but the write counts still come from the shards."""
        if saved is not None:
            self._drawing.load_saved(saved)
            self._version.restarted(saved["version"])
            self._drawing.replies.load(saved_answers(saved.get("answers") or [], self._state.load_reply))
        else:  # the version and draw numbers go on past any a handle may hold, so it sees its draws as old
            self._drawing.ahead.load_state_dict(None)
            self._version.restarted(None)
        self._targets.send(self._shards[ONLINE])  # before the counts are asked for: later appends publish here
        self._writing.recall(self._state.writes())  # a retry is answered, and only missing pieces sent
        self._save()

    def publish_target(self, shard: str) -> Target | None:
        """Where online shard ``shard`` (its actor name) publishes its write count; a restarted shard asks."""
        return self._targets.of(shard)

    def _poll(self) -> None:
        """Take the write counts appends published in the counts map since the last look (no call, no wait)."""
        self._take_counts(list(self._version.poll().items()))

    def _take_counts(self, counts: Sequence[Sequence[int]]) -> bool:
        """Online shards' counts after appends they placed: ``(shard, written)`` pairs; whether any grew."""
        size = int(self._writing.sizes().sum()) if counts else 0
        grown = self._writing.learned(counts) if counts else {}
        if grown:
            self._planner.record_insert(sum(grown.values()), size)
            self._drawing.requery_masses(ONLINE, sorted(grown))
        return bool(grown)

    def _changed(self, settings: bool = False) -> None:
        self._version.bump()
        if settings:  # draws ahead cannot be given back past a change of settings
            self._drawing.forget()

    def version_file(self) -> tuple[str, str | None]:
        """``(node id, path)`` of the counts map on this node (``rayrb.durability.published``), which handles there
        read the version from, and writers there publish their appends in, without a call."""
        import ray

        return ray.get_runtime_context().get_node_id(), self._version.open()

    def close(self) -> None:
        """Remove the version file and the state files: the buffer is being shut down."""
        self._lives.end()
        self._version.file.remove()
        if self._state is not None:
            self._state.remove()
            self._state = None

    def ping(self) -> str:
        return self._name

    def _sizes(self, counted: np.ndarray | None = None) -> dict[str, np.ndarray]:
        if counted is None:
            self._poll()
        return {OFFLINE: self._offline_sizes, ONLINE: self._writing.sizes(counted)}

    def sizes(self) -> dict[str, list[int]]:
        """Per-shard sizes as the next draw allocates with them."""
        sizes = self._sizes()
        return {OFFLINE: sizes[OFFLINE].tolist(), ONLINE: sizes[ONLINE].tolist(), **self._writing.sizes_report()}

    @saved
    def plan(self, batch_size: int, num_batches: int = 1, *, stream: str | None = None, served: int | None = None,
             call: str | None = None, slices: int = 1, waited: float = 0.0, owing: int | None = None
             ) -> GroupPlan | HeldBack:
        """Plan a group of batches for the caller to read (``Drawing.plan``)."""
        counted = self._writing.counted()  # once: it asks Ray which pieces are acknowledged
        group = self._drawing.plan(batch_size, num_batches, sizes=self._sizes(counted), counted=counted,
                                   version=self._version.value, stream=stream, served=served, call=call,
                                   slices=slices, owing=owing)
        if not isinstance(group, HeldBack):
            self._drawing.waited("sample", waited)
        return group

    def plan_packed(self, request: tuple) -> str | HeldBack:
        """``plan`` as a stream asks it: ``(batch_size, num_batches, stream, served, call, waited, owing)`` in, the
        group's JSON text out; Ray's cost per call is nearly half that of keywords and a pickled plan
        (docs/benchmarks.md)."""
        batch_size, num_batches, stream, served, call, waited, owing = request
        group = self.plan(batch_size, num_batches, stream=stream, served=served, call=call, waited=waited, owing=owing)
        return group if isinstance(group, HeldBack) else group.encoded()

    def gave_up(self, call: str, seconds: float) -> None:
        """A handle's ``call`` (``"sample"`` or ``"insert"``) was held back past its timeout (``Drawing.gave_up``)."""
        self._drawing.gave_up(call, seconds)

    def served(self, stream: str, number: int) -> int:
        """``stream`` has served its draws up to ``number``; returns the version (writes, priority updates,
        restores and settings changes so far)."""
        self._drawing.served(stream, number)
        self._poll()
        return self._version.value

    @saved
    def undo(self, stream: str, count: int | None, discard: bool = False, batches: list | None = None) -> GiveBack:
        """Give back draws ``stream`` did not serve (``Drawing.undo``)."""
        return self._drawing.undo(stream, count, discard, batches)

    @saved
    def plan_side(self, side: str, batch_size: int) -> tuple[BatchPlan, list[np.ndarray]]:
        """Rows of one side for the buffer-like views (``Drawing.plan_side``)."""
        side, batch_size = one_of("side", side, SIDES), positive_int("batch_size", batch_size)
        return self._drawing.plan_side(side, batch_size, self._sizes()[side])

    @saved
    def extend(self, rows_ref: Sequence[Any], rows: int, write_id: str | None = None, prefill: bool = False,
               waited: float = 0.0, node: str | None = None, digest: str | None = None
               ) -> tuple[np.ndarray, list[Any]] | HeldBack:
        """Send contiguous pieces of one batch of ``rows`` rows (``rows_ref[0]``, an ObjectRef) to shards; the rows'
        global online indices and the shards' acknowledgements, which the caller waits on before it reports the
        write done. A ``write_id`` seen before with the same rows (``digest``) returns that write's answer and
        writes nothing; with other rows it is refused (``WriteIdError``). The rate limiter may hold a write back
        (``prefill`` writes past it). A write from ``node`` prefers the online shards there, within the slack."""
        if self._shards_place:
            raise InvalidStateError(f"buffer {self._name!r}: its online shards place its writes; a handle of it "
                                    "sends them there (rayrb.handle.direct), not through the coordinator")
        rows, seen = self._writing.check(rows, write_id, digest)
        if seen is not None and seen[1] is not None and not failed(seen[1]):
            return seen  # a retry: applied once, and its acknowledgements are the first call's
        if seen is not None:  # journalled before a restart, or a shard failed its piece
            indices, acks, touched = self._writing.resume(rows_ref, write_id, failed=seen[1] is not None)
        else:
            size = int(self._writing.sizes().sum())
            try:  # judged against the rows served: draws ahead not served yet do not count
                self._planner.admit_insert(rows, size, prefill=prefill, unserved=self._drawing.ahead.unserved_rows())
            except HeldBack as held:
                self._metrics.count("insert_blocked_calls")
                return held
            indices, acks, touched = self._writing.write(rows_ref, rows, write_id, node, digest)
            self._planner.record_insert(rows, size, prefill=prefill)
            self._drawing.waited("insert", waited)
        if touched:
            self._changed()
            self._drawing.requery_masses(ONLINE, touched)
        return indices, acks

    def extend_parts(self, how: Mapping[str, Any], *parts: Mapping[str, np.ndarray], waited: float = 0.0
                     ) -> tuple[np.ndarray, list[Any]] | HeldBack:
        """``extend`` with its rows carried in the call, cut in ``parts`` (``rayrb.actors.inline``), and its other
        arguments in ``how``."""
        return self.extend([joined(parts)], **how, waited=waited)

    def wrote(self, counts: Sequence[Sequence[int]]) -> tuple[int, list[int]]:
        """Write counts online shards answered to writes they placed (``(shard, written)`` pairs, told by the
        writer once the shard acknowledged): the version after and every shard's count, for the writer's next
        placement. Not saved: a restart takes the counts from the shards, and its version goes past any a handle
        holds draws at (``Version.restarted``)."""
        self._poll()
        if self._take_counts(counts):
            self._changed()
        return self._version.value, self._writing.log.written.tolist()

    def relay(self, rows_ref: Sequence[Any], rows: int, write_id: str, digest: str | None = None,
              look: bool = False) -> list[tuple[int, int, int, Any]]:
        """A write too large for one shard, sent to the shards that place its pieces (``Writing.relay``):
        ``(shard, piece, start, ack)`` per piece; the writer tells ``wrote`` once they acknowledged."""
        if not self._shards_place:
            raise InvalidStateError(f"buffer {self._name!r}: the coordinator places its writes (extend)")
        return self._writing.relay(rows_ref, rows, write_id, digest, look)

    @saved
    def update_priority(self, offline: np.ndarray, shard: np.ndarray, index: np.ndarray, generation: np.ndarray,
                        priority: np.ndarray) -> tuple[int, list[Any]]:
        """Route priority updates to the shards that own the rows (``Drawing.update_priority``): the row count and
        the shards' acks. The whole call is checked before any shard gets its part."""
        n, acks = self._drawing.update_priority((offline, shard, index, generation, priority), self._sizes())
        self._changed()
        return n, acks

    def stats(self, include_shards: bool = True) -> dict[str, Any]:
        import ray

        self._poll()
        planner = self._planner.stats()
        self._metrics.gauge("rate_limiter_diff", planner["rate_limiter"]["diff"] or 0.0)
        self._metrics.gauge("cpu_seconds", _cpu_seconds())
        self._metrics.gauge("restarts", self._lives.restarts)
        out = {"coordinator": {**self._metrics.snapshot(), **planner, "offline_fraction": self.offline_fraction(),
                               **self.sizes(), **self._lives.stats()}}
        if include_shards:
            out["shards"] = ray.get([s.stats.remote() for side in SIDES for s in self._shards[side]])
        return out


def _actor(shard: Any) -> Any:
    """A shard's handle: looked up by its actor name, or (tests of the parts) the object given."""
    if isinstance(shard, str):
        import ray

        return ray.get_actor(shard)
    return shard


def _cpu_seconds() -> float:
    """This process's CPU time (user and system), which ``stats()`` reports for the coordinator's cost."""
    import time

    return time.process_time()
