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
  call at all; once a dataset's batch was found outside the page cache, the rows of
  the batches planned next are named to the kernel as each batch is served
  (``rayrb.io.read_ahead``), so the disk reads them while the caller works. The other
  parts are read by their shards, one call per shard for a run of consecutive batches,
  submitted at most ``prefetch`` batches ahead (and, for the ``sample()`` loop,
  ``max_bytes`` of rows): ``prefetch`` bounds the rows held ahead, never the plans.

**Giving back.** Batches planned and not handed over are given back
(``Stream.give_back``) before anything that must see the stream where the caller
left it: the handle's writes, priority updates, settings, saves and other ways of
sampling, and closing an iterator. The coordinator rewinds its planner to before the
first of them, so the stream goes on as if they had never been drawn. If another
caller drew in between, the draws stand: batches without replacement are kept and
served (each row of an epoch once), batches with replacement dropped.

**Two policies** (``rayrb.handle.policies``) set how far ahead a stream plans and reads,
and what it does around each batch: the ``sample()`` loop's follows the coordinator's
version and plans as far as its caller samples between give-backs; an iterator's plans
deep. Under a rate limiter the coordinator plans ahead only as far as the limiter
allows at that moment.

**Served.** The coordinator learns which draws were handed over (so that they are never
given back, and a save or the rate limiter counts them) by one report: the number of
the last draw served, sent once, with the stream's next plan call or by ``report``
(before a save, and after each batch where the policy needs it).
"""
from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from rayrb.core.ahead import MAX_AHEAD, GiveBack
from rayrb.core.plans import GroupPlan, decode_group, offline_epoch
from rayrb.errors import HeldBack, RowsLostError
from rayrb.handle.policies import Ahead, Loop
from rayrb.handle.reads import Held, Planned, Reads, orphans, planned

LOST_RETRIES = 3  # plans made again after a read finds its rows lost with a node (kept draws fail again: raise)
PLAN_ROWS = 1 << 20  # rows one plan call covers: its cost a small share of the batches' own
MAX_PLAN = 240  # batches one plan call covers: with half of them left when the next is asked for, a stream has at
# most 360 planned, within what the coordinator can give back (rayrb.core.ahead.MAX_AHEAD)
HINT_ROWS = 16384  # rows planned next a stream names to the kernel ahead of reading them here (a cold dataset's
# rows: ~0.4 s of this machine's disk at its random-read limit, docs/benchmarks.md), at most prefetch batches
FIRST_PLAN = 16  # batches a stream's first plan call covers, doubling per call up to plan_size: a stream closed
# early (an iterator per training step, a loop that writes soon) gives back little the coordinator drew for nothing


class PlanCalls(deque):
    """A stream's plan calls not answered yet, in order: each ``(ref, batches asked for)``."""

    def __init__(self, rpc: Any):
        super().__init__()
        self.rpc = rpc

    @property
    def batches(self) -> int:
        return sum(k for _, k in self)

    def ask(self, request: tuple) -> None:
        """Send a plan call (``Coordinator.plan_packed``'s ``request``)."""
        self.append((self.rpc.tell("plan_packed", request), request[1]))

    def answered(self) -> bool:
        """Whether the first call's answer has come back (never waits)."""
        import ray

        return bool(self) and bool(ray.wait([self[0][0]], timeout=0)[0])

    def take(self) -> GroupPlan | HeldBack:
        """The first call's answer, waited for. A refused draw (which drew nothing) is dropped with its error; a
        wait that times out leaves the call first in line, since the coordinator may still draw it."""
        try:
            group = self.rpc.get(self[0][0])
        except (TimeoutError, KeyboardInterrupt):
            raise
        except BaseException:
            self.popleft()
            raise
        self.popleft()
        return decode_group(group) if isinstance(group, str) else group  # plan_packed answers the group's text


