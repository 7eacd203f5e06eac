"""One handle's batches, drawn ahead and given back: the one engine behind ``sample()``, ``iter_batches()``
and GPU direct reads.

A batch costs two steps: the coordinator plans it, then the shards read it. A
``Stream`` asks the coordinator for a *group* of consecutive batches in one
call, submits one read per shard for the whole group itself, and hands the batches
over one by one while the next group is planned and read. The stream is exactly
that of single calls with the same seed.

**Giving back.** Batches drawn and not handed over are given back
(``Stream.give_back``) before anything that must see the stream where the
caller left it: the handle's writes, priority updates, settings, saves and other
ways of sampling, and closing an iterator. The coordinator rewinds its planner to
before the first of them, so the stream goes on as if they had never been drawn.
If another caller drew in between, the draws stand: batches without replacement are
kept and served (each row of an epoch once), batches with replacement dropped.

**Following the version** (the plain ``sample()`` loop). Other handles write and
steer too. The coordinator keeps a version (writes, priority updates, restores,
settings); before each ``sample()`` the stream reads it (from a memory map on the
coordinator's node, else from the answer to its previous report) and gives back
batches drawn at an older one, so allocation never uses sizes staler than the
previous call.

**How far ahead.** An iterator keeps exactly up to ``prefetch`` batches in flight: once
a quarter of them is left it asks for the rest in one group. The ``sample()`` loop follows the
number of batches served between its last two give-backs: a loop that writes before
every ``sample()`` draws nothing ahead, one that only samples draws up to ``depth``
(and ``max_bytes`` of rows). Under a rate limiter the coordinator plans ahead only
as far as the limiter allows at that moment; writes are judged against the rows
served, so the limiter's window is the one single calls would see.
"""
from __future__ import annotations

import sys
import threading
import time
import uuid
import weakref
from collections import deque
from typing import Any

import numpy as np

from rayrb.core.ahead import MAX_AHEAD, GiveBack
from rayrb.core.plans import assemble, decode_group, split_group
from rayrb.errors import BufferUnavailableError, HeldBack

MAX_BYTES = 64 << 20  # rows a sample() loop holds drawn ahead
MAX_DEPTH = 100  # batches a sample() loop holds drawn ahead; the coordinator gives back two groups of this


class Held:
    """A fetched batch: rows and info, whether it ends an epoch, the version it was planned at, its number."""

    __slots__ = ("batch", "last", "version", "number")

    def __init__(self, batch: Any, last: bool, version: int, number: int):
        self.batch, self.last, self.version, self.number = batch, last, version, number


class _Asked:
    """A group asked for: the plan call's ref, then the plan, then its reads' refs."""

    __slots__ = ("ref", "group", "reads", "k")

    def __init__(self, ref: Any, k: int):
        self.ref, self.k, self.group, self.reads = ref, k, None, None


def copy_batch(out: Any) -> Any:
    """A batch copied out of its group's object, so that handing it over does not pin the whole group."""
    if isinstance(out, tuple):
        return tuple(copy_batch(o) for o in out)
    return {k: np.array(v) for k, v in out.items()}


