"""Slices on Ray: a buffer with ``sampler=SliceSampler(...)`` serves batches of whole slices of one episode, an
exact offline share of them in every batch, online slices over the steps written only (episodes written over
several ``extend`` calls join up, a running one grows), never across an episode's end or a shard's edge."""
from __future__ import annotations

import numpy as np
import pytest

from rayrb import SliceSampler

pytestmark = pytest.mark.usefixtures("ray_session")
L = 4


def episodes(lengths, first_id=0, first_step=0):
    """Rows of consecutive episodes: ``episode`` ids, and ``step`` numbering every row (to find it again)."""
    ids = np.repeat(np.arange(first_id, first_id + len(lengths)), lengths)
    return {"episode": ids.astype(np.int64), "step": np.arange(first_step, first_step + ids.size, dtype=np.int64)}


def check_slices(batch, info, episode_of):
    """Each run of L rows is one slice: consecutive steps of one episode, from one side and shard."""
    steps, ids = np.asarray(batch["step"]).reshape(-1, L), np.asarray(batch["episode"]).reshape(-1, L)
    for s, e in zip(steps, ids):
        assert np.array_equal(s, np.arange(s[0], s[0] + L)), steps
        assert len(set(e.tolist())) == 1 and {episode_of[x] for x in s.tolist()} == {e[0]}
    for key in ("offline", "shard"):
        flags = np.asarray(info[key]).reshape(-1, L)
        assert (flags == flags[:, :1]).all()


def test_offline_and_online_slices_with_an_exact_share_in_every_batch(make_buffer):
    offline = episodes([9, 2, 7, 3, 12, 5, 4, 6])  # two offline shards: episodes cut at their edge stay apart
    rb = make_buffer(offline, online_capacity=64, num_offline_shards=2, num_online_shards=2, offline_fraction=0.25,
                     sampler=SliceSampler(slice_len=L, traj_key="episode"), seed=0)
    episode_of = dict(zip(offline["step"].tolist(), offline["episode"].tolist()))
    batch, info = rb.sample(8 * L, return_info=True)  # nothing online yet: all offline
    assert np.asarray(info["offline"]).all()
    check_slices(batch, info, episode_of)
    # online: episode 100 written over three extends (it joins up), then 101 still running with 3 steps
    step = 10_000
    for part in ([3], [4], [2]):
        rows = episodes(part, first_id=100, first_step=step)
        rb.extend(rows)
        episode_of.update(dict.fromkeys(rows["step"].tolist(), 100))
        step += part[0]
    rows = episodes([3], first_id=101, first_step=step)
    rb.extend(rows)
    episode_of.update(dict.fromkeys(rows["step"].tolist(), 101))
    for _ in range(30):
        batch, info = rb.sample(8 * L, return_info=True)
        assert int((~np.asarray(info["offline"])).sum()) == 6 * L  # floor(0.25 * 8 + 1/2) = 2 offline slices of 8
        check_slices(batch, info, episode_of)
        assert not np.isin(np.asarray(batch["episode"]), [101]).any()  # 3 steps so far: no whole slice yet
    handle = rb.stats()["handle"]  # this process on the shards' node read their files itself, each read whole
    assert handle["local_reads"] > 0 and handle["fell_back_reads"] == 0, handle
    # TorchRL's marks at each slice's edges: a recurrent learner starts its state at is_init
    assert np.flatnonzero(np.asarray(batch["is_init"]).reshape(-1)).tolist() == list(range(0, 8 * L, L))
    assert np.flatnonzero(np.asarray(batch["next", "truncated"]).reshape(-1)).tolist() == list(range(L - 1, 8 * L, L))


def test_a_buffer_without_the_key_or_with_a_batch_of_part_slices_is_refused(make_buffer):
    with pytest.raises(Exception, match="expected the rows to hold 'traj'"):
        make_buffer(episodes([5, 5]), online_capacity=16, sampler=SliceSampler(slice_len=L, traj_key="traj"))
    rb = make_buffer(episodes([5, 5]), online_capacity=16, sampler="slice", slice_len=L)  # TorchRL's keywords
    with pytest.raises(Exception, match="multiple of slice_len=4"):
        rb.sample(6)
    steps = np.asarray(rb.sample(2 * L)["step"]).reshape(-1, L)  # "episode" found by TorchRL's default
    assert steps[:, -1].tolist() == (steps[:, 0] + L - 1).tolist()


