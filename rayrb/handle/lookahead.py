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

Other handles write and steer too. The coordinator keeps a version (a counter of
writes, priority updates, restores and settings changes) in a memory-mapped file on
its node; before each ``sample()`` a handle on that node reads it and gives back
batches drawn at an older version, so what any handle's acknowledged write or
setting changed applies to the next ``sample()``. A handle on another node reads
the answer to the report its previous ``sample()`` sent instead, so there a batch is
never planned with sizes staler than the previous call.

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

from rayrb.handle.iterator import copy_batch, fetch_group
from rayrb.core.plans import Blocked, assemble, split_group
from rayrb.core.validation import non_negative_int

MAX_BYTES = 64 << 20
MAX_DEPTH = 100  # the coordinator keeps enough to give back two groups of this


class Lookahead:
    """Plain ``sample()`` batches for one handle, drawn up to ``depth`` ahead (see the module)."""

    def __init__(self, client: Any, depth: int, *, max_bytes: int = MAX_BYTES):
        self._rb = client
        self.depth = non_negative_int("prefetch", depth)
        self._max_bytes = max_bytes
        self._id = uuid.uuid4().hex
        self._batch_size: int | None = None  # of the batches held
        self._ready: deque[_Held] = deque()  # fetched, in stream order
        self._pending: deque = deque()  # group refs asked for, or groups planned whose rows are not fetched yet
        self._served = 0  # since the last give-back
        self._seen_ref = None  # the coordinator's version, asked for at the previous sample()
        self._version_map: Any = None  # the coordinator's version file, when on this node (False: not)
        self._run: int | None = None  # served between the last two give-backs
        self._lock = threading.Lock()
        self.stats = {"groups": 0, "given_back": 0, "dropped": 0, "kept": 0, "stale": 0}

    # serving ------------------------------------------------------------------
    def next(self, batch_size: int, return_info: bool) -> tuple[Any, bool]:
        """The next batch of the stream (flat numpy, with info if asked) and whether it ends an epoch."""
        with self._lock:
            if self._batch_size != batch_size:
                self._give_back()
                if self._ready:  # kept: drawn without replacement, but of another size; this size cannot use them
                    self.stats["dropped"] += len(self._ready)
                    self._ready.clear()
                self._batch_size = batch_size
            self._check_version()
            waited = 0.0
            while not self._ready:
                if not self._pending:
                    self._ask(max(1, min(1 + self._cap(), self._expected(now=True))), waited)
                group = self._take()
                if isinstance(group, Blocked):  # the rate limiter holds sampling back: ask again shortly
                    waited = self._rb._backoff(waited, group)
                    continue
                self._unpack(group)
            held = self._ready.popleft()
            self._served += 1
            if self.depth and held.number >= 0:  # answered by the next call: what changed since this one
                self._seen_ref = self._rb._coord.seen.remote(self._id, held.number)
            target = min(self._cap(), self._expected(now=False))
            if not self._pending and len(self._ready) <= target // 2 and target > len(self._ready):
                self._ask(target - len(self._ready), 0.0)  # the next group is drawn while these are served
            return (held.batch if return_info else held.batch[0]), held.last

    def _group(self, entry: Any) -> Any:
        return entry.group if isinstance(entry, _Planned) else self._rb._get(entry)

    def _take(self) -> Any:
        """The first group asked for. A refused draw (which drew nothing) is dropped with its error; one not
        answered in time stays first in line, since the coordinator may still draw it."""
        entry = self._pending.popleft()
        try:
            return self._group(entry)
        except (TimeoutError, KeyboardInterrupt):
            self._pending.appendleft(entry)
            raise

    def _check_version(self) -> None:
        """Give back what is held if anyone wrote, updated priorities or changed a setting since it was drawn,
        as of the previous ``sample()``: a batch is never planned with sizes staler than that."""
        ref, self._seen_ref = self._seen_ref, None
        if not (self._ready or self._pending):
            return
        version = self._local_version()
        if version is None:  # another node: the answer to the previous call's report
            if ref is None:
                return
            version = self._rb._get(ref)
        if not self._ready:  # the next batch is in the group asked for last: its version is known once fetched
            group = self._take()
            if isinstance(group, Blocked):
                return
            self._unpack(group)
        if self._ready[0].version >= version:
            return
        self.stats["stale"] += 1
        self._give_back()
        for held in self._ready:  # kept (without replacement, another handle drew since): served as they are
            held.version = version

    def _local_version(self) -> int | None:
        """The coordinator's version read from its memory map, when it runs on this node (else None)."""
        if self._version_map is None:
            import ray

            self._version_map = False
            try:
                node, path = self._rb._get(self._rb._coord.version_file.remote())
                if path is not None and node == ray.get_runtime_context().get_node_id():
                    import numpy as np

                    self._version_map = np.memmap(path, dtype=np.int64, mode="r", shape=(1,))
            except (OSError, ValueError):
                pass
        return None if self._version_map is False else int(self._version_map[0])

    def _cap(self) -> int:
        """Batches that may be held beyond the one being served: ``depth``, and ``max_bytes`` of rows."""
        batch_bytes = max(1, self._batch_size * max(1, self._rb._spec.row_bytes))
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
        # without drawing ahead nothing is held to give back: the coordinator keeps no log for this handle
        ahead = self._id if self.depth else None
        self._pending.append(self._rb._coord.sample_group.remote(self._batch_size, max(1, k), ahead=ahead,
                                                                 call=uuid.uuid4().hex, **kwargs))
        self.stats["groups"] += 1

    def _unpack(self, group: Any) -> None:
        """Fetch a planned group's rows into ``_ready``; if that fails (a timeout), the group stays first in line."""
        try:
            results = fetch_group(self._rb, group)
        except BaseException:
            self._pending.appendleft(_Planned(group))
            raise
        for j, (plan, parts) in enumerate(split_group(group, results)):
            out = assemble(plan, parts, True)  # with info: a later call may ask for it
            if len(group.plans) > 1 and len(parts) == 1:
                out = copy_batch(out)
            self._ready.append(_Held(out, bool(plan.last_of_epoch), group.version,
                                     group.first + j if group.first >= 0 else -1))

    # giving back --------------------------------------------------------------
    def give_back(self) -> None:
        """Return the unserved batches' draws to the stream, before the handle writes, steers or samples otherwise."""
        with self._lock:
            self._give_back()

    def _give_back(self) -> None:
        """Undo the draws of what is held. Waits for the groups asked for (their draws must be counted); if that
        or the undo times out, it raises with everything still held, so a later call gives them back."""
        planned = []
        for entry in list(self._pending):
            try:
                group = self._group(entry)
            except (ValueError, TypeError, IndexError):  # a refused draw: nothing was drawn
                group = None
            planned.append(group)
        self._pending = deque(_Planned(g) for g in planned if g is not None and not isinstance(g, Blocked))
        count = len(self._ready) + sum(len(p.group.plans) for p in self._pending)
        if self._served or count:
            self._run = self._served
        self._served = 0
        if count == 0:
            return
        verdict = self._rb._get(self._rb._coord.undo.remote(self._id, count))
        if verdict == "keep":  # without replacement, drawn rows are served once: keep them
            while self._pending:
                self._unpack(self._pending.popleft().group)
            self.stats["kept"] += count
            return
        self.stats["given_back" if verdict == "undone" else "dropped"] += count
        self._ready.clear()
        self._pending.clear()


class _Held:
    """A fetched batch: rows and info, whether it ends an epoch, the version it was planned at, its number."""

    __slots__ = ("batch", "last", "version", "number")

    def __init__(self, batch: Any, last: bool, version: int, number: int):
        self.batch, self.last, self.version, self.number = batch, last, version, number


class _Planned:
    """A group whose plan has come back but whose rows are not fetched yet."""

    __slots__ = ("group",)

    def __init__(self, group: Any):
        self.group = group
