"""The Ray-free core: validation, plans, allocators with their samplers, the write log and the split contract.

Batches are planned by the coordinator's own draw (check, begin_epoch, then per
slice read_args, counts and seeds) over stand-in shard handles, and read as shards
read them (one generator per seed, the read's Epoch token). Nothing here imports Ray.
"""
from __future__ import annotations

import json
import math
import re
from fractions import Fraction

import numpy as np
import pytest
import torch
from scipy import stats
from write_model import ModelShard

import rayrb.actors.coordinator
from rayrb.actors.coordinator import Coordinator
from rayrb.actors.metrics import ActorMetrics
from rayrb.core.allocation import offline_count, split_batch, split_slices, write_pieces
from rayrb.core.allocators import PrioritizedAllocator, UniformAllocator, WithoutReplacementAllocator
from rayrb.core.plans import (
    OFFLINE,
    ONLINE,
    SIDES,
    BatchPlan,
    GroupPlan,
    ImportanceWeights,
    Part,
    assemble,
    assemble_slice,
    concat,
    decode_group,
    nest,
    provenance,
    split_group,
)
from rayrb.core.samplers import (
    SAMPLERS,
    Epoch,
    PrioritizedSampler,
    Sampler,
    WithoutReplacementSampler,
    make_allocator,
    make_sampler,
    register_sampler,
    sampler_class,
)
from rayrb.core.validation import (
    callable_or_none,
    finite_number,
    fraction,
    non_negative_int,
    one_of,
    positive_int,
    priority_options,
    timeout,
)
from rayrb.durability.writelog import WriteLog, slots
from rayrb.io.arrays import from_numpy_dict, to_numpy_dict


# ---------------------------------------------------------------------------------------------------------------
# The coordinator over stand-in shard handles
# ---------------------------------------------------------------------------------------------------------------
class _Method:
    def __init__(self, fn):
        self.remote = fn


class StandInShard:
    """What the coordinator calls on a shard handle, recorded."""

    def __init__(self):
        self.updates: list[tuple] = []
        self.mass_stats = _Method(lambda: (1.0, 1.0))
        self.update_priority = _Method(lambda *a: self.updates.append(tuple(np.asarray(x).tolist() for x in a)))


@pytest.fixture(autouse=True)
def local_metrics(monkeypatch):
    """Coordinator metrics kept local, so that nothing here imports Ray."""
    monkeypatch.setattr(rayrb.actors.coordinator, "ActorMetrics", lambda *a, **kw: ActorMetrics(*a, **kw, export=False))


def written_online(coord: Coordinator, rows: list[int]) -> None:
    """Online shard ``i`` holds ``rows[i]`` rows, as the coordinator's write log records them."""
    coord._writing.log.reset(rows)
    assert coord.sizes()[ONLINE] == list(rows)


class Layout:
    """A Coordinator over stand-in shards of these sizes, and one sampler per shard reading as a shard reads."""

    def __init__(self, kind: str, sizes: dict, *, fraction: float = 0.5, seed: int = 0, drop_last: bool | None = None,
                 epoch_end: str | None = None):
        self.kind = kind
        self.sizes = {side: np.asarray(sizes[side], np.int64) for side in SIDES}
        self.coord = Coordinator([StandInShard() for _ in sizes[OFFLINE]], sizes[OFFLINE],
                                 [StandInShard() for _ in sizes[ONLINE]], sizes[ONLINE], offline_fraction=fraction,
                                 sampler=kind, drop_last=drop_last, epoch_end=epoch_end, seed=seed)
        written_online(self.coord, sizes[ONLINE])
        self.samplers = {side: self.fresh_samplers(side) for side in SIDES}

    def fresh_samplers(self, side: str) -> list[Sampler]:
        kind = self.kind[side] if isinstance(self.kind, dict) else self.kind
        return [make_sampler(kind, max(1, int(n))) for n in self.sizes[side]]

    def draw(self, batch_size: int, num_slices: int = 1) -> list[tuple[BatchPlan, list]]:
        """The plans and reads that ``plan`` groups for the handles to submit."""
        drawing, sizes = self.coord._drawing, self.coord._sizes()
        drawing._sync_masses(sizes)
        return drawing._draw(batch_size, sizes, num_slices, None)

    def read(self, plan: BatchPlan, reads: list) -> list[np.ndarray]:
        """Each part's local row indices, as its shard's sampler returns them."""
        return [self.samplers[p.side][p.shard].sample(p.count, int(self.sizes[p.side][p.shard]),
                                                      np.random.default_rng(seed), epoch=kw.get("epoch"))
                for p, (seed, kw) in zip(plan.parts, reads)]

    def rows(self, plan: BatchPlan, reads: list) -> list[tuple[str, int, int]]:
        return [(p.side, p.shard, int(i)) for p, idx in zip(plan.parts, self.read(plan, reads)) for i in idx]

    def batch(self, batch_size: int, num_slices: int = 1) -> list[tuple[str, int, int]]:
        return [row for plan, reads in self.draw(batch_size, num_slices) for row in self.rows(plan, reads)]

    def epochs(self, side: str) -> int:
        return self.coord.stats(include_shards=False)["coordinator"]["epochs"][side]

    def left(self, side: str) -> int:
        return sum(self.coord.state_dict()["allocator"]["left"][side] or [0])


def every_row(sizes, side: str) -> list[tuple[str, int, int]]:
    return sorted((side, s, i) for s, n in enumerate(sizes) for i in range(n))


# ---------------------------------------------------------------------------------------------------------------
# 1. Without replacement over several shards
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


