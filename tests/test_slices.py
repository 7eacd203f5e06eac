"""Slices on Ray: a buffer with ``sampler=SliceSampler(...)`` serves batches of whole slices of one episode, an
exact offline share of them in every batch, online slices over the steps written only (episodes written over
several ``extend`` calls join up, a running one grows), never across an episode's end or a shard's edge."""
from __future__ import annotations

import os
import time

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


def check_short_slices(batch, info, episode_of, lengths):
    """Slices cut at ``is_init``: consecutive steps of one episode, ``min(L, its length)`` of them (short episodes
    whole), from one side and shard, truncated at their last step; the offline ones counted."""
    steps, init = np.asarray(batch["step"]), np.asarray(batch["is_init"]).reshape(-1)
    truncated = np.asarray(batch["next", "truncated"]).reshape(-1)
    assert len(np.asarray(info["index"])) == len(steps) and init[0]
    cuts = np.append(np.flatnonzero(init), len(steps))
    assert np.flatnonzero(truncated).tolist() == (cuts[1:] - 1).tolist()
    offline, short = 0, 0
    for a, b in zip(cuts[:-1], cuts[1:]):
        s, e = steps[a:b], episode_of[int(steps[a])]
        assert np.array_equal(s, np.arange(s[0], s[0] + len(s))) and {episode_of[x] for x in s.tolist()} == {e}
        assert len(s) == min(L, lengths[e]) and (len(s) == L or episode_of.get(int(s[0]) - 1) != e)
        for key in ("offline", "shard"):
            assert len(set(np.asarray(info[key])[a:b].tolist())) == 1
        offline += int(np.asarray(info["offline"])[a])
        short += len(s) < L
    return len(cuts) - 1, offline, short


def short_and_long(rb):
    """Online episodes of 2, 6, 3 (over two extends) and 1 steps; every episode's length by id."""
    episode_of, lengths = {}, {}
    step = 10_000
    for e, n in ((100, 2), (101, 6), (102, 2), (102, 1), (103, 1)):
        rows = episodes([n], first_id=e, first_step=step)
        rb.extend(rows)
        episode_of.update(dict.fromkeys(rows["step"].tolist(), e))
        lengths[e] = lengths.get(e, 0) + n
        step += n
    return episode_of, lengths


def test_short_slices_with_an_exact_share_in_every_batch_short_episodes_whole(make_buffer, ray_session):
    offline = episodes([9, 2, 7, 1, 3, 12, 5])
    rb = make_buffer(offline, online_capacity=64, num_offline_shards=2, num_online_shards=2, offline_fraction=0.25,
                     sampler="slice", slice_len=L, traj_key="episode", strict_length=False, seed=0)
    episode_of = dict(zip(offline["step"].tolist(), offline["episode"].tolist()))
    lengths = dict(enumerate([9, 2, 7, 1, 3, 12, 5]))
    online_of, online_lengths = short_and_long(rb)
    episode_of.update(online_of)
    lengths.update(online_lengths)
    short = 0
    for _ in range(30):
        batch, info = rb.sample(8 * L, return_info=True)
        n, n_off, k = check_short_slices(batch, info, episode_of, lengths)
        assert (n, n_off) == (8, 2)  # floor(0.25 * 8 + 1/2) = 2 offline slices of 8
        short += k
    assert short > 0
    with rb.iter_batches(8 * L, return_info=True, num_batches=3) as it:
        for batch, info in it:
            assert check_short_slices(batch, info, episode_of, lengths)[:2] == (8, 2)
    batch, info = rb.to_tensordict(ray_session.get(rb.sample_async(8 * L, return_info=True)), return_info=True)
    assert check_short_slices(batch, info, episode_of, lengths)[:2] == (8, 2)
    with pytest.raises(Exception, match="return_info=True"):
        rb.sample_async(8 * L)
    handle = rb.stats()["handle"]  # this process read the shards' files itself, each read whole
    assert handle["local_reads"] > 0 and handle["fell_back_reads"] == 0, handle


def test_short_slices_read_here_are_the_rows_the_shards_read(make_buffer):
    offline = episodes([9, 2, 7, 1, 3, 12, 5])
    out = []
    for local in (True, False):
        rb = make_buffer(offline, online_capacity=32, num_offline_shards=2, num_online_shards=1, offline_fraction=0.5,
                         sampler="slice", slice_len=L, traj_key="episode", strict_length=False, seed=4,
                         local_reads=local)
        short_and_long(rb)
        out.append([rb.sample(6 * L, return_info=True) for _ in range(10)])
        handle = rb.stats()["handle"]
        assert (handle.get("local_reads", 0) > 0) == local and handle.get("fell_back_reads", 0) == 0, handle
        rb.shutdown()
    assert any(len(a) < 6 * L for a, _ in out[0])  # short slices among them
    for (a, ia), (b, ib) in zip(*out):
        for key in ("step", "episode", "is_init", ("next", "truncated")):
            assert np.asarray(a[key]).tolist() == np.asarray(b[key]).tolist(), key
        for key in ("offline", "shard", "index", "generation", "episode_start"):
            assert np.asarray(ia[key]).tolist() == np.asarray(ib[key]).tolist(), key
        # each step says where its episode starts in its shard: one place per episode, its first step's
        where = {}
        for o, sh, start, traj in zip(*(np.asarray(ia[k]).tolist() for k in ("offline", "shard", "episode_start")),
                                   np.asarray(a["episode"]).tolist()):
            where.setdefault((o, sh, start), set()).add(traj)
        assert all(len(v) == 1 for v in where.values()), where
        assert len({(o, sh, next(iter(v))) for (o, sh, _), v in where.items()}) == len(where)


