"""The sharded buffer on the session's Ray: exact splits, provenance, writers, errors."""
from __future__ import annotations

import time

import pytest
import torch
from restart_util import kill_for_good
from tensordict import TensorDict

from rayrb import BufferUnavailableError, OfflineToOnlineReplayBuffer, SchemaError, prefill_replay_buffer
from rayrb.core.allocation import offline_count

pytestmark = pytest.mark.usefixtures("ray_session")


def offline_rows(n=600, dim=3):
    return TensorDict({"obs": torch.arange(n * dim, dtype=torch.float32).reshape(n, dim),
                       "id": torch.arange(n, dtype=torch.int64)}, [n])


def online_rows(start, n, dim=3):
    ids = torch.arange(start, start + n, dtype=torch.int64)
    return TensorDict({"obs": -ids.float()[:, None].expand(n, dim).contiguous(), "id": 1_000_000 + ids}, [n])




def test_every_batch_has_exactly_n_off_offline_rows(make_buffer):
    rb = make_buffer(offline_rows(), online_capacity=300, num_offline_shards=3, num_online_shards=2, seed=0)
    rb.extend(online_rows(0, 200))
    for f in (0.0, 0.25, 0.5, 0.7, 1.0):
        rb.offline_fraction = f
        for B in (1, 2, 3, 7, 31, 64, 100):
            batch, info = rb.sample(B, return_info=True)
            n_off = offline_count(B, f)
            assert batch.batch_size == torch.Size([B])
            assert int(info["offline"].sum()) == n_off, (f, B)
            # provenance agrees with the data: offline ids are < 1e6, online ids are >= 1e6
            assert torch.equal(info["offline"], batch["id"] < 1_000_000)
            # and the recorded shard/index point at the row
            off_ids = batch["id"][info["offline"]]
            assert torch.equal(off_ids, info["shard"][info["offline"]] * 200 + info["index"][info["offline"]])


def test_all_offline_while_online_is_empty(make_buffer):
    rb = make_buffer(offline_rows(), online_capacity=10, offline_fraction=0.0, seed=1)
    batch, info = rb.sample(16, return_info=True)
    assert bool(info["offline"].all())
    rb.extend(online_rows(0, 5))
    batch, info = rb.sample(16, return_info=True)
    assert not bool(info["offline"].any())  # fraction 0: all online once there is online data


def test_docstring_example_of_torchrl_runs_unchanged_but_the_import():
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    offline = ReplayBuffer(storage=LazyTensorStorage(1000))
    _ = offline.extend(TensorDict({"observation": torch.randn(1000, 4)}, [1000]))
    rb = OfflineToOnlineReplayBuffer(
        offline_dataset=offline,
        online_capacity=500,
        offline_fraction=0.5,
        batch_size=32,
    )
    try:
        _ = rb.extend(TensorDict({"observation": torch.randn(10, 4)}, [10]))
        assert rb.sample(32).batch_size == torch.Size([32])
    finally:
        rb.shutdown()


def test_index_bookkeeping_key_never_breaks_concatenation(make_buffer):
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    source = TensorDictReplayBuffer(storage=LazyTensorStorage(100))
    source.extend(offline_rows(100))
    rb = make_buffer(source, online_capacity=50, seed=0)
    sampled = source.sample(8)  # TorchRL adds an "index" key
    assert "index" in sampled.keys()
    rb.extend(sampled)
    batch = rb.sample(16)
    assert set(batch.keys()) == {"obs", "id"}