def test_a_writer_killed_mid_episode_leaves_no_slice_over_a_step_it_did_not_land(make_buffer, ray_session):
    """A collector writes episodes a few steps a call, some without waiting, and is killed mid-episode: every slice
    drawn after is whole (consecutive steps of one episode, each landed whole), in one shard."""
    ray = ray_session
    rb = make_buffer(episodes([8, 8]), online_capacity=256, num_online_shards=2, offline_fraction=0.0,
                     sampler=SliceSampler(slice_len=L, traj_key="episode"), seed=1)

    @ray.remote(num_cpus=0)
    class Collector:
        def run(self, client, first_id, episodes_, steps_per_call):
            step = 1000 * first_id
            for e in range(first_id, first_id + episodes_):
                for _ in range(3):  # an episode over three calls, the last one not waited for
                    rows = {"episode": np.full(steps_per_call, e, np.int64),
                            "step": np.arange(step, step + steps_per_call, dtype=np.int64)}
                    client.extend(rows, wait=e % 2 == 0)
                    step += steps_per_call
            return step

    c = Collector.remote()
    ray.get(c.run.remote(rb.client(max_writes_in_flight=4), 100, 6, 5))
    c.run.remote(rb.client(max_writes_in_flight=4), 200, 40, 3)  # killed while it writes
    import time

    time.sleep(1.0)
    ray.kill(c)
    time.sleep(1.0)
    assert rb.write_count >= 6 * 15
    for _ in range(40):
        batch, info = rb.sample(16 * L, return_info=True)
        steps = np.asarray(batch["step"]).reshape(-1, L)
        ids = np.asarray(batch["episode"]).reshape(-1, L)
        assert (np.diff(steps, axis=1) == 1).all() and (ids == ids[:, :1]).all()
        assert (np.asarray(info["shard"]).reshape(-1, L) == np.asarray(info["shard"]).reshape(-1, L)[:, :1]).all()


def test_slices_after_a_restore_come_from_the_rows_restored(make_buffer, tmp_path):
    """Checkpoints of other rows at the same count (other episodes): each restored one is sliced by its own."""
    rb = make_buffer(episodes([8, 8]), online_capacity=64, num_online_shards=1, offline_fraction=0.5,
                     sampler=SliceSampler(slice_len=L, traj_key="episode"), seed=2)
    rb.dumps(tmp_path / "empty")
    rb.extend(episodes([6, 6, 6], first_id=100, first_step=1000))  # 18 rows, 9 slices
    rb.dumps(tmp_path / "long")
    rb.loads(tmp_path / "empty")
    rb.extend(episodes([3] * 6, first_id=300, first_step=3000))  # 18 rows again, no whole slice
    _, info = rb.sample(8 * L, return_info=True)
    assert np.asarray(info["offline"]).all()  # no online slice yet: all offline
    rb.loads(tmp_path / "long")  # the same count, other episodes
    for _ in range(20):
        batch, info = rb.sample(8 * L, return_info=True)
        online = np.asarray(batch["step"])[~np.asarray(info["offline"])].reshape(-1, L)
        assert len(online) == 4 and (np.diff(online, axis=1) == 1).all()
        assert set(online.reshape(-1).tolist()) <= set(range(1000, 1018))


def test_without_replacement_each_offline_slice_comes_once_an_epoch_with_a_short_last_batch(make_buffer):
    offline = episodes([9, 2, 7, 3, 12, 5, 4, 6])  # 6 + 0 + 4 + 0 + 9 + 2 + 1 + 3 = 25 valid slices of 4
    rb = make_buffer(offline, online_capacity=16, num_offline_shards=2, offline_fraction=1.0, seed=3,
                     sampler=SliceSampler(slice_len=L, traj_key="episode", replacement=False))
    starts = []
    for expected in (8, 8, 8, 1):  # TorchRL's default at an epoch's end: a short last batch
        steps = np.asarray(rb.sample(8 * L)["step"]).reshape(-1, L)
        assert len(steps) == expected and (np.diff(steps, axis=1) == 1).all()
        starts += steps[:, 0].tolist()
    ids = offline["episode"]
    valid = [s for s in range(len(ids) - L + 1) if len(set(ids[s:s + L].tolist())) == 1]
    assert sorted(starts) == valid  # each valid slice once
    assert len(rb.sample(8 * L)) == 8 * L  # the next epoch
