"""Cluster-scale preprocessing: parity with TorchRL, resume, locality, Arrow interop, errors."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import run_marked
from tensordict import TensorDict

import rayrb.io.preprocess as preprocess_module
from rayrb import ChunkDataset, OfflineToOnlineReplayBuffer, PreprocessError, export_parquet, preprocess, write_dataset
from rayrb.io.preprocess import arrow_to_arrays

pytestmark = pytest.mark.usefixtures("ray_session")


def affine(td):
    """Works on one row or on a chunk, like TorchRL's preprocess functions."""
    td["X"] = td["X"] * 2 + 1
    td["norm"] = td["X"].pow(2).sum(-1)
    return td


def source(tmp_path, n=200):
    g = torch.Generator().manual_seed(0)
    return write_dataset({"X": torch.randn(n, 3, generator=g).numpy(), "y": np.arange(n, dtype=np.int64)},
                         tmp_path / "src", chunk_rows=64)


def test_same_output_as_torchrl_preprocess(data_home, tmp_path, monkeypatch):
    from torchrl.data.datasets import OpenMLExperienceReplay

    from rayrb.io.datasets.openml import load_openml

    monkeypatch.setenv("SCIKIT_LEARN_DATA", str(data_home))
    trl = OpenMLExperienceReplay("magic", batch_size=8, root=tmp_path / "trl")
    ref = trl.preprocess(affine, num_workers=2, dest=tmp_path / "trl_out", mp_start_method="fork")._storage
    ds = load_openml("magic", root=tmp_path, data_home=data_home, dtype="float64")
    out = preprocess(ds, affine, tmp_path / "rayrb_out", num_workers=2, chunk_rows=4000, pbar=False).read()
    assert set(out) == {"X", "y", "norm"}
    for k in out:
        np.testing.assert_array_equal(out[k], ref[k].numpy())


def test_batched_and_per_row_paths_agree(tmp_path):
    src = source(tmp_path)
    a = preprocess(src, affine, tmp_path / "rows", pbar=False).read()
    b = preprocess(src, affine, tmp_path / "batched", batched=True, pbar=False).read()
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    np.testing.assert_allclose(a["X"], src.read()["X"] * 2 + 1, rtol=1e-6)


def test_num_frames_transforms_only_the_first_rows(tmp_path):
    out = preprocess(source(tmp_path), affine, tmp_path / "out", num_frames=70, chunk_rows=32, pbar=False)
    assert len(out) == 70 and out.read()["y"].tolist() == list(range(70))


def make_flaky(control):
    """A batched fn that logs each chunk it computes and fails on chunks listed in a control file."""

    def flaky(td):
        cfg = json.loads(open(control).read())
        first = int(td["y"][0])
        with open(cfg["log"], "a") as f:
            f.write(f"{first}\n")
        if first in cfg["fail"]:
            raise RuntimeError("worker lost")
        td["X"] = td["X"] + 1
        return td

    return flaky


