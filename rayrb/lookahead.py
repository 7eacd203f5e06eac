"""Batches a handle draws before its plain ``sample()`` asks for them, and gives back when it steers.

A ``sample()`` that waits for a coordinator call and then for the shards pays two
actor round trips per batch. A :class:`Lookahead` asks for a group of ``k``
consecutive batches in one call instead (one read per shard for the whole group),
serves them one per ``sample()``, and asks for the next group while the last ones
are served. The stream is exactly that of ``k`` single calls.

The batches drawn ahead are given back (:meth:`Coordinator.undo`) before anything
that must see the stream where the caller left it: this handle's writes, priority
updates, settings, state, and its other ways of sampling. The coordinator rewinds
its planner to the state before the first unserved draw, so:

* every ``sample()`` after this handle's ``extend()`` may draw those rows;
* a change of fraction, schedule, step, seed or state applies to the next ``sample()``;
* the same seed gives the same stream, whether batches were drawn ahead or not.

Other handles write and steer too. Each ``sample()`` asks the coordinator, without
waiting, for its version (a counter of writes, priority updates, restores and
settings changes); the next ``sample()`` reads the answer and gives back batches
drawn at an older version. So a batch is never planned with sizes staler than the
previous ``sample()`` call, as without drawing ahead.

A rewind is possible while no other caller has drawn or changed a setting since.
When one has, the draws stand: batches with replacement are dropped (the stream
goes on after them), and batches without replacement are kept and served, so that
each row of an epoch is still served once.

How far ahead: ``k`` follows the number of batches served between the last two
give-backs, so a loop that writes before every ``sample()`` never draws ahead,
one that samples four batches per write draws four at a time, and one that only
samples draws up to ``depth`` (bounded by ``max_bytes`` of rows in flight).
"""
from __future__ import annotations

import threading
import uuid
from collections import deque
from typing import Any

from rayrb.plans import Blocked, assemble, split_group
from rayrb.validation import non_negative_int

MAX_BYTES = 64 << 20
MAX_DEPTH = 100  # the coordinator keeps enough to give back two groups of this


def _copy_batch(out: Any) -> Any:
    """The batch out of its group's object, so that a served batch does not pin the group."""
    import numpy as np

    if isinstance(out, tuple):
        return tuple(_copy_batch(o) for o in out)
    return {k: np.array(v) for k, v in out.items()}


