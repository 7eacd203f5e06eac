"""An online shard and its replica (rayrb.actors.replication), here on one node, as two actors: a copy killed
mid-write (with its files, as a node loss takes them) is rebuilt while writes go on, a write acknowledged while
only the primary held it survives the primary's loss after the rebuild, and a retry racing the fail-over lands
once. Each acknowledged row is checked in both copies."""
from __future__ import annotations

import os
import shutil
import threading
import time
import uuid

import numpy as np
import pytest

from rayrb.actors.lifecycle import actor_class
from rayrb.actors.online_shard import OnlineShard
from rayrb.core.schema import RowSpec

SPEC = RowSpec.from_arrays({"x": np.zeros(1, np.int64)}).to_json()
CAPACITY, PIECE = 4096, 16
pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture
def pair(ray_session, tmp_path):
    """A primary and its replica, each restarting after any crash; ``(primary, replica, their directories)``."""
    made = start(ray_session, tmp_path)
    yield made
    for actor in made[:2]:
        ray_session.kill(actor, no_restart=True)


def start(ray, tmp_path):
    tag = uuid.uuid4().hex[:8]
    cls = actor_class(OnlineShard)
    opts = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": 10}
    dirs = [str(tmp_path / f"{tag}-on-0"), str(tmp_path / f"{tag}-on-0.r1")]
    replica = cls.options(name=f"{tag}/on-0.r1", **opts).remote(SPEC, CAPACITY, f"{tag}/on-0.r1",
                                                                 state_dir=dirs[1])
    primary = cls.options(name=f"{tag}/on-0", **opts).remote(SPEC, CAPACITY, f"{tag}/on-0", state_dir=dirs[0],
                                                             replicas=[f"{tag}/on-0.r1"])
    ray.get([replica.ping.remote(), primary.ping.remote()])
    return primary, replica, dirs


def write(ray, primary, first):
    """One piece, as the coordinator sends it to a replicated shard (the rows' ref nested); acknowledged."""
    ref = ray.put({"x": np.arange(first, first + PIECE, dtype=np.int64)})
    ray.get(primary.extend.remote(ref, 0, PIECE, first=first, forward=[ref]))


def lose(ray, actor, directory):
    """The actor's files go (its node's disk), then its process: Ray restarts it empty."""
    shutil.rmtree(directory)
    ray.kill(actor, no_restart=False)


def append(ray, primary, first, write_id=None):
    """One write the primary places itself (``OnlineShard.append``), answered once its live replicas hold it
    too; ``(slots, write count)``."""
    rows = {"x": np.arange(first, first + PIECE, dtype=np.int64)}
    slots, written, _ = ray.get(primary.append.remote(rows, write_id or f"w{first}", 0, 0, f"d{first}"))
    return np.asarray(slots).tolist(), int(written)


def die_while_storing(ray, primary, directory):
    """The primary's node goes (its files, then its process) while it copies its next piece in: after sending the
    piece to its replicas where the coordinator placed it (``extend``), before, where it places it itself
    (``append``)."""
    def arm(shard):
        def store_rows(*args):
            shutil.rmtree(directory)
            os._exit(1)
        shard._store_rows = store_rows

    ray.get(primary.__ray_call__.remote(arm))


def restarted(ray, actor, times=1, limit=60.0):
    """Wait until ``actor`` answers from its ``times``-th restart (a call sent just after ``ray.kill`` may still
    reach the process being killed)."""
    t0 = time.monotonic()
    while True:
        try:
            if ray.get(actor.stats.remote(), timeout=10)["restarts"] >= times:
                return
        except Exception:  # killed between the call and its answer
            pass
        assert time.monotonic() - t0 < limit
        time.sleep(0.1)


def copy_of(ray, actor):
    state = ray.get(actor.state.remote())
    gen = state["generation"]
    return int(state["written"]), gen.copy(), state["rows/x"][gen > 0].copy()


def level(ray, primary, limit=60.0):
    """Wait until the replica is live and counts what the primary counts."""
    t0 = time.monotonic()
    while True:
        ray.get(primary.check_replicas.remote())
        (r,) = ray.get(primary.stats.remote())["replicas"]
        if r["status"] == "live" and r["behind"] == 0:
            return r
        assert time.monotonic() - t0 < limit, r
        time.sleep(0.2)


def writes_through_a_replica_loss(write_at, ray, replica, directory, piece, last, before, after) -> list[int]:
    """Writes of ``piece`` rows from a thread, ``write_at(first)`` each, up to ``last``; the replica is lost with its
    files (``directory``) once ``before`` were acknowledged, and the writes stop once ``after`` were. The firsts
    of those acknowledged (the assertion fails if the writer stopped short)."""
    done, stop = [], threading.Event()

    def writer():
        w = 0
        while not stop.is_set() and w < last:
            write_at(w)
            done.append(w)
            w += piece

    t = threading.Thread(target=writer)
    t.start()
    while len(done) < before and t.is_alive():
        time.sleep(0.01)
    lose(ray, replica, directory)
    while len(done) < after and t.is_alive():
        time.sleep(0.01)
    stop.set()
    t.join()
    assert len(done) >= after, done
    return done


