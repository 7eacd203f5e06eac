"""The coordinator's saved state: plain JSON under a schema number; a state of another schema is refused, naming
both. No Ray here."""
from __future__ import annotations

import json
import struct

import pytest
import xxhash

from rayrb.core.plans import BatchPlan, Epoch, GroupPlan, ImportanceWeights, Part
from rayrb.durability.coordinator_state import STATE_SCHEMA, CoordinatorState
from rayrb.durability.replies import ReplyCache


def test_a_saved_state_is_json_with_its_schema_and_loads_back(tmp_path):
    s = CoordinatorState(tmp_path)
    s.save({"version": 3, "planner": {"step": 7}})
    raw = (tmp_path / "state.1").read_bytes()
    payload = json.loads(raw[struct.calcsize("<4sQQQ"):])
    assert payload == {"schema": STATE_SCHEMA, "state": {"version": 3, "planner": {"step": 7}}}
    assert CoordinatorState(tmp_path).load() == {"version": 3, "planner": {"step": 7}}


@pytest.mark.parametrize("saved", [{"schema": 99, "state": {}}, {"state": {}}, "not json"])
def test_a_state_of_another_schema_is_refused_naming_both(tmp_path, saved):
    payload = (json.dumps(saved) if not isinstance(saved, str) else saved).encode()
    header = struct.pack("<4sQQQ", b"RRBS", 1, len(payload), xxhash.xxh3_64_intdigest(payload))
    (tmp_path / "state.1").write_bytes(header + payload)
    with pytest.raises(ValueError, match=rf"schema {99 if isinstance(saved, dict) and 'schema' in saved else None}; "
                                         rf"this rayrb reads schema {STATE_SCHEMA}"):
        CoordinatorState(tmp_path).load()


def test_answers_kept_for_calls_made_again_are_plain_data_and_come_back_equal():
    plan = BatchPlan([Part("offline", 0, 3), Part("online", 1, 1)], 3, 1, fraction=0.75,
                     weights=ImportanceWeights(0.4, {"offline": 0.5, "online": 0.25}), last_of_epoch=True)
    group = GroupPlan([plan], reads=[("offline", 0), ("online", 1)],
                      args=[([3], [11], [Epoch(2, 5, 100, 40)], None), ([1], [12], [None], 17)], version=6, first=9)
    cache = ReplyCache()
    cache.put("c1", (4, 1, "s", 1), group)
    saved = json.loads(json.dumps(cache.items()))  # what the state file holds
    again = ReplyCache()
    again.load(saved)
    assert again.get("c1", (4, 1, "s", 1)) == group


def test_answers_saved_as_encoded_text_load_back_as_the_same_state(tmp_path):
    group = GroupPlan([BatchPlan([Part("offline", 0, 2)], 2, 0, fraction=1.0)], reads=[("offline", 0)],
                      args=[([2], [5], [None], None)], version=1, first=0)
    cache = ReplyCache(kept=2)
    for call in ("a", "b", "c"):  # "a" falls out: its text must leave with it
        cache.put(call, (2, 1, "s", 1), group)
    assert json.loads(cache.items_json()) == cache.items()
    s = CoordinatorState(tmp_path)
    s.save({"version": 3}, encoded={"answers": cache.items_json()})
    loaded = CoordinatorState(tmp_path).load()
    assert loaded == {"version": 3, "answers": cache.items()}
    again = ReplyCache()
    again.load(loaded["answers"])
    assert again.items_json() == cache.items_json() and again.get("c", (2, 1, "s", 1)) == group
    s.save({}, encoded={"answers": "[]"})
    assert s.load() == {"answers": []}


def test_answers_a_restart_finds_outlive_the_new_calls_of_many_handles():
    """Sixteen handles were mid-call when the coordinator died: after the restart their queued calls may all be
    answered before Ray re-sends the call whose reply was lost, which must still get its own answer."""
    from rayrb.durability.replies import KEPT_AFTER_RESTART

    before = ReplyCache(kept=2)
    for call in ("lost-1", "lost-2"):
        before.put(call, (16, 1, "s", 1), f"plan {call}")
    restarted = ReplyCache(kept=2)
    restarted.load(json.loads(before.items_json()))
    for i in range(16):
        restarted.put(f"queued-{i}", (16, 1, f"h{i}", 1), f"plan {i}")
    assert restarted.get("lost-1", (16, 1, "s", 1)) == "plan lost-1"
    assert restarted.get("lost-2", (16, 1, "s", 1)) == "plan lost-2"
    assert len(restarted.items()) == 4  # the two found, and the two newest answers
    assert restarted.get("queued-0", (16, 1, "h0", 1)) is None
    for i in range(16, KEPT_AFTER_RESTART):
        restarted.put(f"queued-{i}", (16, 1, f"h{i}", 1), f"plan {i}")
    assert restarted.get("lost-1", (16, 1, "s", 1)) is None  # then they go as any answer goes
    assert len(restarted.items()) == 2


def test_each_answer_is_saved_once_in_a_file_of_its_own_and_a_torn_one_is_planned_anew(tmp_path):
    """The state lists the calls; each answer is written once, when it is given, and removed when it falls out
    (a save after every plan call copied every kept answer: ~100 KB for eight groups of 60 batches)."""
    group = GroupPlan([BatchPlan([Part("offline", 0, 2)], 2, 0, fraction=1.0)], reads=[("offline", 0)],
                      args=[([2], [5], [None], None)], version=1, first=0)
    s, cache = CoordinatorState(tmp_path), ReplyCache(kept=2)
    written = []
    for call in ("a", "b", "learner-0/call-41"):
        cache.put(call, (2, 1, "s", 1), group)
        new, gone = cache.take_changes()
        written += [c for c, _ in new]
        for c, text in new:
            s.save_reply(c, text)
        for c in gone:
            s.drop_reply(c)
        s.save({"answers": cache.calls()})
    assert written == ["a", "b", "learner-0/call-41"]  # each once
    assert len(list((tmp_path / "replies").iterdir())) == 2  # "a" fell out, and its file with it
    saved = CoordinatorState(tmp_path).load()["answers"]
    assert saved == ["b", "learner-0/call-41"]
    path = s._reply_path("b")
    path.write_bytes(path.read_bytes()[:-3])  # torn
    assert s.load_reply("b") is None and json.loads(s.load_reply("learner-0/call-41"))[0] == "learner-0/call-41"
    s.clear()
    assert not (tmp_path / "replies").exists()
