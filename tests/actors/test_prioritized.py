"""Prioritized sampling: sum trees, allocation over shard masses, global importance weights, generation checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from tensordict import TensorDict

from rayrb.core.allocation import multinomial_counts
from rayrb.core.samplers import PrioritizedSampler, SumTree


def test_sum_tree_finds_prefix_owners_and_updates():
    t = SumTree(5)
    t.update(np.arange(5), np.array([1.0, 0.0, 3.0, 0.5, 0.5]))
    assert t.total() == 5.0
    assert t.find(np.array([0.0, 0.99, 1.0, 3.99, 4.0, 4.49, 4.5, 4.99])).tolist() == [0, 0, 2, 2, 3, 3, 4, 4]
    t.update(np.array([2, 2]), np.array([9.0, 1.0]))  # last write wins
    assert t.total() == 3.0


def test_two_stage_prioritized_draw_matches_sampling_the_union():
    """Counts ~ Multinomial(mass_i / total), then p-proportional within each shard == p-proportional overall."""
    rng = np.random.default_rng(0)
    sizes = [5, 40, 200]
    prios = [rng.uniform(0.1, 5.0, n) for n in sizes]
    samplers = []
    for p, n in zip(prios, sizes):
        s = PrioritizedSampler(n, alpha=0.7)
        s.set_priority(np.arange(n), p)
        samplers.append(s)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    freq = np.zeros(sum(sizes))
    for _ in range(3000):
        masses = [s.mass(n)[0] for s, n in zip(samplers, sizes)]
        for i, c in enumerate(multinomial_counts(64, masses, rng)):
            np.add.at(freq, offsets[i] + samplers[i].sample(int(c), sizes[i], rng), 1)
    p_all = np.concatenate([(np.abs(p) + 1e-8) ** 0.7 for p in prios])
    expected = freq.sum() * p_all / p_all.sum()
    assert stats.chisquare(freq, expected).pvalue > 1e-3
    # and the check has teeth: allocating by shard size instead of mass fails it
    freq_bad = np.zeros(sum(sizes))
    for _ in range(3000):
        for i, c in enumerate(multinomial_counts(64, sizes, rng)):
            np.add.at(freq_bad, offsets[i] + samplers[i].sample(int(c), sizes[i], rng), 1)
    assert stats.chisquare(freq_bad, expected).pvalue < 1e-6


@pytest.fixture
def prioritized(ray_session, tmp_path):
    from rayrb import OfflineToOnlineReplayBuffer

    made = []

    def make(**kw):
        kw = {"online_capacity": 10, "num_offline_shards": 2, "sampler": "prioritized", "seed": 0,
              "offline_fraction": 1.0, "alpha": 1.0, "beta": 0.5, "dataset_root": tmp_path / f"d{len(made)}", **kw}
        rb = OfflineToOnlineReplayBuffer(TensorDict({"id": torch.arange(100)}, [100]), **kw)
        made.append(rb)
        return rb

    yield make
    for rb in made:
        rb.shutdown()


def test_priority_updates_go_to_the_owning_shard_and_weights_use_global_min(prioritized):
    rb = prioritized()
    batch, info = rb.sample(400, return_info=True)
    assert torch.allclose(info["weight"], torch.ones(400))  # all priorities equal at first
    # rows 7 (shard 0) and 93 (shard 1) get priority 20, every other sampled row 1
    hot = (batch["id"] == 7) | (batch["id"] == 93)
    assert hot.any()
    rb.update_priority(info, torch.where(hot, 20.0, 1.0))
    batch, info = rb.sample(4000, return_info=True)
    counts = np.bincount(batch["id"].numpy(), minlength=100)
    share = (counts[7] + counts[93]) / 4000
    assert abs(share - 40 / (40 + 98)) < 0.05  # (2 x 20) / (2 x 20 + 98 x 1), alpha = 1
    w_hot = info["weight"][(batch["id"] == 7) | (batch["id"] == 93)]
    w_cold = info["weight"][(batch["id"] != 7) & (batch["id"] != 93)]
    assert torch.allclose(w_hot, torch.tensor((20.0 / 1.0) ** -0.5))  # min p over both shards is 1
    assert torch.allclose(w_cold, torch.ones_like(w_cold))


def test_update_for_an_overwritten_slot_is_dropped(prioritized):
    rb = prioritized(online_capacity=4, num_online_shards=1, offline_fraction=0.0)
    rb.extend(TensorDict({"id": torch.arange(1000, 1004)}, [4]))
    batch, info = rb.sample(200, return_info=True)
    rb.extend(TensorDict({"id": torch.arange(2000, 2004)}, [4]))  # every slot overwritten: generation 2
    rb.update_priority(info, torch.full((200,), 1000.0))  # stale: must not apply
    stats_ = {s["shard"]: s for s in rb.stats()["shards"]}
    online = [s for s in stats_.values() if s["kind"] == "online"][0]
    assert online.get("priority_updates", 0) == 0 and online["priority_updates_dropped"] == 200
    batch, info = rb.sample(200, return_info=True)
    assert set(batch["id"].tolist()) == {2000, 2001, 2002, 2003}
    assert torch.allclose(info["weight"], torch.ones(200))


def test_update_priority_needs_a_prioritized_buffer(ray_session, tmp_path):
    from rayrb import OfflineToOnlineReplayBuffer

    rb = OfflineToOnlineReplayBuffer(TensorDict({"id": torch.arange(10)}, [10]), online_capacity=4, seed=0,
                                     dataset_root=tmp_path / "d")
    try:
        _, info = rb.sample(4, return_info=True)
        with pytest.raises(ValueError, match="needs sampler='prioritized'"):
            rb.update_priority(info, torch.ones(4))
    finally:
        rb.shutdown()


def test_feed_carries_importance_weights(prioritized, ray_session):
    ray = ray_session

    @ray.remote(num_cpus=0)
    class Learner:
        def update(self, meta, *parts):
            from rayrb.actors.transport import receive

            td, info = receive(meta, *parts)
            return td["id"].tolist(), info["weight"].tolist()

    rb = prioritized(batch_size=200)
    _, info = rb.sample(300, return_info=True)
    rb.update_priority(info, torch.full((300,), 4.0))  # sampled rows 4, the rest stay 1 (alpha = 1)
    learner = Learner.remote()
    try:
        rb.connect_learners([learner])
        ids, weights = rb.feed("update")[0]
        assert len(ids) == 200
        assert set(np.round(weights, 4)) <= {1.0, round(4.0 ** -0.5, 4)} and min(weights) < 1.0
    finally:
        ray.kill(learner)


def test_a_priority_that_cannot_be_held_is_refused_whole_and_the_buffer_goes_on_sampling(prioritized):
    """alpha = 1 (RLlib's default): one priority of 1e308 used to make the total mass inf, and every row written
    after it got 1e308 too, so every later sample() raised."""
    rb = prioritized(online_capacity=20, num_online_shards=2, offline_fraction=0.5)
    rb.extend(TensorDict({"id": torch.arange(1000, 1010)}, [10]))
    batch, info = rb.sample(40, return_info=True)
    twin_weights = info["weight"].clone()
    bad = torch.ones(40, dtype=torch.float64)
    bad[-1] = 1e308
    with pytest.raises(ValueError, match="priority 1e\\+308 \\(at position 39\\) cannot be held"):
        rb.update_priority(info, bad)
    assert all(s.get("priority_updates", 0) == 0 for s in rb.stats()["shards"])  # no shard got its part
    rb.extend(TensorDict({"id": torch.arange(2000, 2010)}, [10]))
    for _ in range(3):
        batch, info = rb.sample(40, return_info=True)
        assert torch.all(torch.isfinite(info["weight"])) and len(batch) == 40
    assert torch.allclose(twin_weights, torch.ones(40))
    rb.update_priority(info, torch.full((40,), 1e288, dtype=torch.float64))  # large, but every sum of it stays finite
    batch, info = rb.sample(40, return_info=True)
    assert len(batch) == 40 and torch.all(torch.isfinite(info["weight"]))
