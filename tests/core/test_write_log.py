"""The write log: slots, plans and commits, write identity, and writes resumed or left behind a hole. Nothing here
imports Ray."""
from __future__ import annotations

import numpy as np
import pytest
from write_model import ModelShard

from rayrb.core.allocation import cut_write, write_pieces
from rayrb.durability.writelog import WriteLog, slots

pytestmark = pytest.mark.usefixtures("local_metrics")


# ---------------------------------------------------------------------------------------------------------------
# The write log
# ---------------------------------------------------------------------------------------------------------------
def test_write_log_slots_wrap_around():
    assert slots(5, 4, 3).tolist() == [2, 0, 1, 2]
    log = WriteLog([3])
    plan = log.plan([5])
    assert plan[0].slots.tolist() == [0, 1, 2, 0, 1] and log.indices(plan).tolist() == [0, 1, 2, 0, 1]
    log.commit(plan)
    assert log.written.tolist() == [5] and log.sizes.tolist() == [3]
    (w,) = log.plan([2])
    assert (w.first, w.slots.tolist()) == (5, [2, 0])


@pytest.mark.parametrize("capacities", [[8, 8, 8, 8], [5, 11, 7]])
def test_write_log_keeps_fill_levels_within_one_piece_over_a_random_stream(capacities):
    rng = np.random.default_rng(0)
    log = WriteLog(capacities)
    largest = 0
    for _ in range(400):
        pieces = write_pieces(int(rng.integers(1, 200)), len(capacities), min_piece=16)
        largest = max(largest, int(pieces.max()))
        log.commit(log.plan(pieces.tolist()))
        assert log.written.max() - log.written.min() <= largest
    for _ in range(200):  # pieces of any sizes, as a client may cut them
        pieces = rng.integers(1, 30, int(rng.integers(1, len(capacities) + 1))).tolist()
        largest = max(largest, max(pieces))
        log.commit(log.plan(pieces))
        assert log.written.max() - log.written.min() <= largest


def test_write_log_global_indices_match_offsets_and_never_collide_among_held_rows():
    rng = np.random.default_rng(1)
    capacities = [6, 9, 4]
    log = WriteLog(capacities)
    assert log.offsets.tolist() == [0, 6, 15]
    held: dict[int, int] = {}  # global index -> the row written there last
    row = 0
    for _ in range(300):
        plan = log.plan(rng.integers(1, 5, int(rng.integers(1, 4))).tolist())
        idx = log.indices(plan)
        assert idx.size == sum(w.rows for w in plan) and [w.start for w in plan] == [0] + [w.stop for w in plan][:-1]
        for w in plan:
            assert np.all((w.slots >= 0) & (w.slots < capacities[w.shard]))
            np.testing.assert_array_equal(idx[w.start:w.stop], log.offsets[w.shard] + (w.first + np.arange(w.rows))
                                          % capacities[w.shard])
        log.commit(plan)
        for i in idx:
            held[int(i)] = row
            row += 1
        live = {i for i in held if any(o <= i < o + n for o, n in zip(log.offsets, log.sizes))}
        assert len(live) == int(log.sizes.sum()) == len(held)
    assert sorted(held) == list(range(sum(capacities)))


def test_write_log_plan_changes_nothing_and_commit_refuses_a_stale_plan_whole():
    log = WriteLog([4, 4])
    first, again = log.plan([3, 3]), log.plan([3, 3])
    assert log.written.tolist() == [0, 0] and log.state_dict() == {"written": [0, 0], "capacity": [4, 4]}
    assert [(w.shard, w.first, w.slots.tolist()) for w in first] == \
        [(w.shard, w.first, w.slots.tolist()) for w in again]
    log.commit(log.plan([2]))  # another write lands on shard 0 first
    with pytest.raises(RuntimeError, match="write to online shard 0 planned at row 0, but the shard is at row 2"):
        log.commit(first)
    assert log.written.tolist() == [2, 0]  # shard 1's piece was not applied either
    second = log.plan([3, 3])
    assert [w.shard for w in second] == [1, 0]
    log.reset([4, 0])  # shard 0 took a write the log missed: only the plan's second piece is stale
    with pytest.raises(RuntimeError, match="write to online shard 0 planned at row 2, but the shard is at row 4"):
        log.commit(second)
    assert log.written.tolist() == [4, 0]  # the first piece, to shard 1, was not applied
    with pytest.raises(ValueError, match="expected at most 2 pieces"):
        log.plan([1, 1, 1])
    with pytest.raises(ValueError, match="expected positive piece sizes, got \\[2, 0\\]"):
        log.plan([2, 0])
    with pytest.raises(ValueError, match="expected positive shard capacities"):
        WriteLog([4, 0])


def test_write_log_write_identity_returns_the_same_indices_and_receipt_until_forgotten():
    log = WriteLog([5, 5], remember=3)
    receipts = {}
    for name in "abcd":
        plan = log.plan([2])
        receipts[name] = (log.indices(plan), object())
        log.commit(plan, write_id=name, receipt=receipts[name][1])
    assert log.lookup("a") is None and log.lookup(None) is None
    for name in "bcd":
        indices, receipt = log.lookup(name)
        assert indices.tolist() == receipts[name][0].tolist() and receipt is receipts[name][1]
    written = log.written.tolist()
    log.commit([], write_id="empty")
    assert log.written.tolist() == written and log.lookup("b") is None and log.lookup("empty")[0].size == 0


