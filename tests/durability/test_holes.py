"""Attacks on holes in the online write stream, write locality and ``online_nodes``: holes wider than a shard,
writes that wrap the circular buffer behind a hole, shards restarted or restored while a hole is open, sampling
while it is, fill levels under the writer's preference, and the option's edge cases. No Ray here."""
from __future__ import annotations

import numpy as np
import pytest

from rayrb.actors.online_shard import OnlineShard
from rayrb.core.allocation import assign_pieces
from rayrb.core.schema import RowSpec
from rayrb.durability.writelog import WriteLog

SPEC = RowSpec.from_arrays({"id": np.zeros(1, np.int64)}).to_json()


def _rows(ids):
    return {"id": np.asarray(ids, np.int64)}


def _send(shards, plan, ids, skip=()):
    for i, w in enumerate(plan):
        if i not in skip:
            shards[w.shard].extend(_rows(ids), w.start, w.stop, first=w.first)


def _resync(log, shards):
    counts, parked = zip(*(s.write_state() for s in shards))
    log.reset(list(counts), list(parked))


def _a_hole_then_a_write_behind_it(log, shard, n):
    """Write a (2 rows, ids 100..) lands, b (2 rows) never does, c (``n`` rows, ids 300..) lands behind the hole;
    then the log takes the shard's state."""
    for rows, base, lands in [(2, 100, True), (2, 200, False), (n, 300, True)]:
        plan = log.place(rows)
        log.commit(plan)
        if lands:
            _send([shard], plan, np.arange(base, base + rows))
    _resync(log, [shard])


