"""Edge cases of chunk writes and hashes, preprocess's in-flight cap, iterators left early, and dataset ids."""
from __future__ import annotations

import hashlib
import json
import os
import zlib

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rayrb.io import chunks
from rayrb.io.chunks import ChunkDataset, ChunkError, write_chunk, write_dataset, write_manifest
from rayrb.core.schema import RowSpec


# chunks ---------------------------------------------------------------------------------------------------------
def reference_hash(arrays, spec, algorithm):
    """The chunk hash spelled out: per key in spec order, its header then its C-order bytes."""
    data = b"".join(f"{k}|{np.dtype(arrays[k].dtype).name}|{tuple(arrays[k].shape)}|".encode()
                    + np.ascontiguousarray(arrays[k]).tobytes() for k in spec)
    if algorithm == "crc32":
        return f"crc32:{zlib.crc32(data):08x}"
    if algorithm == "sha256":
        return f"sha256:{hashlib.sha256(data).hexdigest()}"
    import xxhash

    return f"xxh3:{xxhash.xxh3_64(data).hexdigest()}"


def odd_layouts(rows=700):
    """Columns whose bytes cross 1 MiB blocks in every layout write_chunk handles on its own."""
    base = np.arange(rows * 600, dtype=np.float64).reshape(rows, 600)
    return {
        "fortran": np.asfortranarray(base[:, :500].astype(np.float32)),
        "reversed": base[::-1, 0].astype(np.int64).copy()[::-1],
        "strided": base[:, ::3],  # 200 float64 per row, not contiguous
        "wide": np.random.default_rng(0).random((rows, 1, 1000)),  # a block is a whole number of rows
        "flags": (base[:, 0] % 3 == 0),
        "nested/u8": (base[:, :7] % 251).astype(np.uint8),
    }


@pytest.mark.parametrize("algorithm", ["xxh3", "crc32", "sha256"])
def test_chunk_hash_is_the_c_order_bytes_whatever_the_layout_and_verifies(tmp_path, algorithm):
    arrays = odd_layouts()
    spec = RowSpec.from_arrays(arrays)
    info = write_chunk(arrays, tmp_path / "ds" / "chunk-00000", spec, algorithm=algorithm)
    assert info.hash == reference_hash(arrays, spec, algorithm)
    assert info.hash == chunks.hash_arrays(arrays, spec, algorithm)
    write_manifest(tmp_path / "ds", spec, [info])
    ds = ChunkDataset.open(tmp_path / "ds", verify=True)
    back = ds.read()
    for k, a in arrays.items():
        np.testing.assert_array_equal(back[k], a, err_msg=k)


