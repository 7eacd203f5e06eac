import json
import os

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rayrb.io import chunks, files, hashing
from rayrb.io.chunks import ChunkDataset, ChunkError, ReadOnlyError, write_dataset


def nested_td(rows=10):
    g = torch.Generator().manual_seed(0)
    return TensorDict(
        {
            "obs": torch.randn(rows, 3, generator=g),
            "action": torch.randint(0, 5, (rows,), generator=g),
            "next": {"done": torch.rand(rows, 1, generator=g) > 0.5, "reward": torch.randn(rows, 1, generator=g).double()},
            "img": torch.randint(0, 255, (rows, 2, 2), generator=g, dtype=torch.uint8),
        },
        [rows],
    )


def test_round_trip_nested_keys_and_dtypes(tmp_path):
    td = nested_td(10)
    ds = write_dataset(td, tmp_path / "ds", chunk_rows=3, source={"test": 1}, recipe={"r": 2})
    assert len(ds) == 10 and [c.rows for c in ds.chunks] == [3, 3, 3, 1]
    again = ChunkDataset.open(tmp_path / "ds")
    back = again.to_tensordict()
    assert set(back.keys(True, True)) == set(td.keys(True, True))
    for k in td.keys(True, True):
        assert back[k].dtype == td[k].dtype
        assert torch.equal(back[k], td[k])
    assert again.source == {"test": 1} and again.recipe == {"r": 2}
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert manifest["rows"] == 10 and manifest["version"] == chunks.FORMAT_VERSION
    assert manifest["spec"]["next/done"] == {"shape": [1], "dtype": "bool"}
    assert all(c["hash"].startswith("xxh3:") for c in manifest["chunks"])
    # each chunk is a plain tensordict memmap
    first = TensorDict.load_memmap(tmp_path / "ds" / "chunk-00000")
    assert torch.equal(first["next", "reward"], td["next", "reward"][:3])


def test_gather_across_chunks_in_any_order(tmp_path):
    x = np.arange(20, dtype=np.int64).reshape(10, 2)
    ds = write_dataset({"x": x}, tmp_path / "ds", chunk_rows=4)
    idx = np.array([9, 0, 4, 4, 3, 7])
    np.testing.assert_array_equal(ds.gather(idx)["x"], x[idx])
    with pytest.raises(IndexError, match=r"expected row indices in \[0, 10\)"):
        ds.gather(np.array([10]))


def test_open_is_read_only(tmp_path):
    ds = write_dataset({"x": np.arange(6.0)}, tmp_path / "ds", chunk_rows=4)
    ds = ChunkDataset.open(tmp_path / "ds")
    with pytest.raises(ReadOnlyError, match="immutable"):
        ds[0] = 1
    with pytest.raises(ReadOnlyError):
        ds.extend({"x": np.zeros(2)})
    mapped = ds.chunk_arrays(0)["x"]
    with pytest.raises(ValueError, match="read-only"):
        mapped[0] = 42.0
    assert ds.read()["x"][0] == 0.0
    # gathered rows are copies: changing them leaves the dataset alone
    rows = ds.gather(np.array([0]))
    rows["x"][0] = 7
    assert ds.gather(np.array([0]))["x"][0] == 0.0


def test_altered_chunk_is_detected_by_name(tmp_path):
    write_dataset({"x": np.arange(8.0)}, tmp_path / "ds", chunk_rows=4)
    path = tmp_path / "ds" / "chunk-00001" / "x.memmap"
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ChunkError, match="chunk-00001: content hash"):
        ChunkDataset.open(tmp_path / "ds", verify=True)


def test_truncated_chunk_is_detected_by_name(tmp_path):
    write_dataset({"x": np.arange(8.0)}, tmp_path / "ds", chunk_rows=4)
    path = tmp_path / "ds" / "chunk-00000" / "x.memmap"
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ChunkError, match="chunk-00000: key 'x' expected 32 bytes"):
        ChunkDataset.open(tmp_path / "ds")  # found when the dataset is opened, not at the first read
    from rayrb.io.chunks import read_manifest

    ds = ChunkDataset(tmp_path / "ds", read_manifest(tmp_path / "ds"))  # unchecked: a read still names it
    with pytest.raises(ChunkError, match="chunk-00000: key 'x' expected 32 bytes"):
        ds.gather(np.array([0]))
    with pytest.raises(ChunkError, match="chunk-00000"):
        ds.verify()


