"""The draws a buffer owes (orphans: batches a handle drew without replacement and will never serve), without Ray:
they are part of the sampling state a checkpoint saves and of what a restarted coordinator loads, and a pass over
an epoch gets them before it ends, the last of them ending it. The coordinator's planning part (``Drawing``)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from rayrb.actors.drawing import Drawing
from rayrb.actors.metrics import ActorMetrics
from rayrb.core.ahead import GiveBack
from rayrb.core.planner import Planner
from rayrb.core.plans import GroupPlan, reads_by_plan
from rayrb.errors import SavedStateError

SIZES = {"offline": np.array([60, 40]), "online": np.array([0, 0])}  # an epoch: 10 batches of 10 rows


def drawing() -> Drawing:
    planner = Planner({"offline": 2, "online": 2}, offline_fraction=1.0, seed=5, sampler="without_replacement")
    return Drawing(planner, {"offline": [None, None], "online": [None, None]},
                   ActorMetrics("coordinator", {}, export=False), seed=5)


def plan(d: Drawing, stream: str | None, k: int, owing: int | None = None) -> GroupPlan:
    return d.plan(10, k, sizes=SIZES, counted=SIZES["online"], version=0, stream=stream, owing=owing)


def rows(group: GroupPlan) -> list:
    """Each batch's reads (side, shard, count, seed, epoch): the rows it serves."""
    return [[(side, i, a[0][0], a[1][0], a[2][0]) for side, i, a in parts] for parts in reads_by_plan(group)]


def close(d: Drawing, stream: str, group: GroupPlan, served: int) -> None:
    """``stream`` served the first ``served`` batches of ``group`` and closes; its draws stand."""
    unserved = [(10, GroupPlan([p], [(s, i) for s, i, _ in parts], [a for _, _, a in parts]).encoded(), 10, 0)
                for p, parts in zip(group.plans[served:], reads_by_plan(group)[served:])]
    assert d.undo(stream, None, discard=True, batches=unserved) == GiveBack.ADOPT


def orphaned(d: Drawing, served: int = 3) -> GroupPlan:
    """An iterator draws 8 of the epoch's 10 batches, another handle draws after it, the iterator closes."""
    it = plan(d, "it", 8)
    plan(d, None, 1)  # a single call (nothing drawn ahead): it serves its batch at once
    close(d, "it", it, served)
    return it


def test_a_sampling_state_holds_the_orphans_and_a_load_owes_them_in_place_of_those_owed_before():
    d = drawing()
    it = orphaned(d)
    state = json.loads(json.dumps(d.state_dict()))  # as a checkpoint's manifest holds it
    assert len(state["orphans"]) == 5
    twin = drawing()
    orphaned(twin, served=6)  # it owes three others: the load replaces them
    twin.load_state_dict(state)
    assert rows(plan(twin, "learner", 20)) == rows(it)[3:], "the loaded state lost the orphans it owes"
    assert rows(plan(d, "learner", 20)) == rows(it)[3:]
    assert rows(plan(twin, "learner", 1)) == rows(plan(d, "learner", 1))  # then both go on alike
    assert twin.ahead.orphans == d.ahead.orphans == []


def test_a_state_saved_before_states_held_orphans_loads_and_owes_none():
    d = drawing()
    orphaned(d)
    state = d.state_dict()
    del state["orphans"]
    twin = drawing()
    orphaned(twin)
    twin.load_state_dict(state)
    assert twin.ahead.orphans == []
    assert rows(plan(twin, "learner", 1)) == rows(plan(drawing_at(state), "learner", 1))


def drawing_at(state: dict) -> Drawing:
    d = drawing()
    d.planner.load_state_dict(state)
    return d


