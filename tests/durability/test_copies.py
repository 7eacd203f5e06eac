"""Two copies of an online shard that took the same writes in any order, each missing some, merge into one that
holds every row either held, counted as far as both together reach. No Ray: shards in this process."""
from __future__ import annotations

import numpy as np
import pytest

from rayrb.actors.online_shard import OnlineShard
from rayrb.core.schema import RowSpec
from rayrb.durability.copies import merged_count, newer, take_newer
from rayrb.durability.storage import whole

SPEC = RowSpec.from_arrays({"x": np.zeros(1, np.int64)}).to_json()


def shard(tmp_path, name, capacity=8, sampler="uniform"):
    return OnlineShard(SPEC, capacity, name, sampler, state_dir=str(tmp_path / name))


def rows(a, b):
    return {"x": np.arange(a, b, dtype=np.int64)}


def held(s):
    """Row values and generations of what ``s`` counts."""
    rows_, info = s.gather(np.arange(s.size()))
    return sorted(rows_["x"].tolist()), s.written()


def test_newer_refuses_copies_of_another_capacity():
    with pytest.raises(ValueError, match="expected two copies of one shard"):
        newer(np.zeros(4), np.zeros(5))


@pytest.mark.parametrize("seed", range(6))
def test_a_merge_holds_every_row_either_copy_held(tmp_path, seed):
    rng = np.random.default_rng(seed)
    pieces = [(a, a + 3) for a in range(0, 30, 3)]  # 30 rows through a shard of 8: laps over every slot
    a, b, whole = shard(tmp_path, "a"), shard(tmp_path, "b"), shard(tmp_path, "whole")
    for lo, hi in pieces:
        whole.extend(rows(lo, hi), first=lo)
        for copy in (a, b):  # each copy misses some pieces, and takes the rest in its own order
            if rng.random() < 0.7:
                copy.extend(rows(lo, hi), first=lo)
    for lo, hi in rng.permutation(np.array(pieces)):  # ... then what the other missed, out of order
        if rng.random() < 0.5:
            b.extend(rows(int(lo), int(hi)), first=int(lo))
    a.merge(b.state())
    b.merge(a.state())
    # every row either held is in both now; a row both missed is a hole in both, at the same place
    assert held(a) == held(b)
    assert a.write_state() == b.write_state()
    gen = np.maximum(a.state()["generation"], 0)
    assert np.array_equal(a.state()["generation"], b.state()["generation"])
    if a.written() == whole.written():
        assert held(a) == held(whole) and np.array_equal(gen, whole.state()["generation"])
    a.merge(b.state())  # taking a copy twice changes nothing
    assert held(a) == held(b)


def test_two_copies_merged_either_way_agree_slot_by_slot_torn_slots_included():
    """Contract 12: whichever copy takes the other, a slot ends the same. Every pair of a slot's states (empty,
    whole rows 1-4, rows 1-4 torn by a crash mid-write): a whole row wins over its own row torn and over the next
    row torn (never acknowledged: the row it would have evicted stays); a torn row over one two rows older."""
    states = np.array([0, 1, 2, 3, 4, -1, -2, -3, -4])
    a, b = np.repeat(states, states.size), np.tile(states, states.size)
    a_takes, b_takes = np.where(newer(a, b), b, a), np.where(newer(b, a), a, b)
    assert (a_takes == b_takes).all()
    # torn 2 takes whole 1; whole 1 keeps itself against torn 2; torn 3 keeps itself against whole 1
    assert np.flatnonzero(newer(np.array([-2, 1, -3]), np.array([1, -2, 1]))).tolist() == [0]


def test_a_copy_whose_rows_do_not_fit_is_refused_before_a_slot_is_marked():
    for theirs in (np.ones((4, 2)), np.ones(3), np.array(["a"] * 4)):
        rows, gen = {"x": np.zeros(4), "y": np.zeros(4)}, np.array([1, 1, 1, 1])
        with pytest.raises(ValueError, match="expected key 'y' of the copy as float64\\[4\\]"):
            take_newer(rows, gen, {"rows/x": np.ones(4), "rows/y": theirs, "generation": np.array([2, 2, 2, 2])})
        assert gen.tolist() == [1, 1, 1, 1] and whole(gen) and rows["x"].tolist() == [0, 0, 0, 0]


