"""Shards whose rows live in a DeviceTable: the GPU shards' code path, run here on the CPU device.

Shards are plain classes, so these tests build them without Ray. The same seeds
must give the same rows, provenance and priorities as host-memory shards.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rayrb import write_dataset
from rayrb.actors.online_shard import OnlineShard
from rayrb.actors.shards import OfflineShard
from rayrb.core.plans import Epoch
from rayrb.io.device_table import DeviceTable


@pytest.fixture
def dataset(tmp_path):
    n = 1000
    td = TensorDict({"obs": torch.randn(n, 5), "id": torch.arange(n), "nested": {"r": torch.rand(n)}}, [n])
    return str(write_dataset(td, tmp_path / "ds", chunk_rows=300).root)


def test_table_loads_in_blocks_and_holds_exactly_its_rows(dataset):
    from rayrb.io.chunks import ChunkDataset

    ds = ChunkDataset.open(dataset)
    shapes = {k: (tuple(ds.spec[k].shape), np.dtype(ds.spec[k].dtype)) for k in ds.spec.keys}
    calls = []

    def gather(idx):
        calls.append(len(idx))
        return ds.gather(idx + 100)

    t = DeviceTable.load(gather, 800, shapes, "cpu", block_bytes=64 * ds.spec.row_bytes)  # 64 rows a block
    assert max(calls) == 64 and sum(calls) == 800
    assert t.nbytes == 800 * ds.spec.row_bytes  # no slack: the rows' bytes
    idx = np.array([0, 799, 5, 5])
    expect = ds.gather(idx + 100)
    for k, v in t.gather(idx).items():
        assert torch.equal(v, torch.from_numpy(expect[k]))


def test_table_refuses_cuda_without_cuda_and_mixed_columns():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            DeviceTable.empty({"x": ((2,), np.dtype("float32"))}, 4, "cuda")
    with pytest.raises(ValueError, match="one length"):
        DeviceTable({"a": torch.zeros(3), "b": torch.zeros(4)})


@pytest.mark.parametrize("sampler", ["uniform", "without_replacement", "prioritized"])
def test_offline_device_shard_gives_the_host_shards_rows(dataset, sampler, tmp_path):
    host = OfflineShard(dataset, 200, 900, "t/off-host", sampler)
    dev = OfflineShard(dataset, 200, 900, "t/off-dev", sampler, device="cpu")
    if sampler == "prioritized":
        for shard in (host, dev):
            shard.update_priority(np.arange(0, 700, 3), np.ones(234, np.int64), np.linspace(0.1, 5, 234))
    epochs = [Epoch(1, 7, 700, 0), Epoch(1, 7, 700, 64)] if sampler == "without_replacement" else None
    (rh, ih), (rd, idev) = (s.sample_many([64, 32], [11, 12], epochs) for s in (host, dev))
    for k in rh:
        np.testing.assert_array_equal(rh[k], rd[k])
    for k in ih:
        np.testing.assert_array_equal(ih[k], idev[k])
    t = dev.sample_many_tensors([64, 32], [11, 12], epochs)
    for k in rh:
        assert torch.equal(t[f"rows/{k}"], torch.from_numpy(rh[k]))
    assert torch.equal(t["info/index"], torch.from_numpy(ih["index"]))
    from rayrb.io.chunks import ChunkDataset

    assert dev.stats()["device_bytes"] == 700 * ChunkDataset.open(dataset).spec.row_bytes
    assert host.stats()["device_bytes"] == 0


def test_online_device_shard_writes_both_copies_and_reopens_after_a_crash(dataset, tmp_path):
    from rayrb.io.chunks import ChunkDataset

    spec = ChunkDataset.open(dataset).spec.to_json()
    rows = {"obs": np.random.default_rng(0).standard_normal((70, 5)).astype(np.float32),
            "id": np.arange(1000, 1070), "nested/r": np.linspace(0, 1, 70, dtype=np.float32)}
    host = OnlineShard(spec, 50, "t/on-host", state_dir=str(tmp_path / "host"))
    dev = OnlineShard(spec, 50, "t/on-dev", state_dir=str(tmp_path / "dev"), device="cpu")
    for shard in (host, dev):
        shard.extend(rows, 0, 40, first=0)
        shard.extend(rows, 40, 70, first=40)  # wraps: slots 0..19 hold rows 50..69
    (rh, ih), (rd, idev) = (s.sample_many([100], [3]) for s in (host, dev))
    for k in rh:
        np.testing.assert_array_equal(rh[k], rd[k])
    np.testing.assert_array_equal(ih["generation"], idev["generation"])
    reopened = OnlineShard(spec, 50, "t/on-dev", state_dir=str(tmp_path / "dev"), device="cpu")  # the process died
    np.testing.assert_array_equal(reopened.gather(np.arange(50))[0]["id"], host.gather(np.arange(50))[0]["id"])
    assert int(reopened.gather(np.array([0]))[0]["id"][0]) == 1050
    state = host.state()
    fresh = OnlineShard(spec, 50, "t/on-fresh", device="cpu")
    fresh.load_state(state)  # a restore refreshes the device copy too
    np.testing.assert_array_equal(fresh.sample_many([20], [5])[0]["id"], host.sample_many([20], [5])[0]["id"])


def test_a_read_that_arrives_before_its_planned_writes_draws_nothing(dataset, tmp_path):
    from rayrb.io.chunks import ChunkDataset

    spec = ChunkDataset.open(dataset).spec.to_json()
    shard = OnlineShard(spec, 50, "t/on", device="cpu")
    rows = {"obs": np.ones((10, 5), np.float32), "id": np.arange(10), "nested/r": np.zeros(10, np.float32)}
    shard.extend(rows, 0, 4, first=0)
    assert set(shard.sample_many_tensors([3], [1], written=10)) == {"behind"}  # 6 rows still on their way
    shard.extend(rows, 4, 10, first=4)
    out = shard.sample_many_tensors([3], [1], written=10)
    assert out["rows/id"].shape == (3,) and "behind" not in out


@pytest.mark.parametrize("device", [None, "cpu"])
def test_a_direct_read_draws_over_the_rows_written_when_it_was_planned(dataset, device):
    """A plan names the write count it was made at: a tensor read (feed(), GPU direct reads, gloo) that arrives
    after later writes landed draws over the same rows as the object-store read of that plan, never newer ones."""
    from rayrb.io.chunks import ChunkDataset

    spec = ChunkDataset.open(dataset).spec.to_json()
    shard = OnlineShard(spec, 500, "t/on", device=device)
    rows = {"obs": np.ones((500, 5), np.float32), "id": np.arange(500), "nested/r": np.zeros(500, np.float32)}
    shard.extend(rows, 0, 50, first=0)  # the plan is made here, at 50 rows written
    shard.extend(rows, 50, 500, first=50)  # then 450 more land before the read arrives
    host_rows, host_info = shard.sample_many([200, 100], [7, 8], written=50)
    direct = shard.sample_many_tensors([200, 100], [7, 8], written=50)
    assert int(direct["info/index"].max()) < 50, "the direct read drew rows written after its plan"
    np.testing.assert_array_equal(direct["info/index"].numpy(), host_info["index"])
    np.testing.assert_array_equal(direct["rows/id"].numpy(), host_rows["id"])


@pytest.mark.usefixtures("ray_session")
def test_iterating_with_reads_submitted_here_gives_the_coordinators_stream(make_buffer, monkeypatch):
    """The GPU actor's path (plan at the coordinator, read from the shards here), over the object store."""
    import rayrb.handle.client as client
    import rayrb.handle.rpc as rpc

    td = TensorDict({"obs": torch.randn(500, 5), "id": torch.arange(500), "nested": {"r": torch.rand(500)}}, [500])
    kwargs = dict(online_capacity=100, num_offline_shards=2, num_online_shards=2, seed=4, batch_size=32)
    here, there = make_buffer(td, **kwargs), make_buffer(td, **kwargs)
    for rb in (here, there):
        rb.extend(td[:60].clone().apply(lambda t: t + 1000 if t.dtype == torch.int64 else t))
    want = [b["id"].tolist() for b in there.iter_batches(prefetch=4, num_batches=7)]
    m = 2
    monkeypatch.setattr(client, "direct_reads",
                        lambda rpc, storage, device: {"offline": rpc.shards[:m], "online": rpc.shards[m:]})
    monkeypatch.setattr(rpc, "DIRECT_TRANSPORT", None)
    got = list(here.iter_batches(prefetch=4, num_batches=7, return_info=True))
    assert [b["id"].tolist() for b, _ in got] == want
    assert all(int(info["offline"].sum()) == 16 for _, info in got)


