"""Without replacement over several shards: epochs, refusals, restarts and the resume token. Batches are drawn as in
``standin_coordinator``; nothing here imports Ray."""
from __future__ import annotations

import json

import numpy as np
import pytest
from standin_coordinator import Layout, every_row

from rayrb.core.allocators import WithoutReplacementAllocator
from rayrb.core.plans import (
    OFFLINE,
    ONLINE,
)
from rayrb.core.samplers import (
    SAMPLERS,
    Epoch,
    WithoutReplacementSampler,
    register_sampler,
)

pytestmark = pytest.mark.usefixtures("local_metrics")


# ---------------------------------------------------------------------------------------------------------------
# Without replacement over several shards
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_slices", [1, 3])
def test_without_replacement_epoch_visits_every_row_once_across_shards_and_slices(num_slices):
    sizes = {OFFLINE: [7, 0, 13, 4], ONLINE: [6, 9]}  # 24 offline rows (8 batches), 15 online (5 batches)
    layout = Layout("without_replacement", sizes, fraction=0.5, seed=3)
    by_epoch: dict[tuple[str, int], list] = {}
    for _ in range(40):
        for plan, reads in layout.draw(6, num_slices)[::-1]:  # slices read in reverse: each read knows its place
            assert plan.n_offline == sum(p.count for p in plan.parts if p.side == OFFLINE)
            for p, (seed, kw), idx in zip(plan.parts, reads, layout.read(plan, reads)):
                by_epoch.setdefault((p.side, kw["epoch"].number), []).extend((p.side, p.shard, int(i)) for i in idx)
    assert sorted(by_epoch) == [(OFFLINE, e) for e in range(1, 6)] + [(ONLINE, e) for e in range(1, 9)]
    for (side, _), rows in by_epoch.items():
        assert sorted(rows) == every_row(sizes[side], side)
    assert (layout.epochs(OFFLINE), layout.epochs(ONLINE)) == (5, 8)


def test_without_replacement_refuses_a_batch_larger_than_the_epoch_has_left_and_changes_nothing():
    layout = Layout("without_replacement", {OFFLINE: [5, 6], ONLINE: [4]}, fraction=1.0, seed=1, epoch_end="raise")
    layout.batch(4)
    layout.batch(4)  # 3 offline rows left
    before = layout.coord.state_dict()  # step, RNG and allocator
    alloc = WithoutReplacementAllocator({OFFLINE: 2, ONLINE: 1}, epoch_end="raise")
    alloc.load_state_dict(before["allocator"])
    with pytest.raises(ValueError, match="cannot draw 4 offline rows without replacement: 3 left in the epoch; "
                                         "pass drop_last=True"):
        alloc.check({OFFLINE: 4, ONLINE: 0}, layout.sizes)
    assert alloc.state_dict() == before["allocator"] and alloc.left(OFFLINE).sum() == 3
    with pytest.raises(ValueError, match="3 left in the epoch"):
        layout.draw(4)
    assert layout.coord.state_dict() == before
    rest = layout.batch(3)  # what is left is still there, and it is the epoch's last three rows
    assert layout.epochs(OFFLINE) == 1 and layout.left(OFFLINE) == 0
    assert len(set(rest)) == 3
    with pytest.raises(ValueError, match="the offline side holds 11 rows"):
        alloc.check({OFFLINE: 12, ONLINE: 0}, layout.sizes)


def test_without_replacement_check_refuses_both_sides_before_either_begins_an_epoch():
    alloc = WithoutReplacementAllocator({OFFLINE: 2, ONLINE: 1})
    sizes = {OFFLINE: np.array([3, 4]), ONLINE: np.array([2])}
    assert alloc.check({OFFLINE: 2, ONLINE: 1}, sizes) == {OFFLINE: True, ONLINE: True}
    before = alloc.state_dict()
    with pytest.raises(ValueError, match="cannot draw 3 online rows without replacement: the online side holds 2"):
        alloc.check({OFFLINE: 2, ONLINE: 3}, sizes)  # offline would begin an epoch, online cannot be served
    assert alloc.state_dict() == before and alloc.stats() == {"epochs": {OFFLINE: 0, ONLINE: 0}}
    assert alloc.read_args(OFFLINE, 0) == {}


