"""The slice sampling kind without Ray: the planner counts slices (exact offline share, all offline while no online
shard holds a whole slice), a shard's reads are whole slices of one episode in write order (across the wrap of a
circular shard, never over an overwritten step), and settings that cannot work are refused at construction."""
from __future__ import annotations

import numpy as np
import pytest

from rayrb.core.planner import Planner
from rayrb.core.plans import OFFLINE, ONLINE
from rayrb.core.samplers import make_sampler
from rayrb.core.slice_sampling import SliceSampler
from rayrb.errors import DrawError, InvalidArgumentError, SchemaError


def planner(fraction=0.3, slice_len=4, masses=((10.0, 5.0), (6.0,))):
    p = Planner({OFFLINE: len(masses[0]), ONLINE: len(masses[1])}, offline_fraction=fraction, sampler="slice",
                slice_len=slice_len, seed=0)
    for side, m in zip((OFFLINE, ONLINE), masses):
        p.alloc.set_masses(side, [(x, 1.0) for x in m], np.full(len(m), 100))
    return p


SIZES = {OFFLINE: np.array([100, 100]), ONLINE: np.array([100])}


def test_a_batch_of_slices_is_cut_for_at_most_as_many_learners_as_it_has_slices():
    """Learners' parts hold whole slices: 2 slices of 4 steps go to at most 2 learners, each its own slice; more
    learners are refused before anything is drawn (rows would refuse more learners than rows the same way)."""
    p = planner(slice_len=4)
    parts = p.draw(8, num_slices=2, sizes=SIZES)
    assert [plan.n_offline + plan.n_online for plan, _ in parts] == [4, 4]
    state = p.snapshot()
    with pytest.raises(InvalidArgumentError, match=r"num_slices must be in \[1, 2\] .* 2 slices of 4 steps\), got 5"):
        p.draw(8, num_slices=5, sizes=SIZES)
    assert p.snapshot() == state


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.5, 0.9, 1.0])
def test_a_batch_is_planned_in_slices_with_an_exact_offline_share(fraction):
    p = planner(fraction)
    for slices in (1, 3, 5, 8):
        ((plan, _),) = p.draw(4 * slices, sizes=SIZES)
        assert plan.n_offline == 4 * int(np.floor(fraction * slices + 0.5)) and plan.n_online == 4 * slices - plan.n_offline
        assert all(part.count % 4 == 0 for part in plan.parts)


def test_all_offline_while_no_online_shard_holds_a_whole_slice_and_shards_without_slices_draw_none():
    p = planner(0.5, masses=((10.0, 0.0), (0.0,)))  # online rows, but no episode of 4 steps yet
    for _ in range(20):
        ((plan, _),) = p.draw(16, sizes=SIZES)
        assert (plan.n_offline, plan.n_online) == (16, 0) and {part.shard for part in plan.parts} == {0}


def test_a_batch_that_is_not_whole_slices_and_too_many_learner_parts_are_refused_and_change_nothing():
    p = planner()
    with pytest.raises(InvalidArgumentError, match="multiple of slice_len=4, got 10"):
        p.draw(10, sizes=SIZES)
    assert p.step == 0
    plans = p.draw(16, num_slices=2, sizes=SIZES)  # two learners' parts, each whole slices
    assert [plan.n_offline + plan.n_online for plan, _ in plans] == [8, 8]


def shard(ids, capacity=None, generation=None, slice_len=3, kind="slice"):
    s = make_sampler(kind, capacity or len(ids), slice_len=slice_len, slice_key="episode")
    s.bind({"episode": np.asarray(ids), "obs": np.zeros(len(ids))}, generation)
    return s


def test_a_shard_draws_whole_slices_of_one_episode_and_weighs_itself_by_them():
    ids = np.repeat([0, 1, 2, 3], [5, 2, 4, 3])
    s = shard(ids)
    assert s.mass(len(ids)) == (3.0 + 0 + 2 + 1, 1.0)
    idx = s.sample(3 * 40, len(ids), np.random.default_rng(0))
    for run in idx.reshape(-1, 3):
        assert np.array_equal(run, np.arange(run[0], run[0] + 3)) and len(set(ids[run])) == 1
    with pytest.raises(DrawError, match="whole slices"):
        s.sample(4, len(ids), np.random.default_rng(0))


