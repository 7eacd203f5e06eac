"""Where a checkpoint's files go: dumps(dir) writes into dir and removes only a previous checkpoint's files (never
the user's), writes through a link to a directory, and loads() only reads (a checkpoint on read-only storage loads);
an older checkpoint of a prioritized buffer loads when the caller says its exponents."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

pytestmark = pytest.mark.usefixtures("ray_session")
KW = dict(online_capacity=60, num_online_shards=2, offline_fraction=0.5, batch_size=8, seed=5, prefetch=0)


def rows(start: int, n: int) -> TensorDict:
    ids = torch.arange(start, start + n, dtype=torch.int64)
    return TensorDict({"obs": ids.float()[:, None], "id": ids}, [n])


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def held(rb) -> list[int]:
    import ray

    return sorted(i for s in ray.get([sh.state.remote() for sh in rb.rpc.by_side["online"]])
                  for i in s["rows/id"][s["generation"] > 0].tolist())


def stream(rb, n: int = 4) -> list[list[int]]:
    return [rb.sample()["id"].tolist() for _ in range(n)]


@pytest.fixture
def source(make_buffer):
    rb = make_buffer(rows(0, 100), **KW)
    rb.extend(rows(1000, 40))
    rb.sample()
    return rb


def test_dumps_into_a_run_directory_keeps_the_users_files(make_buffer, source, tmp_path, monkeypatch):
    import rayrb.handle.checkpoint as checkpoint

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "model.pt").write_bytes(b"weights")
    (run / "config.yaml").write_text("lr: 0.1\n")
    (run / "logs" / "events").write_text("step 1\n")
    source.dumps(run)
    data = [n for n in names(run) if n.startswith("buffer-")]
    assert names(run) == sorted(["buffer.json", "config.yaml", "logs", "model.pt", *data]) and len(data) == 1
    assert (run / "model.pt").read_bytes() == b"weights" and (run / "logs" / "events").read_text() == "step 1\n"
    expected = stream(source)
    rb = make_buffer(rows(0, 100), **KW)
    rb.loads(run)
    assert held(rb) == list(range(1000, 1040)) and stream(rb) == expected

    source.extend(rows(2000, 5))
    source.dumps(run)  # replaces the previous checkpoint: its files go, the user's stay
    data2 = [n for n in names(run) if n.startswith("buffer-")]
    assert names(run) == sorted(["buffer.json", "config.yaml", "logs", "model.pt", *data2]) and data2 != data
    manifest = (run / "buffer.json").read_text()

    def torn(*a, **k):
        raise OSError("disk full while writing the manifest")

    monkeypatch.setattr(checkpoint, "replace_file", torn)
    source.extend(rows(3000, 5))
    with pytest.raises(OSError, match="disk full"):
        source.dumps(run)
    monkeypatch.undo()
    assert names(run) == sorted(["buffer.json", "config.yaml", "logs", "model.pt", *data2])  # nothing of its own left
    assert (run / "buffer.json").read_text() == manifest
    rb.loads(run)  # the previous checkpoint, whole
    assert held(rb) == list(range(1000, 1040)) + list(range(2000, 2005))


def test_dumps_refuses_a_file_or_a_foreign_buffer_json_and_touches_neither(source, tmp_path):
    (tmp_path / "plain").write_text("mine")
    with pytest.raises(ValueError, match="expected a directory .* got a file"):
        source.dumps(tmp_path / "plain")
    assert (tmp_path / "plain").read_text() == "mine"
    run = tmp_path / "run"
    run.mkdir()
    (run / "buffer.json").write_text('{"replay": "my own settings"}')
    with pytest.raises(ValueError, match="rayrb checkpoint's manifest .* got another file"):
        source.dumps(run)
    assert names(run) == ["buffer.json"] and (run / "buffer.json").read_text() == '{"replay": "my own settings"}'


def test_dumps_removes_only_shard_files_a_previous_manifest_names(source, tmp_path):
    """A manifest edited (or written by hand) to name a user's files, or files outside the checkpoint: dumps over
    it removes none of them."""
    from rayrb.handle.checkpoint import manifest_digest

    run = tmp_path / "run"
    source.dumps(run)
    (run / "model.pt").write_text("weights")
    (tmp_path / "outside.txt").write_text("mine")
    (run / "buffer-0000abcd").mkdir()
    (run / "buffer-0000abcd" / "notes.txt").write_text("mine too")
    meta = json.loads((run / "buffer.json").read_text())
    meta["files"].update({"model.pt": {}, "../outside.txt": {}, "buffer-0000abcd/notes.txt": {}})
    meta["digest"] = manifest_digest(meta)
    (run / "buffer.json").write_text(json.dumps(meta))
    source.dumps(run)
    assert (run / "model.pt").read_text() == "weights" and (tmp_path / "outside.txt").read_text() == "mine"
    assert (run / "buffer-0000abcd" / "notes.txt").read_text() == "mine too"
    assert len([n for n in names(run) if n.startswith("buffer-")]) == 2  # the new one, and the user's


def test_a_version_4_checkpoint_beside_user_files_loads_and_is_replaced_without_them(make_buffer, source, tmp_path):
    """Before version 5 the shard files lay beside the manifest: they are read, and replaced by name only."""
    from rayrb.handle.checkpoint import manifest_digest

    run = tmp_path / "run"
    source.dumps(run)
    meta = json.loads((run / "buffer.json").read_text())
    files = {}
    for name, digest in meta["files"].items():
        os.rename(run / name, run / Path(name).name)
        files[Path(name).name] = digest
    os.rmdir(run / Path(name).parent)
    meta.update(version=4, files=files)
    meta["digest"] = manifest_digest(meta)
    (run / "buffer.json").write_text(json.dumps(meta))
    (run / "notes.txt").write_text("keep me")
    expected = stream(source)
    rb = make_buffer(rows(0, 100), **KW)
    rb.loads(run)
    assert stream(rb) == expected
    source.dumps(run)
    data = [n for n in names(run) if n.startswith("buffer-")]
    assert names(run) == sorted(["buffer.json", "notes.txt", *data])  # shard-0.npz ... gone, the note kept


def test_dumps_through_a_linked_directory_writes_into_its_target_and_keeps_the_link(make_buffer, source, tmp_path):
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path  # another file system where there is one
    target = Path(tempfile.mkdtemp(dir=base))
    try:
        link = tmp_path / "ckpt"
        link.symlink_to(target)
        source.dumps(link)
        source.dumps(link)  # again, over the first
        assert link.is_symlink() and os.readlink(link) == str(target)
        assert not [n for n in names(tmp_path) if n.startswith(".ckpt")]  # nothing beside the link
        data = [n for n in names(target) if n.startswith("buffer-")]
        assert "buffer.json" in names(target) and len(data) == 1
        shard = next((target / data[0]).iterdir())
        assert shard.stat().st_dev == target.stat().st_dev
        expected = stream(source)
        rb = make_buffer(rows(0, 100), **KW)
        rb.loads(link)
        assert stream(rb) == expected
    finally:
        shutil.rmtree(target, ignore_errors=True)


@contextlib.contextmanager
def read_only(d: Path):
    """``d`` read-only for this process, root included: a read-only bind mount, else ``chattr +i`` on ``d`` and
    everything in it; skipped where neither takes (a write is tried to be sure)."""
    undo = None
    if subprocess.run(["mount", "--bind", d, d], capture_output=True).returncode == 0:
        undo = ["umount", d]
        if subprocess.run(["mount", "-o", "remount,ro,bind", d], capture_output=True).returncode != 0:
            subprocess.run(undo, capture_output=True)
            undo = None
    if undo is None and subprocess.run(["chattr", "-R", "+i", d], capture_output=True).returncode == 0:
        undo = ["chattr", "-R", "-i", d]
    try:
        try:
            (d / "probe").write_text("x")
        except OSError:
            pass
        else:
            pytest.skip("cannot make a directory read-only for root here (no bind mount, no chattr)")
        yield
    finally:
        if undo is not None:
            subprocess.run(undo, capture_output=True, check=True)


def listing(d: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(d)): (p.stat().st_mtime_ns, p.stat().st_size) for p in [d, *d.rglob("*")]}


@pytest.mark.parametrize("shards", [2, 3], ids=["same-layout", "another-layout"])
def test_loads_only_reads_a_checkpoint_on_read_only_storage(make_buffer, source, tmp_path, shards):
    store = tmp_path / "store"
    source.dumps(store / "ckpt")
    expected_rows = held(source)
    rb = make_buffer(rows(0, 100), **{**KW, "num_online_shards": shards})
    rb.extend(rows(5000, 3))
    before = listing(store)
    with read_only(store):
        rb.loads(store / "ckpt")
    assert listing(store) == before
    assert held(rb) == expected_rows and len(rb.sample()) == 8


def test_a_restore_failing_halfway_from_read_only_storage_puts_the_buffer_back(make_buffer, source, tmp_path,
                                                                                 monkeypatch):
    import rayrb.handle.checkpoint as checkpoint

    store = tmp_path / "store"
    source.dumps(store / "ckpt")
    rb = make_buffer(rows(0, 100), **KW)
    rb.extend(rows(5000, 3))
    twin = make_buffer(rows(0, 100), **KW)
    twin.extend(rows(5000, 3))
    real, calls = checkpoint._apply, []

    def fails_after_the_shards(rb, sources, state):
        calls.append(sources)
        if len(calls) == 1:  # the checkpoint's shards are in; then the coordinator's part fails
            rb.rpc.get([s.load.remote(f) for s, f in zip(rb.rpc.shards, sources)])
            raise OSError("coordinator's disk gone while restoring")
        return real(rb, sources, state)

    monkeypatch.setattr(checkpoint, "_apply", fails_after_the_shards)
    with read_only(store), pytest.raises(OSError, match="disk gone"):
        rb.loads(store / "ckpt")
    assert len(calls) == 2 and held(rb) == [5000, 5001, 5002] and stream(rb) == stream(twin)


def older_checkpoint(ckpt: Path, version: int) -> None:
    """Rewrite a checkpoint's manifest as version 2 or 3 wrote it: no priority exponents (2: no digest either)."""
    from rayrb.handle.checkpoint import manifest_digest

    meta = json.loads((ckpt / "buffer.json").read_text())
    del meta["priority"], meta["digest"]
    meta["version"] = version
    if version == 3:
        meta["digest"] = manifest_digest(meta)
    (ckpt / "buffer.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("version", [2, 3])
def test_an_older_prioritized_checkpoint_loads_with_the_exponents_its_caller_names(make_buffer, tmp_path, version):
    kw = dict(KW, sampler="prioritized", alpha=1.0)
    src = make_buffer(rows(0, 100), **kw)
    src.extend(rows(1000, 20))
    _, info = src.sample(16, return_info=True)
    src.update_priority(info, torch.arange(16, dtype=torch.float64) + 1)
    src.dumps(tmp_path / "ckpt")
    older_checkpoint(tmp_path / "ckpt", version)
    expected = stream(src)
    rb = make_buffer(rows(0, 100), **kw)
    with pytest.raises(ValueError, match=r"does not record its alpha and eps.*loads\(path, priority_exponents="
                                         r"\{'alpha': 1.0, 'eps': 1e-08\}\)"):
        rb.loads(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="alpha 0.5 vs 1.0"):
        rb.loads(tmp_path / "ckpt", priority_exponents={"alpha": 0.5, "eps": 1e-8})
    with pytest.raises(ValueError, match="expected priority_exponents as"):
        rb.loads(tmp_path / "ckpt", priority_exponents={"alpha": 1.0})
    with pytest.raises(ValueError, match="eps must be a finite number > 0.0"):
        rb.loads(tmp_path / "ckpt", priority_exponents={"alpha": 1.0, "eps": -1.0})
    assert held(rb) == []  # every refusal changed nothing
    rb.loads(tmp_path / "ckpt", priority_exponents={"alpha": 1, "eps": 1e-8})
    assert held(rb) == list(range(1000, 1020)) and stream(rb) == expected


def test_exponents_named_for_a_checkpoint_that_records_others_are_refused(make_buffer, tmp_path):
    kw = dict(KW, sampler="prioritized", alpha=1.0)
    src = make_buffer(rows(0, 100), **kw)
    src.dumps(tmp_path / "ckpt")
    rb = make_buffer(rows(0, 100), **kw)
    with pytest.raises(ValueError, match="contradicts the checkpoint's own record"):
        rb.loads(tmp_path / "ckpt", priority_exponents={"alpha": 0.6, "eps": 1e-8})
    rb.loads(tmp_path / "ckpt", priority_exponents={"alpha": 1.0, "eps": 1e-8})  # agreeing with it: taken
    uniform = make_buffer(rows(0, 100), **KW)
    uniform.dumps(tmp_path / "uniform")
    with pytest.raises(ValueError, match="alpha must be a finite number"):  # checked whatever the sampler
        uniform.loads(tmp_path / "uniform", priority_exponents={"alpha": "high", "eps": 1e-8})