@pytest.mark.parametrize("damage, match", [
    (lambda o: o[1].replace('["offline",1]', '["offline",7]'), "it reads offline shard 7"),
    (lambda o: o[1][:-2], "JSONDecodeError"),
    (lambda o: 12, "TypeError"),
])
def test_a_damaged_orphan_is_refused_naming_it_and_the_load_changes_nothing(damage, match):
    d = drawing()
    orphaned(d)
    state = json.loads(json.dumps(d.state_dict()))
    state["orphans"][2][1] = damage(state["orphans"][2])
    twin = drawing()
    orphaned(twin, served=6)
    before = json.dumps(twin.state_dict())
    with pytest.raises(SavedStateError, match=rf"sampling state\['orphans'\]\[2\].*{match}"):
        twin.load_state_dict(state)
    with pytest.raises(SavedStateError, match=match):
        twin.check_state_dict(state, SIZES)
    assert json.dumps(twin.state_dict()) == before and len(twin.ahead.orphans) == 2


def test_another_shard_layout_begins_the_epochs_afresh_and_owes_no_orphan():
    d = drawing()
    orphaned(d)
    state = d.state_dict()
    state.pop("allocator")  # what a restore onto another layout loads (rayrb.handle.checkpoint.restore)
    twin = drawing()
    twin.load_state_dict(state)
    assert twin.ahead.orphans == []


def test_a_restarted_coordinator_owes_the_orphans_it_saved():
    d = drawing()
    it = orphaned(d)
    saved = json.loads(json.dumps(d.saved()))  # through the state file's JSON
    again = drawing()
    again.load_saved(saved)
    assert rows(plan(again, "learner", 20)) == rows(it)[3:]


def test_a_state_taken_while_a_handle_holds_orphans_it_took_over_rewinds_its_new_draws():
    """The handle took over orphans (they stand) and then drew two batches of its own, which can be given back:
    the state is as if those two were given back, so that a buffer loading it draws them again."""
    d = drawing()
    orphaned(d)
    plan(d, "h", 5)  # the five orphans
    new = plan(d, "h", 2)
    twin = drawing()
    twin.load_state_dict(d.state_dict())
    assert rows(plan(twin, "x", 2)) == rows(new), "the state skipped the draws the handle can give back"


def test_a_pass_that_served_the_epochs_last_batch_gets_its_orphans_and_the_last_of_them_ends_the_epoch():
    d = drawing()
    it = plan(d, "it", 8)  # epoch 1's batches 0-7
    loop = plan(d, "loop", 2)  # 8 and 9, the last of the epoch
    assert [p.last_of_epoch for p in loop.plans] == [False, True]
    it2 = plan(d, "it2", 3)  # epoch 2's first three
    plan(d, "loop", 1)
    close(d, "it", it, 3)
    close(d, "it2", it2, 1)
    owed = plan(d, "loop", 20, owing=1)  # the loop served epoch 1's last batch: what does the epoch still owe?
    assert rows(owed) == rows(it)[3:]  # all of epoch 1's orphans, none of epoch 2's
    assert [p.last_of_epoch for p in owed.plans] == [False] * 4 + [True]  # the last of them ends the epoch now
    assert plan(d, "loop", 20, owing=1).plans == []  # nothing more owed
    later = plan(d, "loop", 5)  # epoch 2's orphans go to the next plan call, which does not end the epoch
    assert rows(later) == rows(it2)[1:] and not any(p.last_of_epoch for p in later.plans)
    assert d.ahead.orphans == []


def test_a_give_back_of_draws_that_include_orphans_taken_over_keeps_them_all():
    """The loop drew four batches it can give back, then took over orphans (which stand) in its next plan call;
    giving back everything it holds cannot rewind past the orphans: it keeps all of it, and no row is lost."""
    d = drawing()
    it = plan(d, "it", 4)
    own = plan(d, "loop", 4)
    close(d, "it", it, 1)
    adopted = plan(d, "loop", 10)
    assert rows(adopted) == rows(it)[1:]
    assert d.undo("loop", len(own.plans) + len(adopted.plans)) == GiveBack.KEEP
    assert rows(plan(d, "loop", 1)) != rows(own)[:1]  # the planner was not rewound to before the loop's own draws
