"""Slices by priority (``rayrb.core.prioritized_slices``), without Ray: starts drawn by ``p`` over the valid starts
of a shard and of the union of shards, weights, updates, writes, wraps and restores; TorchRL's
``PrioritizedSliceSampler`` as the peer."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from rayrb.core.planner import Planner
from rayrb.core.plans import OFFLINE, ONLINE
from rayrb.core.prioritized_slices import PrioritizedEpisodeSlices, PrioritizedSliceAllocator
from rayrb.core.samplers import make_sampler
from rayrb.core.slice_sampling import SliceSampler
from rayrb.errors import DrawError, InvalidArgumentError

L = 3
IDS = np.repeat([0, 1, 2, 3, 4], [5, 2, 4, 1, 6])  # valid starts (L=3): 0-2, 7-8, 12-15; episodes 1 and 3 none
STARTS = np.array([0, 1, 2, 7, 8, 12, 13, 14, 15])


def shard(ids=IDS, capacity=None, generation=None, strict=True, alpha=1.0):
    s = make_sampler("prioritized_slice", capacity or len(ids), alpha=alpha, eps=1e-9, slice_len=L,
                     slice_key="episode", **({} if strict else {"slice_strict": False}))
    s.bind({"episode": np.asarray(ids)}, generation)
    s.on_write(np.arange(len(ids)))
    return s


def chi_square(counts, expected):
    return stats.chisquare(counts, expected * counts.sum() / expected.sum()).pvalue


def test_a_shard_draws_each_valid_start_by_its_priority_and_weighs_itself_by_their_sum():
    s = shard()
    p = np.arange(1, len(IDS) + 1, dtype=np.float64)
    s.update_priority(np.arange(len(IDS)), p)
    mass, min_p = s.mass(len(IDS))
    assert mass == pytest.approx(p[STARTS].sum()) and min_p == pytest.approx(p[STARTS].min())
    steps = s.sample(L * 20_000, len(IDS), np.random.default_rng(0)).reshape(-1, L)
    assert (np.diff(steps, axis=1) == 1).all() and (IDS[steps] == IDS[steps[:, :1]]).all()  # whole slices
    counts = np.bincount(steps[:, 0], minlength=len(IDS))
    assert set(np.flatnonzero(counts)) == set(STARTS)
    assert chi_square(counts[STARTS], p[STARTS]) > 1e-3
    info = s.info(steps[:5].reshape(-1))["priority"].reshape(-1, L)  # each step carries its slice's p
    np.testing.assert_allclose(info, np.broadcast_to(p[steps[:5, :1]], info.shape))


def test_a_priority_update_moves_draws_and_a_step_that_starts_no_slice_changes_no_mass():
    s = shard()
    before = s.mass(len(IDS))
    s.update_priority(np.array([4, 6, 11]), np.array([50.0, 50.0, 50.0]))  # the last steps of episodes 0, 1, 2
    assert s.mass(len(IDS)) == pytest.approx(before)
    s.update_priority(np.array([13]), np.array([1000.0]))
    steps = s.sample(L * 2000, len(IDS), np.random.default_rng(1)).reshape(-1, L)
    assert (steps[:, 0] == 13).mean() > 0.95


def test_a_write_makes_new_starts_at_the_largest_priority_seen():
    ids = np.array([0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
    s = shard(ids, capacity=10, generation=np.ones(10, np.int64))
    s.update_priority(np.arange(10), np.array([1.0, 1.0, 4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]))
    assert s.mass(6)[0] == pytest.approx(5.0)  # rows 0..5: starts 2 and 3
    ids[6:] = 1  # four more steps of episode 1 written
    s.on_write(np.arange(6, 10))
    assert s.mass(10)[0] == pytest.approx(4.0 + 1.0 + 1.0 + 1.0 + 4.0 + 4.0)  # starts 2-7; 6 and 7 new, at max p 4


def test_short_episodes_are_slices_too_when_not_strict():
    s = shard(strict=False)
    p = np.ones(len(IDS))
    p[[5, 11]] = 10.0  # episode 1's first step (2 steps: one short slice) and episode 3's only step
    s.update_priority(np.arange(len(IDS)), p)
    starts = np.append(STARTS, [5, 11])
    assert s.mass(len(IDS))[0] == pytest.approx(p[starts].sum())
    steps = s.sample(L * 20_000, len(IDS), np.random.default_rng(2)).reshape(-1, L)
    counts = np.bincount(steps[:, 0], minlength=len(IDS))
    assert set(np.flatnonzero(counts)) == set(starts) and chi_square(counts[starts], p[starts]) > 1e-3


def test_a_wrapped_online_shard_draws_starts_in_write_order_only():
    """Capacity 8, 12 rows written (slots 0-3 hold rows 8-11): episode 1 runs over rows 4-9 across the wrap."""
    by_row = np.repeat([0, 1, 2], [4, 6, 2])
    slots, generation = np.empty(8, np.int64), np.empty(8, np.int64)
    for w in range(4, 12):
        slots[w % 8], generation[w % 8] = by_row[w], w // 8 + 1
    s = shard(slots, capacity=8, generation=generation)
    s.update_priority(np.arange(8), np.arange(1, 9, dtype=np.float64))  # p by slot
    mass = s.mass(8)[0]
    assert mass == pytest.approx(5 + 6 + 7 + 8)  # rows 4-7 start slices: slots 4-7
    for run in s.sample(3 * 300, 8, np.random.default_rng(3)).reshape(-1, 3):
        rows = (generation[run] - 1) * 8 + run
        assert np.array_equal(rows, np.arange(rows[0], rows[0] + 3))


def test_priorities_survive_a_restore_and_a_reopened_mirror():
    s = shard()
    p = np.linspace(1.0, 3.0, len(IDS))
    s.update_priority(np.arange(len(IDS)), p)
    state, mass = s.state_dict(), s.mass(len(IDS))
    fresh = shard()
    fresh.load_state_dict(state)
    assert fresh.mass(len(IDS)) == pytest.approx(mass)
    mirror, max_p = np.zeros(len(IDS)), np.zeros(1)
    s.attach(mirror, max_p, reopened=False)  # the shard's mapped files take its priorities
    s.update_priority(np.array([0]), np.array([7.0]))
    restarted = shard()
    restarted.attach(mirror, max_p, reopened=True)
    assert restarted.mass(len(IDS)) == pytest.approx(s.mass(len(IDS)))


def test_the_union_of_shards_is_drawn_by_priority_with_an_exact_offline_share_and_one_weight_a_slice():
    """Two offline shards and one online shard: the planner spreads each side's slices by the shards' masses, so
    starts follow ``p`` over the union of the side's valid starts; weights are ``(p / min p) ** -beta``."""
    rng = np.random.default_rng(4)
    shards = {OFFLINE: [shard(), shard(IDS[:11])], ONLINE: [shard(IDS[11:])]}
    prio = {OFFLINE: [rng.uniform(1, 5, len(IDS)), rng.uniform(1, 5, 11)], ONLINE: [rng.uniform(1, 5, 7)]}
    for side in shards:
        for s, p in zip(shards[side], prio[side]):
            s.update_priority(np.arange(len(p)), p)
    planner = Planner({OFFLINE: 2, ONLINE: 1}, offline_fraction=0.4, sampler="prioritized_slice", slice_len=L,
                      beta=0.5, seed=5)
    sizes = {OFFLINE: np.array([len(IDS), 11]), ONLINE: np.array([7])}
    for side in shards:
        planner.alloc.set_masses(side, [s.mass(n) for s, n in zip(shards[side], sizes[side])], sizes[side])
    counts = {OFFLINE: np.zeros(len(IDS) + 11), ONLINE: np.zeros(7)}
    for _ in range(3000):
        ((plan, _),) = planner.draw(5 * L, sizes=sizes)
        assert (plan.n_offline, plan.n_online) == (2 * L, 3 * L)  # floor(0.4 * 5 + 1/2) = 2 offline slices
        for part in plan.parts:
            s = shards[part.side][part.shard]
            steps = s.sample(part.count, sizes[part.side][part.shard], np.random.default_rng(rng.integers(1 << 30)))
            w = plan.weights(part.side, s.info(steps)).reshape(-1, L)
            assert (w == w[:, :1]).all()  # one weight a slice
            offset = len(IDS) if part.side == OFFLINE and part.shard == 1 else 0
            np.add.at(counts[part.side], steps.reshape(-1, L)[:, 0] + offset, 1)
    off_p = np.concatenate(prio[OFFLINE])
    off_starts = np.concatenate([STARTS, STARTS[STARTS < 11 - L + 1] + len(IDS)])
    assert set(np.flatnonzero(counts[OFFLINE])) == set(off_starts)
    assert chi_square(counts[OFFLINE][off_starts], off_p[off_starts]) > 1e-3
    on_starts = np.array([1, 2, 3, 4])  # IDS[11:] is episode 4's six steps
    assert chi_square(counts[ONLINE][on_starts], prio[ONLINE][0][on_starts]) > 1e-3
    assert planner.alloc.weights().min_p[OFFLINE] == pytest.approx(off_p[off_starts].min())


