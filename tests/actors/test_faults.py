"""Acknowledged means kept, failed means unchanged: killed writers and shards, damaged checkpoints, bad calls."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from restart_util import kill_for_good
from tensordict import TensorDict

from rayrb import BufferUnavailableError, OfflineToOnlineReplayBuffer, SampleToInsertRatio

pytestmark = pytest.mark.usefixtures("ray_session")


def offline_rows(n=600):
    return TensorDict({"obs": torch.arange(n, dtype=torch.float32)[:, None].expand(n, 2).contiguous(),
                       "id": torch.arange(n, dtype=torch.int64)}, [n])


def online_rows(start, n):
    ids = torch.arange(start, start + n, dtype=torch.int64)
    return TensorDict({"obs": -ids.float()[:, None].expand(n, 2).contiguous(), "id": 1_000_000 + ids}, [n])




def online_ids(rb, draws=20_000) -> set[int]:
    """The online rows a buffer serves: all of them, for up to 500 rows, but with probability e^-40 per row."""
    rb.offline_fraction = 0.0
    batch = rb.sample(draws)
    return {i - 1_000_000 for i in batch["id"].tolist()}


def retry(fn, seconds=30):
    """Call ``fn`` until it stops raising (a restarting actor), returning its result and the time it took."""
    t0 = time.monotonic()
    while True:
        try:
            return fn(), time.monotonic() - t0
        except Exception:
            if time.monotonic() - t0 > seconds:
                raise
            time.sleep(0.1)


def kill(ray, actor):
    ray.kill(actor, no_restart=False)  # the process dies; Ray restarts the actor


def test_rows_are_kept_when_the_writer_exits_right_after_extend(make_buffer, ray_session):
    ray = ray_session

    @ray.remote(num_cpus=0)
    class Writer:
        def write(self, rb, start, n):
            return rb.extend(online_rows(start, n)).tolist()

    rb = make_buffer(offline_rows(), online_capacity=1000, num_online_shards=1, seed=0, offline_fraction=0.0)
    rb.extend(online_rows(0, 100))
    for k in range(1, 3):
        w = Writer.remote()
        ray.get(w.__ray_ready__.remote())
        busy = [rb.sample_async(200_000) for _ in range(5)]  # the shard is busy when the write reaches it
        assert len(ray.get(w.write.remote(rb.client(), 100 * k, 100))) == 100
        ray.kill(w)  # the owner of the written object is gone at once
        ray.get(busy)
    assert rb.write_count == 300
    assert ray.get(rb.rpc.shards[-1].written.remote()) == 300
    assert online_ids(rb) == set(range(300))


def test_a_killed_online_shard_restarts_with_every_acknowledged_row(make_buffer, ray_session):
    ray = ray_session
    rb = make_buffer(offline_rows(), online_capacity=400, num_online_shards=2, seed=0)
    for k in range(6):
        rb.extend(online_rows(50 * k, 50))
    kill(ray, rb.rpc.shards[1])
    _, recovery = retry(lambda: rb.sample(64))
    rb.extend(online_rows(300, 50))  # writes go on where they left off
    assert rb.write_count == 350
    assert online_ids(rb) == set(range(350))
    assert recovery < 20


@pytest.mark.parametrize("placed_by", ["shards", "coordinator"])
def test_extend_to_a_dead_online_shard_raises_instead_of_returning_indices(make_buffer, ray_session, placed_by):
    # a rate limiter admits each write at the coordinator, which then places it; without one the shards place it
    limiter = {"rate_limiter": SampleToInsertRatio(1.0, 1, (-10_000, 10_000))} if placed_by == "coordinator" else {
        "write_path": "shards"}
    rb = make_buffer(offline_rows(), online_capacity=100, num_online_shards=1, seed=0, storage_dir=None, timeout=30,
                     **limiter)
    assert rb._writer.shards_place is (placed_by == "shards")
    rb.extend(online_rows(0, 10))
    shard = rb.rpc.shards[-1]
    kill_for_good(shard)  # in-memory rows: it does not come back; a write that reached it first would have landed
    # the calls that send a write: the coordinator's extend, or the shards' append
    target, name = (rb.rpc, "call") if placed_by == "coordinator" else (rb._writer._direct, "send")
    real, asks = getattr(target, name), []

    def counted(*args, **kwargs):  # the coordinator's extend, with the rows in the call (extend_parts) or not
        asks.append("extend" if name != "call" or args[0].startswith("extend") else args[0])
        return real(*args, **kwargs)

    setattr(target, name, counted)
    for k in range(3):
        with pytest.raises((BufferUnavailableError, RuntimeError)):
            rb.extend(online_rows(10 + k, 1))
        # a dead shard is not a dead coordinator: the write fails at once instead of asking again (for ~90 s)
        assert asks.count("extend") == k + 1


def test_a_retried_write_with_the_same_id_lands_once(make_buffer):
    rb = make_buffer(offline_rows(), online_capacity=100, seed=0)
    first = rb.extend(online_rows(0, 10), write_id="collector-3/step-17")
    again = rb.extend(online_rows(0, 10), write_id="collector-3/step-17")
    assert torch.equal(first, again) and rb.write_count == 10
    rb.extend(online_rows(10, 10), write_id="collector-3/step-18")
    assert rb.write_count == 20
    rb.extend(online_rows(20, 5), wait=True)  # older callers' keyword: every write waits anyway
    assert rb.write_count == 25


def test_killed_offline_shard_keeps_its_place_in_a_without_replacement_epoch(make_buffer, ray_session):
    ray = ray_session
    rb = make_buffer(offline_rows(120), online_capacity=10, num_offline_shards=3, sampler="without_replacement",
                     offline_fraction=1.0, seed=1)
    seen = rb.sample(30)["id"].tolist() + rb.sample(30)["id"].tolist()
    kill(ray, rb.rpc.shards[0])
    kill(ray, rb.rpc.shards[2])
    rest, _ = retry(lambda: rb.sample(30)["id"].tolist())
    seen += rest + rb.sample(30)["id"].tolist()
    assert sorted(seen) == list(range(120))  # the epoch visits every row exactly once, restart or not


def test_killed_prioritized_shards_keep_their_priorities(make_buffer, ray_session):
    ray = ray_session
    rb = make_buffer(TensorDict({"id": torch.arange(100)}, [100]), online_capacity=50, num_offline_shards=2,
                     sampler="prioritized", alpha=1.0, seed=0, offline_fraction=0.5)
    rb.extend(TensorDict({"id": torch.arange(1000, 1050)}, [50]))
    batch, info = rb.sample(2000, return_info=True)
    hot = (batch["id"] == 7) | (batch["id"] == 1003)
    rb.update_priority(info, torch.where(hot, 50.0, 1.0))
    for shard in rb.rpc.shards:  # both offline shards and the online one
        kill(ray, shard)
    (batch, info), _ = retry(lambda: rb.sample(4000, return_info=True))
    off = batch["id"][info["offline"]]
    on = batch["id"][~info["offline"]]
    assert abs(float((off == 7).float().mean()) - 50 / 149) < 0.05  # priorities survived the restart
    assert abs(float((on == 1003).float().mean()) - 50 / 99) < 0.05


def test_checkpoint_resumes_a_without_replacement_epoch(make_buffer, tmp_path):
    kw = dict(num_offline_shards=2, online_capacity=10, sampler="without_replacement", offline_fraction=1.0,
              seed=3)
    a = make_buffer(offline_rows(100), **kw)
    served = a.sample(40)["id"].tolist()
    a.dumps(tmp_path / "ckpt")
    rest = a.sample(30)["id"].tolist() + a.sample(30)["id"].tolist()
    b = make_buffer(offline_rows(100), **kw)
    b.loads(tmp_path / "ckpt")
    got = b.sample(30)["id"].tolist() + b.sample(30)["id"].tolist()
    assert got == rest and sorted(served + got) == list(range(100))


def test_a_damaged_checkpoint_is_refused_and_changes_nothing(make_buffer, tmp_path):
    kw = dict(online_capacity=100, num_online_shards=2, seed=2)
    a = make_buffer(offline_rows(), **kw)
    a.extend(online_rows(0, 80))
    a.dumps(tmp_path / "ckpt")
    b = make_buffer(offline_rows(), **kw)
    b.extend(online_rows(500, 10))
    before_sizes, before_state = b.sizes(), b.state_dict()
    name = next(n for n in json.loads((tmp_path / "ckpt" / "buffer.json").read_text())["files"]
                if n.endswith("/shard-2.npz"))
    shard_file = tmp_path / "ckpt" / name
    shard_file.write_bytes(shard_file.read_bytes()[:-100])  # truncated
    with pytest.raises(ValueError, match="shard-2.npz is damaged"):
        b.loads(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "buffer.json").write_text("{\"format\": ")
    with pytest.raises(ValueError, match="not valid JSON"):
        b.loads(tmp_path / "ckpt")
    assert b.sizes() == before_sizes and b.state_dict() == before_state
    assert online_ids(b) == set(range(500, 510))
    b.extend(online_rows(510, 5))  # writes still go where the rows are
    assert online_ids(b) == set(range(500, 515))


def test_loads_refuses_another_sampler_or_dataset(make_buffer, tmp_path):
    a = make_buffer(offline_rows(), online_capacity=100, seed=0)
    a.extend(online_rows(0, 5))
    a.dumps(tmp_path / "ckpt")
    prio = make_buffer(offline_rows(), online_capacity=100, seed=0, sampler="prioritized")
    with pytest.raises(ValueError, match="sampler 'uniform' vs 'prioritized'"):
        prio.loads(tmp_path / "ckpt")
    other = offline_rows()
    other["id"] = other["id"] + 1  # same spec, other rows
    c = make_buffer(other, online_capacity=100, seed=0)
    with pytest.raises(ValueError, match="offline dataset"):
        c.loads(tmp_path / "ckpt")
    assert prio.write_count == 0 and c.write_count == 0



def test_loads_refuses_other_priority_exponents_or_another_rate_limiter_and_changes_nothing(make_buffer, tmp_path):
    """A checkpoint holds priorities as p = (|priority| + eps)^alpha and the limiter's counters under its config:
    loaded into a buffer with another alpha or eps, two rows of equal priority would get different odds; with
    another rate limiter, flow control would change without a word. Both are refused, naming the difference."""
    kw = dict(online_capacity=20, seed=0, sampler="prioritized", offline_fraction=0.5)
    a = make_buffer(offline_rows(100), **kw, alpha=1.0)
    a.extend(online_rows(0, 8))
    _, info = a.sample(16, return_info=True)
    a.update_priority(info, torch.full((16,), 9.0))
    a.dumps(tmp_path / "ckpt")
    other_alpha = make_buffer(offline_rows(100), **kw, alpha=0.5)
    with pytest.raises(ValueError, match=r"alpha 1.0 vs 0.5"):
        other_alpha.loads(tmp_path / "ckpt")
    other_eps = make_buffer(offline_rows(100), **kw, alpha=1.0, eps=1e-3)
    with pytest.raises(ValueError, match=r"eps 1e-08 vs 0.001"):
        other_eps.loads(tmp_path / "ckpt")
    limited = make_buffer(offline_rows(100), **kw, alpha=1.0, rate_limiter=SampleToInsertRatio(1.0, 10, 50.0))
    before = limited.state_dict()
    with pytest.raises(ValueError, match=r"rate limiter .*samples_per_insert.*None.*vs.*1.0"):
        limited.loads(tmp_path / "ckpt")
    assert limited.state_dict() == before and limited.write_count == 0
    assert other_alpha.write_count == other_eps.write_count == 0
    same = make_buffer(offline_rows(100), **kw, alpha=1.0)
    same.loads(tmp_path / "ckpt")  # the same settings: taken
    assert same.write_count == 8

def test_checkpoint_is_written_whole_with_its_manifest_last(make_buffer, tmp_path):
    rb = make_buffer(offline_rows(), online_capacity=100, seed=0)
    rb.extend(online_rows(0, 5))
    rb.dumps(tmp_path / "ckpt")
    rb.extend(online_rows(5, 5))
    rb.dumps(tmp_path / "ckpt")  # replaces the first one whole
    meta = json.loads((tmp_path / "ckpt" / "buffer.json").read_text())
    assert sum(meta["sizes"]["online_written"]) == 10
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt")) == []  # no temporaries left


def test_a_refused_priority_update_changes_nothing(make_buffer):
    kw = dict(online_capacity=10, num_offline_shards=2, sampler="prioritized", seed=4, offline_fraction=1.0)
    a = make_buffer(offline_rows(100), **kw)
    b = make_buffer(offline_rows(100), **kw)
    _, info = a.sample(50, return_info=True)
    b.sample(50, return_info=True)
    bad = dict(info)
    bad["shard"] = info["shard"].clone()
    bad["shard"][-1] = 7  # one row names a shard that does not exist
    with pytest.raises(ValueError, match="no offline shard 7"):
        a.update_priority(bad, torch.full((50,), 30.0))
    out_of_range = dict(info)
    out_of_range["index"] = info["index"].clone()
    out_of_range["index"][0] = 10_000
    with pytest.raises(IndexError, match="got index 10000"):
        a.update_priority(out_of_range, torch.full((50,), 30.0))
    with pytest.raises(ValueError, match="finite"):
        a.update_priority(info, torch.full((50,), float("nan")))
    assert torch.equal(a.sample(200)["id"], b.sample(200)["id"])  # no shard's masses moved


def test_an_oversized_batch_is_refused_before_the_stream_moves(make_buffer):
    a = make_buffer(offline_rows(), online_capacity=10, seed=5)
    b = make_buffer(offline_rows(), online_capacity=10, seed=5)
    with pytest.raises(ValueError, match="max_batch_bytes"):
        a.sample(10**12)
    with pytest.raises(ValueError, match="max_batch_bytes"):
        list(a.iter_batches(10**12, num_batches=1))
    assert torch.equal(a.sample(64)["id"], b.sample(64)["id"])


def test_small_input_gaps_are_closed(make_buffer, tmp_path):
    rb = make_buffer(offline_rows(), online_capacity=10, seed=0)
    with pytest.raises(ValueError, match="step must be a non-negative integer, got 2.5"):
        rb.set_step(2.5)
    with pytest.raises(ValueError, match="beta must be a finite number"):
        OfflineToOnlineReplayBuffer(offline_rows(), online_capacity=10, beta=float("inf"),
                                    dataset_root=tmp_path / "x")
    # TorchRL's extend takes a list: of batches (concatenated) or of rows (stacked), checked whole first
    with pytest.raises(TypeError, match="a list of rows or a list of batches .* got both"):
        rb.extend([online_rows(0, 2), online_rows(2, 1)[0]])
    with pytest.raises(ValueError, match="the same keys in every item"):
        rb.extend([online_rows(0, 1)[0], online_rows(1, 1)[0].exclude("obs")])
    assert rb.write_count == 0 and rb.extend([online_rows(0, 2), online_rows(2, 2)]).tolist() == [0, 1, 2, 3]
    assert rb.extend([online_rows(4, 1)[0], online_rows(5, 1)[0]]).tolist() == [4, 5] and not rb.extend([]).numel()
    it = rb.iter_batches(8, prefetch=4)
    next(it)
    rb.shutdown()
    with pytest.raises(BufferUnavailableError, match="shut down"):
        next(it)  # prefetched batches are not handed out after shutdown


def test_a_client_handle_cannot_shut_the_buffer_down(make_buffer, ray_session):
    import pickle

    rb = make_buffer(offline_rows(), online_capacity=10, seed=0)
    handle = pickle.loads(pickle.dumps(rb))
    assert not isinstance(handle, OfflineToOnlineReplayBuffer)
    handle.shutdown()  # closes the handle only
    with pytest.raises(BufferUnavailableError):
        handle.sample(4)
    assert rb.sample(4).batch_size[0] == 4
    assert rb.client().sample(4).batch_size[0] == 4



def test_malformed_arguments_are_refused_by_name_and_change_nothing(make_buffer, tmp_path):
    """Each is refused at the handle, naming the argument, what was expected and what came; nothing is written,
    drawn or set."""
    kw = dict(online_capacity=20, num_offline_shards=2, sampler="prioritized", seed=3, offline_fraction=0.5,
              rate_limiter=SampleToInsertRatio(1.0, 1, (-10_000, 10)))
    a = make_buffer(offline_rows(100), **kw)
    twin = make_buffer(offline_rows(100), **kw)
    for rb in (a, twin):
        rb.extend(online_rows(0, 8))
    with pytest.raises(TypeError, match=r"write_id must be a string.*got list"):
        a.extend(online_rows(8, 2), write_id=["w"])
    with pytest.raises(TypeError, match=r"prefill must be True or False, got 'false'"):
        a.extend(online_rows(8, 50), prefill="false")  # a truthy string would write past the rate limiter
    with pytest.raises(TypeError, match=r"online data.*TensorDict or a dict.*got NoneType"):
        a.extend(None)
    with pytest.raises(ValueError, match=r"'cosine' schedule.*'stpes'.*expected"):
        a.offline_fraction = {"kind": "cosine", "start": 1.0, "end": 0.0, "stpes": 10}
    with pytest.raises(ValueError, match=r"'cosine' schedule.*'stpes'"):
        make_buffer(offline_rows(100), online_capacity=20, offline_fraction={"kind": "cosine", "stpes": 10},
                    dataset_root=tmp_path / "never")
    _, info = a.sample(16, return_info=True)
    twin.sample(16, return_info=True)
    floats = dict(info, index=info["index"].double() + 0.5)
    with pytest.raises(ValueError, match=r"index must hold integers, got .*45.5|index must hold integers"):
        a.update_priority(floats, torch.full((16,), 5.0))
    flags = dict(info, offline=info["offline"].long() * 3)
    with pytest.raises(ValueError, match=r"offline must hold booleans.*got 3"):
        a.update_priority(flags, torch.full((16,), 5.0))
    assert a.write_count == twin.write_count == 8 and a.offline_fraction == 0.5
    assert torch.equal(a.sample(64)["id"], twin.sample(64)["id"])  # no row, priority or draw moved

def fails_on_chunk_one(td):
    if float(td["obs"][0, 0]) >= 100:
        raise ValueError("bad row")
    return td


def doubles(td):
    td["obs"] = td["obs"] * 2
    return td


def test_a_failed_preprocess_leaves_the_cluster_able_to_run_the_next(tmp_path):
    from rayrb import PreprocessError, preprocess

    src = tmp_path / "src"
    from rayrb.io.arrays import to_numpy_dict
    from rayrb.io.chunks import write_dataset

    write_dataset(to_numpy_dict(offline_rows(400)), src, chunk_rows=100)
    for attempt in range(2):
        with pytest.raises(PreprocessError, match="bad row"):
            preprocess(str(src), fails_on_chunk_one, tmp_path / f"bad{attempt}", batched=True, pbar=False,
                       num_workers=2)
        out = preprocess(str(src), doubles, tmp_path / f"good{attempt}", batched=True, pbar=False, num_workers=2)
        assert len(out) == 400 and float(out.gather(np.array([3]))["obs"][0, 0]) == 6.0


def test_a_checkpoint_restores_onto_another_shard_layout(make_buffer, tmp_path):
    a = make_buffer(TensorDict({"id": torch.arange(100)}, [100]), online_capacity=400, num_offline_shards=2,
                    num_online_shards=4, sampler="prioritized", alpha=1.0, seed=0)
    a.extend(TensorDict({"id": torch.arange(1000, 1300)}, [300]))
    batch, info = a.sample(3000, return_info=True)
    a.update_priority(info, torch.where((batch["id"] == 3) | (batch["id"] == 1005), 40.0, 1.0))
    a.dumps(tmp_path / "ckpt")
    b = make_buffer(TensorDict({"id": torch.arange(100)}, [100]), online_capacity=400, num_offline_shards=3,
                    num_online_shards=2, sampler="prioritized", alpha=1.0, seed=0)
    b.loads(tmp_path / "ckpt")
    assert len(b) == 400 and b.sizes()["online"] == [150, 150]
    b.offline_fraction = 0.5
    batch, info = b.sample(20_000, return_info=True)
    on = batch["id"][~info["offline"]]
    off = batch["id"][info["offline"]]
    assert set(on.tolist()) == set(range(1000, 1300))  # the same rows
    assert abs(float((on == 1005).float().mean()) - 40 / 339) < 0.02  # with their priorities
    assert abs(float((off == 3).float().mean()) - 40 / 139) < 0.02


def test_a_write_that_timed_out_names_itself_and_its_retry_lands_once(make_buffer, ray_session):
    from rayrb import WriteTimeoutError

    ray = ray_session
    rb = make_buffer(offline_rows(), online_capacity=100, seed=0, timeout=1.0)
    stall = rb.rpc.coord.__ray_call__.remote(lambda self: time.sleep(3))  # the coordinator is busy for 3 s
    with pytest.raises(WriteTimeoutError) as e:
        rb.extend(online_rows(0, 10))
    ray.get(stall)
    assert e.value.write_id
    retried = rb.extend(online_rows(0, 10), write_id=e.value.write_id)  # the first try landed meanwhile
    assert rb.write_count == 10 and len(retried) == 10
    assert online_ids(rb) == set(range(10))