class Lookahead:
    """Plain ``sample()`` batches for one handle, drawn up to ``depth`` ahead (see the module)."""

    def __init__(self, client: Any, depth: int, *, max_bytes: int = MAX_BYTES):
        self._rb = client
        self.depth = non_negative_int("prefetch", depth)
        self._max_bytes = max_bytes
        self._id = uuid.uuid4().hex
        self._key: tuple[int, bool] | None = None  # (batch_size, return_info) of the batches held
        self._ready: deque = deque()  # (batch, last_of_epoch), fetched
        self._pending: deque = deque()  # group refs asked for, not fetched
        self._served = 0  # since the last give-back
        self._version_ref = None  # the coordinator's version, asked for at the previous sample()
        self._run: int | None = None  # served between the last two give-backs
        self._lock = threading.Lock()
        self.stats = {"groups": 0, "given_back": 0, "dropped": 0, "kept": 0, "stale": 0}

    # serving ------------------------------------------------------------------
    def next(self, batch_size: int, return_info: bool) -> tuple[Any, bool]:
        """The next batch of the stream (flat numpy, with info if asked) and whether it ends an epoch."""
        with self._lock:
            if self._key != (batch_size, return_info):
                self._give_back()
                self._ready.clear()  # kept batches of another size or shape cannot be served
                self._key = (batch_size, return_info)
            self._check_version()
            waited = 0.0
            while not self._ready:
                if not self._pending:
                    self._ask(max(1, min(1 + self._cap(), self._expected(now=True))), waited)
                group = self._rb._get(self._pending[0])
                self._pending.popleft()
                if isinstance(group, Blocked):  # the rate limiter holds sampling back: ask again shortly
                    waited = self._rb._backoff(waited, group)
                    continue
                self._unpack(group)
            out = self._ready.popleft()[:2]
            self._served += 1
            if self.depth:  # answered by the next call: what has been written or changed since this one
                self._version_ref = self._rb._coord.version.remote()
            target = min(self._cap(), self._expected(now=False))
            if not self._pending and len(self._ready) <= target // 2 and target > len(self._ready):
                self._ask(target - len(self._ready), 0.0)  # the next group is drawn while these are served
            return out

    def _check_version(self) -> None:
        """Give back what is held if anyone wrote, updated priorities or changed a setting since it was drawn,
        as of the previous ``sample()``: a batch is never planned with sizes staler than that."""
        ref, self._version_ref = self._version_ref, None
        if ref is None or not (self._ready or self._pending):
            return
        version = self._rb._get(ref)
        if not self._ready:  # the next batch is in the group asked for last: its version is known once fetched
            group = self._rb._get(self._pending[0])
            if isinstance(group, Blocked):
                return
            self._pending.popleft()
            self._unpack(group)
        if self._ready[0][2] >= version:
            return
        self.stats["stale"] += 1
        self._give_back()
        # kept (without replacement, another handle drew since): served as they are, not asked about again
        self._ready = deque((out, last, version) for out, last, _ in self._ready)

    def _cap(self) -> int:
        """Batches that may be held beyond the one being served: ``depth``, and ``max_bytes`` of rows."""
        batch_bytes = max(1, self._key[0] * max(1, self._rb._spec.row_bytes))
        return min(self.depth, MAX_DEPTH, max(0, self._max_bytes // batch_bytes - 1))

    def _expected(self, now: bool) -> int | float:
        """``sample()`` calls expected before the next give-back, the one being asked for ``now`` included.

        That is what is left of the last run between give-backs. Past its end a give-back
        may come any time, so nothing is drawn before it is asked for, unless this run
        is already twice as long as the last.
        """
        if self._run is None:
            return float("inf")
        left = self._run - self._served
        if left > 0:
            return left
        return float("inf") if self._served >= 2 * max(1, self._run) else int(now)

    def _ask(self, k: int, waited: float) -> None:
        kwargs = {"waited": waited} if waited else {}
        self._pending.append(self._rb._coord.sample_group.remote(self._key[0], max(1, k), ahead=self._id, **kwargs))
        self.stats["groups"] += 1

    def _unpack(self, group: Any) -> None:
        results = self._rb._get(group.refs)
        for plan, parts in split_group(group, results):
            out = assemble(plan, parts, self._key[1])
            self._ready.append((_copy_batch(out) if len(group.plans) > 1 and len(parts) == 1 else out,
                                bool(plan.last_of_epoch), group.version))

    # giving back --------------------------------------------------------------
    def give_back(self) -> None:
        """Return the unserved batches' draws to the stream, before the handle writes, steers or samples otherwise."""
        with self._lock:
            self._give_back()

    def _give_back(self) -> None:
        if self._served or self._ready or self._pending:
            self._run = self._served
        self._served = 0
        groups = []
        for ref in self._pending:  # the coordinator answered these before it sees the undo
            try:
                group = self._rb._get(ref)
            except Exception:  # a refused draw changed nothing
                continue
            if not isinstance(group, Blocked):
                groups.append(group)
        self._pending.clear()
        count = len(self._ready) + sum(len(g.plans) for g in groups)
        if count == 0:
            return
        verdict = self._rb._get(self._rb._coord.undo.remote(self._id, count))
        if verdict == "keep":  # without replacement, drawn rows are served once: keep them
            for group in groups:
                self._unpack(group)
            self.stats["kept"] += count
            return
        self.stats["given_back" if verdict == "undone" else "dropped"] += count
        self._ready.clear()