def test_a_replica_killed_mid_write_with_its_files_is_rebuilt_while_writes_go_on(ray_session, pair):
    ray = ray_session
    primary, replica, dirs = pair
    # never fails: the primary answers alone while its replica is down
    done = writes_through_a_replica_loss(lambda w: write(ray, primary, w), ray, replica, dirs[1], PIECE,
                                         CAPACITY - PIECE, 20, 80)
    report = level(ray, primary)
    assert report["rebuilds"] >= 1
    written, gen, values = copy_of(ray, primary)
    assert written == len(done) * PIECE
    assert sorted(values.tolist()) == list(range(written))
    r_written, r_gen, r_values = copy_of(ray, replica)
    assert r_written == written and np.array_equal(r_gen, gen) and np.array_equal(r_values, values)


def test_rows_acknowledged_by_the_primary_alone_survive_its_loss_once_the_replica_is_rebuilt(ray_session, pair):
    ray = ray_session
    primary, replica, dirs = pair
    for w in range(0, 10 * PIECE, PIECE):
        write(ray, primary, w)
    lose(ray, replica, dirs[1])
    for w in range(10 * PIECE, 20 * PIECE, PIECE):  # acknowledged while the replica was down
        write(ray, primary, w)
    level(ray, primary)
    lose(ray, primary, dirs[0])  # the primary restarts empty and takes the replica's rows
    write(ray, primary, 20 * PIECE)
    written, _, values = copy_of(ray, primary)
    assert written == 21 * PIECE and sorted(values.tolist()) == list(range(written))
    assert ray.get(primary.stats.remote())["restarts"] == 1


def test_a_retry_racing_the_primarys_fail_over_lands_once(ray_session, pair):
    ray = ray_session
    primary, replica, dirs = pair
    for w in range(0, 5 * PIECE, PIECE):
        write(ray, primary, w)
    ref = ray.put({"x": np.arange(5 * PIECE, 6 * PIECE, dtype=np.int64)})
    first = primary.extend.remote(ref, 0, PIECE, first=5 * PIECE, forward=[ref])  # in flight when the node goes
    lose(ray, primary, dirs[0])
    retry = primary.extend.remote(ref, 0, PIECE, first=5 * PIECE, forward=[ref])  # the writer asks again at once
    ray.get([first, retry])
    level(ray, primary)
    for actor in (primary, replica):
        written, _, values = copy_of(ray, actor)
        assert written == 6 * PIECE and sorted(values.tolist()) == list(range(written))  # each row once


def test_a_restored_state_reaches_the_replica_and_a_later_loss_keeps_it(ray_session, pair):
    ray = ray_session
    primary, replica, dirs = pair
    for w in range(0, 4 * PIECE, PIECE):
        write(ray, primary, w)
    saved = ray.get(primary.state.remote())
    for w in range(4 * PIECE, 8 * PIECE, PIECE):  # rows the restore takes back
        write(ray, primary, w)
    ray.get(primary.load_state.remote(saved))
    level(ray, primary)
    for actor in (primary, replica):
        written, _, values = copy_of(ray, actor)
        assert written == 4 * PIECE and sorted(values.tolist()) == list(range(written))
    lose(ray, primary, dirs[0])  # the restarted primary merges the replica in: the restore holds
    written, _, values = copy_of(ray, primary)
    assert written == 4 * PIECE and sorted(values.tolist()) == list(range(written))


def test_a_write_the_primary_placed_is_answered_by_its_id_after_the_primarys_node_is_lost(ray_session, pair):
    """The replica journals each piece's write id as the primary does: the primary, restarted without its files,
    takes the ids with the rows, and a writer's retry (its answer lost with the node) lands nothing twice."""
    ray = ray_session
    primary, replica, dirs = pair
    placed = [append(ray, primary, w) for w in range(0, 6 * PIECE, PIECE)]
    level(ray, primary)
    lose(ray, primary, dirs[0])
    restarted(ray, primary)
    assert append(ray, primary, 2 * PIECE) == (placed[2][0], 6 * PIECE)  # answered: the same slots, no new rows
    assert append(ray, primary, 6 * PIECE) == (list(range(6 * PIECE, 7 * PIECE)), 7 * PIECE)
    assert ray.get(primary.stats.remote())["writes_answered_again"] >= 1
    level(ray, primary)
    for actor in (primary, replica):
        written, _, values = copy_of(ray, actor)
        assert written == 7 * PIECE and sorted(values.tolist()) == list(range(written))  # each row once


