"""extend(..., wait=False): writes on their way in the caller's order, bounded, flushed, and kept once or not at
all when a shard, the coordinator or the writer's process dies with them on their way."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rayrb.errors import InvalidArgumentError

pytestmark = pytest.mark.usefixtures("ray_session")


def rows(start, n):
    ids = torch.arange(start, start + n, dtype=torch.int64)
    return TensorDict({"obs": ids.float()[:, None].expand(n, 2).contiguous(), "id": ids}, [n])


@pytest.fixture
def buffer(make_buffer):
    def make(**kwargs):
        return make_buffer(rows(-500, 500), **{"online_capacity": 10_000, "seed": 0, "num_online_shards": 2,
                                               "timeout": 60, **kwargs})
    return make


def online_ids(rb):
    """Every online row's id, read back from the shards."""
    import ray

    out = []
    for shard, n in zip(rb.rpc.by_side["online"], rb.sizes()["online"]):
        state = ray.get(shard.state.remote())
        out += [int(x) for x in np.asarray(state["data"]["id"])[:n]] if "data" in state else []
    return out


def test_pending_writes_land_in_order_bounded_and_flushed(buffer):
    rb = buffer()
    client = rb.client(max_writes_in_flight=2)
    data = [rows(16 * i, 16) for i in range(40)]
    pending = [client.extend(td, wait=False) for td in data]  # the bound blocks the caller; nothing is dropped
    for td in data:
        td["id"].zero_()  # the caller reuses its tensors: what was sent is what extend was given
    client.flush()
    got = torch.cat([p.result() for p in pending])
    assert len(set(got.tolist())) == 640  # nothing doubled
    for shard in (0, 1):  # one writer's writes land in its order: each shard's slots in write order
        mine = got[got // 5000 == shard]
        assert mine.tolist() == list(range(shard * 5000, shard * 5000 + len(mine)))
    assert rb.write_count == 640
    batch = rb.online_buffer.sample(640)
    assert set(batch["id"].tolist()) <= set(range(640)) and batch["id"].min() >= 0
    again = client.extend(data[0], write_id=pending[3].write_id, wait=False)  # other rows under a used id
    with pytest.raises(ValueError):
        again.result()
    with pytest.raises(ValueError):
        client.flush()  # the first failure since the last flush
    client.flush()  # raised once
    assert rb.write_count == 640


def test_writes_queued_behind_one_on_its_way_are_appended_here_to_another_shard_in_order(buffer):
    """A write too large for an undo record goes to its shard's actor; the small writes queued behind it go to the
    other shard, which is on this node: the sender appends them here (no call), each shard's slots in write order."""
    rb = buffer()
    client = rb.client(max_writes_in_flight=4)
    first = client.extend(rows(0, 4100), wait=False)  # more rows than an undo record holds: sent
    small = [client.extend(rows(4100 + 16 * i, 16), wait=False) for i in range(10)]
    client.flush()
    got = torch.cat([first.result()] + [p.result() for p in small])
    assert len(set(got.tolist())) == 4260 and rb.write_count == 4260
    assert client.stats()["handle"]["writes_appended_here"] == 10
    for shard in (0, 1):
        mine = got[got // 5000 == shard]
        assert mine.tolist() == list(range(shard * 5000, shard * 5000 + len(mine)))


def test_a_retry_of_a_pending_write_by_its_id_lands_once(buffer):
    rb = buffer()
    first = rb.extend(rows(0, 16), wait=False)
    assert rb.extend(rows(0, 16), write_id=first.write_id).tolist() == first.result().tolist()
    assert rb.write_count == 16


def test_max_writes_in_flight_is_checked_once(buffer):
    rb = buffer()
    with pytest.raises(InvalidArgumentError, match="max_writes_in_flight"):
        rb.client(max_writes_in_flight=0)


def _thirty_writes_killing(ray, rb, actor) -> list:
    """30 writes of 16 rows sent without waiting, ``actor`` killed (Ray restarts it) after the eleventh."""
    pending = []
    for i in range(30):
        pending.append(rb.extend(rows(16 * i, 16), wait=False))
        if i == 10:
            ray.kill(actor, no_restart=False)
    return pending


def test_a_shard_killed_with_writes_on_their_way_keeps_each_acknowledged_write_once(buffer, ray_session):
    ray = ray_session
    rb = buffer()
    pending = _thirty_writes_killing(ray, rb, rb.rpc.by_side["online"][0])
    for p in pending:
        p.exception()
    kept = [p for p in pending if p.exception() is None]
    assert kept, [p.exception() for p in pending]
    acked = {int(x) for p in kept for x in p.result()}
    assert len(acked) == 16 * len(kept)  # nothing doubled
    assert rb.write_count >= len(acked)
    assert len(rb.online_buffer.sample(8)) == 8


def test_the_coordinator_killed_with_writes_on_their_way_keeps_each_write_once(buffer, ray_session):
    ray = ray_session
    rb = buffer()
    pending = _thirty_writes_killing(ray, rb, rb.rpc.coord)
    rb.flush()  # each write asked again under its id: answered from the journal or sent anew, once
    got = torch.cat([p.result() for p in pending])
    assert len(set(got.tolist())) == 480 and rb.write_count == 480  # each write once


def test_a_writer_killed_with_writes_on_their_way_leaves_each_whole_or_absent(buffer, ray_session):
    ray = ray_session
    rb = buffer()

    @ray.remote(num_cpus=0)
    class Collector:
        def run(self, client, n):
            self.pending = [client.extend(rows(16 * i, 16), wait=False) for i in range(n)]
            return "sent"

    c = Collector.remote()
    assert ray.get(c.run.remote(rb.client(max_writes_in_flight=8), 40)) == "sent"
    ray.kill(c)
    import time

    time.sleep(2.0)
    n = rb.write_count
    assert n % 16 == 0  # writes of 16 rows each: none half applied
    ids = sorted(rb.online_buffer.sample(n)["id"].tolist()) if n else []
    assert set(ids) <= set(range(n))  # the first writes, in order, each whole
