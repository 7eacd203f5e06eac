"""The handle's reads: a read that stays behind its planned writes raises within ``timeout``, the time spent in
remote calls included (no Ray: the calls are stand-ins)."""
from __future__ import annotations

import time

import pytest

from rayrb.errors import HeldBack, HeldBackTimeout
from rayrb.handle.rpc import Rpc


class Shard:
    class sample_many:  # noqa: N801 (an actor method's name)
        @staticmethod
        def remote(*args):
            return "ref"


def test_reads_that_stay_behind_raise_within_the_timeout_remote_calls_included(monkeypatch):
    rpc = Rpc(None, [Shard(), Shard()], 1, name="t", timeout=0.5)

    def slow_behind(refs, timeout="call"):  # every answer takes 0.2 s and says the rows have not landed
        time.sleep(0.2)
        return None

    monkeypatch.setattr(rpc, "get", slow_behind)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not apply the writes .* within timeout=0.5s"):
        rpc.fetch_read(("online", 0, ([1], [0], [None], 10)), "ref")
    assert time.monotonic() - t0 < 1.5  # counting only the sleeps between asks, it waited about 100 s


def test_a_read_asked_again_that_times_out_names_the_configured_timeout_not_what_was_left(monkeypatch):
    import ray
    from ray.exceptions import GetTimeoutError

    asked = []
    real_get = ray.get

    def behind_then_silent(refs, timeout=None):  # the first answer: not landed yet; the next never comes
        if refs != "ref":  # another thread's call (an earlier test's iterator closed by the garbage collector)
            return real_get(refs, timeout=timeout)
        asked.append(timeout)
        if len(asked) == 1:
            return None
        time.sleep(timeout)
        raise GetTimeoutError("timed out")

    monkeypatch.setattr(ray, "get", behind_then_silent)
    rpc = Rpc(None, [Shard(), Shard()], 1, name="t", timeout=0.3)
    with pytest.raises(TimeoutError, match=r"online shard \('online', 0\) did not apply the writes .* within "
                                           r"timeout=0\.3s$"):
        rpc.fetch_read(("online", 0, ([1], [0], [None], 10)), "ref")
    assert len(asked) == 2 and asked[1] < 0.3  # the second ask had only what was left


class Coordinator:
    """Holds ``extend`` back ``held`` times; records the ``waited`` each call reports, and the calls that gave up."""

    def __init__(self, held: int):
        self.held, self.reported, self.gave_up_calls = held, [], []

    @property
    def gave_up(self):
        coord = self

        class Method:
            @staticmethod
            def remote(call, seconds):
                coord.gave_up_calls.append((call, seconds))

        return Method

    @property
    def extend(self):
        coord = self

        class Method:
            @staticmethod
            def remote(*args, waited=0.0):
                coord.reported.append(waited)
                if coord.held:
                    coord.held -= 1
                    return HeldBack("insert", "the window is full")
                return "done"

        return Method


def slow_get(refs, timeout="call"):  # every round trip takes 0.1 s, as on a loaded machine
    time.sleep(0.1)
    return refs


def test_a_held_back_call_reports_and_times_out_on_the_wall_time_round_trips_included(monkeypatch):
    coord = Coordinator(held=5)
    rpc = Rpc(coord, [], 0, name="t", timeout=10)
    monkeypatch.setattr(rpc, "get", slow_get)
    t0 = time.monotonic()
    assert rpc.call("extend") == "done"
    waited = time.monotonic() - t0
    # five round trips of 0.1 s and five short sleeps: the sleeps alone add up to about 0.05 s
    assert coord.reported[-1] >= 0.5 and coord.reported[-1] <= waited

    assert coord.gave_up_calls == []  # it went through: it did not give up

    coord = Coordinator(held=10**6)
    rpc = Rpc(coord, [], 0, name="t", timeout=0.5)
    monkeypatch.setattr(rpc, "get", slow_get)
    t0 = time.monotonic()
    with pytest.raises(HeldBackTimeout, match="waited 0.5s for the rate limiter"):
        rpc.call("extend")
    assert 0.5 <= time.monotonic() - t0 < 2.5  # counting only the sleeps, it waited about 5 s
    # the coordinator is told, once, what gave up and after how long (stats() counts it)
    assert len(coord.gave_up_calls) == 1 and coord.gave_up_calls[0][0] == "insert"
    assert 0.5 <= coord.gave_up_calls[0][1] <= time.monotonic() - t0


def test_a_version_map_behind_an_answer_is_dropped_and_looked_up_again():
    """The coordinator writes its map before any answer leaves: an answer ahead of the map means the map is no
    longer the coordinator's (restarted on another node), and the handle stops reading it."""
    import numpy as np

    from rayrb.durability.published import CountsMap

    rpc = Rpc(None, [], 0, name="b", timeout=1.0)
    rpc._version_map = CountsMap(np.array([5], np.int64))
    rpc.answered_at(5)
    assert rpc._version_map is not None  # as current as the answer
    rpc.answered_at(6)
    assert rpc._version_map is None  # asked for again at the next version()
    rpc._version_map = False  # another node: no map, nothing to drop
    rpc.answered_at(7)
    assert rpc._version_map is False


def test_an_actors_refusal_reaches_the_caller_as_itself_and_as_its_builtin(monkeypatch):
    """A ``ValueError``, ``TypeError`` or ``IndexError`` an actor raised is raised as it was (rayrb's own errors
    subclass those builtins); other errors stay wrapped by Ray, and are still instances of their class."""
    import ray
    from ray.exceptions import RayTaskError

    from rayrb.errors import DrawError, InvalidStateError, RowIndexError

    rpc = Rpc(None, [], 0, name="t", timeout=1.0)
    for cause, builtin in [(DrawError("no rows"), ValueError), (RowIndexError("got index 9"), IndexError),
                           (InvalidStateError("no online shards"), RuntimeError)]:
        def failed(refs, timeout=None, cause=cause):
            raise RayTaskError("sample", "traceback", cause).as_instanceof_cause()

        monkeypatch.setattr(ray, "get", failed)
        with pytest.raises(builtin) as e:
            rpc.get("ref")
        assert isinstance(e.value, type(cause))
        assert (e.value is cause) == (builtin is not RuntimeError)
