"""Files of buffers whose owner died without shutdown(): found by the processes they name, and removed."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from rayrb.durability.lease import Lease
from rayrb.durability.leftovers import remove, state_dirs, version_files, version_name

DEAD = 999_999_999  # no such pid here: a process on another node, or in another PID namespace
CLUSTER = "c" * 56
OTHER = "d" * 56


def actor_dir(root, buffer, actor, pid, actor_id=None, cluster=CLUSTER):
    d = root / buffer / actor
    d.mkdir(parents=True)
    (d / "restarts.json").write_text(json.dumps({"restarts": 0, "pid": pid, "actor": actor_id, "cluster": cluster}))
    (d / "written.memmap").write_bytes(b"\0" * 8)
    (d / "lease").touch()
    return d


def age(path, seconds):
    t = time.time() - seconds
    for p in [path, *path.rglob("*")]:
        os.utime(p, (t, t))


def test_version_maps_are_removed_when_their_cluster_says_the_coordinator_is_dead():
    """Not by the pid (a restarting coordinator has none): by Ray's actor table, of the cluster that made it."""
    import tempfile

    shm = Path(tempfile.mkdtemp())
    names = {state: version_name("b", CLUSTER, actor) for actor, state in
             (("a1" * 16, "ALIVE"), ("a2" * 16, "RESTARTING"), ("a3" * 16, "DEAD"), ("a4" * 16, None))}
    other = version_name("b", OTHER, "a5" * 16)  # another cluster's: this one cannot say
    for name in [*names.values(), other, "rayrb-notes.txt"]:
        (shm / name).write_bytes(b"\0" * 8)
    states = {"a1" * 16: "ALIVE", "a2" * 16: "RESTARTING", "a3" * 16: "DEAD"}
    found = version_files([shm], cluster=CLUSTER, state=states.get)
    assert sorted(found) == sorted([shm / names["DEAD"], shm / names[None]])  # dead, or forgotten: dead
    assert version_files([shm]) == [] and version_files([shm], cluster=CLUSTER) == []  # no view: nothing proved
    assert sorted(remove(found)) == sorted(found)
    assert (shm / names["ALIVE"]).exists() and (shm / names["RESTARTING"]).exists() and (shm / other).exists()


def test_a_live_buffer_on_shared_storage_is_kept_though_its_pids_are_not_visible_here(tmp_path):
    """Idle for an hour, its actors' pids not running on this node: the cluster says they are alive, so the
    directory stays (the clean-up of another node used to remove it)."""
    live = actor_dir(tmp_path, "live-1", "coordinator", DEAD, "a1" * 16).parent
    actor_dir(tmp_path, "live-1", "on-0", DEAD, "a2" * 16)
    dead = actor_dir(tmp_path, "dead-2", "coordinator", DEAD, "b1" * 16).parent
    actor_dir(tmp_path, "dead-2", "on-0", DEAD, "b2" * 16)
    for d in (live, dead):
        age(d, 3600)
    states = {"a1" * 16: "ALIVE", "a2" * 16: "RESTARTING", "b1" * 16: "DEAD", "b2" * 16: "DEAD"}
    assert state_dirs(tmp_path, cluster=CLUSTER, state=states.get) == [dead]


def test_without_the_clusters_view_a_state_directory_goes_only_once_its_lease_lapsed(tmp_path):
    """Another cluster's buffer, or a clean-up run with no Ray: the lease is the proof. A live actor renews it
    every minute, so a directory quiet for ten minutes has no live actor."""
    leased = actor_dir(tmp_path, "other-1", "on-0", DEAD, "e1" * 16, cluster=OTHER).parent
    lapsed = actor_dir(tmp_path, "other-2", "on-0", DEAD, "e2" * 16, cluster=OTHER).parent
    age(leased, 3600)
    age(lapsed, 3600)
    Lease(leased / "on-0").renew()  # its actor is alive somewhere
    assert state_dirs(tmp_path, cluster=CLUSTER, state=lambda actor: None) == [lapsed]
    assert state_dirs(tmp_path) == [lapsed]


def test_a_state_directory_is_kept_while_any_process_it_names_runs_here_or_its_lease_is_fresh(tmp_path):
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


def test_a_fresh_shard_directory_keeps_its_restart_record_and_lease(tmp_path):
    """A start that crashes after it made its storage afresh (before it was ready) still backs off the next start:
    making the storage used to delete the restart record its own start had just written."""
    from rayrb.core.schema import RowSpec
    from rayrb.durability.restarts import RestartLog
    from rayrb.durability.storage import OnlineStorage, PriorityStore

    spec = RowSpec.from_arrays({"x": np.zeros((1, 2), "float32")})
    for make in (lambda d: OnlineStorage(spec, 8, d), lambda d: PriorityStore(8, d)):
        d = tmp_path / str(id(make))
        (d / "junk").mkdir(parents=True)  # a half-made directory from before
        assert RestartLog(d).started(0) == 0.0  # the first start ...
        Lease(d).start()
        make(d)  # ... makes its storage, and crashes before it is ready
        assert (d / "restarts.json").exists() and (d / "lease").exists() and not (d / "junk").exists()
        assert RestartLog(d).started(1) == 0.5, "the crashed start went without back-off"


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
