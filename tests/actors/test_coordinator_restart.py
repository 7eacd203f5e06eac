"""A killed coordinator comes back with its stream, settings and write counts (contract 9)."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from restart_util import coordinator_places, kill_coordinator, online_ids, read_group, rows

from rayrb.core.allocation import offline_count

pytestmark = pytest.mark.usefixtures("ray_session")

KW = {"online_capacity": 200, "num_offline_shards": 2, "num_online_shards": 2, "seed": 7, "batch_size": 16,
      "prefetch": 0}


@pytest.mark.parametrize("sampler", ["uniform", "without_replacement", "prioritized"])
def test_a_killed_coordinator_comes_back_where_the_stream_was(make_buffer, sampler):
    a, b = (make_buffer(rows(0, 300), **KW, sampler=sampler) for _ in range(2))
    for rb in (a, b):
        rb.extend(rows(1000, 100))
        rb.offline_fraction = 0.25
    for i in range(25):
        if i == 5:
            kill_coordinator(a)
        (x, ix), (y, iy) = (rb.sample(return_info=True) for rb in (a, b))
        assert torch.equal(x["id"], y["id"]), i
        assert torch.equal(ix["offline"], iy["offline"])
        assert int(ix["offline"].sum()) == offline_count(len(x), 0.25)  # the setting made before the crash holds
    assert a.stats()["coordinator"]["restarts"] == 1


def test_writes_after_a_restart_go_after_every_acknowledged_row(make_buffer):
    rb = make_buffer(rows(0, 50), **KW)
    first = rb.extend(rows(1000, 60))
    kill_coordinator(rb)
    assert rb.write_count == 60 and len(rb) == 50 + 60
    second = rb.extend(rows(2000, 60))
    assert set(first.tolist()).isdisjoint(second.tolist())
    rb.offline_fraction = 0.0
    seen = set(torch.cat([rb.sample(64)["id"] for _ in range(40)]).tolist())
    assert seen == set(range(1000, 1060)) | set(range(2000, 2060))


def test_a_write_retried_after_a_restart_lands_once(make_buffer):
    rb = make_buffer(rows(0, 50), **KW)
    indices = rb.extend(rows(1000, 30), write_id="collector-1/step-1")
    kill_coordinator(rb)
    again = rb.extend(rows(1000, 30), write_id="collector-1/step-1")
    assert torch.equal(again, indices) and rb.write_count == 30


def test_an_epoch_without_replacement_serves_every_row_once_across_a_restart(make_buffer):
    # the handle holds a few batches drawn ahead when the coordinator dies, and draws the rest after
    rb = make_buffer(rows(0, 320), online_capacity=10, seed=1, batch_size=32, sampler="without_replacement",
                     prefetch=2)
    got = [rb.sample()["id"] for _ in range(4)]
    kill_coordinator(rb)
    got += [rb.sample()["id"] for _ in range(6)]
    assert sorted(torch.cat(got).tolist()) == list(range(320))


def test_writers_that_retry_through_a_restart_land_every_row_once(make_buffer):
    rb = make_buffer(rows(0, 50), **{**KW, "online_capacity": 4000})
    writer = rb.client()
    done, errors = [], []

    def write():
        for i in range(60):
            for _ in range(50):  # a failed call is retried with its write_id until it is acknowledged
                try:
                    writer.extend(rows(10_000 + 40 * i, 40), write_id=f"w{i}")
                    done.append(i)
                    break
                except Exception as e:  # the coordinator is restarting
                    errors.append(type(e).__name__)
                    time.sleep(0.05)

    t = threading.Thread(target=write)
    t.start()
    time.sleep(0.3)
    kill_coordinator(rb)
    t.join(timeout=120)
    assert sorted(done) == list(range(60))
    assert rb.write_count == 60 * 40  # each write once, retried or not
    rb.offline_fraction = 0.0
    ids = torch.cat([rb.sample(400)["id"] for _ in range(60)])
    assert set(ids.tolist()) == set(range(10_000, 10_000 + 2400))


def test_a_shut_down_buffer_leaves_no_state_at_all(make_buffer, tmp_path):
    """Every actor's directory goes at shutdown, its restart record and lease included (a uniform offline shard
    keeps no priorities, but its record and lease are there all the same), and nothing makes them again."""
    rb = make_buffer(rows(0, 50), **KW)
    rb.extend(rows(1000, 10))
    state = list((tmp_path / "state").rglob("coordinator"))
    assert state and (state[0] / "state.1").exists() and any((tmp_path / "state").rglob("lease"))
    rb.shutdown()
    assert list((tmp_path / "state").iterdir()) == []


def test_rows_planned_by_a_coordinator_that_died_are_read_again_from_the_shards(make_buffer):
    import numpy as np
    import ray

    a, b = (make_buffer(rows(0, 300), **KW) for _ in range(2))
    for rb in (a, b):
        rb.extend(rows(1000, 100))
    ga, gb = (ray.get(rb.rpc.coord.plan.remote(16, 3)) for rb in (a, b))
    kill_coordinator(a)  # the owner of ga's reads is gone with their rows
    def same(x, y):
        if isinstance(x, dict):
            assert x.keys() == y.keys()
            for k in x:
                same(x[k], y[k])
        elif isinstance(x, (tuple, list)):
            assert len(x) == len(y)
            for u, v in zip(x, y):
                same(u, v)
        else:
            np.testing.assert_array_equal(x, y)

    same(read_group(a, ga), read_group(b, gb))



def test_closing_an_iterator_after_a_restart_takes_back_only_what_it_did_not_serve(make_buffer, monkeypatch):
    """The restarted coordinator numbers draws on from its saved log: the iterator's reports of what it served
    after the restart are understood, and closing it gives back only the batches it never handed over. The rest
    of the epoch then serves every row once. (Plans of four batches, so that the iterator draws after the
    restart: draws made before it stand, and a closed iterator drops those.)"""
    monkeypatch.setattr("rayrb.handle.stream.PLAN_ROWS", 64)
    rb = make_buffer(rows(0, 320), online_capacity=10, seed=1, batch_size=16, sampler="without_replacement",
                     offline_fraction=1.0, prefetch=0)
    it = rb.iter_batches(prefetch=8)
    got = [next(it)["id"] for _ in range(3)]
    kill_coordinator(rb)
    got += [next(it)["id"] for _ in range(9)]  # past what was drawn before the crash
    it.close()
    served = torch.cat(got).tolist()
    rest = torch.cat([rb.sample()["id"] for _ in range((320 - len(served)) // 16)]).tolist()
    twice = len(served) + len(rest) - len(set(served + rest))
    assert twice == 0, f"{twice} rows of the epoch were served twice"
    assert sorted(served + rest) == list(range(320))


def test_an_iterators_draws_that_stood_through_a_restart_are_served_by_the_next_caller(make_buffer):
    """Planned deep before the crash, the iterator's draws stand after it; closed, it hands back those it never
    served, and without replacement the next caller serves them: the epoch serves every row once."""
    rb = make_buffer(rows(0, 320), online_capacity=10, seed=1, batch_size=16, sampler="without_replacement",
                     offline_fraction=1.0, prefetch=0)
    it = rb.iter_batches(prefetch=8)
    got = [next(it)["id"] for _ in range(3)]
    kill_coordinator(rb)
    got += [next(it)["id"] for _ in range(9)]
    it.close()
    served = torch.cat(got).tolist()
    rest = torch.cat([rb.sample()["id"] for _ in range((320 - len(served)) // 16)]).tolist()
    assert sorted(served + rest) == list(range(320))
    assert rb.stats()["coordinator"]["batches_adopted"] > 0

def test_draws_held_ahead_through_a_restart_and_given_back_after_it_stop_counting_as_sampled(make_buffer):
    """A sample() loop holds batches drawn ahead when the coordinator dies; its next write gives them back to the
    restarted coordinator, which finds them in its saved log: the rate limiter counts the online rows served."""
    from rayrb import SampleToInsertRatio

    rb = make_buffer(rows(0, 300), **{**KW, "prefetch": 8}, rate_limiter=SampleToInsertRatio(1.0, 1, (-10_000, 10_000)))
    rb.extend(rows(1000, 100))
    served = sum(int((~info["offline"]).sum()) for _, info in (rb.sample(return_info=True) for _ in range(4)))
    assert rb._sampling.stream.ahead > 0  # batches drawn ahead and held
    kill_coordinator(rb)
    rb.extend(rows(2000, 10))  # gives back what the loop held
    samples = rb.stats()["coordinator"]["rate_limiter"]["samples"]
    assert samples == served, f"the limiter counts {samples} online rows sampled; the handle served {served}"

def test_an_iterator_goes_on_through_a_restart_with_exact_batches(make_buffer):
    rb = make_buffer(rows(0, 300), **{**KW, "prefetch": 8})
    rb.extend(rows(1000, 150))
    rb.offline_fraction = 0.5
    it = rb.iter_batches(prefetch=8, return_info=True)
    for i in range(30):
        if i == 5:
            kill_coordinator(rb)  # groups asked for, planned or being read are in flight
        batch, info = next(it)
        assert len(batch) == 16 and int(info["offline"].sum()) == 8, i
        assert torch.equal(info["offline"], batch["id"] < 1000)


@pytest.mark.parametrize("placed_by", ["shards", "coordinator"])
def test_a_state_save_that_fails_does_not_fail_the_call_that_changed_the_state(make_buffer, tmp_path, placed_by):
    rb = make_buffer(rows(0, 50), **KW, **(coordinator_places() if placed_by == "coordinator" else
                                           {"write_path": "shards"}))
    directory = next((tmp_path / "state").rglob("coordinator"))
    for slot in (directory / "state.0", directory / "state.1"):
        slot.unlink(missing_ok=True)
        slot.mkdir()  # a save into it now fails, as on a broken disk
        (slot / "blocker").write_text("x")
    indices = rb.extend(rows(1000, 20))  # sent to the shards: it must be reported as done
    assert len(indices) == 20 and rb.write_count == 20
    assert len(rb.sample()) == 16
    # the coordinator saves the draws, and the writes it placed (shards that place them journal them themselves)
    assert rb.stats()["coordinator"]["state_save_failed"] >= (2 if placed_by == "coordinator" else 1)


def _half_sent_write(rb, tmp_path, write_id, data):
    """What a coordinator that died between sending the pieces of a write leaves: the write journalled,
    the first piece on shard 0, the second never sent (shard 1 gets nothing)."""
    import ray

    pass
    from rayrb.durability.coordinator_state import CoordinatorState

    arrays = rb._writer.rows(data, "online data")
    n = len(data)
    online = rb.rpc.by_side["online"]
    ray.get(online[0].extend.remote(ray.put(arrays), 0, n // 2, first=0))
    journal = CoordinatorState(next((tmp_path / "state").rglob("coordinator")))
    journal.journal(write_id, [(0, 0, n // 2, 0), (1, n // 2, n, 0)])
    kill_coordinator(rb)


def test_a_write_half_sent_by_a_coordinator_that_died_is_finished_once(make_buffer, tmp_path):
    rb = make_buffer(rows(0, 50), **KW, **coordinator_places())  # two online shards of 100 rows: 150 rows go in two pieces
    _half_sent_write(rb, tmp_path, "collector-1/step-7", rows(1000, 150))
    assert len(rb) == 50 + 75  # the piece shard 0 got is there; the other is not
    indices = rb.extend(rows(1000, 150), write_id="collector-1/step-7")  # the writer's retry
    assert indices.tolist() == list(range(75)) + list(range(100, 175))  # the held piece keeps its place
    assert rb.write_count == 150 and len(rb) == 50 + 150
    assert online_ids(rb) == list(range(1000, 1150))  # every row once
    again = rb.extend(rows(1000, 150), write_id="collector-1/step-7")
    assert torch.equal(again, indices) and online_ids(rb) == list(range(1000, 1150))


def test_a_half_sent_write_whose_place_was_taken_lands_its_missing_piece_elsewhere(make_buffer, tmp_path):
    rb = make_buffer(rows(0, 50), **KW, **coordinator_places())
    _half_sent_write(rb, tmp_path, "w", rows(1000, 150))
    other = rb.extend(rows(5000, 20))  # another writer's rows take shard 1's next slots
    assert other.tolist() == list(range(100, 120))
    indices = rb.extend(rows(1000, 150), write_id="w")
    assert indices[:75].tolist() == list(range(75)) and set(indices[75:].tolist()).isdisjoint(other.tolist())
    assert len(set(indices.tolist())) == 150 and rb.write_count == 170
    assert online_ids(rb) == list(range(1000, 1150)) + list(range(5000, 5020))


def test_a_sample_call_whose_reply_died_with_the_coordinator_gets_the_same_batch_again(make_buffer):
    """Ray re-sends a call whose reply was lost with the process; the restarted coordinator, which had saved
    that draw already, answers it with the same batch, and the stream goes on as a never-killed twin's."""
    import ray

    from rayrb.core.plans import assemble, split_group

    def batch_of(rb, group):
        return [assemble(plan, parts, True)[0]["id"].tolist() for plan, parts in split_group(group, read_group(rb, group))]

    a, b = (make_buffer(rows(0, 300), **KW) for _ in range(2))
    for rb in (a, b):
        rb.extend(rows(1000, 100))
    for _ in range(3):
        assert torch.equal(a.sample()["id"], b.sample()["id"])
    call = "learner-0/call-41"
    first = batch_of(a, ray.get(a.rpc.coord.plan.remote(16, 2, call=call)))  # answered and saved ...
    twin = batch_of(b, ray.get(b.rpc.coord.plan.remote(16, 2)))
    assert first == twin
    kill_coordinator(a)  # ... then the process died before its reply got out: Ray sends the call again
    again = batch_of(a, ray.get(a.rpc.coord.plan.remote(16, 2, call=call)))
    assert again == first
    assert a.stats()["coordinator"]["calls_answered_again"] == 1
    for i in range(5):  # nothing skipped
        assert torch.equal(a.sample()["id"], b.sample()["id"]), i


