"""The offline/online split contract, the sampler registry, and the end of an epoch with a sampler per side. Batches
are drawn as in ``standin_coordinator``; nothing here imports Ray."""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from standin_coordinator import Layout, every_row

from rayrb.core.allocation import offline_count, split_batch, split_slices
from rayrb.core.allocators import UniformAllocator
from rayrb.core.plans import (
    OFFLINE,
    ONLINE,
)
from rayrb.core.samplers import (
    SAMPLERS,
    Sampler,
    make_allocator,
    make_sampler,
    register_sampler,
)
from rayrb.errors import InvalidArgumentError

pytestmark = pytest.mark.usefixtures("local_metrics")


# ---------------------------------------------------------------------------------------------------------------
# The split contract
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
    assert sorted(SAMPLERS) == ["prioritized", "prioritized_slice", "slice", "slice_without_replacement", "uniform",
                                "without_replacement"]
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


def test_every_allocator_says_what_an_epochs_end_does():
    """The planner reads the allocator's ``epoch_end`` (None: no epochs) rather than guessing from its kind."""
    from rayrb.core.allocators import make_allocator

    shards = {OFFLINE: 1, ONLINE: 1}
    assert make_allocator("uniform", shards).epoch_end is None
    assert make_allocator("prioritized", shards).epoch_end is None
    assert make_allocator("without_replacement", shards).epoch_end == "short"
    assert make_allocator("without_replacement", shards, epoch_end="drop").epoch_end == "drop"
    mixed = {OFFLINE: "uniform", ONLINE: "without_replacement"}
    assert make_allocator(mixed, shards, epoch_end="raise").epoch_end == "raise"
    assert make_allocator({OFFLINE: "uniform", ONLINE: "prioritized"}, shards).epoch_end is None


def test_the_base_fraction_anneal_decays_from_is_the_planners_alone():
    """TorchRL's: the base is the fraction the buffer was made with, or the one set as the base; assigning the
    fraction leaves it, and anneal decays linearly from it to 0. A loaded state brings its own."""
    from rayrb.core.planner import Planner

    sizes = {OFFLINE: np.array([10]), ONLINE: np.array([10])}
    p = Planner({OFFLINE: 1, ONLINE: 1}, offline_fraction=0.8, seed=0)
    p.set_fraction(0.0)
    assert p.base_fraction(sizes) == 0.8 and p.fraction(sizes) == 0.0
    assert p.anneal(8, 10, sizes) == pytest.approx(0.16) and p.base_fraction(sizes) == 0.8
    p.set_base_fraction(0.5)
    assert p.anneal(5, 10, sizes) == pytest.approx(0.25)
    state = p.state_dict()
    q = Planner({OFFLINE: 1, ONLINE: 1}, offline_fraction="size_proportional", seed=0)
    assert q.base_fraction(sizes) == 0.5  # made with a schedule: the fraction it gives now
    q.load_state_dict(state)
    assert q.base_fraction(sizes) == 0.5 and q.fraction(sizes) == pytest.approx(0.25)


def test_a_call_that_gave_up_is_counted_by_kind_and_a_bad_report_changes_nothing():
    coord = Layout("uniform", {OFFLINE: [10], ONLINE: [5]}).coord
    coord.gave_up("sample", 1.5)
    counts = coord._metrics.snapshot()
    assert counts["sample_timed_out_calls"] == 1 and counts["sample_timed_out_ms_p50"] == 1500.0
    for call, seconds in (("write", 1.0), ("insert", float("nan")), ("insert", -1.0)):
        with pytest.raises(InvalidArgumentError):
            coord.gave_up(call, seconds)
    assert coord._metrics.snapshot()["sample_timed_out_calls"] == 1
    assert "insert_timed_out_calls" not in coord._metrics.snapshot()