def test_same_seed_same_stream(make_buffer):
    def stream(seed):
        rb = make_buffer(offline_rows(), online_capacity=100, num_offline_shards=3, num_online_shards=2, seed=seed)
        rb.extend(online_rows(0, 80))
        out = [rb.sample(33)["id"].clone() for _ in range(5)]
        rb.shutdown()
        return torch.stack(out)

    a, b, c = stream(7), stream(7), stream(8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_eviction_is_fifo_per_shard(make_buffer):
    rb = make_buffer(offline_rows(), online_capacity=10, num_online_shards=2, offline_fraction=0.0, seed=0)
    history: dict[int, list[int]] = {}  # global online slot -> ids written there, in order
    for start in range(0, 31, 3):  # 33 rows through 2 shards of 5
        slots = rb.extend(online_rows(start, 3))
        for slot, i in zip(slots.tolist(), range(start, start + 3)):
            history.setdefault(slot, []).append(i)
    sizes = rb.sizes()
    assert sizes["online"] == [5, 5] and sum(sizes["online_written"]) == 33
    # per shard, slots are overwritten in order: the slot written longest ago goes first
    for shard in (0, 1):
        per_shard = [i for slot in range(shard * 5, shard * 5 + 5) for i in history.get(slot, [])]
        newest = sorted(per_shard)[-5:]
        assert sorted(history[slot][-1] for slot in range(shard * 5, shard * 5 + 5)) == newest
    batch, info = rb.sample(500, return_info=True)
    expect = {slot: ids[-1] for slot, ids in history.items()}
    for sid, shard, index, gen in zip(batch["id"].tolist(), info["shard"].tolist(), info["index"].tolist(),
                                      info["generation"].tolist()):
        assert sid - 1_000_000 == expect[shard * 5 + index]
        assert gen == len(history[shard * 5 + index])


def test_generation_counts_writes_to_a_slot(make_buffer):
    rb = make_buffer(offline_rows(), online_capacity=4, offline_fraction=0.0, seed=0)
    rb.extend(online_rows(0, 4))
    _, info = rb.sample(50, return_info=True)
    assert set(info["generation"].tolist()) == {1}
    rb.extend(online_rows(4, 2))
    batch, info = rb.sample(200, return_info=True)
    gens = dict(zip(info["index"].tolist(), info["generation"].tolist()))
    assert gens[0] == gens[1] == 2 and gens[2] == gens[3] == 1


@pytest.fixture
def writer_cls(ray_session):
    ray = ray_session

    @ray.remote(num_cpus=0)
    class Writer:
        def __init__(self, rb):
            self.rb = rb  # the pickled handle

        def write(self, start, n, times):
            for i in range(times):
                self.rb.extend(online_rows(start + i * n, n))
            return n * times

    return Writer


def test_concurrent_writers_and_a_learner(make_buffer, writer_cls, ray_session):
    ray = ray_session
    rb = make_buffer(offline_rows(), online_capacity=10_000, num_offline_shards=3, num_online_shards=2,
                     offline_fraction=0.5, seed=0)
    writers = [writer_cls.remote(rb) for _ in range(3)]
    # the writers' processes start before any sampling: a learner looping meanwhile only slows their start
    ray.get([w.__ray_ready__.remote() for w in writers])
    refs = [w.write.remote(100_000 * i, 37, 20) for i, w in enumerate(writers)]
    n_batches = 0
    while ray.wait(refs, num_returns=len(refs), timeout=0)[1]:
        batch, info = rb.sample(64, return_info=True)
        n_on = int((~info["offline"]).sum())
        assert n_on in (0, 32)  # all offline until the first write lands, then exact
        n_batches += 1
    assert n_batches >= 1  # the learner sampled while the writes ran
    total = sum(ray.get(refs))
    assert total == 3 * 37 * 20
    assert rb.write_count == total
    assert len(rb) == 600 + total
    sizes = rb.sizes()
    # writes spread evenly: each goes to the shard least written as its writer sees the counts, and the writes
    # of the others still on their way are not counted yet, so three writers placing at once may each pick the
    # same shard: at most one write each apart
    assert abs(sizes["online"][0] - sizes["online"][1]) <= len(writers) * 37
    batch = rb.sample(4000)
    online_ids = batch["id"][batch["id"] >= 1_000_000] - 1_000_000
    assert {i // 100_000 for i in online_ids.tolist()} == {0, 1, 2}
    for w in writers:
        ray.kill(w)


def test_without_replacement_epoch_visits_each_offline_row_once(make_buffer):
    rb = make_buffer(offline_rows(60), online_capacity=10, num_offline_shards=3, sampler="without_replacement",
                     offline_fraction=1.0, seed=0)
    seen = torch.cat([rb.sample(12)["id"] for _ in range(5)])
    assert sorted(seen.tolist()) == list(range(60))
    seen = torch.cat([rb.sample(12)["id"] for _ in range(5)])  # the next epoch, too
    assert sorted(seen.tolist()) == list(range(60))


def test_without_replacement_refuses_a_batch_larger_than_what_is_left(make_buffer):
    rb = make_buffer(offline_rows(50), online_capacity=10, sampler="without_replacement", offline_fraction=1.0,
                     seed=0, epoch_end="raise")
    rb.sample(40)
    state = rb.state_dict()
    with pytest.raises(ValueError, match="10 left in the epoch; pass drop_last=True"):
        rb.sample(20)
    assert rb.state_dict() == state  # nothing changed
    assert len(rb.sample(10)) == 10  # the rest of the epoch is still there
    with pytest.raises(ValueError, match="holds 50 rows"):
        rb.sample(51)


def test_the_end_of_an_epoch_gives_a_short_batch_as_torchrl_does(make_buffer):
    rb = make_buffer(offline_rows(10), online_capacity=10, sampler="without_replacement", offline_fraction=1.0,
                     seed=0)
    batches = [rb.sample(4)["id"].tolist() for _ in range(4)]
    assert [len(b) for b in batches] == [4, 4, 2, 4]  # then the next epoch begins
    assert sorted(sum(batches[:3], [])) == list(range(10))
    both = make_buffer(offline_rows(11), online_capacity=20, sampler="without_replacement", offline_fraction=0.5,
                       seed=1)
    both.extend(online_rows(0, 20))
    sizes = []
    for _ in range(3):
        _, info = both.sample(8, return_info=True)
        n = len(info["offline"])
        sizes.append(n)
        assert int(info["offline"].sum()) == offline_count(n, 0.5)  # exact, short batches included
    assert sizes == [8, 8, 6]  # 11 offline rows: 4 + 4 + 3, the last in a batch of 6 split 3/3


def test_drop_last_starts_the_next_epoch(make_buffer):
    rb = make_buffer(offline_rows(50), online_capacity=10, sampler="without_replacement", offline_fraction=1.0,
                     seed=0, drop_last=True)
    rb.sample(40)
    assert len(set(rb.sample(20)["id"].tolist())) == 20


def test_schema_mismatch_names_the_key_and_writes_nothing(make_buffer):
    rb = make_buffer(offline_rows(), online_capacity=100, seed=0)
    rb.extend(online_rows(0, 5))
    bad = [
        (TensorDict({"obs": torch.zeros(4, 3)}, [4]), "missing ['id']"),
        (TensorDict({"obs": torch.zeros(4, 2), "id": torch.zeros(4, dtype=torch.int64)}, [4]), "key 'obs': expected trailing shape (3,), got (2,)"),
        (TensorDict({"obs": torch.zeros(4, 3, dtype=torch.float64), "id": torch.zeros(4, dtype=torch.int64)}, [4]), "key 'obs': expected dtype float32, got float64"),
        (TensorDict({"obs": torch.zeros(4, 3), "id": torch.zeros(4, dtype=torch.int64), "x": torch.zeros(4)}, [4]), "unexpected ['x']"),
    ]
    for data, needle in bad:
        with pytest.raises(SchemaError) as e:
            rb.extend(data)
        assert needle in str(e.value)
    assert rb.write_count == 5 and len(rb) == 605


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"offline_fraction": 1.5}, "offline_fraction must be a number in [0, 1], got 1.5"),
        ({"offline_fraction": -0.1}, "got -0.1"),
        ({"batch_size": 0}, "batch_size must be a positive integer, got 0"),
        ({"online_capacity": None}, "exactly one of online_capacity or online_storage"),
        ({"online_capacity": 0}, "online_capacity must be a positive integer, got 0"),
        ({"sampler": "prioritised"}, "sampler must be one of"),
        ({"num_offline_shards": 0}, "num_offline_shards must be a positive integer"),
    ],
)
def test_bad_construction(kwargs, needle, tmp_path):
    args = {"online_capacity": 10, "dataset_root": tmp_path / "ds", **kwargs}
    with pytest.raises(ValueError) as e:
        OfflineToOnlineReplayBuffer(offline_rows(20), **args)
    assert needle in str(e.value)


