"""Rows a crash (or an error) left half written, one key new and the others old: never served by the shard's own
reads nor by a handle reading its files (one rule, rayrb.durability.storage.whole), and repaired by the write's
retry or by a copy that holds them whole: shards in this process and in one killed mid-write, and a shard actor
that Ray restarts after it died mid-write."""
from __future__ import annotations

import multiprocessing
import os
import signal
import time
import uuid

import numpy as np
import pytest
from test_local_reads import SPEC, filled, out_for, rows_from, shard

from rayrb.actors.lifecycle import actor_class
from rayrb.actors.online_shard import OnlineShard
from rayrb.errors import BufferUnavailableError
from rayrb.handle.local import OnlineReader


class _Killed:
    """A key's memory map whose next store kills its process: a crash between a write's per-key copies."""

    def __setitem__(self, key, value):
        os.kill(os.getpid(), signal.SIGKILL)


def _torn_writer(directory: str) -> None:
    s = shard(directory)
    first, last = list(s._data)  # the keys in the order a write copies them
    s._data[last] = _Killed()  # slots 0..15 end with the first key new and the last one old
    s.extend(rows_from(64, 16), first=64)


def _crash_mid_write(d) -> None:
    """64 rows in the shard at ``d``, then a process killed between the per-key copies of a write over 0..15."""
    s = shard(d)
    s.extend(rows_from(0, 64), first=0)
    s._lives.end()
    del s
    writer = multiprocessing.get_context("spawn").Process(target=_torn_writer, args=(str(d),))
    writer.start()
    writer.join(120)
    assert writer.exitcode == -signal.SIGKILL


def test_a_row_a_crash_left_half_written_is_never_served_and_its_write_sent_again_lands_once(tmp_path):
    """A shard killed between its per-key copies of a write that laps slots 0..15 leaves them torn; the restarted
    shard and a reader of its files both serve only whole rows, and the write, sent again, repairs them once."""
    d = tmp_path / "on-0"
    _crash_mid_write(d)
    again = shard(d)  # the restarted shard, on the files the crash left
    assert again.written() == 64 and (again._gen[:16] == -2).all()  # the write was not acknowledged
    reader = OnlineReader(str(d), SPEC, 64, "uniform")

    def served(seed):
        """What each read path serves for one read (None: asked again), each row checked whole."""
        out, got = out_for(8), []
        for rows, info in ((out, reader.read([8], [seed], [None], 64, out)),
                           again.sample_many([8], [seed], None, 64) or (None, None)):
            if info is not None:
                assert (rows["x"][:, 0] == rows["id"]).all(), f"rows {rows['id'].tolist()} served half written"
                assert (rows["id"] % 64 == info["index"]).all() and (info["generation"] > 0).all()
            got.append(info is not None)
        return got

    results = [served(seed) for seed in range(60)]
    assert [True, True] in results and [False, False] in results  # rows clear of the torn slots still served
    assert all(a == b for a, b in results)  # the two paths apply one rule
    with pytest.raises(BufferUnavailableError, match="half written"):
        again.gather(np.arange(4))
    for _ in range(2):  # the write sent again (Ray re-sends it, or the writer retries it), twice: lands once
        again.extend(rows_from(64, 16), first=64)
    assert again.written() == 80 and (again._gen[:16] == 2).all()
    assert all(served(seed) == [True, True] for seed in range(60))
    np.testing.assert_array_equal(again.gather(np.arange(16))[0]["id"], np.arange(64, 80))


def test_a_restarted_shard_takes_the_rows_a_crash_tore_whole_from_a_copy_that_holds_them(tmp_path):
    """The write a crash tore in the primary had reached its replica first (a primary sends each piece to its
    replicas before it copies it): merging the replica's rows in repairs the torn slots, and the write counts."""
    d = tmp_path / "on-0"
    _crash_mid_write(d)
    copy = shard(tmp_path / "on-0.r1")
    copy.extend(rows_from(0, 80), first=0)
    again = shard(d)
    assert (again._gen[:16] < 0).all()
    assert again.merge(copy.state()) == 80
    assert (again._gen[:16] == 2).all() and again.sample_many([64], [3], None, 80) is not None
    rows = again.gather(np.arange(64))[0]
    assert (rows["x"][:, 0] == rows["id"]).all() and sorted(rows["id"].tolist()) == list(range(16, 80))