def test_unsigned_and_big_endian_columns_are_stored_as_host_shards_store_them(tmp_path):
    # torch has no index_copy for uint16/32/64, and no tensors of non-native byte order
    from rayrb.core.schema import RowSpec

    spec = RowSpec.from_arrays({"u16": np.zeros((1,), np.uint16), "u64": np.zeros((1, 2), np.uint64),
                                "f": np.zeros((1,), np.float32)}).to_json()
    data = {"u16": np.array([1, 65535, 7], np.uint16), "u64": np.array([[2**64 - 1, 0], [5, 6], [7, 8]], np.uint64),
            "f": np.array([1.5, -2.0, 3.25], ">f4")}
    host, dev = OnlineShard(spec, 4, "h"), OnlineShard(spec, 4, "d", device="cpu")
    for shard in (host, dev):
        shard.extend(data, 0, 3, first=0)
    (rh, _), (rd, _) = host.gather(np.arange(3)), dev.gather(np.arange(3))
    for k in rh:
        np.testing.assert_array_equal(rh[k], rd[k])
        assert rd[k].dtype == rh[k].dtype
    t = dev.sample_many_tensors([3], [0])
    assert t["rows/u16"].dtype == torch.uint16


def test_a_write_the_device_refuses_leaves_the_acknowledged_rows(tmp_path, monkeypatch):
    # the memory maps were written before the device copy raised: acknowledged rows were overwritten
    from rayrb.core.schema import RowSpec

    spec = RowSpec.from_arrays({"x": np.zeros((1,), np.float32)}).to_json()
    dev = OnlineShard(spec, 4, "d", state_dir=str(tmp_path / "d"), device="cpu")
    dev.extend({"x": np.arange(4, dtype=np.float32)}, 0, 4, first=0)

    def refuse(*args, **kwargs):
        raise RuntimeError("device out of memory")

    monkeypatch.setattr(dev._table, "write", refuse)
    with pytest.raises(RuntimeError, match="out of memory"):
        dev.extend({"x": np.array([10, 11], np.float32)}, 0, 2, first=4)
    restarted = OnlineShard(spec, 4, "d", state_dir=str(tmp_path / "d"), device="cpu")
    assert restarted.written() == 4 and restarted.gather(np.arange(4))[0]["x"].tolist() == [0, 1, 2, 3]