def test_a_rebuilt_replica_takes_the_write_ids_with_the_rows_and_answers_them_once_it_serves(ray_session, pair):
    """A replica rebuilt from the primary's snapshot (it lost its files) holds the journal too, so the ids of
    writes placed before the rebuild are answered after a later loss of the primary."""
    ray = ray_session
    primary, replica, dirs = pair
    placed = [append(ray, primary, w) for w in range(0, 4 * PIECE, PIECE)]
    lose(ray, replica, dirs[1])
    restarted(ray, replica)
    assert level(ray, primary)["rebuilds"] >= 1
    lose(ray, primary, dirs[0])
    restarted(ray, primary)
    assert append(ray, primary, PIECE) == (placed[1][0], 4 * PIECE)
    written, _, values = copy_of(ray, primary)
    assert written == 4 * PIECE and sorted(values.tolist()) == list(range(written))
    with pytest.raises(Exception, match="write_id"):  # other rows under a taken id are refused, as before
        rows = {"x": np.arange(PIECE, dtype=np.int64)}
        ray.get(primary.append.remote(rows, f"w{PIECE}", 0, 0, "another digest"))


def test_a_primary_that_dies_while_it_copies_a_piece_in_lands_the_retry_once(ray_session, pair):
    """A primary placing a piece itself copies it in before it sends it to its replica: one that dies right there,
    its node's disk with it, restarts empty, takes the replica's rows and ids, and the write Ray sends again lands
    once, at the count the replica holds, in both copies."""
    ray = ray_session
    primary, replica, dirs = pair
    for w in range(0, 3 * PIECE, PIECE):
        append(ray, primary, w)

    die_while_storing(ray, primary, dirs[0])
    assert append(ray, primary, 3 * PIECE) == (list(range(3 * PIECE, 4 * PIECE)), 4 * PIECE)
    assert append(ray, primary, 3 * PIECE)[1] == 4 * PIECE  # the writer's own retry: answered too
    assert ray.get(primary.stats.remote())["restarts"] == 1
    level(ray, primary)
    for actor in (primary, replica):
        written, _, values = copy_of(ray, actor)
        assert written == 4 * PIECE and sorted(values.tolist()) == list(range(written))


@pytest.mark.parametrize("stale", ["primary", "replica"])
def test_a_copy_restarted_on_older_files_than_the_other_copys_takes_the_newer_rows(ray_session, pair, tmp_path,
                                                                                   stale):
    """The files a restart finds can be older than what was acknowledged (a bundle moved back to a machine that
    rejoined with its old disk, shared storage that missed a dead client's last pages). Whichever copy restarts on
    them, the newer rows win by generation, and both copies end with every acknowledged row."""
    ray = ray_session
    primary, replica, dirs = pair
    for w in range(0, 6 * PIECE, PIECE):
        write(ray, primary, w)
    level(ray, primary)
    which = ("primary", "replica").index(stale)
    kept = tmp_path / "kept"
    shutil.copytree(dirs[which], kept)  # the copy's files as they were at 6 pieces
    for w in range(6 * PIECE, 12 * PIECE, PIECE):  # acknowledged by both copies
        write(ray, primary, w)
    shutil.rmtree(dirs[which])
    shutil.copytree(kept, dirs[which])
    ray.kill((primary, replica)[which], no_restart=False)  # it restarts on the older files
    restarted(ray, (primary, replica)[which])
    level(ray, primary)
    for actor in (primary, replica):
        written, _, values = copy_of(ray, actor)
        assert written == 12 * PIECE and sorted(values.tolist()) == list(range(written)), stale
    assert ray.get((primary, replica)[which].stats.remote())["restarts"] == 1


def test_a_primary_restarted_on_files_from_before_a_restore_takes_its_replica_whole(ray_session, pair, tmp_path):
    """Generations cannot tell rows the restore removed from rows written after it; the restore epoch does: the
    primary's older files give way to the replica that took the restore, and the removed rows stay removed."""
    ray = ray_session
    primary, replica, dirs = pair
    for w in range(0, 4 * PIECE, PIECE):
        write(ray, primary, w)
    saved = ray.get(primary.state.remote())
    for w in range(4 * PIECE, 8 * PIECE, PIECE):  # rows the restore takes back
        write(ray, primary, w)
    shutil.copytree(dirs[0], tmp_path / "kept")  # the primary's files from before the restore
    ray.get(primary.load_state.remote(saved))
    level(ray, primary)
    for w in range(4 * PIECE, 6 * PIECE, PIECE):  # written after the restore, over slots the removed rows held
        write(ray, primary, w)
    shutil.rmtree(dirs[0])
    shutil.copytree(tmp_path / "kept", dirs[0])
    ray.kill(primary, no_restart=False)
    level(ray, primary)
    for actor in (primary, replica):
        written, _, values = copy_of(ray, actor)
        assert written == 6 * PIECE and sorted(values.tolist()) == list(range(written))