# ---------------------------------------------------------------------------------------------------------------
# 2. Prioritized
# ---------------------------------------------------------------------------------------------------------------
def prioritized_shards(rng, sizes, alpha=0.7):
    """Samplers whose masses are far from proportional to their sizes (the small shard holds high priorities)."""
    out = []
    for n, scale in zip(sizes, [20.0, 1.0, 0.2]):
        s = PrioritizedSampler(n, alpha=alpha)
        s.set_priority(np.arange(n), rng.uniform(0.5, 1.5, n) * scale)
        out.append(s)
    return out


def shard_totals(alloc, side_sizes, draws, n, rng):
    return np.sum([alloc.counts(OFFLINE, n, side_sizes, rng) for _ in range(draws)], axis=0)


def test_prioritized_counts_follow_shard_masses():
    rng = np.random.default_rng(0)
    sizes = np.array([5, 40, 200])
    samplers = prioritized_shards(rng, sizes)
    alloc = PrioritizedAllocator({OFFLINE: 3, ONLINE: 0})
    alloc.set_masses(OFFLINE, [s.mass(int(n)) for s, n in zip(samplers, sizes)], sizes)
    masses = np.array([s.mass(int(n))[0] for s, n in zip(samplers, sizes)])
    totals = shard_totals(alloc, sizes, 2000, 64, rng)
    assert stats.chisquare(totals, totals.sum() * masses / masses.sum()).pvalue > 1e-3


def test_chi_square_catches_prioritized_counts_that_follow_sizes():
    """The check above has teeth: allocating by shard size instead of mass fails it."""
    rng = np.random.default_rng(0)
    sizes = np.array([5, 40, 200])
    samplers = prioritized_shards(rng, sizes)
    masses = np.array([s.mass(int(n))[0] for s, n in zip(samplers, sizes)])
    totals = shard_totals(UniformAllocator({OFFLINE: 3, ONLINE: 0}), sizes, 2000, 64, rng)
    assert stats.chisquare(totals, totals.sum() * masses / masses.sum()).pvalue < 1e-6


def test_prioritized_min_p_ignores_empty_shards_and_weights_use_each_sides_global_min():
    alloc = PrioritizedAllocator({OFFLINE: 3, ONLINE: 2}, beta=0.5)
    empty, partly, full = (PrioritizedSampler(n, alpha=1.0) for n in (4, 8, 3))
    partly.set_priority(np.arange(3), np.array([2.0, 3.0, 5.0]))  # 3 of 8 slots written
    full.set_priority(np.arange(3), np.array([4.0, 8.0, 6.0]))
    assert empty.mass(0) == (0.0, 0.0)
    sizes = np.array([0, 3, 3])
    alloc.set_masses(OFFLINE, [empty.mass(0), partly.mass(3), full.mass(3)], sizes)
    alloc.set_masses(ONLINE, [(0.0, 0.0), (0.0, 0.0)], np.array([0, 0]))  # no online rows yet
    w = alloc.weights()
    assert w.min_p[OFFLINE] == pytest.approx(2.0 + 1e-8) and w.min_p[ONLINE] == 1.0
    counts = alloc.counts(OFFLINE, 50, sizes, np.random.default_rng(0))
    assert counts[0] == 0 and counts.sum() == 50
    # (p / min p) ** -beta is (N P(i)) ** -beta over the side's union of rows, normalized by its largest value
    p = np.concatenate([partly.info(np.arange(3))["priority"], full.info(np.arange(3))["priority"]])
    union = (p.size * p / p.sum()) ** -0.5
    np.testing.assert_allclose(w(OFFLINE, {"index": np.arange(p.size), "priority": p}), union / union.max())


def test_importance_weights_values():
    w = ImportanceWeights(beta=0.5, min_p={OFFLINE: 0.25, ONLINE: 2.0})
    def info(p):
        return {"index": np.arange(len(p)), "priority": np.array(p)}

    np.testing.assert_allclose(w(OFFLINE, info([0.25, 1.0, 4.0])), [1.0, 0.5, 0.25])
    np.testing.assert_allclose(w(ONLINE, info([2.0, 8.0])), [1.0, 0.5])
    assert ImportanceWeights(0.0, {OFFLINE: 3.0, ONLINE: 1.0})(OFFLINE, info([7.0]))[0] == 1.0
    only_offline = ImportanceWeights(0.5, {OFFLINE: 1.0})  # the online side samples without priorities
    np.testing.assert_allclose(only_offline(ONLINE, {"index": np.array([4, 9])}), [1.0, 1.0])


def test_provenance_weighs_each_row_against_its_own_sides_min_p():
    w = ImportanceWeights(beta=1.0, min_p={OFFLINE: 1.0, ONLINE: 4.0})
    plan = BatchPlan([Part(OFFLINE, 1, 2), Part(ONLINE, 0, 2)], n_offline=2, n_online=2, fraction=0.5, step=0,
                     weights=w)
    results = [({"x": np.arange(2)}, {"index": np.array([3, 5]), "generation": np.array([1, 1]),
                                      "priority": np.array([1.0, 2.0])}),
               ({"x": np.arange(2)}, {"index": np.array([0, 1]), "generation": np.array([4, 5]),
                                      "priority": np.array([4.0, 8.0])})]
    _, info = assemble(plan, results, return_info=True)
    assert info["weight"].dtype == np.float32
    np.testing.assert_allclose(info["weight"], [1.0, 0.5, 1.0, 0.5])
    assert info["offline"].tolist() == [True, True, False, False] and info["shard"].tolist() == [1, 1, 0, 0]
    assert "weight" not in provenance(BatchPlan(plan.parts, 2, 2, 0.5, 0), [r[1] for r in results])


