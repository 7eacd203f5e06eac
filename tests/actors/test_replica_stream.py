"""A primary sends its live replica the pieces over a stream (rayrb.actors.stream): both copies agree piece by
piece; a frame from before a rebuild is refused after it; a replica whose process dies (breaking the stream) or
that answers late is rebuilt under a new fence while writes go on, and then takes frames again. Each
acknowledged row is checked in both copies."""
from __future__ import annotations

import time

import numpy as np
import pytest
import test_replicas
from test_replicas import append, copy_of, level, restarted

from rayrb.actors.stream import FENCED, StreamClient

pytestmark = pytest.mark.usefixtures("ray_session")
pair = test_replicas.pair  # the fixture: a primary and its replica, each restarting after any crash


def replica_report(ray, primary) -> dict:
    (r,) = ray.get(primary.stats.remote())["replicas"]
    return r


def appends(ray, primary, start: int, stop: int) -> None:
    """Pieces ``start`` to ``stop`` (16 rows each), one after another, each acknowledged at its count."""
    for w in range(start * 16, stop * 16, 16):
        assert append(ray, primary, w) == (list(range(w, w + 16)), w + 16)


def same_copies(ray, primary, replica, written: int) -> None:
    mine, theirs = copy_of(ray, primary), copy_of(ray, replica)
    assert mine[0] == theirs[0] == written
    assert np.array_equal(mine[1], theirs[1]) and np.array_equal(mine[2], theirs[2])
    assert mine[2].tolist() == list(range(written))  # every acknowledged row once, in write order


def test_pieces_to_a_live_replica_go_over_its_stream_and_both_copies_agree(ray_session, pair):
    ray = ray_session
    primary, replica, _ = pair
    appends(ray, primary, 0, 20)
    assert replica_report(ray, primary)["streamed"] == 20
    same_copies(ray, primary, replica, 20 * 16)


def test_a_frame_sent_before_a_rebuild_is_refused_after_it(ray_session, pair):
    ray = ray_session
    primary, replica, _ = pair
    appends(ray, primary, 0, 4)
    endpoint = ray.get(replica.stream_endpoint.remote())
    ray.get(primary.__ray_call__.remote(lambda shard: shard._replication.rebuild_all()))  # a new fence
    level(ray, primary)
    before = copy_of(ray, replica)
    stale = StreamClient.connect(tuple(endpoint), timeout=5)  # as the primary's frame of fence 0 would arrive
    stale.send(0, 64, ("late", 0, 0, None), {"x": np.full(16, -7, np.int64)})
    assert stale.answer(timeout=10)[0] == FENCED
    stale.close()
    after = copy_of(ray, replica)
    assert before[0] == after[0] == 64 and np.array_equal(before[2], after[2])
    appends(ray, primary, 4, 8)  # the primary's own frames still land
    same_copies(ray, primary, replica, 8 * 16)
    assert ray.get(primary.pieces_of.remote("late")) == {}


def quick_retry(shard):
    """A stream that failed is tried again after 0.2 s, not ``RETRY``."""
    import rayrb.actors.replication as replication

    replication.RETRY = 0.2


def test_a_replica_whose_process_dies_is_rebuilt_and_takes_frames_again(ray_session, pair):
    ray = ray_session
    primary, replica, _ = pair
    ray.get(primary.__ray_call__.remote(quick_retry))
    appends(ray, primary, 0, 5)
    ray.kill(replica, no_restart=False)  # its stream breaks; its files stay
    restarted(ray, replica)
    appends(ray, primary, 5, 10)  # answered while it is rebuilt
    level(ray, primary)
    time.sleep(0.3)
    streamed = replica_report(ray, primary)["streamed"]
    appends(ray, primary, 10, 14)
    r = replica_report(ray, primary)
    assert r["rebuilds"] >= 1 and r["streamed"] == streamed + 4
    same_copies(ray, primary, replica, 14 * 16)


def test_a_replica_that_answers_late_is_rebuilt_and_its_late_frame_changes_nothing(ray_session, pair):
    ray = ray_session
    primary, replica, _ = pair
    appends(ray, primary, 0, 3)

    def slow_once(shard):
        original = shard.replicate

        def replicate(*args, **kwargs):
            shard.replicate = original
            time.sleep(2.0)
            return original(*args, **kwargs)
        shard.replicate = replicate

    def short_wait(shard):  # a write waits 0.3 s for its replica, not 30
        settle = shard._replication.settle
        shard._replication.settle = lambda calls, order, timeout=0.3: settle(calls, order, min(timeout, 0.3))

    ray.get(replica.__ray_call__.remote(slow_once))
    ray.get(primary.__ray_call__.remote(short_wait))
    ray.get(primary.__ray_call__.remote(quick_retry))
    t0 = time.monotonic()
    append(ray, primary, 48)  # answered without the late replica
    assert time.monotonic() - t0 < 1.9
    assert replica_report(ray, primary)["status"] == "waiting"
    appends(ray, primary, 4, 6)
    level(ray, primary)
    appends(ray, primary, 6, 8)
    assert replica_report(ray, primary)["rebuilds"] >= 1
    same_copies(ray, primary, replica, 8 * 16)


