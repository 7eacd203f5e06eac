"""The coordinator's files copied off its node (rayrb.durability.mirror): a coordinator restarted on another node,
with an empty directory, reads the state, journal and answers it saved. No Ray: the mirror is a dict here."""
from __future__ import annotations

import shutil

from rayrb.durability.coordinator_state import CoordinatorState
from rayrb.durability.mirror import DictMirror


def test_a_state_directory_lost_with_its_node_comes_back_from_the_mirror(tmp_path):
    mirror = DictMirror()
    d = tmp_path / "coordinator"
    old = CoordinatorState(d, mirror=mirror)
    old.save({"version": 1})
    old.save({"version": 2})
    for i in range(3):
        old.journal(f"w{i}", [(0, 10 * i, 10 * i + 10, 10 * i)], digest=f"d{i}")
    old.save_reply("call-1", '{"answer": 1}')
    old.save_reply("call-2", '{"answer": 2}')
    old.drop_reply("call-1")
    shutil.rmtree(d)  # the node is gone: the restarted coordinator finds the same path empty on another node
    new = CoordinatorState(d, mirror=mirror)
    assert new.load() == {"version": 2}
    assert new.writes() == old.writes()
    assert new.load_reply("call-2") == '{"answer": 2}' and new.load_reply("call-1") is None
    new.save({"version": 3})  # goes on numbering after the copied saves, and the mirror follows
    shutil.rmtree(d)
    again = CoordinatorState(d, mirror=mirror)
    assert again.load() == {"version": 3}


def test_a_state_directory_that_survived_is_read_as_it_is(tmp_path):
    mirror = DictMirror()
    s = CoordinatorState(tmp_path / "c", mirror=mirror)
    s.save({"version": 5})
    mirror.put(s._key + "state.0", b"not what the disk holds")
    assert CoordinatorState(tmp_path / "c", mirror=mirror).load() == {"version": 5}


def test_the_mirror_keeps_about_as_many_journal_lines_as_the_directory(tmp_path):
    mirror = DictMirror()
    s = CoordinatorState(tmp_path / "c", remember=3, mirror=mirror)
    for i in range(20):
        s.journal(f"w{i}", [(0, i, i + 1, i)])
    assert len(mirror.keys(s._key + "writes/")) == 6
    shutil.rmtree(tmp_path / "c")
    moved = CoordinatorState(tmp_path / "c", remember=3, mirror=mirror)
    assert [w for w, _, _ in moved.writes()] == ["w17", "w18", "w19"]
    moved.journal("w20", [(0, 20, 21, 20)])  # numbered on after the copied lines, not over them
    assert mirror.keys(s._key + "writes/")[-1].endswith(f"{20:012d}")


def test_a_new_coordinator_clears_the_mirror_and_shutdown_removes_it(tmp_path):
    mirror = DictMirror()
    s = CoordinatorState(tmp_path / "c", mirror=mirror)
    s.save({"version": 1})
    s.journal("w", [(0, 0, 1, 0)])
    s.clear()
    assert mirror.keys(s._key) == []
    s.save({"version": 2})
    s.remove()
    assert mirror.keys(s._key) == []


def test_a_gcs_that_fails_a_call_reads_as_a_disk_that_failed(tmp_path):
    """The coordinator treats an OSError from a save as a save that failed (counted; the call's answer stands) and
    from a journal line as a write it must not send: the GCS's own errors come as OSError."""
    import pytest

    from rayrb.durability.mirror import GcsMirror

    class Failing:
        def __getattr__(self, name):
            def call(*args, **kwargs):
                raise RuntimeError("GCS unavailable")
            return call

    gcs = GcsMirror.__new__(GcsMirror)  # without a cluster: the store is the failing stand-in
    gcs._kv = Failing()
    for call in (lambda: gcs.put("k", b"v"), lambda: gcs.get("k"), lambda: gcs.delete("k"), lambda: gcs.keys("k")):
        with pytest.raises(OSError, match="expected the GCS to .*, got RuntimeError: GCS unavailable"):
            call()
    state = CoordinatorState(tmp_path / "c")
    state._mirror = gcs
    with pytest.raises(OSError):
        state.save({"version": 1})
    with pytest.raises(OSError):
        state.journal("w", [(0, 0, 1, 0)])
