"""Clean-up never takes a live buffer's state: not from another node that cannot see its processes, not while
its coordinator restarts; and the version map handles read survives any restart. Also: a call that kills its
actor each time it runs fails after a bounded number of re-sends instead of killing the actor for ever."""
from __future__ import annotations

import contextlib
import json
import os
import time

import pytest
from restart_util import kill_and_wait, kill_coordinator, online_ids, rows

from rayrb.handle.owner import _remove_leftovers

pytestmark = pytest.mark.usefixtures("ray_session")

DEAD = 999_999_999  # a pid that runs on another node: not here


def age(root, seconds):
    t = time.time() - seconds
    for p in [root, *root.rglob("*")]:
        with contextlib.suppress(FileNotFoundError):  # the live buffer may replace a file between listing and here
            os.utime(p, (t, t))


def as_another_node_sees_it(root):
    """Files of a buffer idle for an hour whose processes run elsewhere: pids this node cannot see."""
    for f in root.rglob("restarts.json"):
        record = json.loads(f.read_text())
        f.write_text(json.dumps({**record, "pid": DEAD}))
    age(root, 3600)


def test_clean_up_from_another_node_keeps_a_live_idle_buffer(make_buffer, tmp_path):
    rb = make_buffer(rows(0, 50), online_capacity=200, seed=0, prefetch=0)
    rb.extend(rows(1000, 100))
    root = tmp_path / "state"
    as_another_node_sees_it(root)
    _remove_leftovers(root)  # what any new buffer's driver runs (and `rayrb gc`)
    kill_and_wait(rb.rpc.by_side["online"][0])
    held = online_ids(rb)
    assert held == list(range(1000, 1100)), f"after the shard's restart it holds {len(held)} of the 100 acknowledged rows"


def test_clean_up_during_a_coordinator_restart_keeps_the_version_map_handles_read(make_buffer, tmp_path, ray_session):
    ray = ray_session
    rb = make_buffer(rows(0, 50), online_capacity=200, seed=0, batch_size=8, offline_fraction=0.0, prefetch=8)
    learner, collector = rb.client(), rb.client()
    learner.sample()
    learner.sample()  # maps the version, holds batches drawn ahead (all offline: nothing online yet)
    assert learner.rpc.version() is not None
    root = tmp_path / "state"
    as_another_node_sees_it(root)
    coord = rb.rpc.coord
    pid = ray.get(coord.__ray_call__.remote(lambda self: os.getpid()))
    ray.kill(coord, no_restart=False)
    while True:  # the old process is gone, the new one not yet started: the window
        try:
            os.kill(pid, 0)
            time.sleep(0.01)
        except ProcessLookupError:
            break
    _remove_leftovers(root)
    ray.get(coord.ping.remote(), timeout=60)
    collector.extend(rows(1000, 8))
    _, info = learner.sample(return_info=True)
    online = int((~info["offline"]).sum())
    assert online == 8, f"the first sample() after another handle's write holds {online} online rows, expected 8"


def test_a_version_map_made_just_before_a_crash_is_the_one_the_restarted_coordinator_writes(make_buffer):
    rb = make_buffer(rows(0, 50), online_capacity=200, seed=0, batch_size=8, prefetch=8)
    handle = rb.client()
    assert handle.rpc.version() is not None  # the map is made now, and no call that saves state follows
    kill_coordinator(rb)
    before = handle.rpc.version()
    rb.extend(rows(1000, 8))
    assert handle.rpc.version() > before, "the handle reads a version map nobody writes any more"


def test_a_call_that_kills_its_actor_each_time_fails_after_bounded_re_sends(make_buffer, ray_session, monkeypatch):
    ray = ray_session
    retries = 3  # the package's 10, fewer here: each re-send is an actor restart
    monkeypatch.setattr("rayrb.handle.owner.CALL_RETRIES", retries)
    rb = make_buffer(rows(0, 50), online_capacity=200, seed=0, prefetch=0)
    rb.extend(rows(1000, 20))
    shard = rb.rpc.by_side["online"][0]
    poison = shard.__ray_call__.remote(lambda self: os._exit(1))  # as a read that runs the node out of memory
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(poison, timeout=300)
    assert online_ids(rb) == list(range(1000, 1020))  # the shard came back with its rows, and serves them
    assert [s["restarts"] for s in rb.stats()["shards"]] == [0, retries + 1]