class Stream:
    """Batches of one handle in stream order (see the module).

    ``depth`` bounds the batches drawn ahead. ``prefetch`` (an iterator) keeps that many
    in flight, refilled in one group once a quarter is left; otherwise the depth adapts to the caller (the
    ``sample()`` loop), and ``follow_version`` gives back batches drawn before a change.
    ``direct`` (shard handles by side) reads GPU shards into this actor's GPU.
    """

    def __init__(self, rpc: Any, batch_size: int, *, depth: int, row_bytes: int, prefetch: bool = False,
                 follow_version: bool = False, info: bool = True, direct: dict[str, list] | None = None,
                 max_bytes: int = MAX_BYTES, limit: int | None = None):
        self.rpc, self.batch_size, self.depth = rpc, batch_size, depth
        self._row_bytes, self._max_bytes = max(1, row_bytes), max_bytes
        self._prefetch, self._follow, self._info, self._direct = prefetch, follow_version, info, direct
        self._left = limit  # batches still to hand over (an iterator's num_batches)
        self.id = uuid.uuid4().hex  # names this stream's draws at the coordinator
        self._ready: deque[Held] = deque()  # fetched, in stream order
        self._pending: deque[_Asked] = deque()  # groups asked for, in order
        self._served = 0  # since the last give-back
        self._run: int | None = None  # served between the last two give-backs
        self._last_served = self._reported = -1  # numbers of the last draw handed over, and told
        self._served_ref = None  # the coordinator's version, asked for at the previous batch
        self._lock = threading.Lock()
        self.closed = False
        self.max_in_flight = 0
        self.stats = {"groups": 0, "given_back": 0, "dropped": 0, "kept": 0, "stale": 0}
        _LIVE.add(self)

    @property
    def exhausted(self) -> bool:
        """Whether the stream has handed over every batch it was to (an iterator's ``num_batches``)."""
        return self._left is not None and self._left <= 0

    @property
    def direct(self) -> dict[str, list] | None:
        """The shard handles a GPU actor reads directly from, or None."""
        return self._direct

    @property
    def in_flight(self) -> int:
        return sum(self._size(a) for a in self._pending) + len(self._ready)

    def _size(self, asked: _Asked) -> int:
        if asked.group is None:
            return asked.k
        return 0 if isinstance(asked.group, HeldBack) else len(asked.group.plans)

    # serving ----------------------------------------------------------------------
    def next(self, batch_size: int | None = None) -> Held:
        """The next batch of the stream (its rows and info, whether it ends an epoch)."""
        with self._lock:
            if batch_size is not None and batch_size != self.batch_size:
                self._resize(batch_size)
            if self._follow:
                self._check_version()
            held = self._next()
            self._served += 1
            self._last_served = max(self._last_served, held.number)
            if self._left is not None:
                self._left -= 1
            if self._follow and self.depth and held.number >= 0:  # answered at the next call: what changed
                self._served_ref = self.rpc.tell("served", self.id, held.number)
            self._fill()  # ask for more before handing the batch over, so sampling overlaps the caller's work
            self._advance()
            return held

    def _next(self) -> Held:
        since, waited = time.monotonic(), 0.0
        while not self._ready:
            if not self._pending:
                self._ask(self._first_group(), waited)
            held = self._take()
            if isinstance(held, HeldBack):  # the rate limiter holds sampling back: ask again shortly
                waited = self.rpc.backoff(since, held)
        return self._ready.popleft()

    def _first_group(self) -> int:
        if self._prefetch:
            return max(1, min(self.depth, self._left if self._left is not None else self.depth))
        return max(1, min(1 + self._cap(), self._expected(now=True)))

    def _fill(self) -> None:
        """Ask for the next groups: an iterator keeps ``depth`` in flight, the loop its expected run.

        An iterator refills once a quarter of its depth is left, with one group for the rest: the coordinator's
        cost is per call, so fewer, larger groups serve more batches, and a quarter of the depth still covers a
        plan and its reads (milliseconds) at any rate a learner consumes batches."""
        if self._prefetch:
            if self.in_flight > (max(1, self.depth // 4) if self.depth > 1 else 0):
                return
            k = self.depth - self.in_flight
            if self._left is not None:
                k = min(k, self._left - self.in_flight)
            if k > 0:
                self._ask(k, 0.0)
        else:
            target = min(self._cap(), self._expected(now=False))
            if not self._pending and len(self._ready) <= target // 2 and target > len(self._ready):
                self._ask(target - len(self._ready), 0.0)  # the next group is drawn while these are served
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _cap(self) -> int:
        """Batches the loop may hold beyond the one being served: ``depth``, and ``max_bytes`` of rows."""
        batch_bytes = max(1, self.batch_size * self._row_bytes)
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
        served = None
        if self._last_served > self._reported:  # the served report rides along
            served = self._reported = self._last_served
        # without drawing ahead nothing is held to give back: the coordinator keeps no log for this stream
        stream = self.id if self.depth else None
        request = (self.batch_size, max(1, k), stream, served, uuid.uuid4().hex, waited)
        self._pending.append(_Asked(self.rpc.tell("plan_packed", request), max(1, k)))
        self.stats["groups"] += 1

    def _advance(self) -> None:
        """Submit the reads of every group whose plan has come back (never waits)."""
        import ray

        waiting = [a for a in self._pending if a.group is None and a.ref is not None]
        if not waiting:
            return
        ready, _ = ray.wait([a.ref for a in waiting], num_returns=len(waiting), timeout=0)
        ready = set(ready)
        for a in waiting:
            if a.ref not in ready:
                break  # in order: a later plan's reads wait for the earlier ones
            try:
                self._planned(a, self.rpc.get(a.ref))
            except Exception:
                break  # the error surfaces when this group is taken

    def _planned(self, asked: _Asked, group: Any) -> None:
        if isinstance(group, str):  # plan_packed's answer
            group = decode_group(group)
        asked.group = group
        if not isinstance(group, HeldBack):
            self.rpc.answered_at(group.version)
            asked.reads = self.rpc.submit(group, self._direct)

    def _take(self) -> HeldBack | None:
        """Fetch the first group asked for into the ready batches; a HeldBack if the limiter held it back.

        A refused draw (which drew nothing) is dropped with its error; a wait that times
        out leaves the group first in line, since the coordinator may still draw it.
        """
        asked = self._pending.popleft()
        try:
            if asked.group is None:
                self._planned(asked, self.rpc.get(asked.ref))
            if isinstance(asked.group, HeldBack):
                return asked.group
            results = self.rpc.fetch(asked.group, asked.reads, self._direct)
        except (TimeoutError, KeyboardInterrupt):
            self._pending.appendleft(asked)
            raise
        self._unpack(asked.group, results)
        return None

    def _unpack(self, group: Any, results: list) -> None:
        numbered = group.first >= 0
        if self._direct is not None:
            from rayrb.actors.transport import receive, split_flat

            for j, (plan, parts) in enumerate(split_group(group, [split_flat(r) for r in results])):
                self._ready.append(Held(receive(plan, *parts), bool(plan.last_of_epoch), group.version,
                                        group.first + j if numbered else -1))
            return
        for j, (plan, parts) in enumerate(split_group(group, results)):
            out = assemble(plan, parts, self._info)
            if len(group.plans) > 1 and len(parts) == 1:  # a view would pin the whole group's object
                out = copy_batch(out)
            self._ready.append(Held(out, bool(plan.last_of_epoch), group.version, group.first + j if numbered else -1))

    def _check_version(self) -> None:
        """Give back what is held if anyone wrote, updated priorities or changed a setting since it was drawn,
        as of the previous batch: a batch is never planned with sizes staler than that."""
        ref, self._served_ref = self._served_ref, None
        if not (self._ready or self._pending):
            return
        version = self.rpc.version()
        if version is None:  # another node: the answer to the previous batch's report
            if ref is None:
                return
            version = self.rpc.get(ref)
        if not self._ready:  # the next batch is in the group asked for first: its version is known once fetched
            if isinstance(self._take(), HeldBack):
                return
        if self._ready[0].version >= version:
            return
        self.stats["stale"] += 1
        self._give_back()
        for held in self._ready:  # kept (without replacement, another handle drew since): served as they are
            held.version = version

    def _resize(self, batch_size: int) -> None:
        self._give_back()
        if self._ready:  # kept, but of another size: this size cannot use them
            self.stats["dropped"] += len(self._ready)
            self.rpc.get(self.rpc.coord.undo.remote(self.id, len(self._ready), True))
            self._ready.clear()
        self.batch_size = batch_size

    # giving back ------------------------------------------------------------------
    def give_back(self) -> None:
        """Return the unserved batches' draws to the stream (see the module)."""
        with self._lock:
            self._give_back()

    def _give_back(self) -> None:
        """Undo the draws of what is held. Waits for the groups asked for (their draws must be counted); if that
        or the undo times out, it raises with everything still held, so a later call gives them back."""
        for asked in self._pending:
            if asked.group is None:
                try:
                    self._planned(asked, self.rpc.get(asked.ref))
                except (ValueError, TypeError, IndexError):  # a refused draw: nothing was drawn
                    asked.group = HeldBack("sample", "refused")
        self._pending = deque(a for a in self._pending if not isinstance(a.group, HeldBack))
        count = len(self._ready) + sum(len(a.group.plans) for a in self._pending)
        if self._served or count:
            self._run = self._served
        self._served = 0
        if count == 0:
            return
        verdict = self.rpc.get(self.rpc.coord.undo.remote(self.id, count))
        if verdict == GiveBack.KEEP:  # without replacement, drawn rows are served once: keep them
            while self._pending:
                self._take()
            self.stats["kept"] += count
            return
        self.stats["given_back" if verdict == GiveBack.UNDONE else "dropped"] += count
        self._ready.clear()
        self._pending.clear()

    def report(self) -> None:
        """Tell the coordinator which draws were handed over (fire and forget), before a save counts them."""
        if self._last_served > self._reported and not self.rpc.closed:
            self._reported = self._last_served
            self.rpc.tell("served", self.id, self._last_served)

    def close(self) -> None:
        """Give back what was drawn and not handed over without waiting; the stream then stops."""
        if self.closed:
            return
        self.closed = True
        outstanding = self.in_flight
        self._pending.clear()
        self._ready.clear()
        self.report()  # even with nothing outstanding: once closed, a later save cannot ask this stream
        if outstanding and self.depth and not self.rpc.closed:
            # Queued after this stream's plan calls at the coordinator, which runs one caller's calls in
            # order, so nothing needs to be waited for.
            self.rpc.tell("undo", self.id, None, True)


class BatchIterator:
    """``iter_batches()``: batches in order, with exactly up to ``prefetch`` in flight (see the module).

    Closing it (``close``, leaving a ``with`` block, or dropping the last reference,
    as ``break`` out of a ``for`` loop does) gives back the batches it drew and did not
    hand over. Once the buffer's handle is closed, no further batch is handed over.
    """

    def __init__(self, handle: Any, batch_size: int, *, prefetch: int, device: Any = None,
                 return_info: bool = False, num_batches: int | None = None, direct: dict | None = None):
        self._handle, self._device, self._return_info = handle, device, return_info
        # No deeper than the coordinator can give back on close: past that, rows drawn ahead would be lost.
        depth = prefetch if direct is not None else min(prefetch, MAX_AHEAD)
        self.prefetch = prefetch
        self._stream = Stream(handle.rpc, batch_size, depth=depth, row_bytes=handle.spec.row_bytes, prefetch=True,
                              info=return_info, direct=direct, limit=num_batches)

    @property
    def max_in_flight(self) -> int:
        return self._stream.max_in_flight

    @property
    def in_flight(self) -> int:
        return self._stream.in_flight

    def __iter__(self) -> "BatchIterator":
        return self

    def __enter__(self) -> "BatchIterator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_stream", None) or self._stream.closed or sys.is_finalizing():
            return
        try:
            self.close()
        except Exception:  # the buffer or Ray may be gone already: nothing to give back to
            pass

    def close(self) -> None:
        """Give back what was drawn and not handed over; the iterator then stops."""
        self._stream.close()

    def report(self) -> None:
        self._stream.report()

    def __next__(self):
        s = self._stream
        if s.closed or s.exhausted:
            raise StopIteration
        if self._handle.rpc.closed:  # no batch drawn before the buffer was shut down is handed out
            s.close()
            raise BufferUnavailableError(f"buffer {self._handle.name!r} was shut down")
        held = s.next()
        if s.direct is not None:  # already a TensorDict on this actor's GPU
            return self._handle.finish_tensors(held.batch, self._return_info)
        return self._handle.finish(held.batch, self._return_info, self._device)


_LIVE: "weakref.WeakSet[Stream]" = weakref.WeakSet()


def report_served(rpc: Any) -> None:
    """Report what this process's streams over ``rpc``'s buffer have handed over, before a save counts it."""
    for s in list(_LIVE):
        if s.rpc.name == rpc.name and not s.closed:
            s.report()