def test_prioritized_batches_carry_weights_against_the_union_of_shards():
    rng = np.random.default_rng(1)
    sizes = {OFFLINE: [6, 10], ONLINE: [5]}
    samplers = {side: [PrioritizedSampler(n) for n in sizes[side]] for side in SIDES}
    alloc = PrioritizedAllocator({side: len(sizes[side]) for side in SIDES}, beta=0.4)
    parts, results = [], []
    for side in SIDES:
        for s, n in zip(samplers[side], sizes[side]):
            s.on_write(np.arange(n))
            s.set_priority(np.arange(n), rng.uniform(0.1, 3.0, n))
        alloc.set_masses(side, [s.mass(n) for s, n in zip(samplers[side], sizes[side])], np.array(sizes[side]))
        for i, c in enumerate(alloc.counts(side, 16, np.array(sizes[side]), rng)):
            if c:
                idx = samplers[side][i].sample(int(c), sizes[side][i], rng)
                parts.append(Part(side, i, int(c)))
                info = {"index": idx, "generation": np.zeros_like(idx), **samplers[side][i].info(idx)}
                results.append(({"x": idx}, info))
    _, info = assemble(BatchPlan(parts, 16, 16, 0.5, 0, alloc.weights()), results, return_info=True)
    priority = np.concatenate([r[1]["priority"] for r in results])
    for side, mask in ((OFFLINE, info["offline"]), (ONLINE, ~info["offline"])):
        every_p = np.concatenate([s.info(np.arange(n))["priority"] for s, n in zip(samplers[side], sizes[side])])
        n_p = every_p.size * priority[mask] / every_p.sum()  # N P(i) over the side's union of shards
        expected = n_p ** -0.4 / (every_p.size * every_p.min() / every_p.sum()) ** -0.4
        np.testing.assert_allclose(info["weight"][mask], expected, rtol=1e-6)
        assert np.all(info["weight"][mask] <= 1.0)


def test_priority_options_and_sampler_options_are_checked():
    with pytest.raises(ValueError, match="beta must be a finite number >= 0.0, got inf"):
        PrioritizedAllocator({OFFLINE: 1, ONLINE: 1}, beta=float("inf"))
    with pytest.raises(ValueError, match="alpha must be a finite number >= 0.0, got nan"):
        PrioritizedSampler(4, alpha=float("nan"))
    with pytest.raises(ValueError, match="capacity must be a positive integer, got 0"):
        PrioritizedSampler(0)
    s = PrioritizedSampler(4)
    with pytest.raises(ValueError, match="priorities must be finite numbers, got \\[nan\\]"):
        s.check_priority(np.arange(2), np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="expected 4 finite non-negative priorities"):
        s.load_state_dict({"priority": np.array([1.0, -1.0, 0.0, 0.0]), "max_priority": 1.0})


# ---------------------------------------------------------------------------------------------------------------
# 3. Priority routing (in the coordinator, driven here over stand-in shard handles)
# ---------------------------------------------------------------------------------------------------------------
def test_priority_updates_go_to_the_owning_shard_and_a_bad_row_stops_them_all():
    off, on = [StandInShard(), StandInShard()], [StandInShard(), StandInShard()]
    coord = Coordinator(off, [4, 6], on, [5, 5], sampler="prioritized", seed=0)
    written_online(coord, [3, 0])
    n, acks = coord.update_priority(offline=[True, False, True, True, False, True], shard=[1, 0, 0, 1, 0, 1],
                                    index=[5, 2, 2, 0, 0, 3], generation=[10, 11, 12, 13, 14, 15],
                                    priority=[0.5, 1.5, 2.5, 3.5, 4.5, 5.5])
    assert n == 6 and len(acks) == 3
    assert off[0].updates == [([2], [12], [2.5])]
    assert off[1].updates == [([5, 0, 3], [10, 13, 15], [0.5, 3.5, 5.5])]
    assert on[0].updates == [([2, 0], [11, 14], [1.5, 4.5])] and on[1].updates == []
    for kwargs, error, message in [
        (dict(offline=[True, True], shard=[0, 1], index=[0, 6]), IndexError,
         "offline shard 1 holds 6 rows, got index 6"),
        (dict(offline=[True, True], shard=[0, 2], index=[0, 0]), ValueError, "no offline shard 2: the buffer has 2"),
        (dict(offline=[True, False], shard=[0, 0], index=[0, 3]), IndexError,
         "online shard 0 holds 3 rows, got index 3"),
        (dict(offline=[True, False], shard=[0, 1], index=[0, 0]), IndexError, "online shard 1 holds 0 rows"),
        (dict(offline=[False, True], shard=[0, 0], index=[0, -1]), IndexError,
         "offline shard 0 holds 4 rows, got index -1"),
    ]:
        with pytest.raises(error, match=message):
            coord.update_priority(**kwargs, generation=[0, 0], priority=[1.0, 1.0])
    with pytest.raises(ValueError, match="same length, got \\[2, 2, 2, 2, 1\\]"):
        coord.update_priority([True, True], [0, 0], [0, 1], [0, 0], [1.0])
    with pytest.raises(ValueError, match="priorities must be finite numbers, got \\[inf\\]"):
        coord.update_priority([True], [0], [0], [0], [np.inf])
    assert [len(s.updates) for s in off + on] == [1, 1, 1, 0]  # no refused call reached any shard
    uniform = Coordinator([StandInShard()], [4], [], [], sampler="uniform")
    with pytest.raises(ValueError, match="update_priority needs sampler='prioritized', this buffer samples 'uniform'"):
        uniform.update_priority([True], [0], [0], [0], [1.0])


# ---------------------------------------------------------------------------------------------------------------
# 4. The write log
# ---------------------------------------------------------------------------------------------------------------
def test_write_log_slots_wrap_around():
    assert slots(5, 4, 3).tolist() == [2, 0, 1, 2]
    log = WriteLog([3])
    plan = log.plan([5])
    assert plan[0].slots.tolist() == [0, 1, 2, 0, 1] and log.indices(plan).tolist() == [0, 1, 2, 0, 1]
    log.commit(plan)
    assert log.written.tolist() == [5] and log.sizes.tolist() == [3]
    (w,) = log.plan([2])
    assert (w.first, w.slots.tolist()) == (5, [2, 0])