def test_calls_re_sent_after_a_restart_get_their_answers_behind_many_new_calls(make_buffer):
    """Eight handles' calls were answered and saved, then the coordinator died before their replies got out. Ray
    re-sends them to the restarted process, in any order among the calls other handles queued meanwhile: here
    twelve new ones first, more than the answers it keeps. Each re-sent call still gets its first answer, and the
    new calls get the batches the stream goes on with."""
    import ray

    a, b = (make_buffer(rows(0, 300), **KW) for _ in range(2))
    for rb in (a, b):
        rb.extend(rows(1000, 100))
    first = [ray.get(a.rpc.coord.plan.remote(16, 2, call=f"learner-{i}/call-1")) for i in range(8)]
    twin = [ray.get(b.rpc.coord.plan.remote(16, 2)) for _ in range(8 + 12)]
    assert first == twin[:8]
    kill_coordinator(a)
    new = [ray.get(a.rpc.coord.plan.remote(16, 2, call=f"learner-{8 + i}/call-1")) for i in range(12)]
    again = [ray.get(a.rpc.coord.plan.remote(16, 2, call=f"learner-{i}/call-1")) for i in reversed(range(8))]
    assert again[::-1] == first  # answered from what was saved, not planned anew
    # the re-sent calls drew nothing: the stream went on as the twin's (the restart bumped the version)
    assert [(g.plans, g.reads, g.args) for g in new] == [(g.plans, g.reads, g.args) for g in twin[8:]]
    assert a.stats()["coordinator"]["calls_answered_again"] == 8