def test_a_write_the_memory_maps_refuse_leaves_the_device_copy_as_they_are(tmp_path):
    from rayrb.core.schema import RowSpec

    spec = RowSpec.from_arrays({"x": np.zeros((1,), np.float32)}).to_json()
    dev = OnlineShard(spec, 4, "d", device="cpu")
    dev.extend({"x": np.arange(4, dtype=np.float32)}, 0, 4, first=0)
    dev._data["x"] = np.asarray(dev._data["x"]).copy()
    dev._data["x"].flags.writeable = False  # the host copy cannot take the rows
    with pytest.raises(ValueError):
        dev.extend({"x": np.array([10, 11], np.float32)}, 0, 2, first=4)
    assert dev.sample_many_tensors([50], [1])["rows/x"].unique().tolist() == [0.0, 1.0, 2.0, 3.0]


def test_rows_written_behind_a_gap_are_reported_and_found_again_by_a_restarted_shard(dataset, tmp_path):
    """A piece that has not landed leaves a gap: rows written behind it are held but not counted. The shard
    reports them (for the coordinator's resync), a restarted shard finds them from the generations, and
    filling the gap counts them all."""
    from rayrb.io.chunks import ChunkDataset

    spec = ChunkDataset.open(dataset).spec.to_json()
    rows = {"obs": np.zeros((30, 5), np.float32), "id": np.arange(30), "nested/r": np.zeros(30, np.float32)}
    shard = OnlineShard(spec, 50, "t/on-gap", state_dir=str(tmp_path / "gap"))
    shard.extend(rows, 0, 10, first=0)
    shard.extend(rows, 20, 30, first=20)  # rows 10..19 have not landed
    assert shard.write_state() == (10, [(20, 30)]) and shard.size() == 10
    again = OnlineShard(spec, 50, "t/on-gap", state_dir=str(tmp_path / "gap"))  # the process died
    assert again.write_state() == (10, [(20, 30)])
    again.extend(rows, 10, 20, first=10)
    assert again.write_state() == (30, []) and again.size() == 30
    np.testing.assert_array_equal(again.gather(np.arange(30))[0]["id"], np.arange(30))


