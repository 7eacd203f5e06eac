"""A piece a shard refuses, with any error, never counts: sizes stay at what the shards hold, an epoch without
replacement draws only rows written, and the shard's later writes count again. The coordinator runs in this
process over a real OnlineShard behind a stand-in handle whose next write can be made to fail."""
from __future__ import annotations

import numpy as np
import pytest

from rayrb.actors.coordinator import Coordinator
from rayrb.actors.online_shard import OnlineShard
from rayrb.core.schema import RowSpec


class Handle:
    """A shard object called as Ray calls an actor: ``.remote`` runs it here and returns a ref to the result."""

    def __init__(self, ray, shard, refuse=0):
        self.ray, self.shard, self.refuse = ray, shard, refuse

    def __getattr__(self, name):
        ray, outer = self.ray, self

        class Method:
            def remote(self, *args, **kwargs):
                args = [ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args]
                if name == "extend" and outer.refuse:
                    outer.refuse -= 1
                    return _refuse.remote()
                return ray.put(getattr(outer.shard, name)(*args, **kwargs))

        return Method()


def _refuse():
    raise TypeError("this shard cannot take the piece")


@pytest.mark.usefixtures("ray_session")
def test_a_piece_refused_with_a_type_error_is_not_counted_and_the_shard_goes_on(ray_session):
    ray = ray_session
    global _refuse
    if not hasattr(_refuse, "remote"):
        _refuse = ray.remote(num_cpus=0, max_retries=0)(_refuse)
    spec = RowSpec.from_arrays({"id": np.zeros(1, np.int64)})
    shard = Handle(ray, OnlineShard(spec.to_json(), 100, "t/on"))
    c = Coordinator([object()], [50], [shard], [100], offline_fraction=0.0,
                    sampler={"offline": "uniform", "online": "without_replacement"}, seed=0)

    def write(start, n, write_id):
        indices, acks = c.extend([ray.put({"id": np.arange(start, start + n)})], n, write_id=write_id)
        return ray.get(acks)

    write(1000, 10, "a")
    shard.refuse = 1
    with pytest.raises(TypeError, match="cannot take the piece"):
        write(2000, 10, "b")
    assert c.sizes()["online"] == [10]  # not 20: those rows were never written
    group = c.plan(10, 1)
    assert group.args[0][3] == 10  # the epoch is drawn over the 10 rows the shard holds
    write(3000, 5, "c")  # the next write fills the hole the refused piece left, and counts
    assert c.sizes()["online"] == [15] and shard.shard.size() == 15
