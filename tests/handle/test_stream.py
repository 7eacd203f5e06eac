"""A plain ``sample()`` loop draws batches ahead (rayrb.handle.lookahead) and gives them back when the handle steers.

Each test runs the same calls on a buffer that draws ahead and on one that does not
(``prefetch=0``): the batches must be the same, row for row.
"""
from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

pytestmark = pytest.mark.usefixtures("ray_session")


def rows(start, n):
    ids = torch.arange(start, start + n, dtype=torch.int64)
    return TensorDict({"obs": ids.float()[:, None].expand(n, 3).contiguous(), "id": ids}, [n])


@pytest.fixture
def pair(make_buffer):
    """Two buffers with the same data and seed: one draws ahead (prefetch=8), one does not."""

    def make(**kwargs):
        kwargs = {"online_capacity": 400, "num_offline_shards": 2, "num_online_shards": 2, "seed": 5,
                  "batch_size": 16, **kwargs}
        return make_buffer(rows(0, 300), prefetch=8, **kwargs), make_buffer(rows(0, 300), prefetch=0, **kwargs)

    return make


def both(pair, fn):
    return [fn(rb) for rb in pair]


def same_batches(pair, n=6, **kwargs):
    for _ in range(n):
        (a, ia), (b, ib) = both(pair, lambda rb: rb.sample(return_info=True, **kwargs))
        assert torch.equal(a["id"], b["id"])
        for key in ("offline", "shard", "index"):
            assert torch.equal(ia[key], ib[key]), key


def test_the_stream_is_the_same_through_writes_settings_and_state(pair):
    p = pair()
    both(p, lambda rb: rb.extend(rows(1000, 50)))
    same_batches(p)
    both(p, lambda rb: rb.extend(rows(2000, 40)))
    same_batches(p)
    both(p, lambda rb: setattr(rb, "offline_fraction", 0.25))
    same_batches(p)
    both(p, lambda rb: rb.set_step(3))
    same_batches(p, 3)
    both(p, lambda rb: rb.anneal(2, 10))
    same_batches(p, 3)
    state = p[0].state_dict()
    assert state == p[1].state_dict()
    same_batches(p, 5)
    both(p, lambda rb: rb.load_state_dict(state))
    same_batches(p, 5)
    same_batches(p, 2, batch_size=7)  # another batch size gives back what was drawn at 16
    same_batches(p, 4)
    assert p[0]._sampling.stream.stats["groups"] < 45  # it did draw ahead
    assert p[0]._sampling.stream.stats["given_back"] > 0


def test_a_sample_after_this_handles_extend_can_draw_the_new_rows(pair):
    ahead, _ = pair(offline_fraction=0.5)
    first = ahead.sample()
    assert (first["id"] < 300).all()  # all offline while the online side is empty: more like it are held
    ahead.extend(rows(1000, 30))
    batch, info = ahead.sample(return_info=True)
    assert int((~info["offline"]).sum()) == 8 and bool((batch["id"][~info["offline"]] >= 1000).all())


def test_a_new_fraction_applies_to_the_next_sample(pair):
    ahead, _ = pair(offline_fraction=0.5)
    ahead.extend(rows(1000, 30))
    ahead.sample()
    ahead.offline_fraction = 1.0
    _, info = ahead.sample(return_info=True)
    assert bool(info["offline"].all())


def test_without_replacement_epochs_and_the_short_final_batch(pair):
    p = pair(sampler="without_replacement", offline_fraction=1.0, batch_size=64)
    sizes = []
    for _ in range(11):
        (a, b) = both(p, lambda rb: rb.sample())
        assert torch.equal(a["id"], b["id"])
        sizes.append(len(a))
    assert sizes == [64, 64, 64, 64, 44] * 2 + [64]  # 300 rows: four full batches and a short one, twice
    one_epoch = list(p[0].client())  # iterating ends with the epoch's last batch (its first may be mid-epoch)
    assert 1 <= sum(len(b) for b in one_epoch) <= 300 and len(one_epoch[-1]) in (44, 64)


