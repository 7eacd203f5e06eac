"""Rows cut into parts Ray carries inside a call (rayrb.actors.inline): every part under Ray's inline size, the rows
whole and in order again, and what goes through the object store instead. No Ray."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from rayrb.actors.inline import INLINE_BYTES, PART_BYTES, cut, joined

RAY_INLINE = 100 << 10  # Ray's max_direct_call_object_size: an argument over it is put in the object store


@pytest.mark.parametrize("rows, width", [(1, 8), (16, 54), (406, 54), (407, 54), (1000, 54), (4000, 30), (3, 7000)])
def test_parts_stay_under_rays_inline_size_and_join_to_the_rows_in_order(rows, width):
    rng = np.random.default_rng(rows)
    data = {"obs": rng.standard_normal((rows, width), dtype=np.float32), "label": np.arange(rows, dtype=np.int64),
            "done": rng.random(rows) < 0.1, "next/obs": rng.integers(0, 255, (rows, 2, 3), dtype=np.uint8)}
    parts = cut(data)
    assert parts is not None
    for p in parts:
        assert set(p) == set(data) and len({len(v) for v in p.values()}) == 1
        assert sum(v.nbytes for v in p.values()) <= PART_BYTES < RAY_INLINE
    back = joined(parts)
    for k, v in data.items():
        assert back[k].dtype == v.dtype and np.array_equal(back[k], v)
    assert [int(p["label"][0]) for p in parts] == sorted(int(p["label"][0]) for p in parts)  # in order


def test_writes_over_a_mib_or_with_a_row_over_a_part_or_no_rows_go_through_the_object_store():
    assert cut({"x": np.zeros((INLINE_BYTES // 8 + 1,), np.int64)}) is None
    assert cut({"x": np.zeros((INLINE_BYTES // 8,), np.int64)}) is not None  # exactly a MiB still goes inline
    assert cut({"x": np.zeros((2, PART_BYTES + 1), np.uint8)}) is None
    assert cut({"x": np.zeros((0, 4), np.float32)}) is None
    assert cut({}) is None


def test_parts_are_views_and_a_single_part_joins_without_a_copy():
    data = {"x": np.arange(10, dtype=np.int64)}
    (part,) = cut(data)
    assert np.shares_memory(part["x"], data["x"])
    assert joined([part])["x"] is part["x"]


def serialized_bytes(part: dict) -> int:
    """About what Ray weighs against its inline size: the pickle (protocol 5) of the part with its arrays' buffers
    out of band, each buffer aligned to 64 bytes with 64 of metadata (more than Ray adds)."""
    buffers: list = []
    inband = pickle.dumps(part, protocol=5, buffer_callback=buffers.append)
    return len(inband) + sum(64 + -(-b.raw().nbytes // 64) * 64 for b in buffers)


@pytest.mark.parametrize("keys", [1, 2, 10, 100, 170, 200])
def test_parts_with_many_keys_stay_under_rays_inline_size_serialized(keys):
    """Each array adds its key and framing to a part: with many keys the parts hold fewer rows, and where the
    framing alone would fill a part (200 keys here) the rows go through the object store."""
    data = {f"observation/component_{i:03d}/value": np.ones((3000, 3), np.float32) for i in range(keys)}
    if sum(v.nbytes for v in data.values()) > INLINE_BYTES:
        data = {k: v[:INLINE_BYTES // (12 * keys)] for k, v in data.items()}
    parts = cut(data)
    if keys == 200:
        assert parts is None
        return
    assert max(serialized_bytes(p) for p in parts) < RAY_INLINE
    assert sum(len(next(iter(p.values()))) for p in parts) == len(next(iter(data.values())))
