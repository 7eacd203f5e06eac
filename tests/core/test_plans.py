"""Batch plans: assembling a batch from its parts, provenance, packed plans, concat and nest. Batches are drawn as in
``standin_coordinator``; nothing here imports Ray."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from standin_coordinator import Layout, StandInShard, written_online

from rayrb.actors.coordinator import Coordinator
from rayrb.core.allocation import offline_count
from rayrb.core.plans import (
    OFFLINE,
    ONLINE,
    SIDES,
    BatchPlan,
    GroupPlan,
    Part,
    assemble,
    assemble_slice,
    concat,
    decode_group,
    nest,
    split_group,
)
from rayrb.io.arrays import from_numpy_dict, to_numpy_dict

pytestmark = pytest.mark.usefixtures("local_metrics")


# ---------------------------------------------------------------------------------------------------------------
# Plans
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
    text = packed.plan_packed((16, 3, "s", None, "c1", 0.0, None))
    assert isinstance(text, str) and decode_group(text) == twin.plan(16, 3, stream="s", call="c2")
    assert packed.plan_packed((16, 3, "s", None, "c1", 0.0, None)) == text  # the reply was lost: the same batches
    assert decode_group(packed.plan_packed((16, 2, "s", 2, "c3", 0.0, None))) == twin.plan(16, 2, stream="s", served=2)
    with pytest.raises(ValueError, match="a call id names one call"):
        packed.plan_packed((16, 4, "s", None, "c1", 0.0, None))


def test_assemble_refuses_a_wrong_part_count_and_assemble_slice_postprocesses():
    plan = BatchPlan([Part(OFFLINE, 0, 1), Part(ONLINE, 0, 1)], 1, 1, 0.5)
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
