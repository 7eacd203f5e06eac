"""Pure allocation math, without Ray."""
import math

import numpy as np
import pytest
from scipy import stats

from rayrb.core.allocation import (
    assign_pieces,
    hypergeometric_counts,
    multinomial_counts,
    offline_count,
    row_ranges,
    split_batch,
    split_evenly,
    split_slices,
    write_pieces,
)
from rayrb.core.samplers import UniformSampler, WithoutReplacementSampler


@pytest.mark.parametrize("f", [0.0, 0.25, 0.5, 0.7, 1.0])
@pytest.mark.parametrize("B", range(1, 65))
def test_split_rounds_half_up_for_every_batch_size(f, B):
    n_off, n_on = split_batch(B, f, online_size=10)
    assert n_off == math.floor(f * B + 0.5)
    assert n_on == B - n_off
    assert n_off + n_on == B


def test_split_is_not_bankers_rounding():
    # round(0.5) == 0 and round(2.5) == 2 in Python; the contract rounds half up.
    assert offline_count(1, 0.5) == 1
    assert offline_count(10, 0.25) == 3
    assert offline_count(2, 0.25) == 1


def test_split_edges():
    assert split_batch(7, 0.0, online_size=5) == (0, 7)
    assert split_batch(7, 1.0, online_size=5) == (7, 0)
    assert split_batch(7, 0.0, online_size=0) == (7, 0)  # online side empty: all offline
    for bad in (-0.1, 1.5, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match="offline_fraction must be a number in \\[0, 1\\]"):
            split_batch(8, bad, 1)
    for bad in (0, -3, 2.5, None):
        with pytest.raises(ValueError, match="batch_size must be a positive integer"):
            split_batch(bad, 0.5, 1)


def two_stage_uniform(sizes, n, draws, seed):
    """Per-row frequencies of: multinomial per-shard counts, then a uniform draw inside each shard."""
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    freq = np.zeros(sum(sizes), dtype=np.int64)
    sampler = UniformSampler()
    for _ in range(draws):
        for shard, c in enumerate(multinomial_counts(n, sizes, rng)):
            np.add.at(freq, offsets[shard] + sampler.sample(int(c), sizes[shard], rng), 1)
    return freq


def test_uniform_allocation_matches_sampling_the_union():
    sizes = [3, 40, 400]  # very unequal shards
    freq = two_stage_uniform(sizes, n=64, draws=3000, seed=1)
    p = stats.chisquare(freq).pvalue  # expected: uniform over the 443 rows of the union
    assert p > 1e-3, p


def test_chi_square_catches_an_allocation_that_ignores_shard_sizes():
    """The check above has teeth: an equal split per shard (the classic bug) fails it."""
    sizes = [3, 40, 400]
    rng = np.random.default_rng(1)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    freq = np.zeros(sum(sizes), dtype=np.int64)
    for _ in range(3000):
        for shard, c in enumerate(split_evenly(64, 3)):
            np.add.at(freq, offsets[shard] + rng.integers(0, sizes[shard], c), 1)
    assert stats.chisquare(freq).pvalue < 1e-6


def test_without_replacement_epoch_over_shards_covers_every_row_once():
    sizes = [3, 50, 7]
    rng = np.random.default_rng(0)
    samplers = [WithoutReplacementSampler() for _ in sizes]
    for s, size in zip(samplers, sizes):
        s.begin_epoch(size, rng)
    left = np.array(sizes)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    seen = []
    for _ in range(10):  # 10 batches of 6 = 60 rows = one epoch
        counts = hypergeometric_counts(6, left, rng)
        left -= counts
        for shard, c in enumerate(counts):
            seen.extend((offsets[shard] + samplers[shard].sample(int(c), sizes[shard], rng)).tolist())
    assert sorted(seen) == list(range(60))
    with pytest.raises(ValueError, match="cannot draw 1 rows without replacement: only 0 left"):
        hypergeometric_counts(1, left, rng)


def test_hypergeometric_counts_have_the_right_mean():
    rng = np.random.default_rng(3)
    left = np.array([10, 30, 60])
    mean = np.mean([hypergeometric_counts(20, left, rng) for _ in range(4000)], axis=0)
    np.testing.assert_allclose(mean, [2, 6, 12], atol=0.15)


def test_multinomial_rejects_bad_weights():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="non-negative finite"):
        multinomial_counts(3, [1, -1], rng)
    with pytest.raises(ValueError, match="weights sum to 0"):
        multinomial_counts(3, [0, 0], rng)
    assert multinomial_counts(0, [0, 0], rng).tolist() == [0, 0]


def test_ranges_and_even_splits():
    assert split_evenly(10, 4).tolist() == [3, 3, 2, 2]
    assert row_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert write_pieces(10, 4).tolist() == [10]  # small writes stay whole
    assert write_pieces(2100, 4).tolist() == [1050, 1050]
    assert write_pieces(100_000, 4).tolist() == [25_000] * 4


def test_pieces_go_to_the_least_written_shards():
    assert assign_pieces([5], [10, 3, 7]) == [1]
    assert assign_pieces([1, 9], [10, 3, 7]) == [2, 1]  # the biggest piece to the emptiest shard
    written = np.zeros(3, dtype=np.int64)
    for n in [5, 17, 3, 64, 8, 8, 1, 30] * 10:
        (shard,) = assign_pieces([n], written)
        written[shard] += n
    assert written.max() - written.min() <= 64


@pytest.mark.parametrize("n_off, n_on, parts", [(16, 16, 2), (7, 3, 3), (0, 10, 4), (10, 0, 3), (5, 6, 4)])
def test_learner_slices_keep_the_fraction(n_off, n_on, parts):
    slices = split_slices(n_off, n_on, parts)
    assert sum(o for o, _ in slices) == n_off and sum(n for _, n in slices) == n_on
    sizes = [o + n for o, n in slices]
    assert max(sizes) - min(sizes) <= 1
    offs = [o for o, _ in slices]
    assert max(offs) - min(offs) <= 1
