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


def test_the_reply_cache_answers_again_every_call_one_crash_can_catch():
    """Each stream has at most two plan calls in flight (rayrb.handle.stream), so a crash can lose the replies of
    at most two calls per stream: REPLIES_KEPT covers four streams caught mid-call at once, and a call made again
    after more answers than that were given gets a new plan (the stream then skips the lost one's batches)."""
    from rayrb.durability.replies import REPLIES_KEPT, ReplyCache

    cache = ReplyCache()
    streams, in_flight = 4, 2
    calls = [f"stream{s}/call{c}" for s in range(streams) for c in range(in_flight)]
    assert len(calls) <= REPLIES_KEPT
    for i, call in enumerate(calls):
        cache.put(call, (16, 8, None, 1), {"plan": i})
    assert [cache.get(call, (16, 8, None, 1)) for call in calls] == [{"plan": i} for i in range(len(calls))]
    cache.put("one more", (16, 8, None, 1), {"plan": -1})
    assert cache.get(calls[0], (16, 8, None, 1)) is None  # past the bound: answered anew
