"""Rows an online shard holds past a hole (written behind a piece that never landed) are not sampled before the
hole is filled, and do not count in its prioritized mass. No Ray: real shard objects, called directly."""
from __future__ import annotations

import numpy as np

from rayrb.actors.online_shard import OnlineShard
from rayrb.core.schema import RowSpec


def shard_with_a_hole() -> OnlineShard:
    spec = RowSpec.from_arrays({"id": np.zeros(1, np.int64)})
    shard = OnlineShard(spec.to_json(), 16, "t/on", sampler="prioritized")
    rows = {"id": np.arange(100, 116)}
    shard.extend(rows, 0, 5, first=0)  # rows 0-4 land
    shard.extend(rows, 8, 11, first=8)  # rows 8-10 land behind rows 5-7, which never do
    return shard


def test_a_prioritized_shard_with_a_hole_counts_and_samples_only_the_rows_before_it():
    shard = shard_with_a_hole()
    assert shard.size() == 5 and shard.write_state() == (5, [(8, 11)])
    total, smallest = shard.mass_stats()
    assert total == 5.0 and smallest == 1.0  # five rows of max priority 1, not eight
    (_, info) = shard.sample_many([20_000], [0])
    counts = np.bincount(info["index"], minlength=16)
    assert counts[5:].sum() == 0  # nothing past the hole
    assert counts[:5].min() > 3_500 and counts[4] < 4_500  # row 4 does not take the held rows' share


def test_filling_the_hole_counts_the_held_rows():
    shard = shard_with_a_hole()
    shard.extend({"id": np.arange(100, 116)}, 5, 8, first=5)
    assert shard.size() == 11 and shard.mass_stats() == (11.0, 1.0)
    (_, info) = shard.sample_many([20_000], [1])
    assert set(np.unique(info["index"]).tolist()) == set(range(11))