def test_a_replica_restarted_on_files_from_before_a_restore_that_count_as_many_rows_is_rebuilt(ray_session, pair,
                                                                                                tmp_path):
    """Counts cannot tell a replica's files from before a restore when they count as many rows as the primary:
    the restore epoch in its answers does, and the primary rebuilds it."""
    ray = ray_session
    primary, replica, dirs = pair
    for w in range(0, 8 * PIECE, PIECE):
        write(ray, primary, w)
    level(ray, primary)
    saved = {k: np.array(v) for k, v in ray.get(primary.state.remote()).items()}  # writable
    shutil.copytree(dirs[1], tmp_path / "kept")  # the replica's files, 8 pieces, from before the restore
    saved["written"], saved["generation"][4 * PIECE:] = np.int64(4 * PIECE), 0
    ray.get(primary.load_state.remote(saved))  # back to 4 pieces ...
    for w in range(4 * PIECE, 8 * PIECE, PIECE):  # ... and 4 others in their place: 8 pieces again
        ref = ray.put({"x": np.arange(w, w + PIECE, dtype=np.int64) + 10_000})
        ray.get(primary.extend.remote(ref, 0, PIECE, first=w, forward=[ref]))
    level(ray, primary)
    shutil.rmtree(dirs[1])
    shutil.copytree(tmp_path / "kept", dirs[1])
    ray.kill(replica, no_restart=False)  # it restarts on the older files, at the primary's count
    restarted(ray, replica)
    level(ray, primary)
    expected = list(range(4 * PIECE)) + list(range(10_000 + 4 * PIECE, 10_000 + 8 * PIECE))
    for actor in (primary, replica):
        written, _, values = copy_of(ray, actor)
        assert written == 8 * PIECE and sorted(values.tolist()) == expected


def test_a_write_retried_after_the_coordinator_restarted_on_older_files_is_answered_not_applied_again(
        ray_session, tmp_path):
    """The coordinator of a buffer with replicas restarts on an older copy of its directory (an old disk back)
    while its GCS copy holds the newer journal: a write retried under its id is answered from that journal."""
    from rayrb.actors.coordinator import Coordinator

    ray, tag = ray_session, uuid.uuid4().hex[:8]
    opts = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": 10}
    shard = actor_class(OnlineShard).options(name=f"{tag}/on-0", **opts).remote(
        SPEC, CAPACITY, f"{tag}/on-0", state_dir=str(tmp_path / "on-0"))
    ray.get(shard.ping.remote())
    d = tmp_path / "coordinator"
    coord = actor_class(Coordinator).options(name=f"{tag}/coordinator", **opts).remote(
        [], [], [f"{tag}/on-0"], [CAPACITY], offline_fraction=0.0, seed=0, state_dir=str(d), replicated=True)

    def extend(i):
        ref = ray.put({"x": np.arange(10 * i, 10 * i + 10, dtype=np.int64)})
        _, acks = ray.get(coord.extend.remote([ref], 10, write_id=f"w{i}", digest=f"d{i}"))
        ray.get(acks)

    try:
        extend(0)
        shutil.copytree(d, tmp_path / "kept")  # the directory as the old disk keeps it: w0 journalled, not w1
        extend(1)
        shutil.rmtree(d)
        shutil.copytree(tmp_path / "kept", d)
        ray.kill(coord, no_restart=False)
        extend(1)  # the writer retries: its first call's answer was lost with the coordinator
        written, _, values = copy_of(ray, shard)
        assert written == 20 and sorted(values.tolist()) == list(range(20))  # each row once
    finally:
        ray.get(coord.close.remote())
        ray.kill(coord, no_restart=True)
        ray.kill(shard, no_restart=True)


@pytest.mark.parametrize("kwargs, message", [
    ({"online_replicas": 2}, r"expected at least online_replicas=2 alive nodes .* got 1"),
    ({"online_replicas": 2, "storage_dir": None}, r"expected a storage_dir with online_replicas=2"),
    ({"online_replicas": 2, "online_nodes": [None]}, r"places each copy of an online shard on another node"),
    ({"online_replicas": 0}, r"online_replicas"),
])
def test_replicas_the_cluster_cannot_hold_or_settings_that_clash_are_refused_before_anything_starts(
        ray_session, make_buffer, kwargs, message):
    from ray._private.state import actors

    def made():
        return set(actors()), {k for k, g in ray_session.util.placement_group_table().items() if g["state"] != "REMOVED"}

    before = made()
    with pytest.raises(ValueError, match=message):
        make_buffer({"x": np.arange(10)}, online_capacity=10, **kwargs)
    assert made() == before  # no actor was started, no placement group is left