def test_a_retry_answered_after_the_primary_died_between_copying_a_piece_in_and_sending_it_levels_the_replica(
        ray_session, pair):
    """The primary copies a piece in and counts it, then its process dies before the piece reaches the replica
    (its files stay). Ray sends the write again; the restarted primary answers it from its journal, and checks
    its replica first: the replica, short of the piece, is rebuilt, never left live without it."""
    ray = ray_session
    primary, replica, _ = pair
    appends(ray, primary, 0, 3)

    def die_before_sending(shard):
        import os

        def send(*args, **kwargs):
            os._exit(1)
        shard._replication.send = send

    ray.get(primary.__ray_call__.remote(die_before_sending))
    assert append(ray, primary, 48) == (list(range(48, 64)), 64)  # Ray sent it again: answered from the journal
    r = replica_report(ray, primary)
    held = copy_of(ray, replica)[0]
    assert r["status"] != "live" or held == 64, (r, held)  # answered only with every live copy holding it
    level(ray, primary)
    same_copies(ray, primary, replica, 64)


def test_a_replica_beside_the_coordinator_publishes_the_count_its_primary_cannot(ray_session, pair, tmp_path):
    """A primary off the coordinator's node asks its replica there (here: one node, the primary told another node's
    target) to publish each count the replica holds; the write's answer says so, and the counts map then holds
    exactly the primary's count, never more."""
    from rayrb.durability.published import CountsMap

    ray = ray_session
    primary, replica, _ = pair
    path = str(tmp_path / "counts")
    counts = CountsMap.open(path, shards=1, create=True)
    node = ray.get_runtime_context().get_node_id()

    def publish_via_replica(shard):
        shard._publisher.to(("another node", path, 0))  # the primary is not beside the coordinator
        shard._replication._target = lambda: (node, path, 0)  # its replica is
        shard._replication.publish_to()

    ray.get(primary.__ray_call__.remote(publish_via_replica))
    answers = []
    for w in range(0, 12 * 16, 16):
        rows = {"x": np.arange(w, w + 16, dtype=np.int64)}
        _, written, published = ray.get(primary.append.remote(rows, f"w{w}", 0, 0, f"d{w}"))
        assert int(counts.written()[0]) <= written
        if published:
            assert int(counts.written()[0]) == written
        answers.append(bool(published))
    assert answers[-1] and sum(answers) >= 10, answers  # the target reaches the replica by call, frames by stream
    assert int(counts.changes()[0]) == sum(answers)
    same_copies(ray, primary, replica, 12 * 16)


def test_a_stream_that_keeps_failing_costs_one_rebuild_and_its_pieces_go_by_call_meanwhile(ray_session, pair):
    ray = ray_session
    primary, replica, _ = pair
    append(ray, primary, 0)

    def refuse_frames(shard):
        def apply(frame, waited):
            raise OSError("a frame this copy cannot take")
        shard._stream._apply = apply

    ray.get(replica.__ray_call__.remote(refuse_frames))
    appends(ray, primary, 1, 12)
    r = replica_report(ray, primary)
    assert r["rebuilds"] == 1 and r["streamed"] == 2, r  # the frame that failed, then calls for RETRY s
    level(ray, primary)
    same_copies(ray, primary, replica, 12 * 16)


def test_a_replica_no_stream_reaches_takes_its_pieces_by_call(ray_session, pair):
    """A replica whose port this node cannot open (a firewall, here a closed server): its pieces go by call, no
    copy is rebuilt for it, and the stream is not tried again at every write."""
    ray = ray_session
    primary, replica, _ = pair

    def unreachable(shard):
        from rayrb.actors.stream import StreamServer

        server = StreamServer(lambda frame, waited: (0, 0, False))
        server.close()
        shard._stream = server  # what stream_endpoint hands out: a port that refuses

    ray.get(replica.__ray_call__.remote(unreachable))
    appends(ray, primary, 0, 10)
    r = replica_report(ray, primary)
    assert r["streamed"] == 0 and r["rebuilds"] == 0, r
    assert ray.get(primary.__ray_call__.remote(lambda shard: shard._replication.replicas[0].refused)) == 1
    same_copies(ray, primary, replica, 10 * 16)
