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



def _history(tmp_path, mirror):
    """A coordinator's files at version 2 (two saves, one journalled write), kept aside, then the same files two
    saves, two journalled writes and two answers later; ``(directory, the copy kept aside, the mirror's items as
    they were then, the newer state)``."""
    d = tmp_path / "c"
    s = CoordinatorState(d, mirror=mirror)
    s.save({"version": 1})
    s.journal("w0", [(0, 0, 10, 0)], digest="d0")
    s.save({"version": 2})
    shutil.copytree(d, tmp_path / "old")
    then = dict(mirror.items)
    for i in (1, 2):
        s.journal(f"w{i}", [(0, 10 * i, 10 * i + 10, 10 * i)], digest=f"d{i}")
        s.save_reply(f"call-{i}", f'{{"answer": {i}}}')
        s.save({"version": 2 + i})
    return d, tmp_path / "old", then, s


def test_older_local_files_give_way_to_the_newer_mirror_by_sequence(tmp_path):
    """A restart on an older copy of the directory (a bundle moved back to a machine that rejoined with its old
    disk) takes the mirror's newer state, journal and answers: a retried write is then answered, not applied
    again."""
    mirror = DictMirror()
    d, old, _, newer = _history(tmp_path, mirror)
    shutil.rmtree(d)
    shutil.copytree(old, d)
    back = CoordinatorState(d, mirror=mirror)
    assert back.load() == {"version": 4}
    assert back.writes() == newer.writes() and [w for w, _, _ in back.writes()] == ["w0", "w1", "w2"]
    assert back.load_reply("call-2") == '{"answer": 2}'
    back.journal("w3", [(0, 30, 40, 30)])  # numbered on after the newest line, not over the mirror's
    assert [k.rsplit("/", 1)[1] for k in mirror.keys(back._key + "writes/")] == [f"{i:012d}" for i in range(4)]
    back.save({"version": 5})
    shutil.rmtree(d)  # and a copy down from the mirror holds every line once
    moved = CoordinatorState(d, mirror=mirror)
    assert moved.load() == {"version": 5}
    assert [w for w, _, _ in moved.writes()] == ["w0", "w1", "w2", "w3"]


def test_an_older_mirror_gives_way_to_the_newer_local_files_and_is_brought_level(tmp_path):
    """The reverse: the GCS's copy is the older one (its store came back from an older snapshot). The local files
    win by sequence, and the mirror takes them, so a later move to another node finds the newest too."""
    mirror = DictMirror()
    d, _, then, newer = _history(tmp_path, mirror)
    mirror.items = then
    back = CoordinatorState(d, mirror=mirror)
    assert back.load() == {"version": 4}
    assert back.writes() == newer.writes()
    back.journal("w3", [(0, 30, 40, 30)])
    shutil.rmtree(d)  # moved to another node now: the mirror was brought level
    moved = CoordinatorState(d, mirror=mirror)
    assert moved.load() == {"version": 4}
    assert [w for w, _, _ in moved.writes()] == ["w0", "w1", "w2", "w3"]
    assert moved.load_reply("call-2") == '{"answer": 2}'



def test_a_damaged_journal_line_is_skipped_and_does_not_decide_which_copy_is_newer(tmp_path):
    mirror = DictMirror()
    d, _, _, newer = _history(tmp_path, mirror)
    with open(d / "writes.log", "a") as f:
        f.write('["w9", [[0, 90, 100, 90]], null, "not a number"]\n')
    back = CoordinatorState(d, mirror=mirror)
    assert back.writes() == newer.writes()[:3] and [w for w, _, _ in back.writes()] == ["w0", "w1", "w2"]
    back.journal("w3", [(0, 30, 40, 30)])  # numbered after the last whole line
    assert mirror.keys(back._key + "writes/")[-1].endswith(f"{3:012d}")
