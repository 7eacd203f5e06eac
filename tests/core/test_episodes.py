"""Episodes and slices without Ray: no slice crosses an episode's end, an overwritten step or a step not yet
written; slice starts are uniform over every valid start of every shard; without replacement each valid slice
comes once an epoch; the offline share counts slices exactly; TorchRL's SliceSampler draws the same set of
slices on the same episodes."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from rayrb.core.allocation import hypergeometric_counts, row_ranges
from rayrb.core.episodes import (
    Episodes,
    Slices,
    from_ends,
    from_ids,
    slice_count,
    slice_counts,
    steps,
    whole_ranges,
)
from rayrb.errors import InvalidArgumentError


def random_ids(rng, steps_, mean_len=6):
    """Trajectory ids of consecutive episodes of random lengths (1 .. 2 * mean_len), ``steps_`` steps in all."""
    lengths = rng.integers(1, 2 * mean_len, size=steps_)
    return np.repeat(np.arange(lengths.size), lengths)[:steps_]


def every_slice(slices: Slices) -> list[tuple[int, int]]:
    starts, lengths = slices.locate(np.arange(slices.total))
    return list(zip(starts.tolist(), lengths.tolist()))


@pytest.mark.parametrize("strict", [True, False])
def test_no_slice_crosses_an_episodes_end_and_every_one_is_found(strict):
    rng = np.random.default_rng(0)
    ids = random_ids(rng, 400)
    s = Slices(from_ids(ids), slice_len=5, strict_length=strict)
    found = every_slice(s)
    expected = []  # by brute force: every run of 5 steps of one id; short episodes whole when not strict
    for e in np.unique(ids):
        at = np.flatnonzero(ids == e)
        if at.size >= 5:
            expected += [(int(a), 5) for a in at[:at.size - 4]]
        elif not strict:
            expected.append((int(at[0]), int(at.size)))
    assert found == sorted(expected)
    for start, length in found:
        assert len(set(ids[start:start + length].tolist())) == 1


def test_end_flags_and_ids_give_the_same_episodes_and_a_running_episode_counts_its_steps_so_far():
    ids = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2])
    ends = np.array([0, 0, 1, 0, 1, 0, 0, 0, 0], bool)  # episode 2 is still being written
    a, b = from_ids(ids), from_ends(ends[:, None])
    assert a.starts.tolist() == b.starts.tolist() and a.stops.tolist() == b.stops.tolist()
    assert from_ids(ids, first=100).starts.tolist() == [100, 103, 105]
    assert from_ends(np.zeros(0, bool)).starts.size == 0


def test_online_slices_never_read_an_overwritten_step_or_one_not_written():
    """A circular shard of capacity 16 that has taken 40 steps holds steps 24 .. 39: the oldest episode is cut to
    what is held, the running one to what is written."""
    ids = np.repeat([0, 1, 2, 3], [10, 16, 8, 6])  # episode 3 still running at step 40
    held = from_ids(ids).window(40 - 16, 40)
    s = Slices(held, slice_len=4)
    for start, length in every_slice(s):
        assert 24 <= start and start + length <= 40
    assert held.starts.tolist() == [24, 26, 34] and s.counts.tolist() == [0, 5, 3]


def test_slice_starts_are_uniform_over_every_valid_start_of_the_union_of_shards():
    """Three shards of different episodes: counts ~ Multinomial over each shard's valid slices, then uniform in
    the shard, is uniform over the union (chi-square, 40 slices a batch, 2,000 batches)."""
    rng = np.random.default_rng(1)
    shards = [Slices(from_ids(random_ids(rng, n, m)), slice_len=4) for n, m in ((60, 3), (200, 8), (120, 5))]
    totals = [s.total for s in shards]
    hits = [np.zeros(t, np.int64) for t in totals]
    draws = np.random.default_rng(2)
    for _ in range(2000):
        counts, _ = slice_counts(40, 1.0, totals, [0], draws)
        for s, k, h in zip(shards, counts, hits):
            np.add.at(h, draws.integers(0, s.total, size=k), 1)
    observed = np.concatenate(hits)
    assert stats.chisquare(observed).pvalue > 1e-3


def test_without_replacement_each_valid_slice_comes_once_an_epoch():
    rng = np.random.default_rng(3)
    shards = [Slices(from_ids(random_ids(rng, n)), slice_len=3) for n in (50, 90)]
    left = [rng.permutation(s.total) for s in shards]  # each shard's slices in its own order for the epoch
    seen = [[] for _ in shards]
    while sum(map(len, left)):
        k = min(7, sum(map(len, left)))
        for i, c in enumerate(hypergeometric_counts(k, [len(x) for x in left], rng)):
            seen[i] += left[i][:c].tolist()
            left[i] = left[i][c:]
    assert [sorted(x) for x in seen] == [list(range(s.total)) for s in shards]


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 0.7, 1.0])
def test_the_offline_share_counts_slices_exactly_in_every_batch(fraction):
    rng = np.random.default_rng(4)
    for num_slices in (1, 2, 5, 7, 10, 33):
        off, on = slice_counts(num_slices, fraction, [10, 3], [4, 0, 9], rng)
        assert int(off.sum()) == int(np.floor(fraction * num_slices + 0.5)) and on[1] == 0
        assert int(off.sum() + on.sum()) == num_slices
    off, on = slice_counts(8, 0.25, [10], [0, 0], rng)  # no online slice yet: all offline
    assert (int(off.sum()), int(on.sum())) == (8, 0)


def test_the_same_seed_gives_the_same_stream():
    def stream(seed):
        rng = np.random.default_rng(seed)
        return [np.concatenate(slice_counts(16, 0.5, [5, 7], [3, 9], rng)).tolist() for _ in range(20)]

    assert stream(7) == stream(7) and stream(7) != stream(8)


def test_steps_lay_slices_out_flat_with_their_first_and_last_steps_marked():
    pos, init, trunc = steps(np.array([3, 20, 7]), np.array([4, 1, 2]))
    assert pos.tolist() == [3, 4, 5, 6, 20, 7, 8]
    assert np.flatnonzero(init).tolist() == [0, 4, 5] and np.flatnonzero(trunc).tolist() == [3, 4, 6]


@pytest.mark.parametrize("bad", [
    lambda: Slices(from_ids(np.arange(3)), slice_len=0),
    lambda: Slices(from_ids(np.arange(3)), slice_len=2).locate(np.array([0])),  # strict: no valid slice at all
    lambda: Episodes(np.array([0, 3]), np.array([4, 6])),  # overlapping runs
    lambda: Episodes(np.array([0]), np.array([0])),  # an empty run
    lambda: from_ids(np.zeros((2, 2))),
    lambda: slice_count(64),
    lambda: slice_count(64, slice_len=8, num_slices=8),
    lambda: slice_count(60, slice_len=8),
])
def test_bad_input_is_refused_with_what_was_expected(bad):
    with pytest.raises(InvalidArgumentError, match="expected|must be"):
        bad()


@pytest.mark.parametrize("strict", [True, False])
def test_torchrls_slice_sampler_draws_the_same_set_of_slices_on_the_same_episodes(strict):
    """TorchRL as the peer: every slice its SliceSampler returns is one of rayrb's valid slices, and over many
    batches it returns all of them; episodes shorter than the slice come whole without strict_length, never with."""
    torch = pytest.importorskip("torch")
    tensordict = pytest.importorskip("tensordict")
    rb_mod = pytest.importorskip("torchrl.data.replay_buffers")
    ids = np.repeat(np.arange(6), [7, 2, 5, 9, 3, 6])
    n, length = ids.size, 5
    rb = rb_mod.ReplayBuffer(storage=rb_mod.LazyTensorStorage(n),
                             sampler=rb_mod.SliceSampler(slice_len=length, traj_key="episode", strict_length=strict),
                             batch_size=8 * length)
    rb.extend(tensordict.TensorDict({"episode": torch.as_tensor(ids), "step": torch.arange(n)}, [n]))
    torch.manual_seed(0)
    theirs = set()
    for _ in range(300):
        batch, info = rb.sample(return_info=True)
        step = batch["step"].tolist()
        cuts = np.flatnonzero(np.asarray(info[("next", "truncated")]).reshape(-1)) + 1
        for a, b in zip(np.concatenate([[0], cuts[:-1]]), cuts):
            theirs.add((step[a], int(b - a)))
    assert theirs == set(every_slice(Slices(from_ids(ids), slice_len=length, strict_length=strict)))


def test_offline_shards_hold_whole_episodes_and_none_is_left_empty():
    """Each cut moves to the nearest episode start between the cuts around it: no shard is empty, and an episode
    no longer than half the smallest shard is never cut; a cut stays only inside an episode with no start near it.
    (Moving each cut to the next start, however far, left [(0, 990), (990, 991), (991, 992), (992, 1000)] for
    episodes [0, 100), [100, 990), [990, 1000) over 4 shards: a 10-step episode over three, one shard with 99 %.)"""
    def shard_of(ranges, row):
        return next(i for i, (a, b) in enumerate(ranges) if a <= row < b)

    assert whole_ranges(row_ranges(1000, 4), [0, 100, 990]) == [(0, 100), (100, 500), (500, 990), (990, 1000)]
    assert whole_ranges(row_ranges(15, 3), [0, 14]) == [(0, 5), (5, 14), (14, 15)]
    assert whole_ranges(row_ranges(5, 5), [0, 2, 3]) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    rng = np.random.default_rng(0)
    for _ in range(2000):
        k = int(rng.integers(2, 6))
        lens = rng.integers(1, 40, int(rng.integers(k, 30)))
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        nominal = row_ranges(int(lens.sum()), k)
        out = whole_ranges(nominal, starts.tolist())
        assert out[0][0] == 0 and out[-1][1] == lens.sum() and all(b > a for a, b in out), (nominal, out)
        assert all(out[i][1] == out[i + 1][0] for i in range(k - 1))
        shortest = min(b - a for a, b in nominal)
        for s, n in zip(starts.tolist(), lens.tolist()):
            if n <= shortest // 2:
                assert len({shard_of(out, r) for r in range(s, s + n)}) == 1, (nominal, starts.tolist(), out, s)