def test_a_write_that_raises_between_its_per_key_copies_leaves_no_row_served_torn(tmp_path):
    """A write that fails after some keys were copied (an error, not a crash) is not acknowledged; its slots are
    torn and stay out of every read until its retry lands, as after a crash."""
    d, s, reader = filled(tmp_path)
    first, last = list(s._data)
    real = s._data[last]

    class Fails:
        def __setitem__(self, key, value):
            raise MemoryError("no room for the last key")

    s._data[last] = Fails()
    with pytest.raises(MemoryError):
        s.extend(rows_from(64, 16), first=64)
    s._data[last] = real
    for seed in range(40):
        out = out_for(8)
        for rows, info in ((out, reader.read([8], [seed], [None], 64, out)),
                           s.sample_many([8], [seed], None, 64) or (None, None)):
            assert info is None or (rows["x"][:, 0] == rows["id"]).all(), f"rows {rows['id'].tolist()} served torn"
    s.extend(rows_from(64, 16), first=64)  # the retry
    assert s.written() == 80 and s.sample_many([64], [1], None, 80) is not None


class DiesMidWrite(OnlineShard):
    """An online shard whose process is killed between the per-key copies of its next write, once told so."""

    def die_in_next_write(self) -> None:
        self._data[list(self._data)[-1]] = _Killed()


def test_a_shard_ray_restarts_after_it_died_mid_write_serves_no_torn_row_and_takes_the_retry_once(ray_session,
                                                                                                   tmp_path):
    """Ray restarts the shard on the files its crash left; its reads and a handle's reads of its files serve whole
    rows only while the write is missing, and the writer's retry (sent twice) lands once."""
    ray = ray_session
    d, tag = tmp_path / "on-0", uuid.uuid4().hex[:8]
    actor = actor_class(DiesMidWrite).options(name=f"{tag}/on-0", num_cpus=0, max_restarts=-1, max_task_retries=0
                                              ).remote(SPEC.to_json(), 64, f"{tag}/on-0", state_dir=str(d))
    try:
        ray.get(actor.extend.remote(rows_from(0, 64), first=0))
        ray.get(actor.die_in_next_write.remote())
        with pytest.raises(ray.exceptions.RayActorError):  # not re-sent by Ray here: the writer retries it
            ray.get(actor.extend.remote(rows_from(64, 16), first=64))
        for _ in range(600):  # until Ray has restarted it (calls are not re-sent here: refused while it restarts)
            try:
                ray.get(actor.ping.remote())
                break
            except ray.exceptions.RayActorError:
                time.sleep(0.1)
        reader = OnlineReader(str(d), SPEC, 64, "uniform")
        served = 0
        for seed in range(30):
            out = out_for(8)
            shard_read = ray.get(actor.sample_many.remote([8], [seed], None, 64)) or (None, None)
            for rows, info in ((out, reader.read([8], [seed], [None], 64, out)), shard_read):
                if info is not None:
                    served += 1
                    assert (rows["x"][:, 0] == rows["id"]).all(), f"rows {rows['id'].tolist()} served half written"
        assert served > 0
        for _ in range(2):
            ray.get(actor.extend.remote(rows_from(64, 16), first=64))
        rows, info = ray.get(actor.sample_many.remote([64], [1], None, 80))
        assert ray.get(actor.written.remote()) == 80 and (rows["x"][:, 0] == rows["id"]).all()
        assert sorted(set(ray.get(actor.state.remote())["rows/id"].tolist())) == list(range(16, 80))
    finally:
        ray.kill(actor, no_restart=True)