def test_crash_between_chunks_and_manifest_leaves_no_dataset(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed before the manifest")

    monkeypatch.setattr(chunks, "write_manifest", crash)
    with pytest.raises(KeyboardInterrupt):
        write_dataset({"x": np.arange(8.0)}, tmp_path / "ds", chunk_rows=4)
    assert not (tmp_path / "ds").exists()  # an interrupted call takes back what it made
    (tmp_path / "empty").mkdir()
    with pytest.raises(KeyboardInterrupt):
        write_dataset({"x": np.arange(8.0)}, tmp_path / "empty", chunk_rows=4)
    assert list((tmp_path / "empty").iterdir()) == []
    # a process killed there leaves its chunks (nothing runs to take them back), and no dataset
    chunks.write_chunk({"x": np.arange(4.0)}, tmp_path / "killed" / "chunk-00000")
    with pytest.raises(ChunkError, match="found none"):
        ChunkDataset.open(tmp_path / "killed")


def test_manifest_write_is_atomic(tmp_path, monkeypatch):
    ds = write_dataset({"x": np.arange(4.0)}, tmp_path / "ds")
    before = (tmp_path / "ds" / "manifest.json").read_text()

    def fail_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail_replace)
    with pytest.raises(OSError):
        chunks.write_manifest(tmp_path / "ds", ds.spec, [], source="other")
    assert (tmp_path / "ds" / "manifest.json").read_text() == before


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="at least one row"):
        write_dataset({"x": np.zeros((0, 2))}, tmp_path / "empty")
    write_dataset({"x": np.zeros(3)}, tmp_path / "ds")
    with pytest.raises(FileExistsError, match="non-empty"):
        write_dataset({"x": np.zeros(3)}, tmp_path / "ds")
    with pytest.raises(ValueError, match="chunk_rows must be a positive integer, got 0"):
        write_dataset({"x": np.zeros(3)}, tmp_path / "other", chunk_rows=0)


def test_delete_removes_dataset(tmp_path):
    ds = write_dataset({"x": np.zeros(3)}, tmp_path / "ds")
    ds.delete()
    assert not (tmp_path / "ds").exists()


def test_ray_worker_maps_dataset_read_only(tmp_path, ray_session):
    ray = ray_session
    ds = write_dataset({"x": np.arange(10.0)}, tmp_path / "ds", chunk_rows=4)

    @ray.remote(num_cpus=0)
    def read(root):
        from rayrb.io.chunks import ChunkDataset

        d = ChunkDataset.open(root, verify=True)
        arr = d.chunk_arrays(1)["x"]
        return d.gather(np.array([9, 5]))["x"].tolist(), arr.flags.writeable

    assert ray.get(read.remote(str(ds.root))) == ([9.0, 5.0], False)


def test_indexing_and_sampling_like_a_torchrl_dataset(tmp_path):
    ds = write_dataset({"x": np.arange(10, dtype=np.int64)}, tmp_path / "ds", chunk_rows=3)
    assert ds[4]["x"].item() == 4 and ds[4].batch_size == torch.Size([])
    assert ds[-1]["x"].item() == 9
    assert ds[2:5]["x"].tolist() == [2, 3, 4]
    assert ds[np.array([9, 0])]["x"].tolist() == [9, 0]
    with pytest.raises(IndexError, match=r"expected row indices in \[0, 10\)"):
        ds[10]
    a, b = ds.sample(32, seed=1), ds.sample(32, seed=1)
    assert a.batch_size == torch.Size([32]) and torch.equal(a["x"], b["x"])
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        ds.sample(0)


@pytest.mark.parametrize("older", ["crc32", "sha256"])
def test_chunk_hash_is_xxh3_and_older_manifests_still_verify(tmp_path, older):
    td = nested_td(9)
    ds = write_dataset(td, tmp_path / "ds", chunk_rows=4)
    assert [chunks.hash_algorithm(c.hash) for c in ds.chunks] == ["xxh3"] * 3
    assert all(len(c.hash) == len("xxh3:") + 16 for c in ds.chunks)
    # the checksum computed while writing equals one recomputed from the files
    assert [c.hash for c in ds.chunks] == [chunks.hash_arrays(ds.chunk_arrays(i), ds.spec) for i in range(3)]
    # a manifest from before the switch (crc32 or sha256 hashes) verifies, and still catches an altered chunk
    path = tmp_path / "ds" / "manifest.json"
    manifest = json.loads(path.read_text())
    for i, c in enumerate(manifest["chunks"]):
        c["hash"] = chunks.hash_arrays(ds.chunk_arrays(i), ds.spec, older)
    assert manifest["chunks"][0]["hash"].startswith(f"{older}:")
    assert len(manifest["chunks"][0]["hash"]) == len(older) + 1 + {"crc32": 8, "sha256": 64}[older]
    path.write_text(json.dumps(manifest))
    ChunkDataset.open(tmp_path / "ds", verify=True)
    obs = tmp_path / "ds" / "chunk-00002" / "obs.memmap"
    data = bytearray(obs.read_bytes())
    data[-1] ^= 0x01
    obs.write_bytes(bytes(data))
    with pytest.raises(ChunkError, match=f"chunk-00002: content hash {older}:"):
        ChunkDataset.open(tmp_path / "ds", verify=True)
    manifest["chunks"][0]["hash"] = "md5:00"
    path.write_text(json.dumps(manifest))
    with pytest.raises(ChunkError, match="algorithm in \\('xxh3', 'crc32', 'sha256'\\), got 'md5:00'"):
        ChunkDataset.open(tmp_path / "ds", verify=True)