@pytest.mark.parametrize("capacities", [[8, 8, 8, 8], [5, 11, 7]])
def test_write_log_keeps_fill_levels_within_one_piece_over_a_random_stream(capacities):
    rng = np.random.default_rng(0)
    log = WriteLog(capacities)
    largest = 0
    for _ in range(400):
        pieces = write_pieces(int(rng.integers(1, 200)), len(capacities), min_piece=16)
        largest = max(largest, int(pieces.max()))
        log.commit(log.plan(pieces.tolist()))
        assert log.written.max() - log.written.min() <= largest
    for _ in range(200):  # pieces of any sizes, as a client may cut them
        pieces = rng.integers(1, 30, int(rng.integers(1, len(capacities) + 1))).tolist()
        largest = max(largest, max(pieces))
        log.commit(log.plan(pieces))
        assert log.written.max() - log.written.min() <= largest


def test_write_log_global_indices_match_offsets_and_never_collide_among_held_rows():
    rng = np.random.default_rng(1)
    capacities = [6, 9, 4]
    log = WriteLog(capacities)
    assert log.offsets.tolist() == [0, 6, 15]
    held: dict[int, int] = {}  # global index -> the row written there last
    row = 0
    for _ in range(300):
        plan = log.plan(rng.integers(1, 5, int(rng.integers(1, 4))).tolist())
        idx = log.indices(plan)
        assert idx.size == sum(w.rows for w in plan) and [w.start for w in plan] == [0] + [w.stop for w in plan][:-1]
        for w in plan:
            assert np.all((w.slots >= 0) & (w.slots < capacities[w.shard]))
            np.testing.assert_array_equal(idx[w.start:w.stop], log.offsets[w.shard] + (w.first + np.arange(w.rows))
                                          % capacities[w.shard])
        log.commit(plan)
        for i in idx:
            held[int(i)] = row
            row += 1
        live = {i for i in held if any(o <= i < o + n for o, n in zip(log.offsets, log.sizes))}
        assert len(live) == int(log.sizes.sum()) == len(held)
    assert sorted(held) == list(range(sum(capacities)))


def test_write_log_plan_changes_nothing_and_commit_refuses_a_stale_plan_whole():
    log = WriteLog([4, 4])
    first, again = log.plan([3, 3]), log.plan([3, 3])
    assert log.written.tolist() == [0, 0] and log.state_dict() == {"written": [0, 0], "capacity": [4, 4]}
    assert [(w.shard, w.first, w.slots.tolist()) for w in first] == \
        [(w.shard, w.first, w.slots.tolist()) for w in again]
    log.commit(log.plan([2]))  # another write lands on shard 0 first
    with pytest.raises(RuntimeError, match="write to online shard 0 planned at row 0, but the shard is at row 2"):
        log.commit(first)
    assert log.written.tolist() == [2, 0]  # shard 1's piece was not applied either
    second = log.plan([3, 3])
    assert [w.shard for w in second] == [1, 0]
    log.reset([4, 0])  # shard 0 took a write the log missed: only the plan's second piece is stale
    with pytest.raises(RuntimeError, match="write to online shard 0 planned at row 2, but the shard is at row 4"):
        log.commit(second)
    assert log.written.tolist() == [4, 0]  # the first piece, to shard 1, was not applied
    with pytest.raises(ValueError, match="expected at most 2 pieces"):
        log.plan([1, 1, 1])
    with pytest.raises(ValueError, match="expected positive piece sizes, got \\[2, 0\\]"):
        log.plan([2, 0])
    with pytest.raises(ValueError, match="expected positive shard capacities"):
        WriteLog([4, 0])


def test_write_log_write_identity_returns_the_same_indices_and_receipt_until_forgotten():
    log = WriteLog([5, 5], remember=3)
    receipts = {}
    for name in "abcd":
        plan = log.plan([2])
        receipts[name] = (log.indices(plan), object())
        log.commit(plan, write_id=name, receipt=receipts[name][1])
    assert log.lookup("a") is None and log.lookup(None) is None
    for name in "bcd":
        indices, receipt = log.lookup(name)
        assert indices.tolist() == receipts[name][0].tolist() and receipt is receipts[name][1]
    written = log.written.tolist()
    log.commit([], write_id="empty")
    assert log.written.tolist() == written and log.lookup("b") is None and log.lookup("empty")[0].size == 0


def test_write_log_reset_takes_counts_only_of_the_right_shape():
    log = WriteLog([3, 3])
    for bad, shown in [([1], "\\[1\\]"), ([1, 2, 3], "\\[1, 2, 3\\]"), ([1, -1], "\\[1, -1\\]")]:
        with pytest.raises(ValueError, match=f"expected 2 non-negative write counts, got {shown}"):
            log.reset(bad)
        assert log.written.tolist() == [0, 0]
    counts = np.array([7, 2])
    log.reset(counts)
    counts[0] = 0
    assert log.written.tolist() == [7, 2] and log.sizes.tolist() == [3, 2]
    (w,) = log.plan([2])
    assert (w.shard, w.first, w.slots.tolist()) == (1, 2, [2, 0])


