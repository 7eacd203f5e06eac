"""The planner's hot path stays exact where it was made cheaper: kept size probabilities, seeds from raw bits,
plans pickled as their JSON text, latencies exported in bulk. No Ray here."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from rayrb.actors.metrics import ActorMetrics
from rayrb.core.allocation import multinomial_counts
from rayrb.core.planner import Planner
from rayrb.core.plans import BatchPlan, Epoch, GroupPlan, ImportanceWeights, Part, decode_group


def test_kept_size_probabilities_give_the_draws_of_the_division():
    sizes = np.array([290_506, 290_506, 7], np.int64)
    a, b = np.random.default_rng(3), np.random.default_rng(3)
    for n in (1, 17, 4096, 4096, 65_536):
        assert multinomial_counts(n, sizes, a).tolist() == b.multinomial(n, sizes / sizes.sum()).tolist()


def test_sizes_that_change_are_never_drawn_with_the_old_probabilities():
    rng = np.random.default_rng(0)
    sizes = np.array([100, 0], np.int64)
    assert multinomial_counts(50, sizes, rng).tolist() == [50, 0]
    sizes[:] = [0, 100]  # the same array written in place, as a shard's count grows
    assert multinomial_counts(50, sizes, rng).tolist() == [0, 50]


def test_one_shard_gets_the_whole_count_and_the_generator_moves_as_multinomial_moves_it():
    a, b = np.random.default_rng(5), np.random.default_rng(5)
    for n in (0, 1, 4096):
        assert multinomial_counts(n, np.array([7], np.int64), a).tolist() == b.multinomial(n, [1.0]).tolist() == [n]
        assert a.bit_generator.state == b.bit_generator.state
        assert multinomial_counts(3, np.array([2, 5], np.int64), a).tolist() == \
            b.multinomial(3, np.array([2, 5]) / 7).tolist()
    with pytest.raises(ValueError, match="sum to 0"):
        multinomial_counts(3, np.array([0], np.int64), a)


def test_a_draw_given_the_sizes_sums_equals_one_that_sums_them():
    sizes = {"offline": np.array([500, 300]), "online": np.array([40])}
    # a size-proportional share reads the sums: wrong ones would change the split
    summed, given = (Planner({"offline": 2, "online": 1}, offline_fraction="size_proportional", seed=4)
                     for _ in range(2))
    for b in (1, 7, 64):
        assert summed.draw(b, sizes=sizes) == given.draw(b, sizes=sizes, totals=(800, 40))
    assert summed.rng.bit_generator.state == given.rng.bit_generator.state


def test_bad_sizes_are_refused_after_good_ones_were_kept():
    rng = np.random.default_rng(0)
    multinomial_counts(8, np.array([3, 5]), rng)
    with pytest.raises(ValueError, match="non-negative"):
        multinomial_counts(8, np.array([3, -5]), rng)
    with pytest.raises(ValueError, match="sum to 0"):
        multinomial_counts(8, np.array([0, 0]), rng)
    with pytest.raises(ValueError, match="sum to 0"):  # asked again: the kept answer refuses too
        multinomial_counts(8, np.array([0, 0]), rng)
    assert multinomial_counts(0, np.array([0, 0]), rng).tolist() == [0, 0]


def test_read_seeds_are_63_bit_and_a_group_equals_single_calls():
    from rayrb.actors.drawing import Drawing

    sizes = {"offline": np.array([500, 300]), "online": np.array([40, 60])}
    counted = sizes["online"]

    def drawing() -> Drawing:
        planner = Planner({"offline": 2, "online": 2}, offline_fraction=0.3, seed=11)
        return Drawing(planner, {"offline": [None, None], "online": [None, None]},
                       ActorMetrics("coordinator", {}, export=False), seed=11)

    single, group = drawing(), drawing()
    one_by_one = [single.plan(64, 1, sizes=sizes, counted=counted, version=0) for _ in range(40)]
    together = group.plan(64, 40, sizes=sizes, counted=counted, version=0, stream="s")
    assert [g.plans[0] for g in one_by_one] == together.plans
    seeds = [s for g in one_by_one for a in g.args for s in a[1]]
    grouped = {key: a[1] for key, a in zip(together.reads, together.args)}
    singles = {key: [s for g in one_by_one for k2, a in zip(g.reads, g.args) if k2 == key for s in a[1]]
               for key in together.reads}
    assert grouped == singles  # each shard's seeds, batch after batch, as single calls drew them
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds) and len(set(seeds)) == len(seeds)


def test_a_plan_crosses_pickle_as_its_text_and_comes_back_equal():
    plans = [BatchPlan([Part("offline", 0, 3), Part("online", 1, 2)], 3, 2, fraction=0.6,
                       weights=ImportanceWeights(0.4, {"online": 0.125}), last_of_epoch=True)]
    g = GroupPlan(plans, [("offline", 0), ("online", 1)],
                  [([3], [2**63 - 1], [Epoch(1, 99, 500, 12)], None), ([2], [0], [None], 77)], version=5, first=9)
    raw = pickle.dumps(g)
    assert pickle.loads(raw) == g == decode_group(g.encoded())
    assert g.encoded().encode() in raw  # the text, not the objects
    assert len(raw) < len(g.encoded()) + 120


def test_latencies_reach_rays_metrics_in_bulk_and_all_of_them():
    seen: list[float] = []

    class Histogram:
        def observe(self, value: float) -> None:
            seen.append(value)

    m = ActorMetrics("coordinator", {"buffer": "b"})
    m._metric = lambda kind, name: Histogram() if kind == "histogram" else None  # no Ray here
    for ms in (1.0, 2.0, 3.0):
        m.observe("plan_ms", ms)
    assert seen == [1.0]  # the first exports at once; the rest wait for the next second
    assert m.snapshot()["plan_ms_p50"] == 2.0  # stats() stay exact, and export what waited
    assert seen == [1.0, 2.0, 3.0]


def test_a_schedule_gone_out_of_range_is_refused_even_before_anything_is_online():
    from rayrb.core.schedules import Schedule

    class Broken(Schedule):
        def __call__(self, step, n_offline, n_online):
            return 1.5

    p = Planner({"offline": 1, "online": 1}, offline_fraction=Broken(), seed=0)
    sizes = {"offline": np.array([50]), "online": np.array([0])}
    state = p.rng.bit_generator.state
    with pytest.raises(ValueError, match="offline_fraction"):
        p.draw(8, sizes=sizes)
    assert p.step == 0 and p.rng.bit_generator.state == state