def test_resume_recomputes_only_missing_or_corrupt_chunks(tmp_path, monkeypatch):
    src = source(tmp_path, n=200)  # 5 input chunks of 40 rows
    log, control = tmp_path / "calls.log", tmp_path / "control.json"
    flaky = make_flaky(str(control))
    clean = preprocess(src, lambda td: td.set("X", td["X"] + 1), tmp_path / "clean", batched=True, chunk_rows=40,
                       pbar=False).read()

    def run(fail):
        control.write_text(json.dumps({"fail": fail, "log": str(log)}))
        return preprocess(src, flaky, tmp_path / "out", batched=True, chunk_rows=40, num_workers=1, pbar=False)

    with pytest.raises(PreprocessError, match=r"chunk-00002 \(rows 80..119\): RuntimeError: worker lost"):
        run(fail=[80])  # fn raises at its third chunk
    assert not (tmp_path / "out").exists()  # a run that raised leaves dest as it found it (contract 9)
    check_spec = preprocess_module._check_spec

    def interrupted(infos, i):  # Ctrl-C once two chunks are done: an interrupted run keeps them
        check_spec(infos, i)
        if len(infos) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(preprocess_module, "_check_spec", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(fail=[])
    monkeypatch.setattr(preprocess_module, "_check_spec", check_spec)
    assert not (tmp_path / "out" / "manifest.json").exists()
    done_before = sorted(p.name for p in (tmp_path / "out").glob("*.done.json"))
    assert "chunk-00002.done.json" not in done_before and "chunk-00000.done.json" in done_before
    # corrupt one finished chunk: its hash no longer matches, so it is redone too
    victim = tmp_path / "out" / "chunk-00000" / "X.memmap"
    data = bytearray(victim.read_bytes())
    data[0] ^= 0xFF
    victim.write_bytes(bytes(data))
    log.write_text("")
    out = run(fail=[])
    recomputed = sorted(int(x) // 40 for x in log.read_text().split())
    expected = sorted({0} | {i for i in range(5) if f"chunk-{i:05d}.done.json" not in done_before})
    assert recomputed == expected and 1 not in recomputed
    for k in clean:
        np.testing.assert_array_equal(out.read()[k], clean[k])
    assert out.verify() is None


def test_resume_of_a_finished_run_recomputes_nothing(tmp_path):
    src = source(tmp_path)
    first = preprocess(src, affine, tmp_path / "out", batched=True, pbar=False)
    stamp = {p: p.stat().st_mtime_ns for p in (tmp_path / "out").rglob("*.memmap")}
    again = preprocess(src, affine, tmp_path / "out", batched=True, pbar=False)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "out").rglob("*.memmap")} == stamp
    assert [c.hash for c in again.chunks] == [c.hash for c in first.chunks]


def test_fn_error_names_chunk_row_and_cause(tmp_path):
    def bad(td):
        if int(td["y"]) == 77:
            raise KeyError("no such key: boom")
        return td

    with pytest.raises(PreprocessError) as e:
        preprocess(source(tmp_path), bad, tmp_path / "out", chunk_rows=32, pbar=False)
    msg = str(e.value)
    assert "chunk-00002" in msg and "row 77" in msg and "KeyError" in msg and "boom" in msg
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_schema_change_between_chunks_is_refused(tmp_path):
    def shifty(td):
        if int(td["y"][0]) >= 64:
            td["extra"] = td["y"].float()
        return td

    with pytest.raises(PreprocessError, match="every chunk must have the same keys"):
        preprocess(source(tmp_path), shifty, tmp_path / "out", batched=True, chunk_rows=64, num_workers=1, pbar=False)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_bad_destinations_and_arguments(tmp_path):
    src = source(tmp_path)
    with pytest.raises(ValueError, match="must not be the source"):
        preprocess(src, affine, src.root, pbar=False)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty and is not an interrupted run of this job"):
        preprocess(src, affine, other, pbar=False)
    assert (other / "notes.txt").read_text() == "mine"
    preprocess(src, affine, tmp_path / "done", batched=True, pbar=False)
    with pytest.raises(ValueError, match="different source, fn or arguments"):
        preprocess(src, lambda td: td, tmp_path / "done", batched=True, pbar=False)
    for bad in (0, -5):
        with pytest.raises(ValueError, match=f"num_frames must be a positive integer, got {bad}"):
            preprocess(src, affine, tmp_path / "x", num_frames=bad, pbar=False)