@pytest.mark.parametrize("sampler", ["uniform", "without_replacement"])
def test_a_coordinator_killed_while_sampling_goes_on_with_the_twins_stream(make_buffer, sampler):
    """A kill that does not wait for the restart lands between or during calls: the calls Ray re-sends give
    the stream with no batch skipped or repeated. (The narrow window after a call's save and before its reply
    is hit on purpose by the test above.)"""
    import ray

    a, b = (make_buffer(rows(0, 300), **KW, sampler=sampler) for _ in range(2))
    for rb in (a, b):
        rb.extend(rows(1000, 100))
    want = [b.sample()["id"] for _ in range(60)]
    got, killer = [], threading.Timer(0.05, lambda: ray.kill(a.rpc.coord, no_restart=False))
    for i in range(60):
        if i == 8:
            killer.start()
        got.append(a.sample()["id"])
    killer.join()
    assert a.stats()["coordinator"]["restarts"] == 1
    for i, (x, y) in enumerate(zip(got, want)):
        assert torch.equal(x, y), i


def test_a_save_torn_by_the_crash_restarts_from_the_save_before_it(make_buffer, tmp_path):
    """A crash in the middle of writing the state leaves that save torn; the restart loads the one before,
    as if the crash had come just before the last call's save: that call's batch is drawn again, and the
    stream goes on as a never-killed twin's."""
    a, b = (make_buffer(rows(0, 300), **KW) for _ in range(2))
    for rb in (a, b):
        rb.extend(rows(1000, 100))
    want = [b.sample()["id"] for _ in range(8)]
    for i in range(4):
        assert torch.equal(a.sample()["id"], want[i])
    (directory,) = (d for d in (tmp_path / "state").rglob("coordinator") if d.parent.name.startswith(a._name))
    newest = max(directory.glob("state.*"), key=lambda p: p.stat().st_mtime_ns)  # saved after the 4th sample
    raw = bytearray(newest.read_bytes())
    raw[-5:] = bytes(5)  # torn at the end of its payload
    newest.write_bytes(bytes(raw))
    kill_coordinator(a)
    for i in range(3, 8):
        assert torch.equal(a.sample()["id"], want[i]), i


def test_a_call_answered_again_after_writes_reads_the_rows_it_was_planned_over(make_buffer):
    """Rows written between the first answer and the re-sent call do not change the batch: the shards draw
    over the rows they held when it was planned (the online side is not full here, so none was overwritten)."""
    import ray

    from rayrb.core.plans import assemble, split_group

    def ids(rb, group):
        return [assemble(plan, parts, True)[0]["id"].tolist() for plan, parts in split_group(group, read_group(rb, group))]

    rb = make_buffer(rows(0, 300), **{**KW, "online_capacity": 2000})
    rb.extend(rows(1000, 100))
    rb.extend(rows(1100, 100))  # 100 rows in each online shard
    rb.offline_fraction = 0.5
    first = ids(rb, ray.get(rb.rpc.coord.plan.remote(16, 3, call="c1")))
    assert any(i >= 1000 for batch in first for i in batch)  # online rows are in it
    rb.extend(rows(5000, 800))
    rb.extend(rows(6000, 800))  # each online shard grows from 100 to 900 rows
    assert rb.sizes()["online"] == [900, 900]
    kill_coordinator(rb)
    again = ids(rb, ray.get(rb.rpc.coord.plan.remote(16, 3, call="c1")))
    assert again == first
