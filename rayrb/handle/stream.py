"""One handle's batches, planned ahead, read where the rows lie, given back: the one engine behind ``sample()``,
``iter_batches()`` and GPU direct reads.

A batch costs two steps: the coordinator plans it, then its rows are read. The two
go at different depths:

* **Plan deep.** A ``Stream`` asks the coordinator for a *group* of consecutive
  batches in one call, as many as ``PLAN_ROWS`` rows (at most ``MAX_PLAN`` batches),
  whatever ``prefetch`` is: a plan is a few bytes per batch, and one call costs the
  coordinator about as much for a hundred batches as for one. A stream's first call
  covers ``FIRST_PLAN`` batches and each next one twice as many, so one closed early
  leaves little drawn for nothing. The stream is exactly
  that of single calls with the same seed.
* **Read shallow.** Rows a handle can read itself (``rayrb.handle.local``: the shard's
  files on this node) are gathered in this process when the batch is served, with no
  call at all. The other parts are read by their shards, one call per shard for a run
  of consecutive batches, submitted at most ``prefetch`` batches ahead (and, for the
  ``sample()`` loop, ``max_bytes`` of rows): ``prefetch`` bounds the rows held ahead,
  never the plans.

**Giving back.** Batches planned and not handed over are given back
(``Stream.give_back``) before anything that must see the stream where the caller
left it: the handle's writes, priority updates, settings, saves and other ways of
sampling, and closing an iterator. The coordinator rewinds its planner to before the
first of them, so the stream goes on as if they had never been drawn. If another
caller drew in between, the draws stand: batches without replacement are kept and
served (each row of an epoch once), batches with replacement dropped.

**Following the version** (the plain ``sample()`` loop). Other handles write and
steer too. The coordinator keeps a version (writes, priority updates, restores,
settings); before each ``sample()`` the stream reads it (from a memory map on the
coordinator's node, else from the answer to its previous report) and gives back
batches planned at an older one, so allocation never uses sizes staler than the
previous call.

**How far ahead the loop plans** follows the number of batches served between its
last two give-backs: a loop that writes before every ``sample()`` plans nothing
ahead, one that only samples plans deep. Under a rate limiter the coordinator plans
ahead only as far as the limiter allows at that moment; writes are judged against the
rows served, which a loop under a limiter (or one without the version map) reports
after every batch, so the limiter's window is the one single calls would see.
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
from rayrb.core.plans import GroupPlan, decode_group, provenance, reads_by_plan
from rayrb.errors import BufferUnavailableError, HeldBack, RowsLostError

MAX_BYTES = 64 << 20  # rows a sample() loop holds read ahead
MAX_DEPTH = 100  # batches a sample() loop reads ahead
LOST_RETRIES = 3  # plans made again after a read finds its rows lost with a node (kept draws fail again: raise)
PLAN_ROWS = 1 << 20  # rows one plan call covers: its cost a small share of the batches' own
MAX_PLAN = 240  # batches one plan call covers: with half of them left when the next is asked for, a stream has at
# most 360 planned, within what the coordinator can give back (rayrb.core.ahead.MAX_AHEAD)
FIRST_PLAN = 16  # batches a stream's first plan call covers, doubling per call up to plan_size: a stream closed
# early (an iterator per training step, a loop that writes soon) gives back little the coordinator drew for nothing


class Held:
    """A batch handed over: its rows (for direct reads, ``(TensorDict, info)``), whether it ends an epoch, the
    version it was planned at, its number; ``info()`` builds its provenance when asked for."""

    __slots__ = ("batch", "last", "version", "number", "_plan", "_infos")

    def __init__(self, batch: Any, last: bool, version: int, number: int, plan: Any = None, infos: Any = None):
        self.batch, self.last, self.version, self.number = batch, last, version, number
        self._plan, self._infos = plan, infos

    def info(self) -> dict[str, np.ndarray]:
        """Per-row provenance (``rayrb.core.plans.provenance``): built only when a caller wants it."""
        info = provenance(self._plan, self._infos)
        if "weight" in info:
            info["weight"] = info["weight"].astype(np.float32)
        return info


class _Asked:
    """A plan call: its ref and how many batches it asked for."""

    __slots__ = ("ref", "k")

    def __init__(self, ref: Any, k: int):
        self.ref, self.k = ref, k


class _Remote:
    """One shard read covering parts of consecutive batches: its call, then its ``(rows, info)``."""

    __slots__ = ("read", "ref", "result", "batches")

    def __init__(self, read: tuple, ref: Any, batches: int):
        self.read, self.ref, self.result, self.batches = read, ref, None, batches


class _Planned:
    """A batch planned and not handed over: its plan, version, number, group, and per part its read
    ``(side, shard, args)`` and, once submitted, the shard read carrying it ``(_Remote, offset)``."""

    __slots__ = ("plan", "version", "number", "group", "reads", "sources", "remote")

    def __init__(self, plan: Any, version: int, number: int, group: int, reads: list):
        self.plan, self.version, self.number, self.group, self.reads = plan, version, number, group, reads
        self.sources: list[Any] | None = None
        self.remote = False  # a shard read carries one of its parts


def plan_size(batch_size: int) -> int:
    """Batches one plan call covers at this batch size (``PLAN_ROWS`` rows, 2 to ``MAX_PLAN`` batches).

    >>> plan_size(256), plan_size(4096), plan_size(65536), plan_size(10**7)
    (240, 240, 16, 2)
    """
    return max(2, min(MAX_PLAN, PLAN_ROWS // max(1, batch_size)))


class Reads:
    """The read side of a stream: each planned batch's parts gathered here (``local``) or read by their shards,
    into the batch's own arrays. ``direct`` (shard handles by side) reads GPU shards into this actor's GPU."""

    def __init__(self, rpc: Any, spec: Any, direct: dict[str, list] | None, local: Any, stats: dict[str, int]):
        self.rpc, self._direct, self._stats = rpc, direct, stats
        self._local = None if direct is not None else local
        self._shapes = spec.shapes

    def submit(self, batches: list[_Planned]) -> int:
        """Submit the shard reads of ``batches`` that this process does not read itself: per shard, one read for
        each run of consecutive batches of one group. Returns how many batches have a shard read."""
        runs: dict[tuple, list[tuple[_Planned, int]]] = {}
        for b in batches:
            b.sources = [None] * len(b.reads)
            for i, (side, shard, args) in enumerate(b.reads):
                if self._local is not None and self._local.reader(side, shard) is not None:
                    continue  # gathered here when served
                runs.setdefault((side, shard, b.group), []).append((b, i))
        for (side, shard, _), parts in runs.items():
            counts, seeds, epochs = [], [], []
            for b, i in parts:
                c, s, e, _written = b.reads[i][2]
                counts += c
                seeds += s
                epochs += e
            read = (side, shard, (counts, seeds, epochs, parts[0][0].reads[parts[0][1]][2][3]))
            remote = _Remote(read, self.rpc.read(*read, direct=self._direct), len(parts))
            offset = 0
            for b, i in parts:
                b.sources[i] = (remote, offset)
                b.remote = True
                offset += b.reads[i][2][0][0]
            self._stats["reads"] += 1
        return sum(b.remote for b in batches)

    def all_local(self) -> bool:
        """Whether every part is read here: no shard read to submit ahead."""
        return self._local is not None and self._local.all_local()

    def _remote_part(self, b: _Planned, i: int) -> Any:
        """Part ``i`` of batch ``b`` from its shard: ``(rows, info)`` (numpy, or tensors for direct reads)."""
        side, shard, args = b.reads[i]
        source = b.sources[i] if b.sources is not None else None
        if source is None:  # not submitted ahead, or a read here that could not go: the shard reads it now
            source = (_Remote((side, shard, args), self.rpc.read(side, shard, args, direct=self._direct), 1), 0)
            self._stats["reads"] += 1
        remote, offset = source
        if remote.result is None:
            remote.result = self.rpc.fetch_read(remote.read, remote.ref, self._direct)
            if self._direct is not None:
                from rayrb.actors.transport import split_flat

                remote.result = split_flat(remote.result)
        if remote.batches == 1 and offset == 0:
            return remote.result
        count = args[0][0]
        rows, info = remote.result
        return {k: v[offset:offset + count] for k, v in rows.items()}, {k: v[offset:offset + count]
                                                                      for k, v in info.items()}

    def read(self, b: _Planned) -> Held:
        """Batch ``b``: each part read here into the batch's own arrays, or copied there from its shard read
        (one copy of every row, and nothing that pins a shard read's object); provenance left for ``info()``."""
        last = bool(b.plan.last_of_epoch)
        if self._direct is not None:
            from rayrb.actors.transport import receive

            return Held(receive(b.plan, *(self._remote_part(b, i) for i in range(len(b.reads)))), last,
                        b.version, b.number)
        rows: dict[str, np.ndarray] = {}
        infos, offset = [], 0
        for i, (side, shard, args) in enumerate(b.reads):
            count = args[0][0]
            if not rows:
                rows = {k: np.empty((b.plan.batch_size, *shape), dtype) for k, (shape, dtype) in self._shapes.items()}
            out = {k: v[offset:offset + count] for k, v in rows.items()}
            info = None
            if self._local is not None and (b.sources is None or b.sources[i] is None):
                info = self._local.read_into(side, shard, args, out)
            if info is None:
                part_rows, info = self._remote_part(b, i)
                for k, v in out.items():
                    v[...] = part_rows[k]
            infos.append(info)
            offset += count
        return Held(rows, last, b.version, b.number, b.plan, infos)


class Stream:
    """Batches of one handle in stream order (see the module).

    ``depth`` bounds the batches read ahead (0: the loop plans nothing ahead either: single calls).
    An iterator (``prefetch``) keeps plans ahead and refills its reads once a quarter of ``depth`` is
    left; the ``sample()`` loop's plans follow the caller, and ``follow_version`` gives back batches planned
    before a change. ``local`` reads the parts this process can (``rayrb.handle.local``); ``direct`` (shard
    handles by side) reads GPU shards into this actor's GPU. ``limited``: the buffer has a rate limiter, whose
    window needs each batch's report.
    """

    def __init__(self, rpc: Any, batch_size: int, *, depth: int, spec: Any, prefetch: bool = False,
                 follow_version: bool = False, direct: dict[str, list] | None = None,
                 max_bytes: int = MAX_BYTES, limit: int | None = None, local: Any = None, limited: bool = False):
        self.rpc, self.batch_size, self.depth = rpc, batch_size, depth
        self._row_bytes, self._max_bytes = max(1, spec.row_bytes), max_bytes
        self._prefetch, self._follow = prefetch, follow_version
        self.direct = direct  # the shard handles a GPU actor reads directly from, or None
        self._limited = limited
        self._left = limit  # batches still to hand over (an iterator's num_batches)
        self.id = uuid.uuid4().hex  # names this stream's draws at the coordinator
        self._asked: deque[_Asked] = deque()  # plan calls not answered yet, in order
        self._planned: deque[_Planned] = deque()  # batches planned and not handed over, in order
        self._covered = 0  # of those, the first ones whose shard reads are submitted
        # of those, the ones with a shard read: rows held, or on their way, ahead (the rest are read here when served)
        self.in_flight = 0
        self._groups = 0  # plan answers taken, to tell groups apart (their reads cannot be joined)
        self._served = 0  # since the last give-back
        self._run: int | None = None  # served between the last two give-backs
        self._last_served = self._reported = -1  # numbers of the last draw handed over, and told
        self._served_ref = None  # the coordinator's version, asked for at the previous batch
        self._lock = threading.Lock()
        self.closed = False
        self.max_in_flight = 0
        self.stats = {"groups": 0, "reads": 0, "given_back": 0, "dropped": 0, "kept": 0, "stale": 0, "lost": 0}
        self._reads = Reads(rpc, spec, direct, local, self.stats)
        _LIVE.add(self)

    @property
    def exhausted(self) -> bool:
        """Whether the stream has handed over every batch it was to (an iterator's ``num_batches``)."""
        return self._left is not None and self._left <= 0

    @property
    def ahead(self) -> int:
        """Batches planned (or asked for) and not handed over: what a give-back returns."""
        return len(self._planned) + sum(a.k for a in self._asked)

    # serving ----------------------------------------------------------------------
    def next(self, batch_size: int | None = None) -> Held:
        """The next batch of the stream (its rows and info, whether it ends an epoch)."""
        with self._lock:
            if batch_size is not None and batch_size != self.batch_size:
                self._resize(batch_size)
            if self._follow:
                self._check_version()
            for attempt in range(LOST_RETRIES + 1):
                first = self._first()
                if not self._covered:  # the batch served now and the window beyond it: one read per shard for all
                    self._cover(min(len(self._planned), self._window() + 1))
                try:
                    held = self._reads.read(first)  # a failed read (a timeout) leaves the batch first in line
                    break
                except RowsLostError:  # planned over rows a lost node took: planned again over what there is
                    if attempt == LOST_RETRIES:
                        raise
                    self.stats["lost"] += 1
                    self.rpc.get(self.rpc.coord.resync.remote())
                    self._give_back()
            self._planned.popleft()
            if self._covered:
                self._covered -= 1
                self.in_flight -= first.remote
            self._served += 1
            self._last_served = max(self._last_served, first.number)
            if self._left is not None:
                self._left -= 1
            if self._follow and self.depth and first.number >= 0 and (self._limited or self.rpc.version() is None):
                # answered at the next call: what changed (another node), or served rows the limiter counts
                self._served_ref = self.rpc.tell("served", self.id, first.number)
            self._fill()  # plan and read ahead before handing the batch over, so that overlaps the caller's work
            return held

    def _first(self) -> _Planned:
        """The first batch planned, asking (and waiting out the rate limiter) if none is."""
        since, waited = time.monotonic(), 0.0
        while not self._planned:
            if not self._asked:
                self._ask(self._first_plan(), waited)
            held = self._resolve()
            if held is not None:  # the rate limiter holds sampling back: ask again shortly
                waited = self.rpc.backoff(since, held)
        return self._planned[0]

    def _first_plan(self) -> int:
        if not self.depth:
            return 1
        k = self._plan_target(now=True)
        return max(1, min(k, self._left) if self._left is not None else k)

    def _plan_target(self, now: bool) -> int:
        """Batches to keep planned ahead: deep for an iterator; for the loop, its expected run."""
        if not self.depth:
            return 0
        deep = min(plan_size(self.batch_size), FIRST_PLAN << min(self.stats["groups"], 8))
        return deep if self._prefetch else int(min(deep, self._expected(now)))

    def _expected(self, now: bool) -> int | float:
        """``sample()`` calls expected before the next give-back, the one being asked for ``now`` included.

        That is what is left of the last run between give-backs. Past its end a give-back
        may come any time, so nothing is planned before it is asked for, unless this run
        is already twice as long as the last.
        """
        if self._run is None:
            return float("inf")
        left = self._run - self._served
        if left > 0:
            return left
        return float("inf") if self._served >= 2 * max(1, self._run) else int(now)

    def _fill(self) -> None:
        """Ask for the next plans once half of the target is left (a whole target's worth: fewer, larger calls;
        at most one and a half targets planned ahead), and submit shard reads up to the window."""
        if self.depth:
            target = self._plan_target(now=False)
            want = target if self._left is None else min(target, self._left - self.ahead)
            if not self._asked and want > 0 and self.ahead <= target // 2:
                self._ask(want, 0.0)
        self._read_ahead()
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _window(self) -> int:
        """Batches whose shard reads may be submitted ahead: ``depth``, and the loop's ``max_bytes`` of rows."""
        if self._prefetch:
            return self.depth
        batch_bytes = max(1, self.batch_size * self._row_bytes)
        return min(self.depth, MAX_DEPTH, max(0, self._max_bytes // batch_bytes - 1))

    def _read_ahead(self) -> None:
        """Submit the shard reads of the batches planned next, once a quarter of the window is left."""
        window = self._window()
        if self._asked and self._covered >= len(self._planned) and window and not self._reads.all_local():
            self._resolve_answered()  # asking Ray costs ~0.1 ms: only when there are shard reads to submit
        if self._covered > (max(1, window // 4) if window > 1 else 0) or self._covered >= len(self._planned):
            return
        self._cover(min(len(self._planned), max(window, self._covered)))

    def _ask(self, k: int, waited: float) -> None:
        served = None
        if self._last_served > self._reported:  # the served report rides along
            served = self._reported = self._last_served
        # without drawing ahead nothing is held to give back: the coordinator keeps no log for this stream
        stream = self.id if self.depth else None
        request = (self.batch_size, max(1, k), stream, served, uuid.uuid4().hex, waited)
        self._asked.append(_Asked(self.rpc.tell("plan_packed", request), max(1, k)))
        self.stats["groups"] += 1

    def _resolve_answered(self) -> None:
        """Take the plan answers that have come back (never waits)."""
        import ray

        while self._asked:
            ready, _ = ray.wait([self._asked[0].ref], timeout=0)
            if not ready:
                return
            try:
                if self._resolve() is not None:
                    return  # held back: the next batch asks again
            except Exception:
                return  # the error surfaces when the batch is asked for

    def _resolve(self) -> HeldBack | None:
        """Turn the first plan call's answer into planned batches; the ``HeldBack`` if the limiter held it back.

        A refused draw (which drew nothing) is dropped with its error; a wait that times
        out leaves the call first in line, since the coordinator may still draw it.
        """
        asked = self._asked[0]
        try:
            group = self.rpc.get(asked.ref)
        except (TimeoutError, KeyboardInterrupt):
            raise
        except BaseException:
            self._asked.popleft()
            raise
        self._asked.popleft()
        if isinstance(group, str):  # plan_packed's answer
            group = decode_group(group)
        if isinstance(group, HeldBack):
            return group
        self.rpc.answered_at(group.version)
        self._groups += 1
        numbered = group.first >= 0
        for j, (plan, reads) in enumerate(zip(group.plans, reads_by_plan(group))):
            self._planned.append(_Planned(plan, group.version, group.first + j if numbered else -1, self._groups,
                                          reads))
        return None

    # reading ----------------------------------------------------------------------
    def _cover(self, upto: int) -> None:
        """Submit the shard reads of planned batches ``[covered, upto)`` (``Reads.submit``)."""
        self.in_flight += self._reads.submit([self._planned[j] for j in range(self._covered, upto)])
        self._covered = upto

    def _check_version(self) -> None:
        """Give back what is planned if anyone wrote, updated priorities or changed a setting since it was
        planned, as of the previous batch: a batch is never planned with sizes staler than that."""
        ref, self._served_ref = self._served_ref, None
        if not (self._planned or self._asked):
            return
        version = self.rpc.version()
        if version is None:  # another node: the answer to the previous batch's report
            if ref is None:
                return
            version = self.rpc.get(ref)
        if not self._planned:  # the next batch is in the plan asked for first: its version is known once taken
            if self._resolve() is not None:
                return
        if self._planned[0].version >= version:
            return
        self.stats["stale"] += 1
        self._give_back()
        for b in self._planned:  # kept (without replacement, another handle drew since): served as they are
            b.version = version

    def _resize(self, batch_size: int) -> None:
        self._give_back()
        if self._planned:  # kept, but of another size: this size cannot use them; a handle that asks for it will
            self.stats["dropped"] += len(self._planned)
            self.rpc.get(self.rpc.coord.undo.remote(self.id, len(self._planned), True, self._unserved()))
            self._drop_all()
        self.batch_size = batch_size

    def _unserved(self) -> list[tuple[int, str, int, int]]:
        """The batches planned and not handed over, as the coordinator keeps them for another handle when they
        stand (``rayrb.core.ahead.AheadLog.orphan``): ``(batch size, one-batch group, rows, online rows)``."""
        out = []
        for b in self._planned:
            group = GroupPlan([b.plan], [(side, shard) for side, shard, _ in b.reads], [args for _, _, args in b.reads],
                              version=b.version)
            out.append((b.plan.batch_size, group.encoded(), b.plan.batch_size, b.plan.n_online))
        return out

    def _drop_all(self) -> None:
        self._planned.clear()
        self._asked.clear()
        self._covered = self.in_flight = 0

    # giving back ------------------------------------------------------------------
    def give_back(self) -> None:
        """Return the unserved batches' draws to the stream (see the module)."""
        with self._lock:
            self._give_back()

    def _give_back(self) -> None:
        """Undo the draws of what is planned. Waits for the plans asked for (their draws must be counted); if that
        or the undo times out, it raises with everything still held, so a later call gives them back."""
        while self._asked:
            try:
                self._resolve()
            except (ValueError, TypeError, IndexError):  # a refused draw: nothing was drawn
                pass
        count = len(self._planned)
        if self._served or count:
            self._run = self._served
        self._served = 0
        if count == 0:
            return
        verdict = self.rpc.get(self.rpc.coord.undo.remote(self.id, count))
        if verdict == GiveBack.KEEP:  # without replacement, drawn rows are served once: keep them
            self.stats["kept"] += count
            return
        self.stats["given_back" if verdict == GiveBack.UNDONE else "dropped"] += count  # (ADOPT: not asked here)
        self._drop_all()

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
        if self._asked and not self.rpc.closed:
            self._resolve_answered()  # plans already answered go back as planned (never waits)
        outstanding, unserved = self.ahead, self._unserved()
        self._drop_all()
        self.report()  # even with nothing outstanding: once closed, a later save cannot ask this stream
        if outstanding and self.depth and not self.rpc.closed:
            # Queued after this stream's plan calls at the coordinator, which runs one caller's calls in
            # order, so nothing needs to be waited for.
            self.rpc.tell("undo", self.id, None, True, unserved)


class BatchIterator:
    """``iter_batches()``: batches in order, planned ahead, with up to ``prefetch`` read ahead (see the module).

    Closing it (``close``, leaving a ``with`` block, or dropping the last reference,
    as ``break`` out of a ``for`` loop does) gives back the batches it drew and did not
    hand over. Once the buffer's handle is closed, no further batch is handed over.
    """

    def __init__(self, handle: Any, batch_size: int, *, prefetch: int, device: Any = None,
                 return_info: bool = False, num_batches: int | None = None, direct: dict | None = None):
        self._handle, self._device, self._return_info = handle, device, return_info
        # No deeper than the coordinator can give back on close: past that, rows drawn ahead would be lost.
        depth = prefetch if direct is not None else min(prefetch, MAX_AHEAD)
        self._stream = Stream(handle.rpc, batch_size, depth=depth, spec=handle.spec, prefetch=True, direct=direct,
                              limit=num_batches, local=handle.local_reads)

    @property
    def max_in_flight(self) -> int:
        return self._stream.max_in_flight

    @property
    def in_flight(self) -> int:
        return self._stream.in_flight

    @property
    def ahead(self) -> int:
        return self._stream.ahead

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
        out = (held.batch, held.info()) if self._return_info else held.batch
        return self._handle.finish(out, self._return_info, self._device)


_LIVE: "weakref.WeakSet[Stream]" = weakref.WeakSet()


def report_served(rpc: Any) -> None:
    """Report what this process's streams over ``rpc``'s buffer have handed over, before a save counts it."""
    for s in list(_LIVE):
        if s.rpc.name == rpc.name and not s.closed:
            s.report()
