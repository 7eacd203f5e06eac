"""Appends to an online shard's files by several processes on its node (``rayrb.durability.appends``): each lands
once at the write count, a process killed midway leaves the shard as it was (its undo record put back by the next
lock holder, its journal line dropped), a store that raises changes nothing, retries are answered from the shared
journal, and the count is published in the coordinator's counts map. No Ray."""
from __future__ import annotations

import multiprocessing
import os
import signal

import numpy as np
import pytest

from rayrb.core.schema import RowSpec
from rayrb.durability.appends import UNDO_ROWS, Appender, attach
from rayrb.durability.published import CountsMap
from rayrb.durability.storage import OnlineStorage, whole
from rayrb.durability.write_ids import FILE as JOURNAL

SPEC = RowSpec.from_arrays({"id": np.zeros(1, np.int64), "obs": np.zeros((1, 3), np.float32)})
CAPACITY = 32


def rows(first: int, n: int) -> dict[str, np.ndarray]:
    ids = np.arange(first, first + n, dtype=np.int64)
    return {"id": ids, "obs": np.repeat(ids[:, None], 3, axis=1).astype(np.float32)}


def shard(d) -> Appender:
    return Appender(OnlineStorage(SPEC, CAPACITY, d))


def held(app: Appender) -> dict[int, int]:
    """slot -> row id of every whole slot, each row checked whole (its keys agree)."""
    s = app.storage
    out = {}
    for slot in range(CAPACITY):
        if s.generation[slot] > 0:
            assert (s.rows["obs"][slot] == s.rows["id"][slot]).all(), f"slot {slot} torn"
            out[slot] = int(s.rows["id"][slot])
    return out


class _Killed:
    """A key's memory map whose next store kills its process: a crash between an append's per-key copies."""

    def __init__(self, mapped: np.ndarray):
        self._mapped = mapped

    def __getitem__(self, key):
        return self._mapped[key]

    def __setitem__(self, key, value):
        os.kill(os.getpid(), signal.SIGKILL)


def _append_and_die(directory: str, first_id: int, n: int) -> None:
    app = attach(SPEC, CAPACITY, directory)
    app.storage.rows["obs"] = _Killed(app.storage.rows["obs"])  # "id" is copied, then the process dies before "obs"
    app.append(rows(first_id, n), "dies", digest="d")


def _run(target, *args) -> int:
    p = multiprocessing.get_context("spawn").Process(target=target, args=args)
    p.start()
    p.join(120)
    return p.exitcode


@pytest.mark.parametrize("filled", [10, CAPACITY + 20])  # the slots it goes to: empty, or holding live rows
def test_a_writer_killed_between_its_per_key_copies_leaves_the_shard_as_it_was(tmp_path, filled):
    app = shard(tmp_path)
    app.append(rows(0, filled), "first")
    before = held(app)
    assert _run(_append_and_die, str(tmp_path), 1000, 8) == -signal.SIGKILL
    torn = app.storage.generation[(filled + np.arange(8)) % CAPACITY]
    assert not whole(torn)  # as the crash left them, until a lock holder puts them back
    with app.locked():
        pass  # taking the lock puts the dead append back
    assert app.storage.written == filled and held(app) == before
    again = app.append(rows(1000, 8), "dies", digest="d")  # its retry: placed anew, once, at the same count
    assert not again.answered and again.written == filled + 8
    assert sorted(held(app).values()).count(1000) == 1


def test_appends_from_processes_in_turn_all_land_once_and_the_journal_answers_each_from_any(tmp_path):
    app = shard(tmp_path)
    other = attach(SPEC, CAPACITY, tmp_path)
    for i in range(12):  # wrapping the shard: slots are reused
        (app if i % 2 else other).append(rows(100 * i, 5), f"w{i}", digest=str(i))
    assert app.storage.written == 60 and other.storage.written == 60
    assert sorted(held(app).values()) == sorted([100 * i + j for i in range(12) for j in range(5)][-CAPACITY:])
    retry = app.append(rows(1100, 5), "w11", digest="11")  # written by the other process: answered here
    assert retry.answered and retry.written == 60
    assert retry.slots.tolist() == [(55 + j) % CAPACITY for j in range(5)]


