"""write_batches: a chunk dataset from a stream of batches, in bounded memory, the same chunks as write_dataset, and
resumed after an interruption (an exception, a batch refused, a process killed) without a row lost or doubled."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rayrb.errors import ChunkError, DirectoryNotEmptyError, InvalidArgumentError, InvalidArgumentTypeError, SchemaError
from rayrb.io.chunks import ChunkDataset, write_dataset
from rayrb.io.manifest import MANIFEST
from rayrb.io.streaming import PARTIAL, write_batches

SIZES = [0, 7, 300, 1, 64, 0, 129, 500, 3]  # ragged, with empty batches


def rows(start: int, n: int) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + n, dtype=np.int64)
    return {"obs": np.stack([ids, -ids], 1).astype(np.float32), "id": ids, "next/reward": ids.astype(np.float64)}


def stream(sizes=SIZES, fail_at: int | None = None):
    """The batches of ``sizes`` rows, in order; raising before batch ``fail_at`` (an interrupted source)."""
    def batches(start: int = 0):
        at = 0
        for i, n in enumerate(sizes):
            if i == fail_at:
                raise RuntimeError("the source broke")
            if at + n > start:
                skip = max(0, start - at)
                yield rows(at + skip, n - skip)
            at += n
    return batches


def everything(ds: ChunkDataset) -> dict[str, np.ndarray]:
    return ds.gather(np.arange(len(ds)))


def test_the_same_chunks_and_hashes_as_write_dataset(tmp_path):
    total = sum(SIZES)
    whole = write_dataset(rows(0, total), tmp_path / "whole", chunk_rows=100)
    streamed = write_batches(stream()(), tmp_path / "streamed", chunk_rows=100)
    assert [(c.rows, c.hash) for c in streamed.chunks] == [(c.rows, c.hash) for c in whole.chunks]
    assert streamed.spec.to_json() == whole.spec.to_json()
    got = everything(streamed)
    assert got["id"].tolist() == list(range(total))
    assert not (tmp_path / "streamed" / PARTIAL).exists()


def test_tensordict_batches_and_the_default_chunk_size(tmp_path):
    def batches():
        for i in range(3):
            ids = torch.arange(10 * i, 10 * i + 10)
            yield TensorDict({"obs": ids.float()[:, None], "next": {"done": ids % 3 == 0}}, [10])
    ds = write_batches(batches(), tmp_path / "td")
    assert len(ds) == 30 and len(ds.chunks) == 1 and sorted(ds.spec.keys) == ["next/done", "obs"]
    assert everything(ds)["next/done"][:, ...].reshape(-1).tolist() == [i % 3 == 0 for i in range(30)]


def test_memory_holds_about_one_chunk_not_the_stream(tmp_path):
    n, batch, chunk = 40, 25_000, 50_000  # 40 batches of 25,000 rows of 16 floats: 64 MB in all, chunks of 3.2 MB
    def batches():
        for i in range(n):
            yield {"x": np.full((batch, 16), i, np.float32)}
    tracemalloc.start()
    try:
        ds = write_batches(batches(), tmp_path / "big", chunk_rows=chunk)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(ds) == n * batch
    assert peak < 4 * chunk * 16 * 4, peak  # a chunk and a batch or two, never the 64 MB stream


@pytest.mark.parametrize("seek", [True, False], ids=["callable", "iterable"])
def test_an_interrupted_write_is_no_dataset_and_resumes_to_the_same_rows(tmp_path, seek):
    root = tmp_path / "ds"
    with pytest.raises(RuntimeError, match="broke"):
        write_batches(stream(fail_at=7)(), root, chunk_rows=100)
    assert (root / PARTIAL).exists() and not (root / MANIFEST).exists()
    with pytest.raises(ChunkError):
        ChunkDataset.open(root)  # a part is never taken for the whole
    source = stream() if seek else stream()()
    ds = write_batches(source, root, chunk_rows=100, resume=True)
    whole = write_dataset(rows(0, sum(SIZES)), tmp_path / "whole", chunk_rows=100)
    assert [(c.rows, c.hash) for c in ds.chunks] == [(c.rows, c.hash) for c in whole.chunks]
    assert everything(ds)["id"].tolist() == list(range(sum(SIZES)))
    assert write_batches(stream()(), root, resume=True).chunks == ds.chunks  # a whole dataset: opened as it is


def test_a_chunk_cut_short_by_the_interruption_is_written_again(tmp_path, monkeypatch):
    import rayrb.io.streaming as streaming

    root, real, calls = tmp_path / "ds", streaming.write_chunk, []

    def dying(block, directory, spec):
        calls.append(directory)
        if len(calls) == 3:  # the third chunk's files are begun, never finished
            real({k: v[:5] for k, v in block.items()}, directory, spec)
            raise OSError("disk went away")
        return real(block, directory, spec)
    monkeypatch.setattr(streaming, "write_chunk", dying)
    with pytest.raises(OSError):
        write_batches(stream()(), root, chunk_rows=100)
    monkeypatch.setattr(streaming, "write_chunk", real)
    ds = write_batches(stream(), root, chunk_rows=100, resume=True)
    assert everything(ds)["id"].tolist() == list(range(sum(SIZES)))
    ChunkDataset.open(root, verify=True)


def test_a_killed_writer_resumes_without_a_row_lost_or_doubled(tmp_path):
    root = tmp_path / "ds"
    script = textwrap.dedent(f"""
        import time, numpy as np
        from rayrb.io.streaming import write_batches
        def batches(start):
            for at in range(start, 10_000, 250):
                time.sleep(0.02)
                yield {{"id": np.arange(at, min(at + 250, 10_000))}}
        write_batches(batches, {str(root)!r}, chunk_rows=1000, resume=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    deadline = time.monotonic() + 60
    while not (root / PARTIAL).exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # mid-stream, maybe mid-chunk
    proc.wait()
    assert not (root / MANIFEST).exists()
    done = subprocess.run([sys.executable, "-c", script], timeout=120)
    assert done.returncode == 0
    ds = ChunkDataset.open(root, verify=True)
    assert everything(ds)["id"].tolist() == list(range(10_000))


def test_a_batch_of_another_schema_is_refused_naming_it(tmp_path):
    def batches():
        yield rows(0, 10)
        yield {**rows(10, 10), "id": np.arange(10, 20, dtype=np.int32)}
    with pytest.raises(SchemaError, match="batch 1"):
        write_batches(batches(), tmp_path / "ds", chunk_rows=4)
    assert not (tmp_path / "ds" / MANIFEST).exists()


@pytest.mark.parametrize("bad", [{"obs": np.float32(1), "id": np.int64(1), "next/reward": 1.0},
                                 {"obs": np.zeros(2, np.float32), "id": 5, "next/reward": np.zeros(1)}],
                         ids=["scalars", "one-scalar"])
def test_a_batch_of_scalars_is_refused_as_write_dataset_refuses_it(tmp_path, bad):
    """A batch holding a key with no row dimension: the same SchemaError as ``write_dataset``'s, not a TypeError
    from counting its rows; chunks before it stay recorded, no dataset is made."""
    with pytest.raises(SchemaError, match="expected an array with a row dimension, got a scalar"):
        write_batches(iter([rows(0, 10), bad]), tmp_path / "ds", chunk_rows=4)
    with pytest.raises(SchemaError, match="expected an array with a row dimension, got a scalar"):
        write_dataset(bad, tmp_path / "whole")
    assert not (tmp_path / "ds" / MANIFEST).exists() and (tmp_path / "ds" / PARTIAL).exists()


@pytest.mark.parametrize("bad", [[1, 2, 3], None, np.zeros(4)], ids=["list", "none", "array"])
def test_a_batch_that_is_not_rows_by_key_is_refused_by_type(tmp_path, bad):
    with pytest.raises(InvalidArgumentTypeError, match="expected rows as a TensorDict or a dict of tensors or arrays"):
        write_batches(iter([rows(0, 10), bad]), tmp_path / "ds", chunk_rows=4)
    with pytest.raises(InvalidArgumentTypeError, match=f"got {type(bad).__name__}"):
        write_dataset(bad, tmp_path / "whole")


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_file_where_the_dataset_goes_is_refused_and_kept(tmp_path, overwrite):
    (tmp_path / "ds").write_text("mine")
    for write in (lambda: write_batches(stream()(), tmp_path / "ds", overwrite=overwrite),
                  lambda: write_dataset(rows(0, 5), tmp_path / "ds", overwrite=overwrite)):
        with pytest.raises(DirectoryNotEmptyError, match="got a file at"):
            write()
    assert (tmp_path / "ds").read_text() == "mine"


def test_a_resume_that_cannot_be_the_same_write_is_refused(tmp_path):
    root = tmp_path / "ds"
    with pytest.raises(RuntimeError):
        write_batches(stream(fail_at=7)(), root, chunk_rows=100)
    with pytest.raises(InvalidArgumentError, match="chunk_rows=100"):
        write_batches(stream(), root, chunk_rows=50, resume=True)
    with pytest.raises(SchemaError):
        write_batches(lambda start: iter([{"other": np.zeros(3)}]), root, resume=True)
    ended = tmp_path / "ended"
    write_batches(stream([150])(), ended, chunk_rows=100)
    (ended / MANIFEST).rename(ended / PARTIAL)  # as if killed between the last chunk and the manifest
    with pytest.raises(InvalidArgumentError, match="end at row 150"):
        write_batches(stream([150, 10]), ended, resume=True)


def test_a_root_in_use_and_an_empty_stream_are_refused(tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    with pytest.raises(DirectoryNotEmptyError):
        write_batches(stream()(), tmp_path / "used")
    with pytest.raises(DirectoryNotEmptyError):
        write_batches(stream()(), tmp_path / "used", resume=True)  # nothing recorded there to resume
    assert (tmp_path / "used" / "notes.txt").read_text() == "mine"
    with pytest.raises(InvalidArgumentError, match="at least one row"):
        write_batches(iter([rows(0, 0)]), tmp_path / "empty")
    with pytest.raises(InvalidArgumentError, match="chunk_rows"):
        write_batches(stream()(), tmp_path / "bad", chunk_rows=0)


def test_a_whole_dataset_wins_over_a_record_left_beside_it(tmp_path):
    """Killed between the manifest and removing the record: the manifest names the whole dataset, and a resume
    opens it as it is, whatever the record says."""
    root = tmp_path / "ds"
    whole = write_batches(stream()(), root, chunk_rows=100)
    (root / PARTIAL).write_text((root / MANIFEST).read_text().replace('"rows": 1004', '"rows": 100'))
    again = write_batches(stream([5]), root, chunk_rows=100, resume=True)
    assert again.chunks == whole.chunks and everything(again)["id"].tolist() == list(range(sum(SIZES)))