def test_zero_row_dataset_is_refused(tmp_path):
    with pytest.raises(ValueError, match="at least one row"):
        OfflineToOnlineReplayBuffer(TensorDict({"obs": torch.zeros(0, 3)}, [0]), online_capacity=4,
                                    dataset_root=tmp_path / "ds")


def test_bad_sample_calls_change_nothing(make_buffer):
    rb = make_buffer(offline_rows(), online_capacity=10, seed=0)
    state = rb.state_dict()
    with pytest.raises(ValueError, match="batch_size must be provided"):
        rb.sample()
    for bad in (0, -1):
        with pytest.raises(ValueError, match="batch_size must be a positive integer"):
            rb.sample(bad)
    with pytest.raises(ValueError, match="offline_fraction must be a number in"):
        rb.offline_fraction = 2
    assert rb.state_dict() == state
    assert rb.offline_fraction == 0.5


def test_dead_or_shut_down_handle_raises_instead_of_hanging(make_buffer, ray_session):
    rb = make_buffer(offline_rows(), online_capacity=10, seed=0)
    rb.shutdown()
    with pytest.raises(BufferUnavailableError, match="shut down"):
        rb.sample(4)
    rb2 = make_buffer(offline_rows(), online_capacity=10, seed=0, timeout=30)
    kill_for_good(rb2.rpc.coord)
    t0 = time.monotonic()
    with pytest.raises(BufferUnavailableError, match="dead"):
        rb2.sample(4)
    assert time.monotonic() - t0 < 20