@pytest.mark.parametrize("algorithm", ["xxh3", "crc32", "sha256"])
def test_one_flipped_byte_past_the_first_block_fails_verify(tmp_path, algorithm):
    arrays = {"x": np.arange(3 * (1 << 20) // 8 + 5, dtype=np.float64).reshape(-1, 1)}
    spec = RowSpec.from_arrays(arrays)
    info = write_chunk(arrays, tmp_path / "ds" / "chunk-00000", spec, algorithm=algorithm)
    write_manifest(tmp_path / "ds", spec, [info])
    ChunkDataset.open(tmp_path / "ds", verify=True)
    path = tmp_path / "ds" / "chunk-00000" / "x.memmap"
    with open(path, "r+b") as f:
        f.seek((2 << 20) + 123)
        b = f.read(1)
        f.seek((2 << 20) + 123)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(ChunkError, match="chunk-00000: content hash"):
        ChunkDataset.open(tmp_path / "ds", verify=True)


def test_a_short_or_long_column_file_is_refused_at_open(tmp_path):
    write_dataset({"x": np.arange(40, dtype=np.int32).reshape(20, 2)}, tmp_path / "ds", chunk_rows=8)
    path = tmp_path / "ds" / "chunk-00001" / "x.memmap"
    size = path.stat().st_size
    os.truncate(path, size - 1)
    with pytest.raises(ChunkError, match=f"chunk-00001: key 'x' expected {size} bytes"):
        ChunkDataset.open(tmp_path / "ds")
    os.truncate(path, size + 4096)  # e.g. space reserved past the data and never trimmed
    with pytest.raises(ChunkError, match="chunk-00001"):
        ChunkDataset.open(tmp_path / "ds")


@pytest.mark.parametrize("stored", ["md5:0123", "xxh3", "XXH3:00", "", ":abc", "crc32:", "xxh3:" + "0" * 16])
def test_unknown_or_malformed_stored_hashes_never_verify(tmp_path, stored):
    write_dataset({"x": np.arange(6.0)}, tmp_path / "ds", chunk_rows=4)
    manifest_path = tmp_path / "ds" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["chunks"][0]["hash"] = stored
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ChunkError):
        ChunkDataset.open(tmp_path / "ds", verify=True)


def test_short_pwrites_and_a_failing_fallocate_still_write_every_byte(tmp_path, monkeypatch):
    real = os.pwrite
    calls = []

    def short_pwrite(fd, data, offset):
        calls.append(len(data))
        return real(fd, bytes(data)[:4093], offset)  # an odd count, so blocks end mid-element

    monkeypatch.setattr(chunks.os, "pwrite", short_pwrite)
    monkeypatch.setattr(chunks, "_FALLOCATE", lambda fd, mode, offset, length: -1)  # e.g. EOPNOTSUPP
    arrays = odd_layouts(rows=40)
    ds = write_dataset(arrays, tmp_path / "a", chunk_rows=17)
    assert len(calls) > 10
    monkeypatch.setattr(chunks, "_FALLOCATE", None)
    ds2 = write_dataset(arrays, tmp_path / "b", chunk_rows=17)
    for d in (ds, ds2):
        d.verify()
        back = d.read()
        for k, a in arrays.items():
            np.testing.assert_array_equal(back[k], a, err_msg=k)


def test_rewriting_a_chunk_with_fewer_rows_leaves_no_old_bytes(tmp_path):
    spec = RowSpec.from_arrays({"x": np.zeros((1, 3), np.float32)})
    write_chunk({"x": np.ones((1000, 3), np.float32)}, tmp_path / "ds" / "chunk-00000", spec)
    info = write_chunk({"x": np.full((10, 3), 2, np.float32)}, tmp_path / "ds" / "chunk-00000", spec)
    assert (tmp_path / "ds" / "chunk-00000" / "x.memmap").stat().st_size == 10 * 3 * 4
    write_manifest(tmp_path / "ds", spec, [info])
    ds = ChunkDataset.open(tmp_path / "ds", verify=True)
    assert ds.read()["x"].tolist() == [[2.0] * 3] * 10


# preprocess's cap on tasks in flight ---------------------------------------------------------------------------
def ray_slots(cluster_cpus, task_cpus):
    """How many tasks Ray runs at once: it counts resources in fixed point, 1/10000 of a unit."""
    return int(round(cluster_cpus * 10000)) // int(round(task_cpus * 10000))


@pytest.mark.parametrize("num_workers,cluster_cpus,task_cpus", [
    (1, 2.0, 1), (2, 2.0, 1), (3, 2.0, 1), (2, 3.0, 1), (4, 16.0, 4), (19, 2.0, 0.1), (4, 1.0, 0.2),
    (2, 0.6, 0.2), (29, 3.0, 0.1), (5, 2.0, 0.5), (7, 7.0, 1.0), (1, 0.0, 1),
])
def test_tasks_queued_ahead_never_let_more_than_num_workers_run(num_workers, cluster_cpus, task_cpus):
    from rayrb.io.preprocess import in_flight_limit

    limit = in_flight_limit(num_workers, cluster_cpus, task_cpus)
    assert num_workers <= limit <= 2 * num_workers
    running_at_once = min(limit, ray_slots(cluster_cpus, task_cpus))
    assert running_at_once <= num_workers, (limit, ray_slots(cluster_cpus, task_cpus))


# iterators left early ------------------------------------------------------------------------------------------
KW = {"online_capacity": 100, "num_offline_shards": 2, "num_online_shards": 1, "seed": 3, "batch_size": 10,
      "prefetch": 0}


def rows(n, start=0):
    ids = torch.arange(start, start + n, dtype=torch.int64)
    return TensorDict({"obs": ids.float()[:, None], "id": ids}, [n])


def reference(make_buffer, n, data=None, **kw):
    ref = make_buffer(rows(200) if data is None else data, **{**KW, **kw})
    return [ref.sample()["id"] for _ in range(n)]


def assert_stream(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"batch {i}: {a.tolist()} != {b.tolist()}"


def index_in(want, batch):
    return next(i for i, w in enumerate(want) if torch.equal(w, batch))


@pytest.mark.usefixtures("ray_session")
def test_a_state_dict_after_an_iterator_ran_out_and_was_dropped_resumes_after_its_last_batch(make_buffer):
    want = reference(make_buffer, 12, sampler="without_replacement")
    rb = make_buffer(rows(200), **KW, sampler="without_replacement")
    got = [b["id"] for b in rb.iter_batches(prefetch=8, num_batches=5)]  # runs out, then is dropped
    state = rb.state_dict()
    twin = make_buffer(rows(200), **KW, sampler="without_replacement")
    twin.load_state_dict(state)
    assert_stream(got + [twin.sample()["id"] for _ in range(7)], want)


@pytest.mark.usefixtures("ray_session")
def test_a_state_dict_from_a_second_handle_here_while_iterating(make_buffer):
    want = reference(make_buffer, 12, sampler="without_replacement")
    rb = make_buffer(rows(200), **KW, sampler="without_replacement")
    other = rb.client()
    it = rb.iter_batches(prefetch=6)
    got = [next(it)["id"] for _ in range(3)]
    state = other.state_dict()
    got.append(next(it)["id"])  # the save does not disturb the iterator
    twin = make_buffer(rows(200), **KW, sampler="without_replacement")
    twin.load_state_dict(state)
    assert_stream(got[:3] + [twin.sample()["id"] for _ in range(9)], want)
    assert torch.equal(got[3], want[3])
    it.close()


@pytest.mark.usefixtures("ray_session")
def test_a_prefetch_deeper_than_the_coordinators_log_skips_no_row_of_the_epoch(make_buffer):
    kw = {**KW, "batch_size": 1, "sampler": "without_replacement"}
    rb = make_buffer(rows(700), **kw)
    it = rb.iter_batches(prefetch=300)
    seen = [next(it)["id"]]
    assert it.in_flight >= 200  # deep, but no deeper than the coordinator can give back
    it.close()
    seen += [rb.sample(233)["id"] for _ in range(3)]  # the 699 rows left in the epoch
    assert sorted(torch.cat(seen).tolist()) == list(range(700))


@pytest.mark.usefixtures("ray_session")
def test_the_later_of_two_iterators_on_one_handle_gives_back_its_draws(make_buffer):
    want = reference(make_buffer, 20, sampler="without_replacement")
    rb = make_buffer(rows(200), **KW, sampler="without_replacement")
    a = rb.iter_batches(prefetch=4)
    first = next(a)["id"]
    b = rb.iter_batches(prefetch=4)
    from_b = [next(b)["id"] for _ in range(2)]
    b.close()
    after_b = rb.sample()["id"]
    assert torch.equal(after_b, want[index_in(want, from_b[-1]) + 1])
    a.close()  # another caller drew since: its draws stand, and nothing else is disturbed
    a.close()
    assert torch.equal(first, want[0])
    nxt = rb.sample()["id"]
    assert torch.equal(nxt, want[index_in(want, after_b) + 1])
    assert rb.stats()["coordinator"]["undo_refused"] == 1


@pytest.mark.usefixtures("ray_session")
def test_an_exception_inside_with_still_gives_back(make_buffer):
    want = reference(make_buffer, 8)
    rb = make_buffer(rows(200), **KW)
    got = []
    with pytest.raises(KeyError):
        with rb.iter_batches(prefetch=8) as it:
            got += [next(it)["id"] for _ in range(2)]
            raise KeyError("learner failed")
    with pytest.raises(StopIteration):
        next(it)
    got += [rb.sample()["id"] for _ in range(6)]
    assert_stream(got, want)


@pytest.mark.usefixtures("ray_session")
def test_closing_after_shutdown_or_a_dead_coordinator_is_quiet(make_buffer, ray_session):
    rb = make_buffer(rows(200), **KW)
    it = rb.iter_batches(prefetch=4)
    next(it)
    rb.shutdown()
    it.close()
    it.close()
    with pytest.raises(StopIteration):
        next(it)

    rb2 = make_buffer(rows(200), **KW)
    it2 = rb2.iter_batches(prefetch=4)
    next(it2)
    ray_session.kill(rb2._coord, no_restart=True)
    it2.close()  # nothing to give back to: no error


@pytest.mark.usefixtures("ray_session")
def test_an_iterator_over_a_rate_limited_buffer_gives_back_its_samples_on_close(make_buffer):
    from rayrb.core.rate_limiter import SampleToInsertRatio

    def make():
        rb = make_buffer(rows(200), **{**KW, "online_capacity": 1000},
                         rate_limiter=SampleToInsertRatio(1.0, 10, 40.0), timeout=0.5)
        rb.extend(rows(60, start=10_000))
        return rb

    twin = make()
    want = [twin.sample()["id"] for _ in range(3)]
    rb = make()
    it = rb.iter_batches(prefetch=6)
    got = [next(it)["id"] for _ in range(3)]
    assert it.in_flight > 0
    it.close()
    assert_stream(got, want)
    limits = rb.stats()["coordinator"]["rate_limiter"]
    assert limits["samples"] == twin.stats()["coordinator"]["rate_limiter"]["samples"]
    # the limiter's window is where the twin's is: the same number of batches go through before it holds back
    counts = []
    for buf in (rb, twin):
        n = 0
        while n < 50:
            try:
                buf.sample()
            except TimeoutError:
                break
            n += 1
        counts.append(n)
    assert counts[0] == counts[1] and counts[0] < 50, counts


@pytest.mark.usefixtures("ray_session")
def test_a_prioritized_iterator_closed_after_a_priority_update(make_buffer):
    def run(iterate):
        rb = make_buffer(rows(200), **KW, sampler="prioritized")
        if iterate:
            it = rb.iter_batches(prefetch=6, return_info=True)
            got = [next(it) for _ in range(3)]
        else:
            got = [rb.sample(return_info=True) for _ in range(3)]
        _, info = got[0]
        rb.update_priority(info, torch.full((10,), 50.0))
        if iterate:
            it.close()
        return [b["id"] for b, _ in got] + [rb.sample()["id"] for _ in range(6)]

    assert_stream(run(True), run(False))


# dataset ids ---------------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("ray_session")
def test_a_dataset_id_needs_batch_size_and_a_path_does_not(tmp_path, make_buffer):
    from rayrb import OfflineToOnlineReplayBuffer

    with pytest.raises(ValueError, match="batch_size must be provided when offline_dataset is a string"):
        OfflineToOnlineReplayBuffer("openml:no-such-table", online_capacity=10)
    write_dataset({"obs": np.zeros((8, 1), np.float32), "id": np.arange(8)}, tmp_path / "prepared")
    rb = make_buffer(str(tmp_path / "prepared"), online_capacity=10, seed=0)  # a path: batch_size may come later
    assert len(rb.sample(4)["id"]) == 4


# OpenMLEnv -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch_size", [None, [2, 3]])
def test_openml_env_with_no_or_two_batch_dims_passes_torchrls_checks(data_home, tmp_path, monkeypatch, batch_size):
    from torchrl.envs.utils import check_env_specs

    from rayrb import OpenMLEnv

    monkeypatch.setenv("RAYRB_HOME", str(tmp_path / "home"))
    env = OpenMLEnv("shuttle", batch_size=batch_size, data_home=data_home, seed=0)
    check_env_specs(env)
    td = env.reset()
    assert td["observation"].shape[:-1] == env.batch_size and td["y"].shape == env.batch_size
    td["action"] = td["y"].clone()
    out = env.step(td)["next"]
    assert out["reward"].shape == (*env.batch_size, 1) and bool((out["reward"] == 1).all())
