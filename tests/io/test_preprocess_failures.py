"""A preprocess run that raises leaves its destination as it found it (contract 9), resumes only chunks the same
function made, and names the chunk whose task failed, whatever failed it."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from rayrb import PreprocessError, preprocess, write_dataset

pytestmark = pytest.mark.usefixtures("ray_session")


def scaled_by(k, fail_from=None):
    def fn(td):  # one source text for every k
        if fail_from is not None and float(td["x"][0]) >= fail_from:
            raise RuntimeError("a bug in fn")
        td["x"] = td["x"] * k
        return td
    return fn


def test_a_run_that_raised_leaves_dest_as_it_was_and_another_closure_never_resumes_it(tmp_path):
    src = write_dataset({"x": np.arange(40, dtype=np.float32)}, tmp_path / "src")
    with pytest.raises(PreprocessError, match="RuntimeError: a bug in fn"):
        preprocess(src, scaled_by(2, fail_from=20), tmp_path / "out", batched=True, chunk_rows=5, pbar=False,
                   num_workers=1)
    assert not (tmp_path / "out").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(PreprocessError):
        preprocess(src, scaled_by(2, fail_from=20), tmp_path / "empty", batched=True, chunk_rows=5, pbar=False)
    assert list((tmp_path / "empty").iterdir()) == []
    out = preprocess(src, scaled_by(3), tmp_path / "out", batched=True, chunk_rows=5, pbar=False, num_workers=1)
    np.testing.assert_array_equal(out.read()["x"], np.arange(40, dtype=np.float32) * 3)
    # an unfinished run of another closure (left by an interruption) is refused, or started over with resume=False
    (tmp_path / "out" / "manifest.json").unlink()
    with pytest.raises(ValueError, match="not an interrupted run of this job"):
        preprocess(src, scaled_by(4), tmp_path / "out", batched=True, chunk_rows=5, pbar=False)
    out = preprocess(src, scaled_by(4), tmp_path / "out", batched=True, chunk_rows=5, pbar=False, resume=False)
    np.testing.assert_array_equal(out.read()["x"], np.arange(40, dtype=np.float32) * 4)
    with pytest.raises(ValueError, match="not an interrupted run of this job"):  # a finished dataset stays
        preprocess(src, scaled_by(5), tmp_path / "out", batched=True, chunk_rows=5, pbar=False, resume=False)


def _dies_on_chunk_2(td):
    if float(td["x"][0]) == 10:
        os.kill(os.getpid(), signal.SIGKILL)
    return td


def test_a_chunk_whose_worker_always_dies_is_a_preprocess_error_naming_it(tmp_path):
    src = write_dataset({"x": np.arange(40, dtype=np.float32)}, tmp_path / "src")
    with pytest.raises(PreprocessError, match=r"chunk-00002 \(input rows 10 to 15\): its task failed: WorkerCrashed"):
        preprocess(src, _dies_on_chunk_2, tmp_path / "out", batched=True, chunk_rows=5, pbar=False,
                   task_options={"max_retries": 0})
    assert not (tmp_path / "out").exists()
