"""Prioritized allocation over shards, importance weights, and priority updates routed by the coordinator. Batches are
drawn as in ``standin_coordinator``; nothing here imports Ray."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats
from standin_coordinator import StandInShard, written_online

from rayrb.actors.coordinator import Coordinator
from rayrb.core.allocation import multinomial_counts
from rayrb.core.allocators import PrioritizedAllocator, UniformAllocator
from rayrb.core.plans import (
    OFFLINE,
    ONLINE,
    SIDES,
    BatchPlan,
    ImportanceWeights,
    Part,
    assemble,
    provenance,
)
from rayrb.core.samplers import (
    MAX_STORED_PRIORITY,
    PrioritizedSampler,
)

pytestmark = pytest.mark.usefixtures("local_metrics")


# ---------------------------------------------------------------------------------------------------------------
# Prioritized
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
    plan = BatchPlan([Part(OFFLINE, 1, 2), Part(ONLINE, 0, 2)], n_offline=2, n_online=2, fraction=0.5,
                     weights=w)
    results = [({"x": np.arange(2)}, {"index": np.array([3, 5]), "generation": np.array([1, 1]),
                                      "priority": np.array([1.0, 2.0])}),
               ({"x": np.arange(2)}, {"index": np.array([0, 1]), "generation": np.array([4, 5]),
                                      "priority": np.array([4.0, 8.0])})]
    _, info = assemble(plan, results, return_info=True)
    assert info["weight"].dtype == np.float32
    np.testing.assert_allclose(info["weight"], [1.0, 0.5, 1.0, 0.5])
    assert info["offline"].tolist() == [True, True, False, False] and info["shard"].tolist() == [1, 1, 0, 0]
    assert "weight" not in provenance(BatchPlan(plan.parts, 2, 2, 0.5), [r[1] for r in results])


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
    _, info = assemble(BatchPlan(parts, 16, 16, 0.5, alloc.weights()), results, return_info=True)
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
# Priority routing (in the coordinator, driven here over stand-in shard handles)
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
    for bad, shown in (([1.0, "a"], "'1.0' \\(<U32\\)"), (np.array([1 + 2j, 1.0]), "\\(1\\+2j\\) \\(complex128\\)"),
                       ([1.0, None], "1.0 \\(object\\)")):  # a cast would raise deep inside, or drop 2j
        with pytest.raises(ValueError, match=f"priority must hold real numbers, got {shown}"):
            coord.update_priority([True, True], [0, 0], [0, 1], [0, 0], bad)
    assert [len(s.updates) for s in off + on] == [1, 1, 1, 0]  # no refused call reached any shard
    uniform = Coordinator([StandInShard()], [4], [], [], sampler="uniform")
    with pytest.raises(ValueError, match="update_priority needs sampler='prioritized', this buffer samples 'uniform'"):
        uniform.update_priority([True], [0], [0], [0], [1.0])


# ---------------------------------------------------------------------------------------------------------------
# Priorities that cannot be held (their power or their sum past float64)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha, bad", [(1.0, 1e308), (1.0, 1.7e308), (3.0, 1e103), (2.0, 1e200), (0.6, np.nan),
                                        (1.0, np.inf), (1.0, -np.inf)])
def test_a_priority_that_cannot_be_held_is_refused_and_sampling_goes_on(alpha, bad):
    s = PrioritizedSampler(8, alpha=alpha)
    s.add(np.arange(4))
    s.set_priority(np.arange(4), np.array([1.0, 2.0, -3.0, 0.5]))  # a negative one counts as its size
    before = (s.state_dict()["priority"].copy(), s.max_priority, s.mass(4))
    with pytest.raises(ValueError, match="cannot be held|must be finite") as e:
        s.set_priority(np.arange(3), np.array([1.0, bad, 2.0]))
    assert "nan" in str(e.value) or "inf" in str(e.value) or repr(bad) in str(e.value)
    with pytest.raises(ValueError):
        s.check_priority(np.arange(3), np.array([1.0, bad, 2.0]))
    after = s.state_dict()
    assert after["priority"].tolist() == before[0].tolist() and s.max_priority == before[1]
    s.add(np.arange(4, 8))  # new rows get the largest priority kept, still a finite one
    total, _ = s.mass(8)
    assert np.isfinite(total) and total > before[2][0]
    assert multinomial_counts(16, [total, 1.0], np.random.default_rng(0)).sum() == 16
    assert set(s.sample(64, 8, np.random.default_rng(1)).tolist()) <= set(range(8))


def test_the_largest_priority_kept_keeps_every_sum_finite():
    s = PrioritizedSampler(1024, alpha=1.0)
    s.add(np.arange(1))
    s.set_priority(np.arange(1), np.array([MAX_STORED_PRIORITY]))  # the largest that is kept
    s.add(np.arange(1, 1024))  # every new row gets it: 1024 of them
    total, smallest = s.mass(1024)
    assert np.isfinite(total) and np.isfinite(sum([total] * 1000)) and smallest == MAX_STORED_PRIORITY
    assert len(s.sample(32, 1024, np.random.default_rng(0))) == 32
    with pytest.raises(ValueError, match="at position 0"):
        s.set_priority(np.arange(1), np.array([MAX_STORED_PRIORITY * 2]))


def test_a_saved_state_whose_priorities_cannot_be_held_is_refused():
    s = PrioritizedSampler(4, alpha=1.0)
    with pytest.raises(ValueError, match="sums over them would not stay finite"):
        s.load_state_dict({"priority": np.array([1e308, 1.0, 0.0, 0.0]), "max_priority": 1e308})
    with pytest.raises(ValueError, match="sums over them would not stay finite"):
        s.load_state_dict({"priority": np.array([1.0, 1.0, 0.0, 0.0]), "max_priority": 1e308})
    assert s.max_priority == 1.0 and s.mass(4)[0] == 0.0


def test_one_priority_that_cannot_be_held_stops_the_whole_update_at_the_coordinator():
    off, on = [StandInShard()], [StandInShard(), StandInShard()]
    coord = Coordinator(off, [4], on, [5, 5], sampler="prioritized", seed=0, alpha=2.0, eps=1e-6)
    written_online(coord, [3, 3])
    for bad in (1e200, 1e155, np.nan):  # 1e155 ** 2 is past what a sum may hold, 1e200 ** 2 past float64
        with pytest.raises(ValueError, match="cannot be held|must be finite"):
            coord.update_priority([True, False, False], [0, 0, 1], [0, 1, 2], [0, 0, 0], [1.0, 2.0, bad])
    assert [s.updates for s in off + on] == [[], [], []]
    coord.update_priority([True, False, False], [0, 0, 1], [0, 1, 2], [0, 0, 0], [1.0, 2.0, 1e100])
    assert [len(s.updates) for s in off + on] == [1, 1, 1]
