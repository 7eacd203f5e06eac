"""Files of buffers whose owner died without shutdown(): found by the processes they name, and removed."""
from __future__ import annotations

import json
import os
import time

from rayrb.durability.leftovers import remove, state_dirs, version_files

DEAD = 999_999_999  # no such pid


def actor_dir(root, buffer, actor, pid):
    d = root / buffer / actor
    d.mkdir(parents=True)
    (d / "restarts.json").write_text(json.dumps({"restarts": 0, "pid": pid}))
    (d / "written.memmap").write_bytes(b"\0" * 8)
    return d


def age(path, seconds):
    t = time.time() - seconds
    for p in [path, *path.rglob("*")]:
        os.utime(p, (t, t))


def test_version_maps_of_dead_coordinators_are_removed_and_live_ones_kept(tmp_path):
    live = tmp_path / f"rayrb-b-{os.getpid()}-0a1b2c3d.version"
    dead = tmp_path / f"rayrb-b-{DEAD}-0a1b2c3d.version"
    other = tmp_path / "rayrb-notes.txt"
    for p in (live, dead, other):
        p.write_bytes(b"\0" * 8)
    assert version_files([tmp_path]) == [dead]
    assert remove(version_files([tmp_path])) == [dead]
    assert live.exists() and other.exists() and not dead.exists()


def test_a_buffers_state_is_removed_only_when_all_its_actors_are_gone_and_it_is_quiet(tmp_path):
    gone = actor_dir(tmp_path, "gone-1", "coordinator", DEAD).parent
    actor_dir(tmp_path, "gone-1", "on-0", DEAD)
    one_alive = actor_dir(tmp_path, "mixed-2", "coordinator", DEAD).parent
    actor_dir(tmp_path, "mixed-2", "on-0", os.getpid())
    fresh = actor_dir(tmp_path, "restarting-3", "on-0", DEAD).parent  # its actor may be restarting right now
    for d in (gone, one_alive):
        age(d, 3600)
    assert state_dirs(tmp_path) == [gone]
    remove(state_dirs(tmp_path))
    assert not gone.exists() and one_alive.exists() and fresh.exists()
    age(fresh, 3600)
    assert state_dirs(tmp_path) == [fresh]