def hint_batches(batch_size: int, depth: int) -> int:
    """Batches planned next whose rows a stream names to the kernel ahead: ``HINT_ROWS`` rows, at most ``depth``
    batches, at least one (a stream with ``depth`` 0 plans nothing ahead, so it has none to name).

    >>> hint_batches(256, 32), hint_batches(4096, 32), hint_batches(65536, 32), hint_batches(256, 0)
    (32, 4, 1, 1)
    """
    return max(1, min(depth, HINT_ROWS // max(1, batch_size)))


def plan_size(batch_size: int) -> int:
    """Batches one plan call covers at this batch size (``PLAN_ROWS`` rows, 2 to ``MAX_PLAN`` batches).

    >>> plan_size(256), plan_size(4096), plan_size(65536), plan_size(10**7)
    (240, 240, 16, 2)
    """
    return max(2, min(MAX_PLAN, PLAN_ROWS // max(1, batch_size)))


class Stream:
    """Batches of one handle in stream order (see the module), the way ``policy`` samples (``rayrb.handle.policies``).

    ``depth`` bounds the batches read ahead (0: nothing is planned ahead either: single calls). ``local`` reads the
    parts this process can (``rayrb.handle.local``); ``direct`` (shard handles by side) reads GPU shards into this
    actor's GPU; ``limit``: batches to hand over (an iterator's ``num_batches``).
    """

    def __init__(self, rpc: Any, batch_size: int, *, depth: int, spec: Any, policy: Ahead | Loop,
                 direct: dict[str, list] | None = None, limit: int | None = None, local: Any = None):
        self.rpc, self.batch_size, self.depth, self.policy = rpc, batch_size, depth, policy
        self.direct = direct  # the shard handles a GPU actor reads directly from, or None
        self._left = limit  # batches still to hand over (an iterator's num_batches)
        self.id = uuid.uuid4().hex  # names this stream's draws at the coordinator
        self._asked = PlanCalls(rpc)
        self._planned: deque[Planned] = deque()  # batches planned and not handed over, in order
        self._covered = 0  # of those, the first ones whose shard reads are submitted
        # of those, the ones with a shard read: rows held, or on their way, ahead (the rest are read here when served)
        self.in_flight = 0
        self._groups = 0  # plan answers taken, to tell groups apart (their reads cannot be joined)
        self._last_served = self._reported = -1  # numbers of the last draw handed over, and told
        self._lock = threading.Lock()
        self.closed = False
        self.max_in_flight = 0
        self.stats = {"groups": 0, "reads": 0, "given_back": 0, "dropped": 0, "kept": 0, "stale": 0, "lost": 0}
        self._reads = Reads(rpc, spec, direct, local, self.stats)

    @property
    def exhausted(self) -> bool:
        """Whether the stream has handed over every batch it was to (an iterator's ``num_batches``)."""
        return self._left is not None and self._left <= 0

    @property
    def ahead(self) -> int:
        """Batches planned (or asked for) and not handed over: what a give-back returns."""
        return len(self._planned) + self._asked.batches

    def next(self, batch_size: int | None = None) -> Held:
        """The next batch of the stream (its rows and info, whether it ends an epoch)."""
        with self._lock:
            if batch_size is not None and batch_size != self.batch_size:
                self._resize(batch_size)
            self.policy.before(self)
            for attempt in range(LOST_RETRIES + 1):
                first = self._first()
                if not self._covered:  # the batch served now and the window beyond it: one read per shard for all
                    self._cover(min(len(self._planned), self.policy.window(self.depth, self.batch_size) + 1))
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
            self._last_served = max(self._last_served, first.number)
            if self._left is not None:
                self._left -= 1
            self.policy.after(self, first.number)
            self._fill()  # plan and read ahead before handing the batch over, so that overlaps the caller's work
            return held

    def _first(self) -> Planned:
        """The first batch planned, asking (and waiting out the rate limiter) if none is."""
        since, waited = time.monotonic(), 0.0
        while not self._planned:
            if not self._asked:
                k = self._plan_target(now=True) if self.depth else 1
                self._ask(max(1, min(k, self._left) if self._left is not None else k), waited)
            held = self._resolve()
            if held is not None:  # the rate limiter holds sampling back: ask again shortly
                waited = self.rpc.backoff(since, held)
        return self._planned[0]

    def _plan_target(self, now: bool) -> int:
        """Batches to keep planned ahead: the policy's share of what one plan call may cover."""
        if not self.depth:
            return 0
        return self.policy.target(min(plan_size(self.batch_size), FIRST_PLAN << min(self.stats["groups"], 8)), now)

    def _fill(self) -> None:
        """Ask for the next plans once half of the target is left (a whole target's worth: fewer, larger calls;
        at most one and a half targets planned ahead), and submit shard reads up to the window."""
        if self.depth:
            target = self._plan_target(now=False)
            want = target if self._left is None else min(target, self._left - self.ahead)
            if not self._asked and want > 0 and self.ahead <= target // 2:
                self._ask(want, 0.0)
        self._read_ahead()
        if self._reads.hints_wanted():  # rows read here when served, named to the kernel now (cold datasets only)
            n = hint_batches(self.batch_size, self.depth)
            if self._asked and len(self._planned) < n:
                self._resolve_answered()  # the next plans' batches too: a group's first batch is hinted ahead
            self._reads.hint(itertools.islice(self._planned, n))
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _read_ahead(self) -> None:
        """Submit the shard reads of the batches planned next, once a quarter of the window is left."""
        window = self.policy.window(self.depth, self.batch_size)
        if self._asked and self._covered >= len(self._planned) and window and not self._reads.all_local():
            self._resolve_answered()  # asking Ray costs ~0.1 ms: only when there are shard reads to submit
        if self._covered > (max(1, window // 4) if window > 1 else 0) or self._covered >= len(self._planned):
            return
        self._cover(min(len(self._planned), max(window, self._covered)))

    def _ask(self, k: int, waited: float, owing: int | None = None) -> None:
        served = self._unreported()  # what was served rides along
        # without drawing ahead nothing is held to give back: the coordinator keeps no log for this stream
        stream = self.id if self.depth else None
        request = (self.batch_size, max(1, k), stream, served, uuid.uuid4().hex, waited, owing)
        self._asked.ask(request)
        self.stats["groups"] += 1

    def _resolve_answered(self) -> None:
        """Take the plan answers that have come back (never waits)."""
        while self._asked.answered():
            try:
                if self._resolve() is not None:
                    return  # held back: the next batch asks again
            except Exception:
                return  # the error surfaces when the batch is asked for

    def _resolve(self) -> HeldBack | None:
        """Turn the first plan call's answer into planned batches (``PlanCalls.take``); the ``HeldBack`` if the
        limiter held it back."""
        group = self._asked.take()
        if isinstance(group, HeldBack):
            return group
        self.rpc.answered_at(group.version)
        self._groups += 1
        self._planned.extend(planned(group, self._groups))
        return None

    def _cover(self, upto: int) -> None:
        """Submit the shard reads of planned batches ``[covered, upto)`` (``Reads.submit``)."""
        self.in_flight += self._reads.submit([self._planned[j] for j in range(self._covered, upto)])
        self._covered = upto

    def catch_up(self, version: int | Callable[[], int]) -> None:
        """Give back what is planned if it was planned before ``version`` (the coordinator's count of writes,
        priority updates, restores and settings changes; a callable is asked only if anything is planned): a
        batch is never planned with sizes staler than that."""
        if not (self._planned or self._asked):
            return
        if callable(version):
            version = version()
        if not self._planned and self._resolve() is not None:  # the next batch's version is known once taken
            return
        if self._planned[0].version >= version:
            return
        self.stats["stale"] += 1
        self._give_back()
        for b in self._planned:  # kept (without replacement, another handle drew since): served as they are
            b.version = version

    def next_fraction(self) -> float | None:
        """The offline fraction of the next batch, if it is planned at the coordinator's version (else None:
        the coordinator's own answer is the next batch's)."""
        with self._lock:
            if self._asked and not self._planned and self._resolve() is not None:
                return None
            version = self.rpc.version()
            if not self._planned or version is None or self._planned[0].version < version:
                return None
            return float(self._planned[0].plan.fraction)

    def owes(self, epoch: int) -> bool:
        """Whether offline epoch ``epoch``, whose last batch this stream just served, owes batches it serves next
        (a pass over the epoch goes on to the one that ends it now): orphans of the epoch it took over, or that the
        coordinator hands it now (``Drawing.plan``'s ``owing``), before what it planned beyond the epoch."""
        with self._lock:
            self._give_back(pace=False)  # what cannot be given back stays first
            before = len(self._planned)
            self._ask(MAX_AHEAD, 0.0, owing=epoch)
            self._resolve()  # never held back: the orphans were drawn already
            return len(self._planned) > before or any(b.plan.last_of_epoch and offline_epoch(b.reads) == epoch
                                                      for b in self._planned)

    def _resize(self, batch_size: int) -> None:
        self._give_back()
        if self._planned:  # kept, but of another size: this size cannot use them; a handle that asks for it will
            self.stats["dropped"] += len(self._planned)
            self.rpc.get(self.rpc.coord.undo.remote(self.id, len(self._planned), True, orphans(self._planned)))
            self._drop_all()
        self.batch_size = batch_size

    def _drop_all(self) -> None:
        self._planned.clear()
        self._asked.clear()
        self._covered = self.in_flight = 0

    def give_back(self, pace: bool = True) -> None:
        """Return the unserved batches' draws (see the module); ``pace``: the policy counts the end of a run."""
        with self._lock:
            self._give_back(pace)

    def _give_back(self, pace: bool = True) -> None:
        """Undo the draws of what is planned. Waits for the plans asked for (their draws must be counted); if that
        or the undo times out, it raises with everything still held, so a later call gives them back."""
        while self._asked:
            try:
                self._resolve()
            except (ValueError, TypeError, IndexError):  # a refused draw: nothing was drawn
                pass
        count = len(self._planned)
        if pace:
            self.policy.gave_back(count)
        if count == 0:
            return
        verdict = self.rpc.get(self.rpc.coord.undo.remote(self.id, count))
        if verdict == GiveBack.KEEP:  # without replacement, drawn rows are served once: keep them
            self.stats["kept"] += count
            return
        self.stats["given_back" if verdict == GiveBack.UNDONE else "dropped"] += count  # (ADOPT: not asked here)
        self._drop_all()

    def _unreported(self) -> int | None:
        """The number of the last draw handed over, if the coordinator has not been told it (it is, now)."""
        told, self._reported = self._reported, self._last_served
        return self._last_served if self._last_served > told else None

    def report(self, always: bool = False) -> Any:
        """Tell the coordinator which draws were handed over (fire and forget): before a save counts them, and
        (``always``) when the policy needs the answer, the coordinator's version. The other way they travel is
        with the next plan call. Returns the call's ref, or None if nothing was sent."""
        if self.rpc.closed or (self._unreported() is None and not always):
            return None
        return self.rpc.tell("served", self.id, self._last_served)

    def close(self) -> None:
        """Give back what was drawn and not handed over without waiting; the stream then stops."""
        if self.closed:
            return
        self.closed = True
        if self._asked and not self.rpc.closed:
            self._resolve_answered()  # plans already answered go back as planned (never waits)
        outstanding, unserved = self.ahead, orphans(self._planned)
        self._drop_all()
        self.report()  # even with nothing outstanding: once closed, a later save cannot ask this stream
        if outstanding and self.depth and not self.rpc.closed:
            # Queued after this stream's plan calls at the coordinator, which runs one caller's calls in
            # order, so nothing needs to be waited for.
            self.rpc.tell("undo", self.id, None, True, unserved)