def test_trajectory_ids_of_several_values_a_step_are_refused_and_end_flags_of_several_are_not():
    """``[steps, 2]`` ids (say, environment and episode) would be cut by their first value only: refused by name.
    End flags of several values a step (one per agent) end an episode where any is set: taken."""
    shapes = {"traj": (2,), "episode": (1,), "next/done": (3,)}
    with pytest.raises(SchemaError, match=r"one trajectory id a step in 'traj' \(shape \[\] or \[1\]\), got shape \[2\]"):
        SliceSampler(slice_len=2, traj_key="traj").resolve(shapes, None)
    assert SliceSampler(slice_len=2, traj_key="episode").resolve(shapes, None)["slice_key"] == "episode"
    assert SliceSampler(slice_len=2).resolve(shapes, None)["slice_ends"] is True


@pytest.mark.parametrize("ends", [True, False])
def test_an_empty_shard_of_flags_or_ids_shaped_steps_by_one_holds_no_slice(ends):
    """TorchRL's done keys (and ids stored so) are ``[steps, 1]``: an online shard with none written yet holds no
    slice, and says so, rather than failing to find episodes in zero steps."""
    s = make_sampler("slice", 8, slice_len=2, slice_key="k", slice_ends=ends)
    column = np.zeros((8, 1), bool if ends else np.int64)
    s.bind({"k": column}, np.zeros(8, np.int64))
    assert s.mass(0) == (0.0, 1.0)
    column[:4] = np.array([[False], [True], [False], [True]]) if ends else np.array([[3], [3], [4], [4]])
    s.on_write(np.arange(4))
    assert s.mass(4) == (2.0, 1.0)


def test_a_wrapped_online_shard_draws_in_write_order_and_never_over_an_overwritten_step():
    """Capacity 8, 12 rows written: slots 0-3 hold rows 8-11 (generation 2), slots 4-7 rows 4-7. Episode 1 runs
    over rows 4-9 (slots 4-7 then 0-1): its slices cross the wrap in write order; episode 0's rows 0-3 are gone."""
    by_row = np.repeat([0, 1, 2], [4, 6, 2])  # rows 0..11
    slots = np.empty(8, np.int64)
    generation = np.empty(8, np.int64)
    for w in range(4, 12):
        slots[w % 8], generation[w % 8] = by_row[w], w // 8 + 1
    s = shard(slots, capacity=8, generation=generation)
    assert s.mass(8)[0] == 4  # episode 1: 6 steps, 4 slices of 3; episode 2: 2 steps, none
    seen = set()
    for run in s.sample(3 * 200, 8, np.random.default_rng(1)).reshape(-1, 3):
        rows = (generation[run] - 1) * 8 + run
        assert np.array_equal(rows, np.arange(rows[0], rows[0] + 3)) and set(slots[run]) == {1}
        seen.add(int(rows[0]))
    assert seen == {4, 5, 6, 7}


@pytest.mark.parametrize("kind", ["slice", "prioritized_slice"])
def test_each_drawn_step_says_where_its_episode_starts_in_the_write_stream(kind):
    """The wrapped shard above: episode 1 holds rows 4-9 (slots 4-7, 0-1), episode 2 rows 10-11 (slots 2-3).
    Every step of a slice of episode 1 says row 4; a gather by index beyond the draw's rows says nothing."""
    by_row = np.repeat([0, 1, 2], [4, 6, 2])
    slots, generation = np.empty(8, np.int64), np.empty(8, np.int64)
    for w in range(4, 12):
        slots[w % 8], generation[w % 8] = by_row[w], w // 8 + 1
    s = shard(slots, capacity=8, generation=generation, slice_len=2, kind=kind)
    s.on_write(np.arange(8))
    steps = s.sample(2 * 50, 8, np.random.default_rng(2))
    first = s.info(steps)["episode_start"]
    expected = np.where(slots[steps] == 1, 4, 10)
    assert first.tolist() == expected.tolist() and set(first.tolist()) == {4, 10}
    assert s.info(np.array([0, 1, 2, 3]))["episode_start"].tolist() == [4, 4, 10, 10]
    unwrapped = shard(np.array([5, 5, 5, 6, 6]), capacity=8, generation=np.ones(8, np.int64), slice_len=2, kind=kind)
    unwrapped.on_write(np.arange(5))
    unwrapped.sample(2, 5, np.random.default_rng(0))
    assert unwrapped.info(np.array([1, 2, 3, 4]))["episode_start"].tolist() == [0, 0, 3, 3]
    assert "episode_start" not in unwrapped.info(np.array([6]))  # not a step of the draw's rows


def test_a_write_is_seen_by_the_next_read():
    ids = np.array([0, 0, 1, 1, 1, 1, 2, 2])
    s = shard(ids, capacity=8, generation=np.ones(8, np.int64))
    assert s.mass(6)[0] == 2  # rows 0..5: episode 1 has 4 steps
    ids[6:] = 1  # two more steps of episode 1 written
    s.on_write(np.array([6, 7]))
    assert s.mass(8)[0] == 4