def test_a_batch_larger_than_a_sides_whole_epoch_is_that_epoch_in_one_short_batch_as_torchrls():
    """``epoch_end="short"`` (TorchRL's ``drop_last=False``): a batch asking for more rows than the side holds is
    the whole epoch in one batch, split exactly; the next begins the next epoch. ``"raise"`` refuses it."""
    sizes = [5, 6]
    layout = Layout("without_replacement", {OFFLINE: sizes, ONLINE: [3]}, fraction=1.0, seed=2)
    assert sorted(layout.batch(40)) == every_row(sizes, OFFLINE) and layout.epochs(OFFLINE) == 1
    assert len(set(layout.batch(40))) == 11 and layout.epochs(OFFLINE) == 2
    both = Layout("without_replacement", {OFFLINE: sizes, ONLINE: [3]}, fraction=0.5, seed=2)
    rows = both.batch(40)  # 3 online rows at most: the largest batch split exactly around them, 4 + 3
    assert sorted(r for r in rows if r[0] == ONLINE) == every_row([3], ONLINE) and len(rows) == 7
    refused = Layout("without_replacement", {OFFLINE: sizes, ONLINE: [3]}, fraction=1.0, seed=2, epoch_end="raise")
    with pytest.raises(ValueError, match="the offline side holds 11 rows"):
        refused.draw(12)


def test_without_replacement_drop_last_drops_the_remainder_and_begins_the_next_epoch():
    sizes = [5, 6]
    layout = Layout("without_replacement", {OFFLINE: sizes, ONLINE: [3]}, fraction=1.0, seed=2, drop_last=True)
    first = layout.batch(4) + layout.batch(4)
    assert len(set(first)) == 8 and layout.left(OFFLINE) == 3
    second = layout.batch(4)  # 4 > 3 left: those 3 are dropped, epoch 2 begins
    assert layout.epochs(OFFLINE) == 2 and layout.left(OFFLINE) == 11 - 4
    second += layout.batch(4) + layout.batch(3)  # epoch 2 runs to its end
    assert sorted(second) == every_row(sizes, OFFLINE)
    with pytest.raises(ValueError, match="the offline side holds 11 rows"):  # drop_last never serves a short side
        layout.draw(12)


class OnlineShardLost(WithoutReplacementAllocator):
    """Without replacement, failing once the offline side is drawn and an epoch of each side has begun."""

    def counts(self, side, n, sizes, rng):
        out = super().counts(side, n, sizes, rng)
        if side == ONLINE:
            raise RuntimeError("online shard lost")
        return out


class OnlineShardLostSampler(WithoutReplacementSampler):
    name = "online_shard_lost_for_tests"
    allocator = OnlineShardLost


def test_a_draw_that_fails_midway_leaves_step_rng_and_epochs_as_they_were():
    register_sampler(OnlineShardLostSampler)
    try:
        layout = Layout(OnlineShardLostSampler.name, {OFFLINE: [5, 6], ONLINE: [4]}, fraction=0.5, seed=3)
        before = layout.coord.state_dict()
        with pytest.raises(RuntimeError, match="online shard lost"):
            layout.draw(4)
        assert layout.coord.state_dict() == before
        assert (layout.epochs(OFFLINE), layout.epochs(ONLINE)) == (0, 0)
    finally:
        SAMPLERS.pop(OnlineShardLostSampler.name)


@pytest.mark.parametrize("restarted", [[0], [0, 1, 2]])
def test_without_replacement_restarted_shard_continues_with_the_rows_it_would_have_given(restarted):
    sizes = {OFFLINE: [7, 5, 9], ONLINE: [4]}
    kept = Layout("without_replacement", sizes, fraction=1.0, seed=5, drop_last=True)
    moved = Layout("without_replacement", sizes, fraction=1.0, seed=5, drop_last=True)
    for _ in range(3):  # 12 of 21 rows into the first epoch
        assert kept.batch(4, 2) == moved.batch(4, 2)
    for i in restarted:
        moved.samplers[OFFLINE][i] = WithoutReplacementSampler()
    for _ in range(5):  # through the end of the epoch and into the next
        assert kept.batch(4, 2) == moved.batch(4, 2)
    assert kept.epochs(OFFLINE) == 2