# ------------------------------------------------------------------ holes across a wrap of the circular buffer
def test_a_write_after_a_hole_that_the_next_lap_wrapped_over_keeps_its_rows():
    """One shard of 8: a (2 rows) lands, b (2 rows) never does, c (8 rows) lands behind the hole and wraps over
    a's slots and b's. After the resync, the writes that follow are acknowledged with slots that hold their rows,
    not c's."""
    log, shard = WriteLog([8]), OnlineShard(SPEC, 8, "t/wrap")
    _a_hole_then_a_write_behind_it(log, shard, 8)
    for base in (400, 500, 600):
        plan = log.place(2)
        log.commit(plan)
        _send([shard], plan, [base, base + 1])
        rows = np.concatenate([np.arange(w.first, w.first + w.rows) for w in plan])
        at, gen = log.indices(plan), shard._gen[log.indices(plan)]
        assert np.all(gen >= rows // 8 + 1)  # never lost to an older row
        if np.all(gen == rows // 8 + 1):  # not evicted at once by a newer lap (the hole's rows are)
            assert shard._data["id"][at].tolist() == [base, base + 1], (base, shard._data["id"].tolist())
    assert shard._data["id"][log.indices(plan)].tolist() == [600, 601]  # the last write is in the buffer
    assert shard.written() == int(log.written[0]) and not shard._held


def test_a_piece_wider_than_the_shard_behind_a_hole_is_counted_when_the_hole_fills():
    """A write larger than the shard lands behind a hole (the shard keeps its tail). Filling the hole counts it:
    the count reaches the log's, and later writes are counted as they land."""
    log, shard = WriteLog([8]), OnlineShard(SPEC, 8, "t/wide")
    _a_hole_then_a_write_behind_it(log, shard, 16)
    while any(log.holes):
        plan = log.place(3)
        log.commit(plan)
        _send([shard], plan, [0, 0, 0])
    assert shard.written() == int(log.written[0]), (shard.written(), log.written, shard._held)
    plan = log.place(2)
    log.commit(plan)
    _send([shard], plan, [700, 701])
    assert shard.written() == int(log.written[0]) and not shard._held
    assert shard._data["id"][log.indices(plan)].tolist() == [700, 701]


# ------------------------------------------------------------------ sizes while a hole is open
def test_sizes_count_no_row_behind_a_hole():
    """Shard 0's first piece never landed, rows behind it did: the shard counts none of them, so the sizes the
    coordinator allocates with must not either (a draw from shard 0 would find no rows)."""
    log, shards = WriteLog([16, 16]), [OnlineShard(SPEC, 16, f"t/s{i}") for i in range(2)]
    plan = log.place(4)  # to shard 0
    log.commit(plan)
    plan = log.place(4)  # to shard 1
    log.commit(plan)
    _send(shards, plan, np.arange(4))
    plan = log.place(6)  # to shard 0, behind the piece that never landed
    log.commit(plan)
    _send(shards, plan, np.arange(6))
    _resync(log, shards)
    assert log.holes == [[(0, 4)], []]
    assert log.sizes.tolist() == [s.size() for s in shards] == [0, 4]
    plan = log.place(2)  # half the hole
    log.commit(plan)
    _send(shards, plan, [1, 2])
    assert log.sizes.tolist() == [s.size() for s in shards] == [2, 4]
    plan = log.place(2)  # the rest: the rows behind are counted
    log.commit(plan)
    _send(shards, plan, [3, 4])
    assert log.sizes.tolist() == [s.size() for s in shards] == [10, 4]


def test_the_coordinator_draws_only_from_counted_rows_and_reads_planned_behind_a_hole_are_not_behind_for_ever():
    """The coordinator's sizes and the write count its reads carry (a read made again, or a direct read, waits
    for the shard to reach it) are the counted rows, not the rows planned past a hole."""
    from rayrb.actors.coordinator import Coordinator

    shards = [OnlineShard(SPEC, 16, f"t/c{i}") for i in range(2)]
    c = Coordinator([object()], [100], shards, [16, 16], offline_fraction=0.0, seed=0)
    log = c._writing.log
    for n, shard, lands in [(4, 0, True), (4, 1, True), (4, 0, False), (4, 1, True), (6, 0, True)]:
        plan = log.place(n)
        assert [w.shard for w in plan] == [shard]
        log.commit(plan)
        if lands:
            _send(shards, plan, np.arange(n))
    _resync(log, shards)
    assert c.sizes()["online"] == [s.size() for s in shards] == [4, 8]
    group = c.plan(64, 1)
    assert sorted(group.reads) == [("online", 0), ("online", 1)]
    for (side, i), (counts, seeds, epochs, written) in zip(group.reads, group.args):
        out = shards[i].sample_many_tensors(counts, seeds, epochs, written=written)
        assert "behind" not in out and len(out["rows/id"]) == sum(counts), (i, written, shards[i].write_state())
        assert out["info/index"].max() < shards[i].size()


# ------------------------------------------------------------------ restarts and restores while a hole is open
def test_a_shard_restored_from_a_checkpoint_while_a_hole_is_open_counts_the_rows_behind_it_once_filled():
    """A shard's state saved with rows held behind a hole, loaded into a fresh shard: the resync finds them, the
    hole is filled, and the shard counts on to the log's count (its own, not stuck at the hole's end)."""
    log, shard = WriteLog([50]), OnlineShard(SPEC, 50, "t/ck")
    for n, lands in [(10, True), (5, False), (10, True)]:
        plan = log.place(n)
        log.commit(plan)
        if lands:
            _send([shard], plan, np.arange(n))
    restored = OnlineShard(SPEC, 50, "t/ck2")
    restored.load_state(shard.state())
    _resync(log, [restored])
    assert log.holes == [[(10, 15)]]
    plan = log.place(5)
    log.commit(plan)
    _send([restored], plan, np.arange(5))
    assert restored.write_state() == (25, []) and restored.size() == 25 == int(log.sizes[0])
    plan = log.place(3)
    log.commit(plan)
    _send([restored], plan, np.arange(3))
    assert restored.size() == 28 == int(log.sizes[0])


def test_holes_on_one_shard_filled_out_of_order_after_a_restart(tmp_path):
    """Two holes on one shard; the shard process dies; a resumed write fills the second hole first, then a new
    write the first: every row is counted, in order."""
    log, shard = WriteLog([100]), OnlineShard(SPEC, 100, "t/two", state_dir=str(tmp_path / "s"))
    ids = {}
    for w, (n, lands) in enumerate([(3, True), (4, False), (5, True), (6, False), (2, True)]):
        plan = log.place(n)
        log.commit(plan, write_id=w)
        ids[w] = np.arange(n) + 100 * w
        if lands:
            _send([shard], plan, ids[w])
    shard = OnlineShard(SPEC, 100, "t/two", state_dir=str(tmp_path / "s"))  # the process died
    _resync(log, [shard])
    assert log.holes == [[(3, 7), (12, 18)]] and shard.size() == 3
    whole, send = log.resume(3)  # goes back into its own hole, the second one
    assert [(w.first, w.rows) for w in send] == [(12, 6)]
    _send([shard], send, ids[3])
    assert shard.size() == 3 == int(log.sizes[0])
    plan = log.place(4)
    log.commit(plan)
    _send([shard], plan, [7, 7, 7, 7])
    assert shard.size() == 20 == int(log.sizes[0]) and log.holes == [[]]
    assert shard.gather(log.indices(whole))[0]["id"].tolist() == ids[3].tolist()


# ------------------------------------------------------------------ the randomized model on real shards
def _check_no_plan_over_held(landed, plan, ids, shards):
    """No row of ``plan`` is one a shard still holds for another write (one a newer lap took is free)."""
    for w in plan:
        s = shards[w.shard]
        for r in range(w.rows):
            row = w.first + r
            kept = landed.get((w.shard, row))
            if kept is not None and s._gen[row % s._capacity] == row // s._capacity + 1:
                assert kept == ids[w.start + r], ("planned over a held row", w, row, kept)


def _record(landed, plan, ids, shards):
    for w in plan:
        cap = shards[w.shard]._capacity
        for r in range(w.rows):
            row = w.first + r
            s = shards[w.shard]
            if s._gen[row % cap] == row // cap + 1 and s._data["id"][row % cap] == ids[w.start + r]:
                landed[(w.shard, row)] = ids[w.start + r]


def _shard_event(rng, shards, caps, dirs):
    """After a write a shard process may die and reopen its files, or a shard be restored: whether a resync follows."""
    event = rng.random()
    if 0.3 <= event < 0.4:  # a shard process dies and reopens its files
        i = int(rng.integers(len(shards)))
        shards[i] = OnlineShard(SPEC, caps[i], f"t/{i}", state_dir=dirs[i])
    elif 0.4 <= event < 0.5:  # a shard is restored from its saved state
        i = int(rng.integers(len(shards)))
        state = shards[i].state()
        shards[i] = OnlineShard(SPEC, caps[i], f"t/{i}", state_dir=dirs[i] + "-r")
        dirs[i] += "-r"
        shards[i].load_state(state)
    return event < 0.5


def _fill_holes(log, rng, next_id, ids, send):
    for extra in range(200):
        if not any(log.holes):
            break
        w = ("fill", extra)
        ids[w] = np.array([next(next_id) for _ in range(int(rng.integers(1, 10)))])
        plan = log.place(len(ids[w]))
        log.commit(plan)
        send(plan, w)


def _check_acknowledged_rows_kept(trial, shards, caps, acked, ids):
    """Each acknowledged row stays where its index says until a newer lap takes its slot; no row is held twice."""
    for w, (plan, indices) in acked.items():
        for p in plan:
            s, cap = shards[p.shard], caps[p.shard]
            for r in range(p.rows):
                row, slot = p.first + r, (p.first + r) % caps[p.shard]
                if s._gen[slot] == row // cap + 1:  # still there: it must be this write's row
                    assert s._data["id"][slot] == ids[w][p.start + r], (trial, w, p, r)
                else:  # taken by a newer lap, never lost to an older one
                    assert s._gen[slot] > row // cap + 1, (trial, w, p, r, s._gen.tolist())
    held = np.concatenate([s._data["id"][s._gen > 0] for s in shards])
    assert len(held) == len(set(held.tolist())), trial  # no row twice


def test_holes_wraps_restarts_and_restores_keep_every_acknowledged_row(tmp_path):
    """Small shards (writes wrap them, pieces wider than a shard), pieces that never land, resyncs, resumed
    writes, shard processes that die and shards restored from their saved state, writers that prefer a shard.
    Invariants: no row is planned over a row a shard holds; after each resync the sizes are the shards' own;
    each acknowledged row stays where its index says until a newer row takes the slot; once the holes are
    filled every shard counts what the log does, and no row is held twice."""
    rng = np.random.default_rng(7)
    next_id = iter(range(10 ** 9))
    for trial in range(60):
        k = int(rng.integers(1, 4))
        caps = [int(c) for c in rng.integers(3, 20, size=k)]
        log = WriteLog(caps)
        dirs = [str(tmp_path / f"{trial}-{i}") for i in range(k)]
        shards = [OnlineShard(SPEC, c, f"t/{i}", state_dir=d) for i, (c, d) in enumerate(zip(caps, dirs))]
        landed, acked, pending, ids = {}, {}, [], {}

        def send(plan, w, skip=()):
            _check_no_plan_over_held(landed, [p for i, p in enumerate(plan) if i not in skip], ids[w], shards)
            _send(shards, plan, ids[w], skip)
            _record(landed, [p for i, p in enumerate(plan) if i not in skip], ids[w], shards)

        def resync():
            _resync(log, shards)
            assert log.sizes.tolist() == [s.size() for s in shards], (trial, log.holes)

        for w in range(int(rng.integers(5, 25))):
            n = int(rng.integers(1, 2 * sum(caps) + 2))
            ids[w] = np.array([next(next_id) for _ in range(n)])
            local = {int(s) for s in rng.choice(k, size=int(rng.integers(0, k + 1)), replace=False)}
            plan = log.place(n, local)
            log.commit(plan, write_id=w)
            if rng.random() < 0.3:
                send(plan, w, skip={int(rng.integers(len(plan)))})
                pending.append(w)
            else:
                send(plan, w)
                acked[w] = (plan, log.indices(plan))
            if _shard_event(rng, shards, caps, dirs):
                resync()
            if pending and rng.random() < 0.3:  # a writer retries: its client resyncs first
                v = pending.pop(0)
                resync()
                whole, more = log.resume(v)
                send(more, v)
                acked[v] = (whole, log.indices(whole))
        resync()
        _fill_holes(log, rng, next_id, ids, send)  # new writes fill what holes are left
        assert not any(log.holes), trial
        for i, s in enumerate(shards):
            assert s.written() == int(log.written[i]) and not s._held, (trial, i, s.write_state(), log.written)
        assert log.sizes.tolist() == [s.size() for s in shards], trial
        _check_acknowledged_rows_kept(trial, shards, caps, acked, ids)


# ------------------------------------------------------------------ reset: malformed input changes nothing
@pytest.mark.parametrize("written, parked, match", [
    ([5], [[(3, 6)]], r"at or beyond its count \[5\]"),  # a run below the count
    ([5], [[(7, 7)]], r"got \[\[\(7, 7\)\]\]"),  # an empty run
    ([5], [[(9, 8)]], r"got \[\[\(8, 9\)\]\]|got \[\[\(9, 8\)\]\]"),  # reversed
    ([5], [[], []], r"runs"),  # one list per shard
    ([5, 1], None, r"expected 1 non-negative write counts, got \[5, 1\]"),
    ([-1], None, r"expected 1 non-negative write counts, got \[-1\]"),
])
def test_reset_with_malformed_counts_or_runs_is_refused_and_changes_nothing(written, parked, match):
    log = WriteLog([16])
    log.commit(log.plan([4]), "a")
    log.reset([2], [[(3, 4)]])
    before = (log.written.tolist(), [list(h) for h in log.holes], {k: set(v[3]) for k, v in log._ids.items()})
    with pytest.raises(ValueError, match=match):
        log.reset(written, parked)
    assert (log.written.tolist(), [list(h) for h in log.holes], {k: set(v[3]) for k, v in log._ids.items()}) == before


def test_reset_with_a_run_that_is_not_a_pair_names_what_it_expected():
    log = WriteLog([16])
    with pytest.raises(ValueError, match=r"expected per shard runs \[a, b\).*got"):
        log.reset([2], [[(3, 4, 5)]])
    assert log.written.tolist() == [0] and log.holes == [[]]


# ------------------------------------------------------------------ locality
def test_local_preference_with_one_shard_all_shards_local_and_no_slack():
    assert assign_pieces([5], [9], local={0}, slack=0) == [0]
    written = [7, 3, 3, 9]
    assert assign_pieces([4, 2, 1], written, local={0, 1, 2, 3}, slack=100) == assign_pieces([4, 2, 1], written)
    # slack 0 (shards under 8 rows): a local shard wins only a tie for the least written
    assert WriteLog([7, 7]).slack == 0
    assert assign_pieces([3], [2, 2], local={1}, slack=0) == [1]
    assert assign_pieces([3], [2, 3], local={1}, slack=0) == [0]


def test_fill_levels_stay_within_the_slack_and_one_piece_under_any_local_sets():
    """Writers of any size, each with a random set of local shards, tiny to large shards: the spread of write
    counts never exceeds the slack plus the largest piece written."""
    rng = np.random.default_rng(3)
    for trial in range(40):
        k = int(rng.integers(1, 6))
        log = WriteLog([int(rng.integers(1, 200))] * k)
        biggest = 0
        for _ in range(200):
            local = {int(s) for s in rng.choice(k, size=int(rng.integers(0, k + 1)), replace=False)}
            plan = log.place(int(rng.integers(1, 300)), local)
            log.commit(plan)
            biggest = max(biggest, *(w.rows for w in plan))
            assert log.written.max() - log.written.min() <= log.slack + biggest, (trial, log.written)


# ------------------------------------------------------------------ online_nodes
def test_online_nodes_that_name_no_node_need_no_cluster(monkeypatch):
    """A list of None places nothing: it is accepted without asking Ray for its nodes (Ray may not have started;
    the buffer starts it with its first actor)."""
    import ray

    from rayrb.actors.placement import online_nodes_option

    def no_cluster():
        raise RuntimeError("Ray has not been started yet")

    monkeypatch.setattr(ray, "nodes", no_cluster)
    assert online_nodes_option([None, None], 2, {}) == [None, None]
    assert online_nodes_option((None,), 1, {"scheduling_strategy": "SPREAD"}) == [None]


@pytest.mark.parametrize("nodes, error, match", [
    ({"a", "b"}, TypeError, "expected online_nodes as a list.*got set"),
    (b"ab", TypeError, r"node ids \(str\) or None in online_nodes, got \[97, 98\]"),
    ([], ValueError, r"one entry of online_nodes per online shard \(2\), got 0"),
    ([None, None, None], ValueError, r"per online shard \(2\), got 3"),
    ((n for n in ["a", "b"]), TypeError, "got generator"),
])
def test_online_nodes_of_the_wrong_shape_are_refused_before_ray_is_asked(monkeypatch, nodes, error, match):
    import ray

    from rayrb.actors.placement import online_nodes_option

    monkeypatch.setattr(ray, "nodes", lambda: pytest.fail("asked Ray before the shape was checked"))
    with pytest.raises(error, match=match):
        online_nodes_option(nodes, 2, {})


def test_on_node_asks_for_a_sliver_of_cpu_only_when_the_actor_asks_for_nothing():
    from rayrb.actors.placement import HINTED_CPUS, on_node

    node = "ab" * 28  # a node id's form
    assert on_node({"num_cpus": 0}, None) == {"num_cpus": 0}
    assert on_node({"num_cpus": 0}, node)["num_cpus"] == HINTED_CPUS
    assert on_node({"num_cpus": 2}, node)["num_cpus"] == 2
    assert "num_cpus" not in on_node({"num_gpus": 0.01}, node)
    assert on_node({"num_cpus": 0, "resources": {"x": 1}}, node)["num_cpus"] == 0