def test_rows_replaced_whole_by_a_restore_are_found_again():
    ids = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    s = shard(ids, capacity=8, generation=np.ones(8, np.int64))
    assert s.mass(8)[0] == 4
    ids[:] = np.arange(8)  # a restore wrote other rows over the same slots, at the same count
    s.load_state_dict({})
    assert s.mass(8)[0] == 0


@pytest.mark.parametrize("kwargs, error, message", [
    ({}, InvalidArgumentError, "one of slice_len and num_slices"),
    ({"slice_len": 4, "num_slices": 2}, InvalidArgumentError, "one of slice_len and num_slices"),
    ({"slice_len": 0}, InvalidArgumentError, "slice_len must be a positive integer, got 0"),
    ({"num_slices": -2}, InvalidArgumentError, "num_slices must be a positive integer, got -2"),
    ({"slice_len": 4, "traj_key": ""}, InvalidArgumentError, "expected traj_key a key name .*, got ''"),
    ({"slice_len": 4, "traj_key": ()}, InvalidArgumentError, r"expected traj_key a key name .*, got \(\)"),
    ({"slice_len": 4, "end_key": ("next", "")}, InvalidArgumentError, "expected end_key a key name"),
    ({"slice_len": 4, "traj_key": 3}, InvalidArgumentError, "expected traj_key a key name .*, got 3"),
    ({"slice_len": 4, "traj_key": "a", "end_key": "b"}, InvalidArgumentError, "one of traj_key and end_key"),
    ({"slice_len": 4, "strict_length": 1}, InvalidArgumentError, "strict_length True or False"),
])
def test_settings_that_cannot_work_are_refused_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        SliceSampler(**kwargs)


def test_keys_are_resolved_against_the_rows_as_torchrl_does():
    assert SliceSampler(slice_len=2).resolve(["episode", "obs"], None)["slice_key"] == "episode"
    assert SliceSampler(slice_len=2, end_key=("next", "terminated")).resolve(["next/terminated"], None) == {
        "slice_len": 2, "slice_key": "next/terminated", "slice_ends": True}
    with pytest.raises(SchemaError, match="expected the rows to hold 'traj'"):
        SliceSampler(slice_len=2, traj_key="traj").resolve(["episode"], None)
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        SliceSampler(num_slices=4).resolve(["episode"], None)
    with pytest.raises(InvalidArgumentError, match="multiple of num_slices=4"):
        SliceSampler(num_slices=4).resolve(["episode"], 30)


def test_the_buffer_settings_take_slices_on_both_sides_only_and_keep_a_torchrl_datasets_slice_sampler(tmp_path):
    from rayrb.handle.settings import checked_settings

    data = {"episode": np.zeros(10, np.int64), "obs": np.zeros(10)}
    s = checked_settings(data, online_capacity=10, sampler=SliceSampler(slice_len=2))
    assert s.samplers == {OFFLINE: "slice", ONLINE: "slice"} and s.slices == SliceSampler(slice_len=2)
    for bad, message in (({"sampler": "slice"}, "one of slice_len and num_slices"),
                         ({"sampler": SliceSampler(slice_len=2), "online_sampler": "uniform"}, "SliceSampler"),
                         ({"offline_sampler": "slice"}, "SliceSampler"),
                         ({"slice_len": 2}, "expected sampler='slice'"),
                         ({"sampler": SliceSampler(slice_len=2), "traj_key": "episode"}, "takes them itself")):
        with pytest.raises(InvalidArgumentError, match=message):
            checked_settings(data, online_capacity=10, **bad)
    # TorchRL's keywords on the buffer, as its SliceSampler takes them
    s = checked_settings(data, online_capacity=10, sampler="slice", slice_len=2, traj_key="episode")
    assert s.slices == SliceSampler(slice_len=2, traj_key="episode") and s.samplers[OFFLINE] == "slice"
    s = checked_settings(data, online_capacity=10, sampler="slice_without_replacement", num_slices=2, batch_size=8)
    assert s.slices == SliceSampler(num_slices=2, replacement=False)
    assert s.samplers == {OFFLINE: "slice_without_replacement", ONLINE: "slice"}
    rb_mod = pytest.importorskip("torchrl.data.replay_buffers")
    torchrl_rb = rb_mod.ReplayBuffer(storage=rb_mod.LazyTensorStorage(10),
                                     sampler=rb_mod.SliceSampler(num_slices=4, traj_key="episode"))
    s = checked_settings(torchrl_rb, online_capacity=10, batch_size=32)
    assert s.slices == SliceSampler(num_slices=4, traj_key="episode") and s.online_sampler == "slice"


