"""Writing a dataset into a directory: keys as files, one writer at a time, a failed write taking back what it
made, and a streaming write resumed after a kill in each window no record covers. No Ray."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import rayrb.io.chunks as chunks
import rayrb.io.streaming as streaming
from rayrb.errors import DirectoryNotEmptyError, SchemaError
from rayrb.io.chunks import ChunkDataset, write_dataset
from rayrb.io.claim import CLAIM
from rayrb.io.streaming import write_batches


@pytest.mark.parametrize("key", ["sepal length", "a:b", "ratio%", "a\\b", "q?", "obs/left eye", "é/x"])
def test_keys_whose_file_names_are_encoded_round_trip(tmp_path, key):
    ds = write_dataset({key: np.arange(3.0), "y": np.arange(3)}, tmp_path / "ds", chunk_rows=2)
    assert ChunkDataset.open(tmp_path / "ds").read()[key].tolist() == [0.0, 1.0, 2.0] and ds.verify() is None


@pytest.mark.parametrize("arrays, message", [
    ({"a": np.arange(3), "a/b": np.arange(3)}, "keys 'a' and 'a/b': expected a key to be a value or hold keys"),
    ({"a/b": np.arange(3), "a": {"b": np.arange(3) * 7}}, "key 'a/b': expected it once, got it twice"),
    ({"x" * 300: np.arange(3)}, "expected names of at most 248 bytes as files"),
])
def test_keys_that_cannot_name_one_file_each_are_refused_before_anything_is_written(tmp_path, arrays, message):
    with pytest.raises(SchemaError, match=message):
        write_dataset(arrays, tmp_path / "ds")
    assert not (tmp_path / "ds").exists()


def test_a_write_that_raises_leaves_the_directory_as_it_found_it(tmp_path, monkeypatch):
    real = chunks.write_chunk

    def full_disk(block, directory, *args, **kwargs):
        if directory.name == "chunk-00001":
            raise OSError(28, "No space left on device")
        return real(block, directory, *args, **kwargs)

    monkeypatch.setattr(chunks, "write_chunk", full_disk)
    for root in (tmp_path / "absent", tmp_path / "empty"):
        if root.name == "empty":
            root.mkdir()
        with pytest.raises(OSError, match="No space left"):
            write_dataset({"x": np.arange(10.0)}, root, chunk_rows=4)
        assert (not root.exists()) if root.name == "absent" else list(root.iterdir()) == []
    monkeypatch.setattr(chunks, "write_chunk", real)
    assert len(write_dataset({"x": np.arange(10.0)}, tmp_path / "absent", chunk_rows=4)) == 10  # no overwrite needed


def test_two_writers_of_one_directory_at_once_one_is_refused_and_the_other_writes_its_rows(tmp_path):
    """Both pass the 'absent or empty' look before either wrote a chunk (a stream fills its first chunk slowly):
    one holds the directory (``rayrb.io.claim``), the other is refused; the dataset holds the first's rows only.
    Without the claim the second rewrote the first's chunks under the first's manifest, and it opened."""
    root = tmp_path / "ds"
    go, inside, errors = threading.Event(), threading.Barrier(3), {}

    def stream(value):
        inside.wait(timeout=30)  # both writers are past their look at the directory
        go.wait(timeout=30)
        yield {"x": np.full(8, value)}

    def run(name, value):
        try:
            write_batches(stream(value), root, chunk_rows=4)
        except DirectoryNotEmptyError as e:
            errors[name] = e
            inside.wait(timeout=30)

    threads = [threading.Thread(target=run, args=(n, v)) for n, v in (("a", 0.0), ("b", 1.0))]
    for t in threads:
        t.start()
    inside.wait(timeout=30)
    go.set()
    for t in threads:
        t.join(timeout=60)
    assert len(errors) == 1 and "writing it now" in str(next(iter(errors.values())))
    x = ChunkDataset.open(root).read()["x"]
    assert x.tolist() == [1.0 if "a" in errors else 0.0] * 8 and not (root / CLAIM).exists()


def _killed_at(monkeypatch, which):
    real = streaming.write_manifest

    def killed(root, spec, chunk_list, *, name="manifest.json", **kwargs):
        if name == which:
            raise KeyboardInterrupt("killed")
        return real(root, spec, chunk_list, name=name, **kwargs)

    monkeypatch.setattr(streaming, "write_manifest", killed)
    return real


@pytest.mark.parametrize("which, n", [(streaming.PARTIAL, 10), (streaming.MANIFEST, 3)])
def test_a_stream_killed_before_its_first_record_or_its_manifest_resumes(tmp_path, monkeypatch, which, n):
    """Killed with chunk 0 on disk and no record of it yet, or after the one short chunk of a stream shorter than
    a chunk: ``resume=True`` with the same arguments finishes the dataset."""
    real = _killed_at(monkeypatch, which)
    with pytest.raises(KeyboardInterrupt):
        write_batches([{"x": np.arange(float(n))}], tmp_path / "ds", chunk_rows=4)
    monkeypatch.setattr(streaming, "write_manifest", real)
    with pytest.raises(DirectoryNotEmptyError):  # without resume, the leftovers are not taken for a new dataset
        write_batches([{"x": np.arange(float(n))}], tmp_path / "ds", chunk_rows=4)
    ds = write_batches([{"x": np.arange(float(n))}], tmp_path / "ds", chunk_rows=4, resume=True)
    assert ds.read()["x"].tolist() == list(np.arange(float(n)))


def test_a_preprocess_job_is_the_same_in_another_process_and_a_closures_values_make_it_another():
    """The job a destination is for: rerun in a new process (a resubmitted job) it is found again, whatever the
    memory addresses; a closure over other values, or other defaults, is another job."""
    import subprocess
    import sys

    code = ("from rayrb.io.destination import fn_fingerprint\n"
            "def make(k, scale=1.0):\n"
            "    def fn(td, _m=object()):\n"
            "        return td * k * scale\n"
            "    return fn\n"
            "print(fn_fingerprint(make(2)), fn_fingerprint(make(3)), fn_fingerprint(make(2, 0.5)))")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120) for _ in "ab"]
    a, b = (r.stdout.split() for r in runs)
    assert a == b and len(a) == 3 and len(set(a)) == 3, (a, b, runs[0].stderr[-2000:])