def test_strided_and_large_arrays_are_written_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(hashing, "_BLOCK_BYTES", 64)  # many blocks per key
    base = np.arange(2 * 50 * 6, dtype=np.float32).reshape(50, 12)
    strided = base[:, ::2]  # not C-contiguous: copied block by block, never whole
    flags = np.arange(50) % 3 == 0
    info = chunks.write_chunk({"a": strided, "b": flags}, tmp_path / "c")
    back = TensorDict.load_memmap(tmp_path / "c")
    np.testing.assert_array_equal(back["a"].numpy(), strided)
    np.testing.assert_array_equal(back["b"].numpy(), flags)
    spec = chunks.RowSpec.from_arrays({"a": strided, "b": flags})
    assert info.hash == chunks.hash_arrays({"a": np.ascontiguousarray(strided), "b": flags}, spec)
    assert info.hash != chunks.hash_arrays({"a": np.ascontiguousarray(strided) + 1, "b": flags}, spec)


def test_damaged_manifests_are_refused_when_opened(tmp_path):
    write_dataset({"x": np.arange(8.0)}, tmp_path / "ds", chunk_rows=4)
    manifest = tmp_path / "ds" / "manifest.json"
    good = manifest.read_text()
    manifest.write_text(good[: len(good) // 2])  # truncated
    with pytest.raises(ChunkError, match="not valid JSON"):
        ChunkDataset.open(tmp_path / "ds")
    import json

    m = json.loads(good)
    m["rows"] = 9  # disagrees with its chunks
    manifest.write_text(json.dumps(m))
    with pytest.raises(ChunkError, match="says 9 rows, but its chunks hold 8"):
        ChunkDataset.open(tmp_path / "ds")
    manifest.write_text(good)
    (tmp_path / "ds" / "chunk-00001" / "x.memmap").unlink()
    with pytest.raises(ChunkError, match="chunk-00001: file for key 'x' is missing"):
        ChunkDataset.open(tmp_path / "ds")


def test_short_writes_and_no_fallocate_still_write_every_byte(tmp_path, monkeypatch):
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: real(fd, data[:7], offset))  # 7 bytes a call at most
    monkeypatch.setattr(files, "_FALLOCATE", None)  # a platform without Linux fallocate
    arrays = {"a": np.arange(300, dtype=np.float32).reshape(100, 3), "b": np.arange(100) % 2 == 0}
    info = chunks.write_chunk(arrays, tmp_path / "c")
    back = TensorDict.load_memmap(tmp_path / "c")
    np.testing.assert_array_equal(back["a"].numpy(), arrays["a"])
    np.testing.assert_array_equal(back["b"].numpy(), arrays["b"])
    assert info.hash == chunks.hash_arrays(arrays, chunks.RowSpec.from_arrays(arrays))


def test_a_failed_fallocate_is_ignored(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(files, "_FALLOCATE", lambda fd, mode, off, n: calls.append(n) or -1)  # e.g. EOPNOTSUPP
    arrays = {"a": np.arange(10, dtype=np.int64)}
    chunks.write_chunk(arrays, tmp_path / "c")
    assert calls == [80]
    np.testing.assert_array_equal(TensorDict.load_memmap(tmp_path / "c")["a"].numpy(), arrays["a"])


def test_a_zero_width_column_round_trips(tmp_path):
    data = {"x": np.arange(6, dtype=np.float32).reshape(3, 2), "empty": np.zeros((3, 0), np.float32)}
    ds = write_dataset(data, tmp_path / "ds")
    again = ChunkDataset.open(tmp_path / "ds", verify=True)
    np.testing.assert_array_equal(again.read()["x"], data["x"])
    assert again.read()["empty"].shape == (3, 0) and ds.gather(np.array([2, 0]))["empty"].shape == (2, 0)


def test_a_pwrite_that_writes_nothing_raises_instead_of_looping(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: 0)
    with pytest.raises(OSError, match="pwrite wrote nothing"):
        chunks.write_chunk({"a": np.arange(10, dtype=np.int64)}, tmp_path / "c")


def test_big_endian_rows_are_written_as_their_values(tmp_path):
    values = np.arange(12, dtype=np.float32).reshape(6, 2)
    data = {"x": values.astype(">f4"), "i": np.arange(6).astype(">i8")}
    ds = write_dataset(data, tmp_path / "ds", chunk_rows=4)
    back = ChunkDataset.open(tmp_path / "ds", verify=True).read()
    np.testing.assert_array_equal(back["x"], values)
    np.testing.assert_array_equal(back["i"], np.arange(6))
    assert back["x"].dtype == np.float32 and ds[5]["x"].tolist() == [10.0, 11.0]
