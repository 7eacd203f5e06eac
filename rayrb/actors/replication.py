"""An online shard's replicas, as the shard that serves it (its primary) keeps them.

The primary sends every piece it is given to each replica (after it copied the piece in and counted it, where it
placed the piece itself; before, where the coordinator placed it), and answers only once every *live* replica has
applied it and counts as many rows as the primary does. A live replica is sent its pieces
over a stream of its own (``rayrb.actors.stream``: a frame costs both copies far less CPU than a call), each
frame answered before the next write; a replica being rebuilt, or one no stream reaches, by call (rows up to a
MiB in the call itself, ``rayrb.actors.inline``; larger ones as the same object-store ref, which each copy
fetches itself). The primary awaits what it sent itself, which costs less than its writers awaiting calls
through refs they borrow (``docs/benchmarks.md``, "Rows in the call"). Every rebuild gives the replica a new
*fence*: a frame sent before it, arriving after it, is refused, and calls follow the rebuild in Ray's order, so
frames start again only once a call sent after the rebuild was answered. A replica is in one
of four states:

* ``live``: awaited on every write; a write is acknowledged only when it holds the rows;
* ``catching``: being rebuilt from a snapshot of the primary (``OnlineShard.replace``), sent
  ahead of every later piece, which Ray runs in the order one caller sent them. Writes go on
  without waiting for it; it is live again once the merge and a count check pass;
* ``waiting``: it did not answer within ``WAIT`` seconds (its node is gone, or it is
  restarting): nothing more is sent until that call comes back, then it is rebuilt;
* ``down``: dead for good (Ray will not restart it): a rebuild is tried again every
  ``RETRY`` seconds.

A replica that answers with another count or restore epoch than the primary's (it restarted
empty or on older files, or missed a piece) is rebuilt: it takes the primary's snapshot whole
(so a checkpoint restored into the primary reaches its replicas too), and a piece arriving
twice changes nothing. A restarted primary, files found or not (they may be older than what
was acknowledged), does the converse with a merge: by restore epoch, then slot by slot by
generation, it keeps the newer of its own rows and each replica's (``rayrb.durability.copies``). ``docs/durability.md`` says what a node loss takes with and without replicas.
"""
from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rayrb.actors.inline import cut
from rayrb.actors.stream import APPLIED, StreamClient

logger = logging.getLogger(__name__)
WAIT = 30.0  # seconds a write waits for a live replica before it goes on without it
RETRY = 10.0  # seconds between rebuilds of a replica Ray reports dead for good
LOOKUP = 60.0  # seconds to find a replica by name (it may still be starting)
CONNECT = 5.0  # seconds to open a replica's stream; one that cannot be opened is tried again later (_stream)
LIVE, CATCHING, WAITING, DOWN = "live", "catching", "waiting", "down"


@dataclass
class Replica:
    name: str
    actor: Any = None
    status: str = LIVE
    pending: Any = None  # the merge (catching) or the call not answered in time (waiting)
    count: int = 0  # the write count it last answered
    since: float = field(default_factory=time.monotonic)
    rebuilds: int = 0
    fence: int = 0  # given with every rebuild: frames carry it, and the replica refuses others (rayrb.actors.stream)
    stream: Any = None  # the connection its pieces go over while live (StreamClient), once opened
    settled: bool = True  # every piece sent it by call was answered: frames may follow them in order
    connect_at: float = 0.0  # when to try opening its stream again
    refused: int = 0  # opens that failed in a row: each waits twice as long again (a port this node cannot reach)
    streamed: int = 0  # pieces sent it over the stream


