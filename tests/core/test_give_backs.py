"""Draws given back in any order, and across a coordinator restart: the limiter counts the rows served, and a
restarted coordinator goes on numbering draws where it left off. No Ray: the coordinator's planning part
(``Drawing``) and what it saves."""
from __future__ import annotations

import json

import numpy as np
import pytest

from rayrb.actors.drawing import Drawing
from rayrb.actors.metrics import ActorMetrics
from rayrb.core.ahead import GiveBack
from rayrb.core.planner import Planner
from rayrb.core.rate_limiter import SampleToInsertRatio

SIZES = {"offline": np.array([500, 300]), "online": np.array([200, 200])}
COUNTED = SIZES["online"]


def drawing(sampler="uniform", limiter=None) -> Drawing:
    planner = Planner({"offline": 2, "online": 2}, offline_fraction=0.5, seed=5, sampler=sampler,
                      rate_limiter=limiter or SampleToInsertRatio(1.0, 1, (-10_000, 100)))
    planner.record_insert(400, 0, prefill=True)
    return Drawing(planner, {"offline": [None, None], "online": [None, None]},
                   ActorMetrics("coordinator", {}, export=False), seed=5)


def sampled(d: Drawing) -> int:
    return d.planner.limiter.state_dict()["samples"]


def plan(d: Drawing, stream: str, k: int, served: int | None = None):
    return d.plan(16, k, sizes=SIZES, counted=COUNTED, version=0, stream=stream, served=served)


@pytest.mark.parametrize("order", ["G then H", "H then G"])
def test_give_backs_in_either_order_leave_no_dropped_row_counted(order):
    """G draws ahead, then H; both give everything back. Whichever gives back first, nothing was served, so the
    limiter counts no online row sampled (G's draws stand and are dropped, H's are undone)."""
    d = drawing()
    plan(d, "G", 4)
    plan(d, "H", 3)
    assert sampled(d) == 7 * 8
    first, second = ("G", "H") if order == "G then H" else ("H", "G")
    verdicts = {first: d.undo(first, None), second: d.undo(second, None)}
    assert verdicts == {"G": GiveBack.DROP, "H": GiveBack.UNDONE}
    assert sampled(d) == 0, f"the limiter counts {sampled(d)} online rows sampled; the handles served 0"
    assert d.planner.state_dict()["rate_limiter"]["state"]["samples"] == 0


def test_the_sampling_state_as_of_the_first_unserved_draw_leaves_out_rows_dropped_since():
    """``state_dict`` (what a checkpoint saves) rewinds to before the latest handle's unserved draws; rows
    another handle dropped after those draws were made are not counted again."""
    d = drawing()
    plan(d, "G", 2)
    plan(d, "H", 2)
    d.undo("G", None)  # dropped: 16 online rows no longer count
    assert d.state_dict()["rate_limiter"]["state"]["samples"] == 0


def restarted(d: Drawing) -> Drawing:
    """What a restarted coordinator's planning part is: a fresh one, given what the old one saved."""
    saved = json.loads(json.dumps(d.saved()))  # through the state file's JSON
    again = drawing(sampler=d.planner.sampler)
    again.load_saved(saved)
    return again


def test_after_a_restart_draws_are_numbered_on_and_closing_gives_back_only_what_was_not_served():
    """An iterator was served draws before and after the coordinator restarted, then closed: what it served after
    the restart stays served (without replacement, an epoch would otherwise serve those rows twice)."""
    d = drawing(sampler="without_replacement")
    before = plan(d, "it", 4)
    assert before.first == 0
    d = restarted(d)
    after = plan(d, "it", 4, served=3)  # the iterator served draws 0-3, reported with its next plan call
    assert after.first == 4, "a restarted coordinator numbered draws from 0 again"
    d.served("it", 6)  # and 4-6 of the new group; then it closes
    d.undo("it", None, discard=True)
    assert d.ahead.unserved("it") == 0
    assert sampled(d) == 7 * 8  # the seven batches served, not the dropped eighth


def test_draws_made_before_a_restart_and_given_back_after_it_stop_counting_as_sampled():
    d = drawing()
    plan(d, "loop", 5)
    d.served("loop", 1)  # two served, three held when the coordinator died
    d = restarted(d)
    assert d.undo("loop", 3) == GiveBack.DROP  # they stand (the stream moved on), with replacement: dropped
    assert sampled(d) == 2 * 8, f"the limiter counts {sampled(d) // 8} batches; the handle served 2"


def test_without_replacement_standing_draws_a_closed_iterator_hands_back_are_served_by_the_next_caller():
    """An iterator drew a whole epoch ahead, another handle drew after it, and it closed: its draws stand and it
    will never serve them. Rather than drop them (rows the epoch would never serve), the coordinator hands them
    to the next caller of their batch size; every row of the epoch is served once, none twice."""
    from rayrb.core.plans import GroupPlan, reads_by_plan

    sizes = {"offline": np.array([60, 40]), "online": np.array([0, 0])}

    def plan(d, stream, k):
        return d.plan(10, k, sizes=sizes, counted=sizes["online"], version=0, stream=stream)

    def rows_of(group):  # each batch's (shard, count, epoch start) per part: what its reads cover
        return [[(side, i, a[0][0], a[2][0].start) for side, i, a in parts] for parts in reads_by_plan(group)]

    d = drawing(sampler="without_replacement")
    d.planner.set_fraction(1.0)
    it = plan(d, "it", 10)  # the whole epoch: 10 batches of 10 rows
    other = plan(d, "other", 1)  # the next epoch's first batch: the iterator's draws stand now
    unserved = [(10, GroupPlan([p], [(s, i) for s, i, _ in parts], [a for _, _, a in parts]).encoded(), 10, 0)
                for p, parts in zip(it.plans[3:], reads_by_plan(it)[3:])]  # it served three
    assert d.undo("it", None, discard=True, batches=unserved) == GiveBack.ADOPT
    adopted = plan(d, "learner", 20)
    assert rows_of(adopted) == rows_of(it)[3:]  # the seven it never served, as planned
    assert plan(d, "learner", 1).plans[0].n_offline == 10  # then new draws
    assert rows_of(other)[0][0][3] == 0  # (the other handle's batch began the next epoch)