def test_trajectory_ids_of_two_values_a_step_are_refused_before_any_actor_starts(make_buffer, ray_session):
    from rayrb import SchemaError

    ids = np.stack([np.arange(40) // 20, np.arange(40) // 10 % 2], 1)  # (environment, episode): 4 episodes
    rows = {"obs": np.arange(40, dtype=np.float32)[:, None], "traj": ids}
    before = ray_session.util.list_named_actors(all_namespaces=True)
    with pytest.raises(SchemaError, match=r"one trajectory id a step in 'traj'"):
        make_buffer(rows, online_capacity=64, batch_size=8, sampler=SliceSampler(slice_len=4, traj_key="traj"))
    assert ray_session.util.list_named_actors(all_namespaces=True) == before


def test_prioritized_slices_follow_the_priorities_set_with_an_exact_share_and_keep_them_over_a_kill_and_a_restore(
        make_buffer, ray_session, tmp_path):
    """``SliceSampler(prioritized=True)``: each slice's first step drawn by its priority over every valid start of
    its side, one importance weight a slice, the split exact; the priorities set are kept by an online shard killed
    and restarted, and by a checkpoint."""
    ray = ray_session
    offline = episodes([9, 2, 7, 3, 12, 5, 4, 6])
    rb = make_buffer(offline, online_capacity=64, num_offline_shards=2, num_online_shards=2, offline_fraction=0.5,
                     sampler=SliceSampler(slice_len=L, traj_key="episode", prioritized=True), alpha=1.0, beta=0.5,
                     seed=3)
    rb.extend(episodes([10, 6], first_id=100, first_step=10_000))
    episode_of = dict(zip(offline["step"].tolist(), offline["episode"].tolist()))
    episode_of.update({10_000 + i: 100 if i < 10 else 101 for i in range(16)})
    batch, info = rb.sample(16 * L, return_info=True)
    check_slices(batch, info, episode_of)
    # every step's priority 1, then the slices starting at offline step 24 and online step 10_002 far above
    rb.update_priority(info, np.ones(16 * L))
    for _ in range(20):  # until both starts were drawn once (new rows start at the largest priority: 1 here)
        batch, info = rb.sample(16 * L, return_info=True)
        steps = np.asarray(batch["step"])
        hot = np.where(np.isin(steps, [24, 10_002]), 1000.0, 1.0)
        rb.update_priority(info, hot)
    def shares():
        firsts, weights = [], []
        for _ in range(40):
            batch, info = rb.sample(16 * L, return_info=True)
            check_slices(batch, info, episode_of)
            side = np.asarray(info["offline"]).reshape(-1, L)[:, 0]
            assert side.sum() == 8  # floor(0.5 * 16 + 1/2) offline slices
            w = np.asarray(info["weight"]).reshape(-1, L)
            assert np.allclose(w, w[:, :1])  # one weight a slice
            firsts += np.asarray(batch["step"]).reshape(-1, L)[:, 0].tolist()
            weights += w[:, 0].tolist()
        firsts, weights = np.asarray(firsts), np.asarray(weights)
        return (firsts == 24).mean(), (firsts == 10_002).mean(), weights[np.isin(firsts, [24, 10_002])]
    off, on, hot_weights = shares()
    assert off > 0.4 and on > 0.4  # each hot start holds most of its side's mass
    assert np.allclose(hot_weights, 1000.0 ** -0.5, rtol=1e-3)  # (p / min p) ** -beta, min p = 1
    online = rb.rpc.by_side["online"]
    for shard in online:  # both online shards killed: restarted from their files, priorities kept
        pid = ray.get(shard.__ray_call__.remote(lambda self: os.getpid()))
        ray.kill(shard, no_restart=False)
        while ray.get(shard.__ray_call__.remote(lambda self: os.getpid()), timeout=60) == pid:
            time.sleep(0.01)
    assert shares()[1] > 0.4
    rb.dumps(tmp_path / "ckpt")
    rb.update_priority(*_all_ones(rb))
    assert shares()[0] < 0.2  # flattened
    rb.loads(tmp_path / "ckpt")
    off, on, _ = shares()
    assert off > 0.4 and on > 0.4


def _all_ones(rb):
    """Priority 1 for every step the buffer holds, as one update: an info naming each (side, shard, index)."""
    batch, info = rb.sample(64 * L, return_info=True)
    for _ in range(30):
        more, more_info = rb.sample(64 * L, return_info=True)
        info = {k: np.concatenate([np.asarray(info[k]), np.asarray(more_info[k])]) for k in info}
    return info, np.ones(len(info["index"]))