def test_an_allocator_counts_shards_without_a_slice_as_not_drawable_and_outside_min_p():
    alloc = PrioritizedSliceAllocator({OFFLINE: 2, ONLINE: 2}, slice_len=L)
    alloc.set_masses(ONLINE, [(0.0, 1.0), (0.0, 1.0)], np.array([5, 5]))
    assert alloc.drawable(ONLINE, np.array([5, 5])) == 0  # online rows, but no whole slice: all offline
    alloc.set_masses(OFFLINE, [(6.0, 0.5), (0.0, 1e-9)], np.array([10, 10]))
    assert alloc.drawable(OFFLINE, np.array([10, 10])) == 1 and alloc.weights().min_p[OFFLINE] == 0.5


def test_a_shard_without_a_valid_slice_refuses_a_draw_and_bad_priorities_change_nothing():
    s = shard(np.array([0, 1, 2, 3]))
    assert s.mass(4) == (0.0, 1.0)
    with pytest.raises(DrawError, match="no episode here holds that many"):
        s.sample(L, 4, np.random.default_rng(0))
    s = shard()
    mass = s.mass(len(IDS))
    with pytest.raises(InvalidArgumentError, match="priorities must be finite"):
        s.update_priority(np.array([0, 1]), np.array([2.0, np.nan]))
    assert s.mass(len(IDS)) == mass