def test_without_replacement_sampler_resumes_from_its_token_in_any_state():
    token_rows = WithoutReplacementSampler().sample(10, 10, None, epoch=Epoch(3, seed=11, size=10, start=0))
    behind = WithoutReplacementSampler()
    behind.sample(2, 10, None, epoch=Epoch(3, seed=11, size=10, start=0))  # it missed the reads of rows 2..5
    assert behind.sample(4, 10, None, epoch=Epoch(3, seed=11, size=10, start=6)).tolist() == token_rows[6:].tolist()
    older = WithoutReplacementSampler()
    older.sample(5, 5, None, epoch=Epoch(2, seed=11, size=5, start=0))  # a past epoch of another size
    assert older.sample(3, 10, None, epoch=Epoch(3, seed=11, size=10, start=1)).tolist() == token_rows[1:4].tolist()
    with pytest.raises(ValueError, match="cannot draw 5 rows without replacement: 4 left in the epoch"):
        older.sample(5, 10, None, epoch=Epoch(3, seed=11, size=10, start=6))


def test_without_replacement_sampler_follows_the_token_seed_when_number_and_size_match():
    expected = WithoutReplacementSampler().sample(6, 6, None, epoch=Epoch(1, seed=8, size=6, start=0))
    shard = WithoutReplacementSampler()
    shard.sample(3, 6, None, epoch=Epoch(1, seed=7, size=6, start=0))
    assert shard.sample(3, 6, None, epoch=Epoch(1, seed=8, size=6, start=3)).tolist() == expected[3:].tolist()


def test_without_replacement_state_round_trip_gives_the_same_future():
    sizes = {OFFLINE: [7, 5, 9], ONLINE: [3, 4]}
    kept = Layout("without_replacement", sizes, fraction=0.5, seed=9, drop_last=True)
    for _ in range(4):
        kept.batch(6, 2)
    state = json.loads(json.dumps(kept.coord.state_dict(), default=int))  # as a checkpoint stores it
    alloc = WithoutReplacementAllocator({OFFLINE: 3, ONLINE: 2}, drop_last=True)
    alloc.load_state_dict(state["allocator"])
    assert alloc.state_dict() == state["allocator"]
    restored = Layout("without_replacement", sizes, fraction=0.5, seed=0, drop_last=True)
    restored.coord.load_state_dict(state)
    assert restored.coord.state_dict() == kept.coord.state_dict()
    for _ in range(10):  # fresh samplers too: the shards restarted with the coordinator
        a, b = kept.draw(6, 2), restored.draw(6, 2)
        assert [(p.parts, [kw for _, kw in r]) for p, r in a] == [(p.parts, [kw for _, kw in r]) for p, r in b]
        assert [kept.rows(*x) for x in a] == [restored.rows(*x) for x in b]


def test_without_replacement_state_with_another_shard_count_is_refused_and_changes_nothing():
    saved = Layout("without_replacement", {OFFLINE: [4, 4, 4], ONLINE: [2]}, fraction=1.0)
    saved.draw(5)
    saved = saved.coord
    alloc = WithoutReplacementAllocator({OFFLINE: 2, ONLINE: 1})
    alloc.begin_epoch(OFFLINE, np.array([4, 4]), np.random.default_rng(0))
    before = alloc.state_dict()
    with pytest.raises(ValueError, match="saved offline epoch has 3 shards, this buffer has 2"):
        alloc.load_state_dict(saved.state_dict()["allocator"])
    assert alloc.state_dict() == before
    layout = Layout("without_replacement", {OFFLINE: [4, 4], ONLINE: [2]}, fraction=1.0, seed=1)
    layout.batch(3)
    before = layout.coord.state_dict()
    with pytest.raises(ValueError, match="saved offline epoch has 3 shards, this buffer has 2"):
        layout.coord.load_state_dict(saved.state_dict())
    assert layout.coord.state_dict() == before