# ---------------------------------------------------------------------------------------------------------------
# 5. Validation
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("check, value, message", [
    (positive_int, True, "batch_size must be a positive integer, got True"),
    (positive_int, np.True_, "batch_size must be a positive integer, got "),
    (positive_int, 0, "batch_size must be a positive integer, got 0"),
    (positive_int, 2.0, "batch_size must be a positive integer, got 2.0"),
    (positive_int, np.float64(3.0), "batch_size must be a positive integer, got "),
    (positive_int, "4", "batch_size must be a positive integer, got '4'"),
    (non_negative_int, 2.5, "batch_size must be a non-negative integer, got 2.5"),
    (non_negative_int, False, "batch_size must be a non-negative integer, got False"),
    (non_negative_int, -1, "batch_size must be a non-negative integer, got -1"),
])
def test_integers_refuse_bools_floats_and_strings_naming_the_argument(check, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check("batch_size", value)


def test_integers_take_numpy_ints_as_plain_ints():
    for value in (np.int64(8), np.int32(8), np.uint8(8)):
        out = positive_int("batch_size", value)
        assert out == 8 and type(out) is int
    assert non_negative_int("step", np.int64(0)) == 0 and type(non_negative_int("step", 0)) is int
    with pytest.raises(ValueError, match="step must be a non-negative integer, got 2.5"):
        non_negative_int("step", 2.5)


@pytest.mark.parametrize("name", ["alpha", "beta", "eps"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), np.float64("nan"), True, "1"])
def test_priority_options_refuse_non_finite_values(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a finite number .*, got {re.escape(repr(value))}$"):
        priority_options(**{name: value})


def test_priority_options_bounds():
    assert priority_options(alpha=0, beta=0, eps=1e-12) == {"alpha": 0.0, "beta": 0.0, "eps": 1e-12}
    assert priority_options(alpha=np.float32(0.5))["alpha"] == 0.5
    with pytest.raises(ValueError, match="eps must be a finite number > 0.0, got 0"):
        priority_options(eps=0)
    with pytest.raises(ValueError, match="beta must be a finite number >= 0.0, got -0.1"):
        priority_options(beta=-0.1)


def test_fraction_bounds():
    assert fraction("offline_fraction", 0) == 0.0 and fraction("offline_fraction", 1) == 1.0
    assert fraction("offline_fraction", np.float32(0.25)) == 0.25
    for bad in (-1e-12, 1 + 1e-12, float("nan"), float("inf"), True, None, "0.5"):
        with pytest.raises(ValueError, match=f"offline_fraction must be a number in \\[0, 1\\], got {bad!r}"):
            fraction("offline_fraction", bad)


def test_timeouts_and_choices():
    assert timeout(None) is None and timeout(2) == 2.0
    for bad in (0, -1, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match=f"timeout must be a finite number > 0.0, got {bad!r}"):
            timeout(bad)
    assert one_of("sampler", "uniform", SAMPLERS) == "uniform"
    with pytest.raises(ValueError, match=re.escape("sampler must be one of ('uniform', 'without_replacement', "
                                                   "'prioritized'), got 'fifo'")):
        sampler_class("fifo")
    assert callable_or_none("transform", None) is None
    with pytest.raises(TypeError, match="transform must be callable, got int"):
        callable_or_none("transform", 3)
    assert finite_number("x", 1, minimum=1.0) == 1.0
    with pytest.raises(ValueError, match="x must be a finite number > 1.0, got 1"):
        finite_number("x", 1, minimum=1.0, strict=True)


def test_numbers_too_large_for_a_float_are_refused_naming_the_argument():
    for check in (lambda v: priority_options(beta=v), lambda v: fraction("beta", v)):
        with pytest.raises(ValueError, match="beta must be"):
            check(10**400)


# ---------------------------------------------------------------------------------------------------------------
# 6. Plans
# ---------------------------------------------------------------------------------------------------------------
def coded_shards(layout: Layout):
    """Each shard's rows as codes ``side * 10_000 + shard * 1000 + index``, and a generation per row."""
    return {(side, i): (np.arange(n) + (side == ONLINE) * 10_000 + i * 1000, np.arange(n) % 3 + 1)
            for side in SIDES for i, n in enumerate(layout.sizes[side])}


def shard_results(layout: Layout, plan: BatchPlan, reads: list):
    data = coded_shards(layout)
    out = []
    for p, idx in zip(plan.parts, layout.read(plan, reads)):
        code, gen = data[(p.side, p.shard)]
        out.append(({"x": code[idx], "obs/pos": np.stack([code[idx], -code[idx]], 1)},
                    {"index": idx, "generation": gen[idx]}))
    return out


@pytest.mark.parametrize("num_slices", [1, 2])
def test_assemble_puts_offline_rows_first_and_provenance_matches_the_rows(num_slices):
    layout = Layout("uniform", {OFFLINE: [30, 50, 20], ONLINE: [10, 40]}, fraction=0.3, seed=6)
    for _ in range(5):
        slices = layout.draw(37, num_slices)
        assert sum(p.n_offline for p, _ in slices) == offline_count(37, 0.3)
        for plan, reads in slices:
            rows, info = assemble(plan, shard_results(layout, plan, reads), return_info=True)
            assert rows["x"].shape == (plan.batch_size,) and rows["obs/pos"].shape == (plan.batch_size, 2)
            assert info["offline"].tolist() == [True] * plan.n_offline + [False] * plan.n_online
            np.testing.assert_array_equal(rows["x"] // 10_000, ~info["offline"])
            np.testing.assert_array_equal(rows["x"] % 10_000 // 1000, info["shard"])
            np.testing.assert_array_equal(rows["x"] % 1000, info["index"])
            np.testing.assert_array_equal(info["generation"], info["index"] % 3 + 1)
            assert set(info) == {"offline", "shard", "index", "generation"}
            assert assemble(plan, shard_results(layout, plan, reads)).keys() == {"x", "obs/pos"}


def test_split_group_recovers_each_batchs_parts():
    layout = Layout("uniform", {OFFLINE: [30, 50], ONLINE: [10, 40]}, fraction=0.5, seed=7)
    drawn = [layout.draw(16)[0] for _ in range(4)]
    alone = [shard_results(layout, plan, reads) for plan, reads in drawn]
    by_shard: dict[tuple[str, int], list] = {}
    for (plan, _), results in zip(drawn, alone):
        for part, result in zip(plan.parts, results):
            by_shard.setdefault((part.side, part.shard), []).append(result)
    group = GroupPlan([plan for plan, _ in drawn], reads=list(by_shard))
    joined = [(concat([r for r, _ in rs]), concat([i for _, i in rs])) for rs in by_shard.values()]
    for (plan, parts), (original, _), results in zip(split_group(group, joined), drawn, alone):
        assert plan is original and len(parts) == len(results)
        for (rows, info), (rows0, info0) in zip(parts, results):
            for got, want in ((rows, rows0), (info, info0)):
                assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def test_plan_packed_answers_plans_text_and_the_same_text_to_a_call_asked_again():
    def coordinator() -> Coordinator:
        c = Coordinator([StandInShard(), StandInShard()], [40, 60], [StandInShard()], [50], offline_fraction=0.5,
                        seed=3)
        written_online(c, [30])
        return c

    packed, twin = coordinator(), coordinator()
    text = packed.plan_packed((16, 3, "s", None, "c1", 0.0))
    assert isinstance(text, str) and decode_group(text) == twin.plan(16, 3, stream="s", call="c2")
    assert packed.plan_packed((16, 3, "s", None, "c1", 0.0)) == text  # the reply was lost: the same batches
    assert decode_group(packed.plan_packed((16, 2, "s", 2, "c3", 0.0))) == twin.plan(16, 2, stream="s", served=2)
    with pytest.raises(ValueError, match="a call id names one call"):
        packed.plan_packed((16, 4, "s", None, "c1", 0.0))


def test_assemble_refuses_a_wrong_part_count_and_assemble_slice_postprocesses():
    plan = BatchPlan([Part(OFFLINE, 0, 1), Part(ONLINE, 0, 1)], 1, 1, 0.5, 0)
    part = ({"x": np.array([1])}, {"index": np.array([0]), "generation": np.array([1])})
    with pytest.raises(ValueError, match="expected 2 shard parts for this batch, got 1"):
        assemble(plan, [part])
    assert assemble_slice(plan, False, lambda rows: rows["x"].sum(), part, part) == 2
    out, info = assemble_slice(plan, True, lambda rows, info: rows["x"] + info["shard"], part, part)
    assert out.tolist() == [1, 1] and info["offline"].tolist() == [True, False]


def test_concat_joins_numpy_and_torch_and_skips_empty_parts():
    a = {"x": np.arange(3), "y": np.ones((3, 2))}
    empty = {"x": np.arange(0), "y": np.ones((0, 2))}
    out = concat([a, empty, {"x": np.arange(2), "y": np.zeros((2, 2))}])
    assert out["x"].tolist() == [0, 1, 2, 0, 1] and out["y"].shape == (5, 2)
    assert concat([empty, a, empty])["x"] is a["x"]  # a single non-empty part is returned as is
    assert concat([empty])["x"].shape == (0,)
    t = concat([{"x": torch.arange(2)}, {"x": torch.arange(0)}, {"x": torch.arange(3)}])
    assert isinstance(t["x"], torch.Tensor) and t["x"].tolist() == [0, 1, 0, 1, 2]


def test_nest_round_trips_with_to_numpy_dict_for_nested_keys():
    flat = {"obs/pixels": np.zeros((2, 3, 3), np.uint8), "obs/state/pos": np.ones((2, 4), np.float32),
            "obs/state/vel": np.arange(2.0), "reward": np.array([0.5, 1.5])}
    nested = nest(flat)
    assert set(nested) == {"obs", "reward"} and set(nested["obs"]["state"]) == {"pos", "vel"}
    for back in (to_numpy_dict(nested), to_numpy_dict(from_numpy_dict(flat))):
        assert back.keys() == flat.keys()
        for k in flat:
            np.testing.assert_array_equal(back[k], flat[k])
            assert back[k].dtype == flat[k].dtype


# ---------------------------------------------------------------------------------------------------------------
# 7. The split contract
# ---------------------------------------------------------------------------------------------------------------
def round_half_up(f: Fraction) -> int:
    return math.floor(f + Fraction(1, 2))


# Fractions exact in binary, so f * B is exact and the expectation needs no float rounding.
BINARY_FRACTIONS = sorted({k / 64 for k in range(65)} | {0.5, 0.25, 0.75, 0.375})


def test_split_rounds_half_up_for_every_batch_size_and_binary_fraction():
    python_round_differs = 0
    for B in range(1, 200):
        for f in BINARY_FRACTIONS:
            expected = round_half_up(Fraction(f) * B)
            assert split_batch(B, f, online_size=1) == (expected, B - expected), (B, f)
            python_round_differs += round(f * B) != expected
            for parts in (1, 2, 3, min(B, 7)):
                slices = split_slices(expected, B - expected, parts)
                assert sum(o for o, _ in slices) == expected and sum(n for _, n in slices) == B - expected
                sizes, offs = [o + n for o, n in slices], [o for o, _ in slices]
                assert max(sizes) - min(sizes) <= 1 and max(offs) - min(offs) <= 1
                assert all(o >= 0 and n >= 0 for o, n in slices)
    assert python_round_differs > 100  # the halves are there, and round() would get them wrong


def test_split_rounds_decimal_halves_up():
    assert split_batch(5, 0.5, online_size=1) == (3, 2)
    for B, f, n_off in [(5, 0.1, 1), (5, 0.3, 2), (5, 0.7, 4), (5, 0.9, 5), (10, 0.45, 5), (10, 0.25, 3),
                        (2, 0.25, 1), (1, 0.5, 1), (3, 0.5, 2)]:
        assert offline_count(B, f) == n_off, (B, f)


def test_split_edges_all_offline_or_all_online():
    assert split_batch(7, 0.3, online_size=0) == (7, 0)  # online side empty: the whole batch is offline
    assert split_batch(7, 1.0, online_size=9) == (7, 0)
    assert split_batch(7, 0.0, online_size=9) == (0, 7)
    assert split_batch(7, 0.05, online_size=9) == (0, 7)  # 0.35 rounds to 0: all online


def test_split_is_the_double_precision_formula_users_write():
    # floor(f * B + 1/2) evaluated in IEEE doubles, as Python code computing it by hand gets it:
    # 0.29 * 50 is 14.499999999999998 there, so 14 offline rows, not the 15 of exact decimal arithmetic.
    for B, f in [(50, 0.29), (90, 0.35), (100, 0.145), (5, 0.5), (3, 0.5)]:
        assert offline_count(B, f) == math.floor(f * B + 0.5), (B, f)


# ---------------------------------------------------------------------------------------------------------------
# The sampler registry
# ---------------------------------------------------------------------------------------------------------------
def test_a_registered_sampler_brings_its_allocator():
    class Lowest(Sampler):
        name = "lowest_rows_for_tests"
        allocator = UniformAllocator

        def sample(self, count, size, rng, epoch=None):
            return np.zeros(count, np.int64)

    register_sampler(Lowest)
    try:
        assert isinstance(make_sampler("lowest_rows_for_tests"), Lowest)
        alloc = make_allocator("lowest_rows_for_tests", {OFFLINE: 2, ONLINE: 0})
        assert type(alloc) is UniformAllocator and alloc.counts(OFFLINE, 5, np.array([0, 3]),
                                                                 np.random.default_rng(0)).tolist() == [0, 5]
    finally:
        SAMPLERS.pop("lowest_rows_for_tests")
    assert sorted(SAMPLERS) == ["prioritized", "uniform", "without_replacement"]
    with pytest.raises(ValueError, match="update_priority needs sampler='prioritized', this shard samples 'uniform'"):
        make_sampler("uniform").update_priority(np.arange(1), np.ones(1))
    with pytest.raises(ValueError, match="cannot draw 2 rows from an empty shard"):
        make_sampler("uniform").sample(2, 0, np.random.default_rng(0))


# ---------------------------------------------------------------------------------------------------------------
# The end of an epoch, and a sampler per side
# ---------------------------------------------------------------------------------------------------------------
def test_short_final_batches_keep_the_split_exact_and_cover_the_epoch():
    layout = Layout("without_replacement", {OFFLINE: [6, 5], ONLINE: [9]}, fraction=0.5, seed=4)
    sizes, seen = [], []
    for _ in range(4):
        (plan, reads), = layout.draw(6)
        sizes.append((plan.n_offline, plan.n_online))
        seen += [r for r in layout.rows(plan, reads) if r[0] == OFFLINE]
    # 11 offline rows at 3 a batch: 3, 3, 3, then 2 (a batch of 4 splits 2/2, exact); then a new epoch
    assert sizes[:3] == [(3, 3)] * 3 and sizes[3] == (2, 2)
    assert sorted(seen) == every_row([6, 5], OFFLINE)
    (plan, _), = layout.draw(6)
    assert (plan.n_offline, plan.n_online) == (3, 3) and layout.epochs(OFFLINE) == 2


def test_drop_last_is_torchrls_name_for_dropping_and_conflicts_are_refused():
    from rayrb.core.allocators import epoch_end_option

    assert epoch_end_option(None, True) == "drop" and epoch_end_option(None, False) == "short"
    assert epoch_end_option(None, None) == "short" and epoch_end_option("raise", None) == "raise"
    with pytest.raises(ValueError, match="drop_last=True means epoch_end='drop', got epoch_end='short'"):
        epoch_end_option("short", True)
    with pytest.raises(ValueError, match="epoch_end must be one of"):
        epoch_end_option("wrap", None)


def test_each_side_is_allocated_by_its_own_kind():
    layout = Layout({OFFLINE: "without_replacement", ONLINE: "uniform"}, {OFFLINE: [4, 4], ONLINE: [2]},
                    fraction=0.5, seed=0)
    offline, online = [], []
    for _ in range(2):
        for plan, reads in layout.draw(8):
            for side, shard, i in layout.rows(plan, reads):
                (offline if side == OFFLINE else online).append((shard, i))
    assert sorted(offline) == sorted((s, i) for s in range(2) for i in range(4))  # one epoch, each row once
    assert len(online) == 8 and set(online) <= {(0, 0), (0, 1)}  # with replacement from 2 rows
    state = layout.coord.state_dict()
    assert state["sampler"] == {OFFLINE: "without_replacement", ONLINE: "uniform"}
    assert set(state["allocator"]) == {OFFLINE, ONLINE}


@pytest.mark.parametrize("sampler", ["uniform", "without_replacement"])
def test_planner_restore_rewinds_draws_given_back(sampler):
    """What the coordinator's undo relies on: restoring the snapshot before a draw gives that draw again."""
    from rayrb.core.planner import Planner

    p = Planner({"offline": 2, "online": 1}, offline_fraction=0.5, sampler=sampler, seed=1)
    sizes = {"offline": np.array([30, 20]), "online": np.array([15])}
    p.draw(10, sizes=sizes)
    first = [p.draw(10, sizes=sizes) for _ in range(3)]
    p.restore(p.last_snapshot)  # the state before the third draw
    third = p.draw(10, sizes=sizes)
    assert [(pl.parts, r) for pl, r in third] == [(pl.parts, r) for pl, r in first[2]]
    assert p.step == 4
    saved = p.snapshot()
    later = [p.draw(10, sizes=sizes) for _ in range(2)]
    p.set_fraction(0.5)  # settings are not part of the snapshot
    p.restore(saved)
    assert [[(pl.parts, r) for pl, r in p.draw(10, sizes=sizes)] for _ in range(2)] == \
        [[(pl.parts, r) for pl, r in d] for d in later]


@pytest.mark.parametrize("epoch_end,last", [("short", 5), ("drop", 4), ("raise", 4)])
def test_the_last_batch_of_an_epoch_is_marked_for_every_epoch_end(epoch_end, last):
    """Iteration stops at the mark: with "drop" and "raise" it is the last full batch (TorchRL's drop_last)."""
    from rayrb.core.planner import Planner

    p = Planner({"offline": 2, "online": 1}, offline_fraction=1.0, sampler="without_replacement",
                epoch_end=epoch_end, seed=0)
    sizes = {"offline": np.array([150, 150]), "online": np.array([0])}
    marks = [p.draw(64, sizes=sizes)[0][0].last_of_epoch for _ in range(last)]
    assert marks == [False] * (last - 1) + [True]


def test_resumed_writes_land_every_row_exactly_once():
    """Writes cut short (a coordinator dies between its sends; a shard fails one piece) are retried, in any
    order and between new writes, after the log took the shards' counts: every row is then held exactly once."""
    from rayrb.durability.writelog import WriteLog

    rng = np.random.default_rng(0)
    for trial in range(40):
        k = int(rng.integers(2, 5))
        log, shards, pending, rows = WriteLog([10 ** 6] * k), [ModelShard() for _ in range(k)], [], {}

        def send(w, pieces, skip=()):
            for i, piece in enumerate(pieces):
                if i not in skip:
                    shards[piece.shard].extend(piece.first, [(w, r) for r in range(piece.start, piece.stop)])

        for w in range(int(rng.integers(5, 30))):
            if pending and rng.random() < 0.3:  # a writer retries a write cut short earlier
                v = pending.pop(int(rng.integers(len(pending))))
                send(v, log.resume(v)[1])
            rows[w] = int(rng.integers(1, 4000))
            plan = log.plan(log.cut(rows[w]))
            log.commit(plan, write_id=w)
            event = rng.random()
            if event < 0.2:  # the coordinator dies after sending some of the pieces; it restarts
                send(w, plan[:int(rng.integers(len(plan)))])
            elif event < 0.4:  # one shard fails its piece; the writer's client resyncs at once
                send(w, plan, skip={int(rng.integers(len(plan)))})
            else:
                send(w, plan)
                continue
            log.reset([s.written for s in shards])
            pending.append(w)
        for v in pending:
            send(v, log.resume(v)[1])
        held = sorted(r for s in shards for pos, r in s.rows.items() if pos < s.written)
        assert held == sorted({(w, r) for w, n in rows.items() for r in range(n)}), trial  # all, and once
        assert all(s.written == len(s.rows) and not s.ahead for s in shards), trial


def test_rows_written_behind_a_piece_that_never_lands_are_kept_and_counted_once_the_hole_is_filled():
    """A shard fails one piece for good while later writes land behind it (held, not counted); the writer of
    the failed write resyncs, and may retry or not. No acknowledged row is planned over, every one is counted
    once later writes fill the hole, and nothing lands twice."""
    from rayrb.durability.writelog import WriteLog

    rng = np.random.default_rng(1)
    for trial in range(40):
        k = int(rng.integers(1, 4))
        log, shards, acked, retry = WriteLog([10 ** 6] * k), [ModelShard() for _ in range(k)], {}, []

        def send(w, pieces, skip=()):
            for i, piece in enumerate(pieces):
                if i not in skip:
                    shards[piece.shard].extend(piece.first, [(w, r) for r in range(piece.start, piece.stop)])

        def resync():
            counts, parked = zip(*(s.write_state() for s in shards))
            log.reset(list(counts), list(parked))

        pending = {}  # writes whose piece failed: the later writes land behind it before anyone resyncs
        for w in range(int(rng.integers(10, 40))):
            n = int(rng.integers(1, 3000))
            plan = log.place(n)
            log.commit(plan, write_id=w)
            if rng.random() < 0.25:  # one piece fails for good; the write is not acknowledged
                send(w, plan, skip={int(rng.integers(len(plan)))})
                pending[w] = int(rng.integers(1, 4))  # the writer notices after this many more writes
            else:
                send(w, plan)
                acked[w] = n
            for v in [v for v in pending if pending[v] == 0]:
                del pending[v]
                resync()
                if rng.random() < 0.5:
                    retry.append(v)
            pending = {v: c - 1 for v, c in pending.items()}
            if retry and rng.random() < 0.3:
                v = retry.pop(0)
                send(v, log.resume(v)[1])
                acked[v] = sum(p.rows for p in log._ids[v][2])
        resync()
        for v in retry:
            send(v, log.resume(v)[1])
            acked[v] = sum(p.rows for p in log._ids[v][2])
        for extra in range(100):  # new writes fill what holes are left
            if not any(log.holes):
                break
            plan = log.place(int(rng.integers(1, 3000)))
            log.commit(plan)
            send(("fill", extra), plan)
        for s in shards:
            assert not s.ahead and s.written == len(s.rows), trial  # every held row is counted
        counted = [r for s in shards for pos, r in s.rows.items() if pos < s.written]
        assert len(counted) == len(set(counted)), trial  # nothing twice
        got = {r for r in counted if not isinstance(r[0], tuple)}
        for w, n in acked.items():
            assert {(w, r) for r in range(n)} <= got, (trial, w)  # every acknowledged row, counted