@pytest.mark.parametrize("kind", ["slice", "prioritized_slice"])
def test_slices_from_a_device_shard_are_the_host_shards_slices(tmp_path, kind):
    """The GPU shards' code path with slices, on the CPU device: the same slices, provenance (``episode_start``,
    priorities) and tensors as a host shard's; online, after writes that grow a running episode."""
    n = 600
    episode = np.repeat(np.arange(n // 30), 30)
    td = TensorDict({"obs": torch.randn(n, 3), "episode": torch.from_numpy(episode)}, [n])
    root = str(write_dataset(td, tmp_path / "eps", chunk_rows=250).root)
    options = {"slice_len": 8, "slice_key": "episode", "slice_ends": False, "alpha": 0.7}
    host, dev = (OfflineShard(root, 90, 540, f"t/off-{d}", kind, sampler_options=options, device=d)
                 for d in (None, "cpu"))
    if kind == "prioritized_slice":
        for shard in (host, dev):
            shard.update_priority(np.arange(0, 450, 7), np.ones(65, np.int64), np.linspace(0.1, 9, 65))
    (rh, ih), (rd, idev) = (s.sample_many([64, 32], [11, 12]) for s in (host, dev))
    assert set(ih) == set(idev) and "episode_start" in ih
    for k in rh:
        np.testing.assert_array_equal(rh[k], rd[k])
    for k in ih:
        np.testing.assert_array_equal(ih[k], idev[k])
    steps = rh["episode"].reshape(-1, 8)
    assert (steps == steps[:, :1]).all()  # whole slices of one episode
    t = dev.sample_many_tensors([64, 32], [11, 12])
    assert torch.equal(t["rows/episode"], torch.from_numpy(rh["episode"]))
    assert torch.equal(t["info/episode_start"], torch.from_numpy(ih["episode_start"]))
    spec = {"obs": np.zeros((1, 3), np.float32), "episode": np.zeros(1, np.int64)}
    from rayrb.core.schema import RowSpec

    spec = RowSpec.from_arrays(spec).to_json()
    online = [OnlineShard(spec, 64, f"t/on-{d}", kind, sampler_options=options, device=d,
                          state_dir=str(tmp_path / f"on-{d}")) for d in (None, "cpu")]
    for first in range(0, 40, 10):  # episode 7 grows by 10 steps a write; then episode 8 begins
        rows = {"obs": np.full((10, 3), first, np.float32), "episode": np.full(10, 7 if first < 30 else 8)}
        for shard in online:
            shard.extend(rows, 0, 10)
    (oh, oih), (od, oid) = (s.sample_many([16, 8], [3, 4]) for s in online)
    for k in oh:
        np.testing.assert_array_equal(oh[k], od[k])
    for k in oih:
        np.testing.assert_array_equal(oih[k], oid[k])
    assert set(oih["episode_start"].tolist()) <= {0, 30} and (oh["episode"].reshape(-1, 8) == 7).any()