def test_parquet_round_trip_and_parquet_source(tmp_path):
    td = TensorDict({"obs": torch.randn(50, 2, 3), "a": torch.arange(50), "next": {"r": torch.randn(50)}}, [50])
    ds = write_dataset(td, tmp_path / "src", chunk_rows=20)
    files = export_parquet(ds, tmp_path / "pq")
    assert [f.name for f in files] == ["chunk-00000.parquet", "chunk-00001.parquet", "chunk-00002.parquet"]
    import pandas as pd

    frame = pd.read_parquet(tmp_path / "pq")  # readable by pandas (and Ray Data)
    assert len(frame) == 50 and "next.r" in frame.columns
    out = preprocess(tmp_path / "pq", lambda t: t.set("a", t["a"] * 10), tmp_path / "out", batched=True, pbar=False)
    got = out.read()
    np.testing.assert_array_equal(got["obs"], td["obs"].numpy())
    np.testing.assert_array_equal(got["a"], td["a"].numpy() * 10)
    np.testing.assert_array_equal(got["next/r"], td["next", "r"].numpy())


def test_arrow_table_source(tmp_path):
    table = pa.table({"x": pa.array(np.arange(10, dtype=np.float32)),
                      "v": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(20, dtype=np.int64)), 2)})
    assert arrow_to_arrays(table)["v"].shape == (10, 2)
    out = preprocess(table, lambda t: t.set("x", t["x"] + 1), tmp_path / "out", batched=True, pbar=False)
    np.testing.assert_array_equal(out.read()["x"], np.arange(10, dtype=np.float32) + 1)
    with pytest.raises(TypeError, match="fixed-width numeric column"):
        arrow_to_arrays(pa.table({"s": ["a", "b"]}))


def test_buffer_preprocess_result_is_an_offline_dataset(tmp_path):
    rb = OfflineToOnlineReplayBuffer(source(tmp_path), online_capacity=10, seed=0)
    try:
        new = rb.preprocess(affine, tmp_path / "new", batched=True, pbar=False)
    finally:
        rb.shutdown()
    assert isinstance(new, ChunkDataset) and "norm" in new.spec.keys
    rb2 = OfflineToOnlineReplayBuffer(new, online_capacity=10, seed=0)
    try:
        assert set(rb2.sample(8).keys()) == {"X", "y", "norm"}
    finally:
        rb2.shutdown()


def test_two_node_cluster_records_where_chunks_were_written(tmp_path):
    result = run_marked("cluster_preprocess.py", str(tmp_path))
    assert result["values_ok"] and result["sampled"] == 16
    assert len(set(result["nodes"])) == 2, result  # both nodes wrote chunks
    assert set(result["nodes"]) <= set(result["alive"])


def test_in_place_fn_never_touches_the_source(tmp_path):
    src = source(tmp_path)
    before = src.read()

    def in_place(td):
        td["X"].mul_(-1)  # writes into the mapped input: copy-on-write keeps it private
        return td

    out = preprocess(src, in_place, tmp_path / "out", batched=True, chunk_rows=64, pbar=False).read()
    np.testing.assert_array_equal(out["X"], -before["X"])
    src.verify()
    np.testing.assert_array_equal(src.read()["X"], before["X"])


def make_sleepy(log: str):
    def sleepy(td):
        import os
        import time

        start = time.time()
        time.sleep(0.2)
        with open(log, "a") as f:
            f.write(f"{start} {time.time()} {os.getpid()}\n")
        return td

    return sleepy


@pytest.mark.parametrize("num_workers", [1, 2])
def test_num_workers_caps_the_tasks_running_at_once(tmp_path, num_workers):
    # the session's Ray has 2 CPUs: with num_workers=1 a second task must wait, even though one is queued
    # ahead when the cluster is full (num_workers=2)
    log = tmp_path / "intervals.log"
    out = preprocess(source(tmp_path, n=120), make_sleepy(str(log)), tmp_path / "out", batched=True, chunk_rows=20,
                     num_workers=num_workers, pbar=False)
    assert len(out) == 120
    spans = sorted(tuple(map(float, line.split()[:2])) for line in log.read_text().split("\n") if line)
    assert len(spans) == 6
    most = max(sum(1 for a, b in spans if a <= t < b) for t, _ in spans)
    assert most <= num_workers, spans