def lookup(name: str, timeout: float = LOOKUP) -> Any:
    """The actor named ``name``, waiting while it may still be being created."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get_actor(name)
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class Replication:
    """The replicas of one online shard, driven by its primary. ``snapshot`` returns the primary's state
    (``OnlineShard.state``): called between its writes, it is a consistent copy."""

    def __init__(self, names: Sequence[str], snapshot: Callable[[], dict], target: Callable[[], Any]):
        self.replicas = [Replica(n) for n in names]
        self._snapshot, self._target = snapshot, target  # target: where the primary was told to publish its count

    def _actor(self, r: Replica) -> Any:
        if r.actor is None:  # at the first start it may still be being made; later a short look will do
            r.actor = lookup(r.name, LOOKUP if r.rebuilds == 0 and r.status == LIVE else 1.0)
        return r.actor

    def send(self, rows_ref: Any, start: int, stop: int, first: int, write: tuple | None = None,
             piece: Mapping[str, Any] | None = None, publish: bool = False) -> list[tuple[Replica, Any]]:
        """Send a piece, ``rows_ref[start:stop]`` (rows, or their object-store ref; ``piece``: those rows, where the
        primary holds them), to every replica that takes pieces (live or catching), with its ``(write id, piece,
        start, digest)`` where the primary placed it (``OnlineShard.replicate``); the frames and calls to await.
        A live replica is sent it over its stream once every call sent it before was answered; otherwise, and
        where no stream opens, by call, rows small enough in the call itself, in parts. ``publish``: a frame asks
        its replica to publish the count where it can (the primary cannot: ``rayrb.actors.stream``)."""
        self.poll()
        if piece is None and isinstance(rows_ref, Mapping):
            piece = {k: v[start:stop] for k, v in rows_ref.items()}
        parts, sent = None, []
        for r in self.replicas:
            if r.status == LIVE and r.settled and piece is not None and self._stream(r) is not None:
                try:
                    r.stream.send(r.fence, first, write, piece, publish=publish, timeout=WAIT)
                except OSError:  # maybe half sent: rebuilt under a new fence, so that it never lands after
                    self._rebuild(r)
                    continue
                r.streamed += 1
                sent.append((r, r.stream))
            elif r.status in (LIVE, CATCHING):
                if parts is None and isinstance(rows_ref, Mapping):
                    parts = cut(piece)
                if parts is not None:  # in the call itself (rayrb.actors.inline)
                    how = {"start": 0, "stop": int(stop) - int(start), "first": first, "write": write}
                    call = self._actor(r).replicate_parts.remote(how, *parts)
                else:
                    call = self._actor(r).replicate.remote(rows_ref, start, stop, first=first, write=write)
                if r.status == LIVE:
                    sent.append((r, call))
                else:  # not awaited: frames wait until a later call to it is answered
                    r.settled = False
        return sent

    def _stream(self, r: Replica) -> StreamClient | None:
        """The replica's stream, opened at the first piece it is sent (None where it cannot be: calls instead)."""
        if r.stream is None and time.monotonic() >= r.connect_at:
            import ray

            try:
                endpoint = ray.get(self._actor(r).stream_endpoint.remote(), timeout=CONNECT)
                r.stream, r.refused = StreamClient.connect(tuple(endpoint), CONNECT), 0
            except Exception as e:  # a port this node cannot reach, a replica restarting: calls, tried again later
                logger.info("rayrb: no stream to replica %s (%r): its pieces go by call", r.name, e)
                r.connect_at = time.monotonic() + RETRY * 2 ** min(r.refused, 6)  # at most one write in ~10 min waits
                r.refused += 1
        return r.stream

    def settle(self, calls: list[tuple[Replica, Any]], order: tuple[int, int], timeout: float = WAIT) -> bool:
        """Wait (up to ``timeout`` s in all) for the live replicas' answers (``OnlineShard.order``: write count and
        restore epoch); one that fails, is late or answers otherwise than the primary's ``order`` is rebuilt (or
        waited for) while writes go on. The epoch shows a replica restarted on files from before a restore, which
        may count as many rows. Whether a replica that answered ``order`` published that count."""
        import ray
        from ray.exceptions import GetTimeoutError

        deadline, published = time.monotonic() + timeout, False
        for r, call in calls:
            left = max(0.0, deadline - time.monotonic())
            told = False
            if isinstance(call, StreamClient):
                try:
                    status, *answer, told = call.answer(left)
                except TimeoutError:  # asked again by call: once that comes back, it is rebuilt
                    pause_stream(r)
                    try:
                        self._late(r, self._actor(r).order.remote())
                    except Exception as e:  # its name is gone: down, the write answered all the same
                        drop_stream(r)
                        failed(r, e)
                    continue
                except OSError:  # the connection broke (StreamError among them)
                    status = None
                if status != APPLIED:  # broken, refused (fenced) or failed
                    pause_stream(r)
                    self._rebuild(r)
                    continue
                answer = tuple(answer)
            else:
                try:
                    answer = tuple(int(x) for x in ray.get(call, timeout=left))
                except GetTimeoutError:
                    self._late(r, call)
                    continue
                except Exception:
                    self._rebuild(r)
                    continue
                r.settled = True  # answered after every call sent it before
            r.count = answer[0]
            if answer != tuple(order):
                self._rebuild(r)
            elif told:
                published = True
        return published

    def redo(self) -> None:
        """The primary could not store a piece it had sent: every replica that takes pieces may hold it (slots and
        a journal line of a write never acknowledged, which a later write of the same length at that count would
        leave in place, counts agreeing), so each is rebuilt from the primary, ahead of any later piece."""
        for r in self.replicas:
            if r.status in (LIVE, CATCHING):
                self._rebuild(r)

    def check(self, order: tuple[int, int]) -> None:
        """Between writes: ask each live replica its count and epoch (one restarted empty, or on older files, while
        no write came); asked after every piece sent, it answers behind them."""
        self.poll()
        self.settle([(r, self._actor(r).order.remote()) for r in self.replicas if r.status == LIVE], order, 5.0)

    def poll(self) -> None:
        """Move replicas along: a late call that came back starts a rebuild; a finished rebuild makes the replica
        live (the next write checks its count); a dead one is tried again after ``RETRY`` s. Never waits."""
        import ray

        for r in self.replicas:
            if r.status in (CATCHING, WAITING) and r.pending is not None:
                ready, _ = ray.wait([r.pending], timeout=0)
                if not ready:
                    continue
                if r.status == WAITING:
                    self._rebuild(r)
                    continue
                try:
                    r.count = int(ray.get(r.pending))
                    r.status, r.pending, r.since = LIVE, None, time.monotonic()
                except Exception as e:
                    failed(r, e)
            elif r.status == DOWN and time.monotonic() - r.since > RETRY:
                self._rebuild(r)

    def _late(self, r: Replica, call: Any) -> None:
        drop_stream(r)  # a frame left unanswered: what follows goes after the rebuild, under a new fence
        r.status, r.pending, r.since = WAITING, call, time.monotonic()

    def close_all(self) -> None:
        """Each replica removes its files (the buffer is being shut down for good); waited for up to 5 s."""
        import ray

        for r in self.replicas:
            drop_stream(r)
        calls = [lookup(r.name, 1.0).close.remote() for r in self.replicas]
        ray.wait(calls, num_returns=len(calls), timeout=5)

    def rebuild_all(self, timeout: float = WAIT) -> None:
        """Every replica made again from the primary (its state was replaced: a checkpoint restored), and waited
        for (up to ``timeout`` s in all, as a write waits): a restore returns once every copy that answers holds
        it. A handle beside a replica reads the replica's files when they hold the rows a read was planned over
        (``rayrb.handle.local``), which counts cannot tell for a restore: rows from before it may count as many
        or more. One that fails is down; one still busy stays catching, the snapshot ahead of any later piece."""
        import ray

        for r in self.replicas:
            self._rebuild(r)
        pending = [r.pending for r in self.replicas if r.status == CATCHING and r.pending is not None]
        if pending:
            ray.wait(pending, num_returns=len(pending), timeout=timeout)
            self.poll()  # those that answered are live (their counts checked at the next write), failed ones down

    def publish_to(self) -> None:
        """Pass on where the shard's count is published (``target()``, ``rayrb.actors.publishing``) to every
        replica (not awaited); each one rebuilt is told again (it may have restarted without it). One on the
        coordinator's node publishes the count a frame asks it to."""
        for r in self.replicas:
            if r.status != DOWN:
                self._tell_target(r)

    def _tell_target(self, r: Replica) -> None:
        target = self._target()
        if target is None:
            return
        try:
            self._actor(r).publish_to.remote(target, now=False)
        except Exception:  # gone: told again when it is rebuilt
            pass

    def _rebuild(self, r: Replica) -> None:
        """Send the replica a snapshot of the primary to take in place of its own, under a new fence (a frame sent
        before it is refused after it); later pieces follow it in order, by call until one is answered."""
        drop_stream(r)
        r.fence, r.settled = secrets.randbits(62) + 1, False
        try:
            r.pending = self._actor(r).replace.remote(self._snapshot(), fence=r.fence)
            self._tell_target(r)
        except Exception as e:
            failed(r, e)
            return
        r.status, r.since = CATCHING, time.monotonic()
        r.rebuilds += 1

    def take_all(self, merge: Callable[[dict], int], what: str) -> bool:
        """``merge`` each replica's state into the primary (restarted, its files gone or older than what was
        acknowledged); whether one answered. A replica of another restore epoch than the primary's after the
        merges (it missed a restore, or the primary took another replica's whole) is rebuilt: counts alone would
        not show it."""
        import ray

        took, epochs = False, {}
        for r in self.replicas:
            try:
                state = ray.get(lookup(r.name).state.remote(journal=True), timeout=WAIT)
                merge(state)
                took, epochs[r.name] = True, int(state.get("restores", 0))
            except Exception as e:  # that copy is gone too (a second loss before it was rebuilt)
                logger.warning("rayrb: shard %s could not take the rows of its replica %s: %r", what, r.name, e)
        mine = int(self._snapshot().get("restores", 0)) if epochs else 0
        for r in self.replicas:
            if r.name in epochs and epochs[r.name] != mine:
                self._rebuild(r)
        return took

    def priorities(self, idx: Any, generation: Any, priority: Any) -> None:
        """Send a priority update to every replica that takes pieces (not awaited: ordered before later ones)."""
        for r in self.replicas:
            if r.status in (LIVE, CATCHING):
                self._actor(r).update_priority.remote(idx, generation, priority)

    def report(self, count: int) -> list[dict[str, Any]]:
        """Each replica: name, node, state, rows behind the primary (as last answered; None unless live),
        rebuilds and pieces sent over its stream so far."""
        import ray

        out = []
        for r in self.replicas:
            try:
                node = ray.get(self._actor(r).place.remote(), timeout=2.0)["node"] if r.status == LIVE else None
            except Exception:  # it just went away: the next write says so
                node = None
            out.append({"name": r.name, "node": node, "status": r.status, "rebuilds": r.rebuilds,
                        "streamed": r.streamed, "behind": max(0, count - r.count) if r.status == LIVE else None})
        return out

    def live(self) -> int:
        return sum(r.status == LIVE for r in self.replicas)


def pause_stream(r: Replica) -> None:
    """A stream that failed carries nothing for ``RETRY`` s (calls instead): one that keeps failing costs a
    rebuild then, not one a write."""
    r.connect_at = time.monotonic() + RETRY


def drop_stream(r: Replica) -> None:
    if r.stream is not None:
        r.stream.close()
        r.stream = None


def failed(r: Replica, error: Exception) -> None:
    """A replica a call could not reach is down: for good where Ray says it is dead (its handle dropped), else
    tried again at the next poll."""
    from ray.exceptions import ActorDiedError

    if isinstance(error, (ActorDiedError, ValueError)):  # dead for good, or its name is gone
        r.status, r.pending, r.actor, r.since = DOWN, None, None, time.monotonic()
    else:
        r.status, r.pending, r.since = DOWN, None, time.monotonic() - RETRY  # try again at the next poll