def test_write_log_reset_takes_counts_only_of_the_right_shape():
    log = WriteLog([3, 3])
    for bad, shown in [([1], "\\[1\\]"), ([1, 2, 3], "\\[1, 2, 3\\]"), ([1, -1], "\\[1, -1\\]")]:
        with pytest.raises(ValueError, match=f"expected 2 non-negative write counts, got {shown}"):
            log.reset(bad)
        assert log.written.tolist() == [0, 0]
    counts = np.array([7, 2])
    log.reset(counts)
    counts[0] = 0
    assert log.written.tolist() == [7, 2] and log.sizes.tolist() == [3, 2]
    (w,) = log.plan([2])
    assert (w.shard, w.first, w.slots.tolist()) == (1, 2, [2, 0])


def test_resumed_writes_land_every_row_exactly_once():
    """Writes cut short (a coordinator dies between its sends; a shard fails one piece) are retried, in any
    order and between new writes, after the log took the shards' counts: every row is then held exactly once."""
    from rayrb.durability.writelog import WriteLog

    rng = np.random.default_rng(0)
    for trial in range(40):
        k = int(rng.integers(2, 5))
        log, shards, pending, rows = WriteLog([10 ** 6] * k), [ModelShard() for _ in range(k)], [], {}

        def send(w, pieces, skip=()):
            for i, piece in enumerate(pieces):
                if i not in skip:
                    shards[piece.shard].extend(piece.first, [(w, r) for r in range(piece.start, piece.stop)])

        for w in range(int(rng.integers(5, 30))):
            if pending and rng.random() < 0.3:  # a writer retries a write cut short earlier
                v = pending.pop(int(rng.integers(len(pending))))
                send(v, log.resume(v)[1])
            rows[w] = int(rng.integers(1, 4000))
            plan = log.plan(cut_write(rows[w], log.capacity))
            log.commit(plan, write_id=w)
            event = rng.random()
            if event < 0.2:  # the coordinator dies after sending some of the pieces; it restarts
                send(w, plan[:int(rng.integers(len(plan)))])
            elif event < 0.4:  # one shard fails its piece; the writer's client resyncs at once
                send(w, plan, skip={int(rng.integers(len(plan)))})
            else:
                send(w, plan)
                continue
            log.reset([s.written for s in shards])
            pending.append(w)
        for v in pending:
            send(v, log.resume(v)[1])
        held = sorted(r for s in shards for pos, r in s.rows.items() if pos < s.written)
        assert held == sorted({(w, r) for w, n in rows.items() for r in range(n)}), trial  # all, and once
        assert all(s.written == len(s.rows) and not s.ahead for s in shards), trial


def test_rows_written_behind_a_piece_that_never_lands_are_kept_and_counted_once_the_hole_is_filled():
    """A shard fails one piece for good while later writes land behind it (held, not counted); the writer of
    the failed write resyncs, and may retry or not. No acknowledged row is planned over, every one is counted
    once later writes fill the hole, and nothing lands twice."""
    from rayrb.durability.writelog import WriteLog

    rng = np.random.default_rng(1)
    for trial in range(40):
        k = int(rng.integers(1, 4))
        log, shards, acked, retry = WriteLog([10 ** 6] * k), [ModelShard() for _ in range(k)], {}, []

        def send(w, pieces, skip=()):
            for i, piece in enumerate(pieces):
                if i not in skip:
                    shards[piece.shard].extend(piece.first, [(w, r) for r in range(piece.start, piece.stop)])

        def resync():
            counts, parked = zip(*(s.write_state() for s in shards))
            log.reset(list(counts), list(parked))

        pending = {}  # writes whose piece failed: the later writes land behind it before anyone resyncs
        for w in range(int(rng.integers(10, 40))):
            n = int(rng.integers(1, 3000))
            plan = log.place(n)
            log.commit(plan, write_id=w)
            if rng.random() < 0.25:  # one piece fails for good; the write is not acknowledged
                send(w, plan, skip={int(rng.integers(len(plan)))})
                pending[w] = int(rng.integers(1, 4))  # the writer notices after this many more writes
            else:
                send(w, plan)
                acked[w] = n
            for v in [v for v in pending if pending[v] == 0]:
                del pending[v]
                resync()
                if rng.random() < 0.5:
                    retry.append(v)
            pending = {v: c - 1 for v, c in pending.items()}
            if retry and rng.random() < 0.3:
                v = retry.pop(0)
                send(v, log.resume(v)[1])
                acked[v] = sum(p.rows for p in log._ids[v][2])
        resync()
        for v in retry:
            send(v, log.resume(v)[1])
            acked[v] = sum(p.rows for p in log._ids[v][2])
        for extra in range(100):  # new writes fill what holes are left
            if not any(log.holes):
                break
            plan = log.place(int(rng.integers(1, 3000)))
            log.commit(plan)
            send(("fill", extra), plan)
        for s in shards:
            assert not s.ahead and s.written == len(s.rows), trial  # every held row is counted
        counted = [r for s in shards for pos, r in s.rows.items() if pos < s.written]
        assert len(counted) == len(set(counted)), trial  # nothing twice
        got = {r for r in counted if not isinstance(r[0], tuple)}
        for w, n in acked.items():
            assert {(w, r) for r in range(n)} <= got, (trial, w)  # every acknowledged row, counted