def test_anneal_and_schedules(make_buffer):
    rb = make_buffer(offline_rows(), online_capacity=100, offline_fraction=0.8, seed=0)
    rb.extend(online_rows(0, 50))
    rb.anneal(50, 100)
    assert rb.offline_fraction == pytest.approx(0.4)
    rb.anneal(200, 100)
    assert rb.offline_fraction == 0.0
    rb.offline_fraction = "size_proportional"
    assert rb.offline_fraction == pytest.approx(600 / 650)
    rb.offline_fraction = {"kind": "step", "boundaries": [2], "values": [1.0, 0.0]}
    rb.set_step(0)
    _, i0 = rb.sample(10, return_info=True)
    rb.sample(10)
    _, i2 = rb.sample(10, return_info=True)
    assert bool(i0["offline"].all()) and not bool(i2["offline"].any())


def test_transform_and_add_and_prefill(make_buffer):
    rb = make_buffer(offline_rows(), online_capacity=1000, batch_size=8, seed=0,
                     transform=lambda td: td.set("double", td["obs"] * 2))
    idx = rb.add(TensorDict({"obs": torch.ones(3), "id": torch.tensor(5)}, []))
    assert idx == 0 and rb.write_count == 1
    batch = rb.sample()
    assert torch.equal(batch["double"], batch["obs"] * 2)
    prefill_replay_buffer(rb, offline_rows(300), n_samples=250, chunk_size=100, seed=0)
    assert rb.write_count == 251