def test_merged_count_goes_over_held_runs_that_join_and_stops_at_a_hole():
    gen = np.array([1, 1, 1, 1, 0, 1, 0, 0])  # rows 0-3 and 5 held
    assert merged_count(gen, 2, 0) == 4
    assert merged_count(gen, 0, 3) == 4
    assert merged_count(np.zeros(8, np.int64), 0, 0) == 0


def test_a_merge_takes_the_other_copys_priorities_for_the_rows_it_takes(tmp_path):
    a, b = shard(tmp_path, "a", sampler="prioritized"), shard(tmp_path, "b", sampler="prioritized")
    for s in (a, b):
        s.extend(rows(0, 4), first=0)
    b.extend(rows(4, 6), first=4)
    b.update_priority(np.array([4, 5]), np.array([1, 1]), np.array([7.0, 9.0]))
    a.merge(b.state())
    assert a.written() == 6
    assert np.allclose(a.state()["sampler/priority"][4:6], b.state()["sampler/priority"][4:6])
    assert a.state()["sampler/max_priority"] == b.state()["sampler/max_priority"]


def test_a_copy_of_other_keys_is_refused_and_changes_nothing(tmp_path):
    a = shard(tmp_path, "a")
    a.extend(rows(0, 3), first=0)
    other = OnlineShard(RowSpec.from_arrays({"y": np.zeros(1, np.int64)}).to_json(), 8, "o",
                        state_dir=str(tmp_path / "o"))
    other.extend({"y": np.arange(5, dtype=np.int64)}, first=0)
    with pytest.raises(ValueError, match=r"expected a copy with keys \['x'\]"):
        a.merge(other.state())
    assert held(a) == ([0, 1, 2], 3)


def test_a_restore_orders_two_copies_before_their_generations_do(tmp_path):
    """Rows written after a restore take the generations of the rows it removed (and a copy from before it may
    hold higher ones): the restore epoch decides first, in both directions. A copy from before the restore takes
    the restored one whole; the restored one takes nothing from it."""
    restored, before = shard(tmp_path, "restored"), shard(tmp_path, "before")
    for s in (restored, before):
        s.extend(rows(0, 12), first=0)  # 12 rows through 8 slots: slots 0-3 hold rows 8-11, generation 2
    saved = {k: np.array(v) for k, v in restored.state().items()}
    restored.extend(rows(12, 14), first=12)
    saved["rows/x"][:4], saved["generation"][:4], saved["written"] = [0, 1, 2, 3], 1, np.int64(6)
    saved["generation"][6:] = 0
    restored.load_state(saved)  # back to rows 0-5, then two more written over what the restore removed
    restored.extend(rows(100, 102), first=6)
    assert held(restored) == ([0, 1, 2, 3, 4, 5, 100, 101], 8)
    restored.merge(before.state())  # the older copy's generation-2 rows are from before the restore
    assert held(restored) == ([0, 1, 2, 3, 4, 5, 100, 101], 8)
    before.merge(restored.state())  # the copy from before the restore takes the restored one whole
    assert held(before) == held(restored) and before.state()["restores"] == restored.state()["restores"] == 1
    restored.merge(before.state())  # the same epoch now: slot by slot again, and nothing newer to take
    assert held(restored) == ([0, 1, 2, 3, 4, 5, 100, 101], 8)


def test_a_shard_directory_from_before_the_restore_epoch_reopens_at_epoch_0(tmp_path):
    s = shard(tmp_path, "a")
    s.extend(rows(0, 3), first=0)
    (tmp_path / "a" / "restores.memmap").unlink()  # as an older rayrb left it
    again = shard(tmp_path, "a")
    assert held(again) == ([0, 1, 2], 3) and again.state()["restores"] == 0