def test_a_batch_of_slices_is_marked_at_each_slices_edges_as_torchrls_slice_sampler_marks_it():
    torch = pytest.importorskip("torch")
    from tensordict import TensorDict

    from rayrb.handle.output import mark_slices

    done = torch.tensor([0, 1, 0, 0, 0, 0, 0, 0], dtype=torch.bool).reshape(8, 1)
    stored_init = torch.tensor([0, 0, 1, 0, 0, 0, 0, 0], dtype=torch.uint8).reshape(8, 1)
    td = TensorDict({"obs": torch.zeros(8, 2), "is_init": stored_init, "next": {"done": done}}, [8])
    mark_slices(td, 4)
    assert td["is_init"].dtype == torch.uint8 and td["is_init"].reshape(-1).tolist() == [1, 0, 1, 0, 1, 0, 0, 0]
    assert td["next", "truncated"].shape == (8, 1) and td["next", "truncated"].dtype == torch.bool
    assert td["next", "truncated"].reshape(-1).tolist() == [False, False, False, True] * 2
    assert td["next", "done"].reshape(-1).tolist() == [False, True, False, True, False, False, False, True]
    bare = TensorDict({"obs": torch.zeros(6, 1)}, [6])
    mark_slices(bare, 3)
    assert "done" not in bare["next"].keys() and bare["is_init"].reshape(-1).tolist() == [True, False, False] * 2


@pytest.mark.parametrize("epoch_end", ["short", "drop"])
def test_without_replacement_each_valid_slice_of_each_offline_shard_comes_once_an_epoch(epoch_end):
    """The planner's epochs over the offline shards' valid slices and each shard's permutation of its own, as
    the shards and handles run them: every valid slice once an epoch (a short last batch, or the rest dropped)."""
    from rayrb.core.reads import read_indices

    rng = np.random.default_rng(5)
    columns = [np.repeat(np.arange(n), rng.integers(1, 9, n)) for n in (30, 45)]
    shards = [shard(c, kind="slice_without_replacement") for c in columns]
    sizes = [len(c) for c in columns]
    totals = [int(s.mass(n)[0]) for s, n in zip(shards, sizes)]
    p = Planner({OFFLINE: 2, ONLINE: 1}, offline_fraction=1.0, sampler={OFFLINE: "slice_without_replacement",
                ONLINE: "slice"}, slice_len=3, epoch_end=epoch_end, seed=0)
    p.alloc.set_masses(OFFLINE, [(t, 1.0) for t in totals], np.array(sizes))
    p.alloc.set_masses(ONLINE, [(0.0, 1.0)], np.array([0]))
    seen = [[] for _ in shards]
    while p.stats()["epochs"][OFFLINE] < 2:
        ((plan, reads),) = p.draw(7 * 3, sizes={OFFLINE: np.array(sizes), ONLINE: np.array([0])})
        if p.stats()["epochs"][OFFLINE] == 2:
            break
        for part, (seed, kwargs) in zip(plan.parts, reads):
            s = shards[part.shard]
            idx = read_indices(s, [part.count], [seed], [kwargs["epoch"]], sizes[part.shard])
            seen[part.shard] += idx.reshape(-1, 3)[:, 0].tolist()
    for s, got, n in zip(shards, seen, sizes):
        expected = s._slices(n).locate(np.arange(s.mass(n)[0], dtype=np.int64))[0].tolist()
        if epoch_end == "short":
            assert sorted(got) == sorted(expected)  # each once
        else:
            assert len(got) == len(set(got)) and set(got) <= set(expected)  # once at most: the rest dropped


def test_numpy_booleans_and_list_keys_are_taken_as_their_python_values():
    """Options as a config file or numpy gives them: ``np.False_`` is False, a key as a list is its tuple (so the
    sampler hashes, compares equal to the same sampler, and resolves the same key)."""
    a = SliceSampler(slice_len=2, end_key=["next", "done"], strict_length=np.False_, replacement=np.True_)
    b = SliceSampler(slice_len=2, end_key=("next", "done"), strict_length=False)
    assert a == b and hash(a) == hash(b) and a.strict_length is False and a.replacement is True
    assert a.resolve(["next/done", "obs"], None) == b.resolve(["next/done", "obs"], None)


def test_a_planner_of_slices_needs_no_import_of_the_shards_samplers_first():
    import subprocess
    import sys

    code = ("from rayrb.core.planner import Planner\nfrom rayrb.core.plans import OFFLINE, ONLINE\n"
            "print(type(Planner({OFFLINE: 1, ONLINE: 1}, sampler='slice', slice_len=2, seed=0).alloc).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "SliceAllocator", out.stderr[-2000:]