@pytest.mark.parametrize("kwargs", [{"prioritized": True, "replacement": False}, {"prioritized": "yes"}])
def test_prioritized_slices_without_replacement_or_not_a_bool_are_refused(kwargs):
    with pytest.raises(InvalidArgumentError, match="expected prioritized=True with replacement=True"):
        SliceSampler(slice_len=L, **kwargs)


def test_the_starts_are_torchrls_and_each_comes_in_proportion_to_its_priority():
    """TorchRL's ``PrioritizedSliceSampler`` draws a start ``s`` with probability ``p_s / sum(p)`` over the starts
    its ``SliceSampler`` half allows (it zeroes the others); its segment trees need TorchRL's C++ extension, which
    this torch build does not load, so its ``SliceSampler`` gives the set of starts here, and the frequencies are
    checked against ``p`` over that set."""
    torch = pytest.importorskip("torch")
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.data.replay_buffers.samplers import SliceSampler as TorchRLSliceSampler

    n = len(IDS)
    theirs = ReplayBuffer(storage=LazyTensorStorage(n), batch_size=L * 5000,
                          sampler=TorchRLSliceSampler(slice_len=L, traj_key="episode", strict_length=True))
    theirs.extend(TensorDict({"episode": torch.as_tensor(IDS), "step": torch.arange(n)}, [n]))
    torch.manual_seed(0)
    their_starts = set(theirs.sample()["step"].reshape(-1, L)[:, 0].tolist())
    p = np.arange(1, n + 1, dtype=np.float64)
    ours = shard()
    ours.update_priority(np.arange(n), p)
    counts = np.bincount(ours.sample(L * 20_000, n, np.random.default_rng(6)).reshape(-1, L)[:, 0], minlength=n)
    assert set(np.flatnonzero(counts)) == their_starts == set(STARTS)
    assert chi_square(counts[STARTS], p[STARTS]) > 1e-3


def test_the_kind_is_registered_with_its_allocator():
    assert isinstance(make_sampler("prioritized_slice", 4, slice_len=2, slice_key="e"), PrioritizedEpisodeSlices)
    assert SliceSampler(slice_len=2, prioritized=True).kinds() == {OFFLINE: "prioritized_slice",
                                                                   ONLINE: "prioritized_slice"}


def test_the_buffer_settings_take_prioritized_slices_by_keyword_and_from_a_torchrl_dataset():
    from rayrb.handle.settings import checked_settings, slices_option

    data = {"episode": np.zeros(10, np.int64), "obs": np.zeros(10)}
    s = checked_settings(data, online_capacity=10, sampler="prioritized_slice", slice_len=2, traj_key="episode",
                         alpha=0.7, beta=0.3)
    assert s.slices == SliceSampler(slice_len=2, traj_key="episode", prioritized=True)
    assert s.samplers == {OFFLINE: "prioritized_slice", ONLINE: "prioritized_slice"} and (s.alpha, s.beta) == (0.7, 0.3)
    with pytest.raises(InvalidArgumentError, match="expected sampler=rayrb.SliceSampler"):
        checked_settings(data, online_capacity=10, sampler=SliceSampler(slice_len=2, prioritized=True),
                         online_sampler="prioritized")
    # a TorchRL buffer's PrioritizedSliceSampler (its C++ segment trees do not load here: a stand-in of its name)
    theirs = type("PrioritizedSliceSampler", (), {"slice_len": 4, "num_slices": None, "traj_key": "episode",
                                                  "end_key": ("next", "done"), "strict_length": False})()
    dataset = type("TorchRLBuffer", (), {"_sampler": theirs})()
    assert slices_option(dataset, None, None) == SliceSampler(slice_len=4, traj_key="episode", strict_length=False,
                                                              prioritized=True)