def _append_many(directory: str, writer: int, n: int) -> None:
    app = attach(SPEC, 4096, directory)
    for i in range(n):
        app.append(rows(writer * 100_000 + i * 3, 3), f"{writer}-{i}")


def test_two_processes_appending_at_once_never_share_a_slot(tmp_path):
    app = Appender(OnlineStorage(SPEC, 4096, tmp_path))
    procs = [multiprocessing.get_context("spawn").Process(target=_append_many, args=(str(tmp_path), w, 150))
             for w in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    s = app.storage
    assert s.written == 900 and (s.generation[:900] == 1).all()
    ids = s.rows["id"][:900]
    assert len(set(ids.tolist())) == 900 and (s.rows["obs"][:900] == ids[:, None]).all()


def test_a_store_that_raises_midway_changes_nothing_and_its_id_is_free_again(tmp_path):
    app = shard(tmp_path)
    app.append(rows(0, CAPACITY), "full")
    before = held(app)

    def store(r, first, n):  # copies one key, then fails, as a full disk would
        w = first + np.arange(n)
        app.storage.generation[w % CAPACITY] = -(w // CAPACITY + 1)
        app.storage.rows["id"][w % CAPACITY] = r["id"]
        raise OSError("no space left")

    with pytest.raises(OSError, match="no space"):
        app.append(rows(500, 4), "fails", store=store)
    assert app.storage.written == CAPACITY and held(app) == before
    assert not app.append(rows(500, 4), "fails").answered  # placed, not answered from a line that never counted


def test_a_journal_line_torn_by_a_killed_writer_is_closed_and_the_next_is_read_by_every_process(tmp_path):
    app = shard(tmp_path)
    app.append(rows(0, 4), "a")
    with open(tmp_path / JOURNAL, "a") as f:
        f.write('["half",0,4,')  # a writer killed mid-line
    other = attach(SPEC, CAPACITY, tmp_path)
    other.append(rows(10, 4), "b", digest="b")
    assert app.append(rows(10, 4), "b", digest="b").answered  # the line after the torn one is read whole
    assert (tmp_path / JOURNAL).read_text().splitlines()[-1].startswith('["b",0,4,4,0')


def test_the_count_is_published_in_the_counts_map_after_the_rows(tmp_path):
    counts = CountsMap.open(tmp_path / "version", shards=3, create=True)
    app = Appender(OnlineStorage(SPEC, CAPACITY, tmp_path / "on-1"), publish=lambda w: counts.publish(1, w))
    app.append(rows(0, 5), "a")
    assert app.append(rows(0, 5), "a").answered  # a retry: answered, nothing published
    app.append(rows(5, 2), "b")
    assert counts.changes().tolist() == [0, 2, 0] and counts.written().tolist() == [0, 7, 0]


def test_a_write_larger_than_the_undo_record_goes_unrecorded_and_lands_whole(tmp_path):
    app = Appender(OnlineStorage(SPEC, UNDO_ROWS + 8, tmp_path))
    done = app.append({k: np.concatenate([v] * 2) for k, v in rows(0, UNDO_ROWS // 2 + 4).items()}, "big")
    assert done.written == UNDO_ROWS + 8 and whole(app.storage.generation)


def test_files_of_another_layout_are_not_attached(tmp_path):
    shard(tmp_path)
    assert attach(SPEC, CAPACITY + 1, tmp_path) is None
    assert attach(RowSpec.from_arrays({"id": np.zeros(1, np.int64)}), CAPACITY, tmp_path) is None
    assert attach(SPEC, CAPACITY, tmp_path / "missing") is None
