"""The handle's reads: a read that stays behind its planned writes raises within ``timeout``, the time spent in
remote calls included (no Ray: the calls are stand-ins)."""
from __future__ import annotations

import time

import pytest

from rayrb.core.plans import BatchPlan, GroupPlan, Part
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
        return [None] * len(refs)

    monkeypatch.setattr(rpc, "get", slow_behind)
    group = GroupPlan([BatchPlan([Part("online", 0, 1)], 0, 1, fraction=0.0, step=0)], reads=[("online", 0)],
                      args=[([1], [0], [None], 10)])
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not apply the writes .* within timeout=0.5s"):
        rpc.fetch(group, ["ref"])
    assert time.monotonic() - t0 < 1.5  # counting only the sleeps between asks, it waited about 100 s