def test_stats_report_sizes_rates_latencies(make_buffer):
    rb = make_buffer(offline_rows(), online_capacity=100, num_offline_shards=2, seed=0)
    rb.extend(online_rows(0, 10))
    rb.sample(16)
    s = rb.stats()
    assert s["coordinator"]["batches"] == 1 and s["coordinator"]["rows_sampled"] == 16
    assert "plan_ms_p50" in s["coordinator"]
    kinds = sorted(sh["kind"] for sh in s["shards"])
    assert kinds == ["offline", "offline", "online"]
    assert sum(sh["size"] for sh in s["shards"]) == 610


def test_dumps_and_loads_restore_the_online_rows_and_the_batch_stream(make_buffer, tmp_path):
    kw = dict(online_capacity=50, num_offline_shards=2, num_online_shards=2, seed=5)
    a = make_buffer(offline_rows(), **kw)
    a.extend(online_rows(0, 70))  # wraps: some slots written twice
    a.sample(16)
    a.dumps(tmp_path / "saved")
    want = [a.sample(32, return_info=True) for _ in range(3)]
    b = make_buffer(offline_rows(), **kw)
    b.loads(tmp_path / "saved")
    assert b.sizes() == a.sizes() | {"online_written": b.sizes()["online_written"]} and b.write_count == 70
    for (wt, wi), (gt, gi) in ((w, b.sample(32, return_info=True)) for w in want):
        assert torch.equal(wt["id"], gt["id"]) and torch.equal(wi["generation"], gi["generation"])
    c = make_buffer(offline_rows(), online_capacity=60, num_offline_shards=2, num_online_shards=2, seed=5)
    with pytest.raises(ValueError, match="layout"):
        c.loads(tmp_path / "saved")


def test_killed_offline_shard_restarts_and_remaps_its_chunks(make_buffer, ray_session):
    ray = ray_session
    rb = make_buffer(offline_rows(), online_capacity=10, num_offline_shards=2, offline_fraction=1.0, seed=0)
    before = rb.sample(64)
    ray.kill(rb.rpc.shards[0], no_restart=False)  # the actor process dies; Ray restarts it from the same root
    for _ in range(50):
        try:
            batch, info = rb.sample(64, return_info=True)
            break
        except Exception:
            time.sleep(0.2)
    assert batch.batch_size[0] == 64 and set(info["shard"].tolist()) <= {0, 1}
    assert torch.equal(batch["obs"][:, 0], batch["id"].float() * 3)  # the rows are the dataset's rows
    assert before.batch_size == batch.batch_size


def test_a_dataset_id_needs_batch_size_but_a_dataset_path_does_not(make_buffer, tmp_path):
    from rayrb import write_dataset

    # TorchRL's rule and message for ids, checked before the id is resolved (so before anything is prepared)
    with pytest.raises(ValueError, match="batch_size must be provided when offline_dataset is a string, so the "
                                         "dataset can be constructed. Got batch_size=None for 'openml:magic'"):
        make_buffer("openml:magic", online_capacity=10)
    path = write_dataset(offline_rows(50), tmp_path / "ds").root
    rb = make_buffer(str(path), online_capacity=10)  # a chunk dataset's directory, named by a string
    assert len(rb.sample(8)) == 8


def test_big_endian_rows_go_in_as_their_values(make_buffer):

    base = offline_rows(40)
    offline = {"obs": base["obs"].numpy().astype(">f4"), "id": base["id"].numpy().astype(">i8")}
    rb = make_buffer(offline, online_capacity=20, seed=0)
    online = online_rows(0, 20)
    rb.extend({"obs": online["obs"].numpy().astype(">f4"), "id": online["id"].numpy().astype(">i8")})
    rb.offline_fraction = 0.5
    batch = rb.sample(64)
    on = batch["id"] >= 1_000_000
    assert torch.equal(batch["obs"][~on], base["obs"][batch["id"][~on]])
    assert torch.equal(batch["obs"][on][:, 0], -(batch["id"][on] - 1_000_000).float())
