"""Writes the online shards place themselves (``rayrb.handle.direct``), the default write path: appended by the
writer itself where the shard's files are on its node, else sent to the shard in one call. Seen by every reader
once ``extend`` returned, balanced, a caller-named retry answered from any handle, a write too large for one shard
relayed whole, rows a writer never told counted once the coordinator takes the shards' counts again, and, with
things killed, nothing acknowledged lost, nothing doubled, nothing served torn."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch
from restart_util import coordinator_places, kill_and_wait, kill_coordinator, online_ids, rows

from rayrb.errors import InvalidArgumentError, InvalidStateError, WriteIdError

pytestmark = pytest.mark.usefixtures("ray_session")

KW = {"online_capacity": 400, "num_offline_shards": 1, "num_online_shards": 2, "seed": 5, "batch_size": 16}


@pytest.fixture
def rb(make_buffer):
    return make_buffer(rows(0, 50), **KW)


def _handle_stats(handle) -> dict:
    return handle.stats()["handle"]


def _unpublished(ray, shard) -> None:
    """Make ``shard`` publish no more, as one on another node than the coordinator, once the coordinator's own
    target reached it (sent at the coordinator's start, it may come after a call from here)."""
    deadline = time.monotonic() + 30
    while not ray.get(shard.__ray_call__.remote(lambda self: self._publisher.publishing)):
        assert time.monotonic() < deadline, "the coordinator never told the shard where to publish"
        time.sleep(0.01)
    assert ray.get(shard.publish_to.remote(None)) is False


def test_the_shards_place_writes_by_default_and_a_writer_on_their_node_appends_them_itself(rb):
    assert rb._writer.shards_place
    got = [rb.extend(rows(1000 + 10 * i, 10)).tolist() for i in range(6)]
    assert _handle_stats(rb)["writes_appended_here"] == 6 and _handle_stats(rb)["writes_sent"] == 0
    assert sorted(rb.sizes()["online"]) == [30, 30]  # one writer alone alternates its shards
    assert sorted(sum(got, [])) == sorted(set(sum(got, [])))
    assert online_ids(rb) == list(range(1000, 1060)) and rb.write_count == 60
    ids = rb.sample(256, return_info=True)[0]["id"]
    assert set(ids[ids >= 1000].tolist()) <= set(range(1000, 1060))


@pytest.mark.parametrize("local", [True, False])
def test_a_sample_started_after_extend_returned_sees_its_rows_in_another_process(make_buffer, ray_session, local):
    """Contract 2 with the coordinator off the write's path: the append publishes the shard's count in the
    coordinator's counts map (here: the writer's own append, or the shard's), which the reader's loop checks
    before each batch and the coordinator before each plan. The reader holds draws ahead meanwhile."""
    ray = ray_session
    rb = make_buffer(rows(0, 50), **{**KW, "offline_fraction": 0.0})
    writer = rb.client(local_reads=local)

    @ray.remote(num_cpus=0)
    class Reader:
        def __init__(self, client):
            self.client = client

        def seen(self, times: int) -> tuple[int, list[int]]:
            ids = []
            for _ in range(times):  # a loop that samples more than once plans ahead
                ids = self.client.sample(512)["id"].tolist()
            return len(self.client.online_buffer), ids

    reader = Reader.remote(rb.client())
    ray.get(reader.seen.remote(1))
    for i in range(6):
        writer.extend(rows(1000 + 10 * i, 10))
        n, ids = ray.get(reader.seen.remote(3))
        assert n == 10 * (i + 1), f"after write {i} the reader sees {n} online rows"
        assert set(ids) <= set(range(1000, 1000 + 10 * (i + 1)))
        assert set(ids) & set(range(1000 + 10 * i, 1010 + 10 * i)), f"write {i}'s rows never drawn"
    assert _handle_stats(writer)["writes_appended_here" if local else "writes_sent"] == 6


def test_a_writer_in_another_process_is_seen_by_the_loop_here_that_holds_draws_ahead(rb, ray_session):
    ray = ray_session

    @ray.remote(num_cpus=0)
    def write(client, start, n):
        client.extend(rows(start, n))
        return client.stats()["handle"]["writes_appended_here"]

    rb.extend(rows(1000, 10))
    for _ in range(4):
        rb.sample(64)  # the loop plans ahead
    assert ray.get(write.remote(rb.client(), 2000, 30)) == 1
    drawn = set()
    for _ in range(3):
        batch, info = rb.sample(64, return_info=True)
        drawn |= set(batch["id"][~info["offline"]].tolist())
    assert drawn & set(range(2000, 2030)), "the other process's rows were never drawn"


def test_an_append_no_shard_could_publish_is_told_before_extend_returns(rb, ray_session):
    """A shard on another node than the coordinator cannot publish its count in the coordinator's map: the writer
    tells the coordinator and waits for its answer. Here the shards are told no map is theirs to publish in."""
    ray = ray_session
    for shard in rb.rpc.by_side["online"]:
        _unpublished(ray, shard)
    writer = rb.client(local_reads=False)  # no append here either: each write goes to its shard
    for i in range(4):
        writer.extend(rows(1000 + 10 * i, 10))
        assert rb.write_count == 10 * (i + 1)
    stats = _handle_stats(writer)
    assert stats["writes_told"] == 4 and stats["writes_sent"] == 4, stats


def test_a_named_write_retried_from_another_handle_is_answered_once_and_other_rows_refused(rb, ray_session):
    ray = ray_session
    first = rb.extend(rows(1000, 30), write_id="collector-2/step-9")

    @ray.remote(num_cpus=0)
    def retry(client, data, write_id):
        return client.extend(data, write_id=write_id)

    again = ray.get(retry.remote(rb.client(), rows(1000, 30), "collector-2/step-9"))
    assert torch.equal(again, first) and rb.write_count == 30
    with pytest.raises(WriteIdError, match="collector-2/step-9"):
        rb.client().extend(rows(5000, 30), write_id="collector-2/step-9")  # same count, other rows
    kill_and_wait(rb.rpc.by_side["online"][int(first[0]) // 200])  # the shard reopens its journal
    assert torch.equal(rb.client().extend(rows(1000, 30), write_id="collector-2/step-9"), first)
    assert rb.write_count == 30 and online_ids(rb) == list(range(1000, 1030))


def test_a_write_appended_here_is_answered_again_when_retried_by_its_id_from_a_handle_that_sends(rb):
    rb.extend(rows(900, 5))
    mine = rb._writer._direct
    rows_in = rb._writer.rows(rows(1000, 12), "rows")
    from rayrb.io.arrays import rows_digest

    first = mine.here(rows_in, 12, "w-12", rows_digest(rows_in), look=False)  # appended here under that id
    sent = rb.client(local_reads=False)
    assert torch.equal(sent.extend(rows(1000, 12), write_id="w-12"), torch.from_numpy(first))
    assert rb.write_count == 17 and online_ids(rb).count(1000) == 1


def test_a_write_too_large_for_one_shard_is_relayed_in_pieces_and_its_retry_finishes_it_once(rb, ray_session):
    ray = ray_session
    rb.extend(rows(1000, 20))
    big = rb.extend(rows(2000, 300), write_id="big")  # 300 rows over two shards of 200
    assert len(set(big.tolist())) == 300 and rb.write_count == 320
    assert _handle_stats(rb)["writes_relayed"] == 1
    assert online_ids(rb) == list(range(1000, 1020)) + list(range(2000, 2300))
    assert torch.equal(rb.client().extend(rows(2000, 300), write_id="big"), big)  # answered, not written
    assert rb.write_count == 320
    # a relay cut short (the coordinator died after sending one piece): the shard holds piece 0 only
    data = rb._writer.rows(rows(3000, 300), "rows")
    shard0 = rb.rpc.by_side["online"][0]
    ray.get(shard0.append.remote({k: v[:150] for k, v in data.items()}, "half", 0, 0, None))
    kill_coordinator(rb)
    done = rb.client().extend(rows(3000, 300), write_id="half")  # another handle: it asks the shards first
    assert len(set(done.tolist())) == 300 and online_ids(rb).count(3000) == 1
    assert rb.write_count == 620 and len(rb.online_buffer) == 400  # the shards are full: 620 rows written


def test_rows_a_writer_never_told_are_counted_when_the_coordinator_takes_the_counts_again(rb, ray_session):
    ray = ray_session
    rb.extend(rows(1000, 10))
    shard1 = rb.rpc.by_side["online"][1]
    _unpublished(ray, shard1)
    # a writer that died between its shard's acknowledgement and its tell: the rows are kept, not yet counted
    ray.get(shard1.append.remote(rb._writer.rows(rows(4000, 25), "rows"), "untold", 0, 0, None))
    assert rb.write_count == 10
    kill_coordinator(rb)  # a restart takes every shard's count
    assert rb.write_count == 35 and sorted(online_ids(rb)) == list(range(1000, 1010)) + list(range(4000, 4025))
    later = rb.extend(rows(5000, 10))  # placed after every row, none doubled
    assert rb.write_count == 45 and set(later.tolist()).isdisjoint(range(200, 235))
    assert len(online_ids(rb)) == len(set(online_ids(rb))) == 45


def test_pipelined_writes_appended_here_resolve_at_once_in_order(rb):
    pending = [rb.extend(rows(1000 + 8 * i, 8), wait=False) for i in range(10)]
    assert all(p.done() for p in pending)
    rb.flush()
    got = torch.cat([p.result() for p in pending])
    assert len(set(got.tolist())) == 80 and online_ids(rb) == list(range(1000, 1080))
    sent = rb.client(local_reads=False)
    pending = [sent.extend(rows(2000 + 8 * i, 8), wait=False) for i in range(10)]
    sent.flush()
    assert rb.write_count == 160 and online_ids(rb) == list(range(1000, 1080)) + list(range(2000, 2080))


def test_the_coordinator_refuses_a_write_its_shards_place(rb):
    with pytest.raises(InvalidStateError, match="online shards place its writes"):
        rb.rpc.get(rb.rpc.coord.extend.remote([rb._writer.rows(rows(0, 5), "rows")], 5))


def test_the_coordinator_places_writes_where_a_limiter_admits_them(make_buffer):
    with pytest.raises(InvalidArgumentError, match="write_path='shards' takes no rate limiter"):
        make_buffer(rows(0, 50), **KW, write_path="shards", **coordinator_places())
    with pytest.raises(InvalidArgumentError, match="expected write_path None, 'coordinator' or 'shards', got 'x'"):
        make_buffer(rows(0, 50), **KW, write_path="x")
    assert not make_buffer(rows(0, 50), **KW, **coordinator_places())._writer.shards_place
    rb = make_buffer(rows(0, 50), **KW, write_path="coordinator")
    assert not rb._writer.shards_place
    assert rb.extend(rows(1000, 10)).tolist() == list(range(10)) and rb.write_count == 10


# killed --------------------------------------------------------------------------------------------
def _writer_actor(ray):
    @ray.remote(num_cpus=0, max_restarts=0)
    class Collector:
        def __init__(self, client, log: str):
            self.client, self.log = client, log

        def pid(self) -> int:
            return os.getpid()

        def write(self, start: int, writes: int, n: int) -> None:
            for i in range(writes):
                self.client.extend(rows(start + n * i, n))
                with open(self.log, "a") as f:  # acknowledged: logged once extend returned
                    f.write(f"{start + n * i}\n")

    return Collector


@pytest.mark.parametrize("local", [True, False])
def test_a_writer_killed_mid_stream_keeps_every_acknowledged_write_and_no_other_row_half(
        make_buffer, ray_session, tmp_path, local):
    ray = ray_session
    rb = make_buffer(rows(0, 50), **{**KW, "online_capacity": 4000})
    log = tmp_path / "acked"
    collector = _writer_actor(ray).remote(rb.client(local_reads=local), str(log))
    pid = ray.get(collector.pid.remote())
    running = collector.write.remote(1000, 10_000, 7)
    while not log.exists() or len(log.read_text().split()) < 30:
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(running, timeout=60)
    acked = [int(x) for x in log.read_text().split()]
    rb.extend(rows(100_000, 7))  # the next write repairs whatever the dead one left, and lands whole
    held = online_ids(rb)
    assert len(held) == len(set(held)), "a row held twice"
    starts = {i for i in held if i < 100_000 and (i - 1000) % 7 == 0}
    assert set(acked) <= starts, "an acknowledged write lost"
    assert len(starts - set(acked)) <= 1, "more than the write in flight landed unacknowledged"
    for s in starts:  # each write whole or not at all
        assert all(s + j in held for j in range(7)), f"write {s} half applied"
    assert rb.write_count == len(held) == 7 * len(starts) + 7
    for _ in range(20):  # every row served is whole: its obs is its id
        batch = rb.sample(64)
        assert torch.equal(batch["obs"][:, 0], batch["id"].float())


def test_a_shard_killed_while_writes_go_to_it_takes_each_once(make_buffer, ray_session, tmp_path):
    ray = ray_session
    rb = make_buffer(rows(0, 50), **{**KW, "online_capacity": 4000})
    log = tmp_path / "acked"
    collector = _writer_actor(ray).remote(rb.client(local_reads=False), str(log))
    running = collector.write.remote(1000, 150, 5)
    while not log.exists() or len(log.read_text().split()) < 20:
        time.sleep(0.01)
    kill_and_wait(rb.rpc.by_side["online"][0])
    ray.get(running, timeout=120)  # Ray sends the calls again to the restarted shard: the journal answers
    held = online_ids(rb)
    assert held == list(range(1000, 1000 + 750)) and rb.write_count == 750


def test_writes_go_on_while_the_coordinator_restarts_and_it_counts_them_all(rb, ray_session):
    rb.extend(rows(1000, 10))
    kill_coordinator(rb)
    for i in range(5):
        rb.extend(rows(2000 + 10 * i, 10))
    assert rb.write_count == 60 and online_ids(rb) == list(range(1000, 1010)) + list(range(2000, 2050))
    sizes = rb.sizes()["online"]
    assert sum(sizes) == 60 and abs(sizes[0] - sizes[1]) <= 10


def test_an_append_here_waits_for_a_shard_restarting_on_its_files_and_lands_once(rb, ray_session):
    rb.extend(rows(1000, 10))
    shard = rb.rpc.by_side["online"][0]
    pid = rb.rpc.get(shard.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGKILL)  # its lease is released at once: appends here go to the restarted shard
    for i in range(6):
        rb.extend(rows(2000 + 10 * i, 10))
    assert rb.write_count == 70 and online_ids(rb) == list(range(1000, 1010)) + list(range(2000, 2060))
    assert np.isclose(sum(rb.sizes()["online"]), 70)


def test_writes_named_by_a_writer_killed_mid_stream_are_retried_by_another_handle_and_land_once(
        make_buffer, ray_session, tmp_path):
    ray = ray_session
    rb = make_buffer(rows(0, 50), **{**KW, "online_capacity": 4000})

    @ray.remote(num_cpus=0, max_restarts=0)
    class Named:
        def __init__(self, client, log: str):
            self.client, self.log = client, log

        def pid(self) -> int:
            return os.getpid()

        def write(self, writes: int) -> None:
            for i in range(writes):
                with open(self.log, "a") as f:  # tried: logged before the call
                    f.write(f"{i}\n")
                self.client.extend(rows(1000 + 6 * i, 6), write_id=f"collector-7/{i}")

    log = tmp_path / "tried"
    collector = Named.remote(rb.client(), str(log))
    pid = ray.get(collector.pid.remote())
    collector.write.remote(10_000)
    while not log.exists() or len(log.read_text().split()) < 25:
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    tried = max(int(x) for x in log.read_text().split())
    retry = rb.client()
    for i in range(tried + 1):  # every write it may have sent, again under its id: each lands once
        got = retry.extend(rows(1000 + 6 * i, 6), write_id=f"collector-7/{i}")
        assert len(set(got.tolist())) == 6
    assert online_ids(rb) == list(range(1000, 1000 + 6 * (tried + 1))) and rb.write_count == 6 * (tried + 1)


def test_pipelined_writes_sent_at_the_bound_block_the_caller_and_none_is_dropped(make_buffer, ray_session):
    rb = make_buffer(rows(0, 50), **{**KW, "online_capacity": 4000})
    sent = rb.client(local_reads=False, max_writes_in_flight=2)
    pending = [sent.extend(rows(1000 + 5 * i, 5), wait=False) for i in range(40)]
    assert sum(not p.done() for p in pending) <= 2  # at most the bound on its way: the caller waited for the rest
    sent.flush()
    got = torch.cat([p.result() for p in pending])
    assert len(set(got.tolist())) == 200 and online_ids(rb) == list(range(1000, 1200))
