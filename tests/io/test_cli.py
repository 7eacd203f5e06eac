import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from rayrb.cli import main
from rayrb.io.chunks import ChunkDataset, write_dataset


def test_info_verify_export(tmp_path, capsys):
    write_dataset({"x": np.arange(6, dtype=np.float32)}, tmp_path / "ds", chunk_rows=4)
    assert main(["info", str(tmp_path / "ds")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["rows"] == 6 and info["chunks"] == 2
    assert main(["verify", str(tmp_path / "ds")]) == 0
    assert main(["export-parquet", str(tmp_path / "ds"), str(tmp_path / "pq")]) == 0
    assert len(list((tmp_path / "pq").glob("*.parquet"))) == 2
    (tmp_path / "ds" / "chunk-00001" / "x.memmap").write_bytes(b"\0" * 8)
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "ds")]) == 1  # a failure, not a crash
    err = capsys.readouterr().err
    assert err.startswith("rayrb verify: error: ") and "chunk-00001: content hash" in err


def test_prepare_openml(tmp_path, capsys, data_home):
    assert main(["prepare", "openml:magic", "--data-home", str(data_home), "--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip().endswith("magic-float32")


def test_prepare_writes_another_loaders_rows_as_chunks(tmp_path, capsys, monkeypatch):
    import torch
    from tensordict import TensorDict

    from rayrb.io.datasets import registry

    seen = []
    monkeypatch.setitem(registry._REGISTRY, "scratch_source", lambda name, **kw: seen.append((name, kw)) or TensorDict(
        {"obs": torch.arange(10.0)}, [10]))
    assert main(["prepare", "scratch_source:suite/task-v0", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert seen == [("suite/task-v0", {"batch_size": 1})]
    assert out == str(tmp_path / "scratch_source" / "suite--task-v0")
    np.testing.assert_array_equal(ChunkDataset.open(out).gather(np.arange(10))["obs"], np.arange(10.0))
    assert main(["prepare", "scratch_source:suite/task-v0", "--root", str(tmp_path)]) == 0  # reused
    assert len(seen) == 1 and capsys.readouterr().out.strip().splitlines()[-1] == out


def test_prepare_that_fails_leaves_no_half_written_dataset(tmp_path, capsys, monkeypatch):
    import torch
    from tensordict import TensorDict

    from rayrb.io import chunks
    from rayrb.io.datasets import registry

    monkeypatch.setitem(registry._REGISTRY, "scratch_source", lambda name, **kw: TensorDict(
        {"obs": torch.arange(10.0)}, [10]))
    real = chunks.write_chunk

    def failing(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(chunks, "write_chunk", failing)
    assert main(["prepare", "scratch_source:x", "--root", str(tmp_path)]) == 1
    assert "disk full" in capsys.readouterr().err
    assert not any((tmp_path / "scratch_source").iterdir())  # nothing half-written is left, nor reused
    monkeypatch.setattr(chunks, "write_chunk", real)
    assert main(["prepare", "scratch_source:x", "--root", str(tmp_path)]) == 0
    assert len(ChunkDataset.open(tmp_path / "scratch_source" / "x")) == 10
    for bad in ("scratch_source:", "scratch_source:.."):
        assert main(["prepare", bad, "--root", str(tmp_path)]) == 1
    assert "expected a dataset name after 'scratch_source:'" in capsys.readouterr().err


def test_exit_codes_for_usage_errors_and_failures(tmp_path, capsys):
    assert main(["info"]) == 2  # missing argument
    assert main(["frobnicate"]) == 2
    assert main(["info", str(tmp_path), "--bogus"]) == 2
    assert main(["preprocess", str(tmp_path), str(tmp_path / "out"), "--fn", "no_colon"]) == 2
    assert main(["preprocess", str(tmp_path), str(tmp_path / "out"), "--fn", "rayrb_no_such_module:f"]) == 2
    assert main(["preprocess", str(tmp_path), str(tmp_path / "out"), "--fn", "json:no_such_function"]) == 2
    err = capsys.readouterr().err
    assert "expected module:function, got 'no_colon'" in err
    assert "cannot import module 'rayrb_no_such_module'" in err
    assert "expected a function 'no_such_function' in module 'json', got NoneType" in err
    assert main(["info", str(tmp_path / "missing")]) == 1
    assert "rayrb info: error: expected a chunk dataset" in capsys.readouterr().err


def test_help_shows_examples_and_address(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "rayrb preprocess" in out and "--address" in out and "exit status" in out
    for cmd in ("prepare", "info", "verify", "export-parquet", "preprocess"):
        assert main([cmd, "--help"]) == 0
        out = capsys.readouterr().out
        assert "example:\n  rayrb " + cmd in out and "--address ADDRESS" in out, cmd


def test_console_script_exit_status(tmp_path):
    rayrb = os.path.join(os.path.dirname(sys.executable), "rayrb")
    if not os.path.exists(rayrb):
        pytest.skip("the rayrb console script is not installed beside this python")
    usage = subprocess.run([rayrb, "verify"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "the following arguments are required: path" in usage.stderr
    failed = subprocess.run([rayrb, "verify", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert failed.returncode == 1 and "rayrb verify: error:" in failed.stderr


@pytest.mark.ray
def test_preprocess_with_a_function_from_the_current_directory(tmp_path, monkeypatch, capsys, ray_session):
    write_dataset({"x": np.arange(10, dtype=np.float32)}, tmp_path / "src", chunk_rows=4)
    work = tmp_path / "work"
    work.mkdir()
    (work / "cli_user_fns.py").write_text("def triple(td):\n    td['x'] = td['x'] * 3\n    return td\n"
                                          "def boom(td):\n    raise RuntimeError('bad row')\n")
    monkeypatch.chdir(work)  # the module lives only here: workers get it by value
    assert main(["preprocess", str(tmp_path / "src"), str(tmp_path / "out"), "--fn", "cli_user_fns:triple",
                 "--batched", "--chunk-rows", "5"]) == 0
    assert capsys.readouterr().out.strip().endswith("out")
    out = ChunkDataset.open(tmp_path / "out", verify=True)
    np.testing.assert_array_equal(out.read()["x"], np.arange(10, dtype=np.float32) * 3)
    assert [c.rows for c in out.chunks] == [5, 5]
    # --address runs verify as a Ray task; a failure there is still exit status 1 with the chunk named
    assert main(["verify", str(tmp_path / "out"), "--address", "auto"]) == 0
    (tmp_path / "out" / "chunk-00001" / "x.memmap").write_bytes(b"\0" * 20)
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "out"), "--address", "auto"]) == 1
    assert "rayrb verify: error: chunk chunk-00001: content hash xxh3:" in capsys.readouterr().err
    assert main(["preprocess", str(tmp_path / "src"), str(tmp_path / "bad"), "--fn", "cli_user_fns:boom"]) == 1
    err = capsys.readouterr().err
    assert re.search(r"rayrb preprocess: error: fn failed on chunk-0000\d, row \d+: RuntimeError: bad row", err), err