def test_an_epoch_end_that_raises_leaves_the_stream_where_it_was(pair):
    p = pair(sampler="without_replacement", offline_fraction=1.0, batch_size=128, epoch_end="raise")
    same_batches(p, 2)
    for rb in p:
        with pytest.raises(ValueError, match="without replacement"):
            rb.sample()
    assert p[0].state_dict() == p[1].state_dict()
    same_batches(p, 2, batch_size=22)  # 44 rows were left in the epoch


def test_priority_updates_reach_the_next_sample(pair):
    p = pair(sampler="prioritized", offline_fraction=0.5)
    both(p, lambda rb: rb.extend(rows(1000, 50)))
    for _ in range(4):
        (a, ia), (b, ib) = both(p, lambda rb: rb.sample(return_info=True))
        assert torch.equal(a["id"], b["id"]) and torch.equal(ia["weight"], ib["weight"])
        prio = (a["id"] % 7).float() + 0.5
        both(p, lambda rb: rb.update_priority(ia, prio))


def test_another_handles_draw_stops_the_give_back_and_nothing_is_served_twice(pair):
    ahead, _ = pair(sampler="without_replacement", offline_fraction=1.0, batch_size=20)
    other = ahead.client(prefetch=0)
    seen = list(ahead.sample()["id"].tolist())  # ahead holds the rest of this epoch, and more, planned
    held = ahead._sampling.stream.ahead
    assert held >= 14
    later = other.sample()["id"].tolist()  # another draw: ahead's batches can no longer be given back
    ahead.extend(rows(1000, 5))  # a give-back that is refused: without replacement they are kept
    assert ahead._sampling.stream.stats["kept"] == held
    while len(seen) < 300:  # the kept batches: the rest of the epoch
        seen += ahead.sample()["id"].tolist()
    assert sorted(seen) == list(range(300))  # one epoch: every row once, none lost
    assert len(later) == 20 and len(set(later)) == 20  # the other handle's batch: from an epoch after them


def test_uniform_batches_that_cannot_be_given_back_are_dropped(pair):
    ahead, _ = pair(offline_fraction=0.5)
    ahead.sample()
    ahead.client().sample()
    ahead.extend(rows(1000, 30))
    assert ahead._sampling.stream.stats["dropped"] > 0
    _, info = ahead.sample(return_info=True)
    assert int((~info["offline"]).sum()) == 8  # drawn after the write


def test_a_rate_limiter_that_can_block_draws_nothing_ahead(make_buffer):
    from rayrb import SampleToInsertRatio

    rb = make_buffer(rows(0, 300), online_capacity=400, batch_size=16, offline_fraction=0.5, seed=0,
                     rate_limiter=SampleToInsertRatio(samples_per_insert=1.0, min_size_to_sample=8,
                                                      error_buffer=200), prefetch=8)
    rb.extend(rows(1000, 100))
    for _ in range(5):
        rb.sample()
    limiter = rb.stats()["coordinator"]["rate_limiter"]
    assert limiter["samples"] == 5 * 8  # online rows sampled: exactly those served


def test_prefetch_is_checked(make_buffer):
    with pytest.raises(ValueError, match="prefetch"):
        make_buffer(rows(0, 10), online_capacity=10, prefetch=-1)


def test_another_handles_write_reaches_this_handles_samples_within_one_call(pair):
    """Sizes are no staler than the previous sample() call, even with batches drawn ahead."""
    ahead, _ = pair(offline_fraction=0.5)
    collector = ahead.client(prefetch=0)
    ahead.sample(return_info=True)  # 8 all-offline batches held: the online side is empty
    ahead.sample(return_info=True)
    collector.extend(rows(1000, 30))
    _, info = ahead.sample(return_info=True)  # on the coordinator's node, the very next call
    assert int((~info["offline"]).sum()) == 8
    assert ahead._sampling.stream.stats["stale"] == 1, ahead._sampling.stream.stats
    collector.offline_fraction = 1.0  # a setting from another handle applies to the next call too
    _, info = ahead.sample(return_info=True)
    assert bool(info["offline"].all())
