"""Chunk writes and hashes at their edges: odd layouts, flipped bytes, short writes, rewrites."""
from __future__ import annotations

import hashlib
import json
import os
import zlib

import numpy as np
import pytest

from rayrb.core.schema import RowSpec
from rayrb.io import chunks, files
from rayrb.io.chunks import ChunkDataset, ChunkError, write_chunk, write_dataset, write_manifest


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
    monkeypatch.setattr(files, "_FALLOCATE", lambda fd, mode, offset, length: -1)  # e.g. EOPNOTSUPP
    arrays = odd_layouts(rows=40)
    ds = write_dataset(arrays, tmp_path / "a", chunk_rows=17)
    assert len(calls) > 10
    monkeypatch.setattr(files, "_FALLOCATE", None)
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
