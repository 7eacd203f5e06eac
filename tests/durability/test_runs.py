"""Runs of rows a circular shard holds beyond its count (rayrb.durability.runs). No Ray."""
import numpy as np

from rayrb.durability.runs import gaps, held_runs, insert, overlaps


def test_rows_held_more_than_a_lap_beyond_the_count_are_all_reported():
    """Capacity 8, rows 0-1 counted, rows 2-3 never landed, rows 4-11 written behind them: slots 0-3 hold rows
    8-11 now. The shard holds rows 4-11 beyond its count, not just the lap after it (4-9)."""
    gen = np.array([2, 2, 2, 2, 1, 1, 1, 1])
    assert held_runs(gen, 2) == [(4, 12)]
    assert held_runs(np.array([1, 1, 0, 0, 3, 3, 0, 0]), 2) == [(20, 22)]  # a hole wider than the shard
    assert held_runs(np.zeros(5, np.int64), 0) == []  # nothing written
    assert held_runs(np.full(4, 3), 12) == [] and held_runs(np.full(4, 3), 10) == [(10, 12)]  # full laps


def test_runs_merge_and_meet_only_where_rows_are_shared():
    runs = ([], [])
    for a, b in [(10, 12), (0, 2), (4, 6), (2, 4)]:
        insert(runs, a, b)
    assert runs == ([0, 10], [6, 12])  # [0, 2), [2, 4) and [4, 6) touch: one run
    assert [overlaps(runs, a, b) for a, b in [(6, 10), (5, 7), (9, 11), (12, 13)]] == [False, True, True, False]
    assert gaps(0, [(0, 6), (10, 12)]) == [(6, 10)] and gaps(3, []) == []
