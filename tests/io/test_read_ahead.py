"""Reading ahead (rayrb.io.read_ahead): the rows of batches planned next are put in the page cache by hints that
change no row, start only once a batch was found cold, stop while the data is cached, never block the caller beyond
a few waiting, and never fail where the batch's own gather would report the fault."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
from test_cold_gather import ROWS, dataset, evict

from rayrb.core.plans import Epoch
from rayrb.handle.local import LOCAL_KINDS, OfflineReader
from rayrb.io import read_ahead
from rayrb.io.chunks import ChunkError, write_dataset


def wait_hints(ds, timeout: float = 10.0) -> None:
    """Until the hint thread has nothing of ``ds`` waiting."""
    deadline = time.monotonic() + timeout
    while ds._ahead._pending and time.monotonic() < deadline:
        time.sleep(0.005)
    assert ds._ahead._pending == 0, "hints still waiting"


def resident(ds, rows) -> bool:
    return all(col.resident([int(r)]) for col in ds._columns(0).values() for r in rows)


def test_ranges_join_near_rows_and_cover_each_once():
    offsets, lengths = read_ahead.ranges(np.array([50, 0, 3, 3, 1000]), row_bytes=100, max_gap=250)
    assert offsets.tolist() == [0, 5000, 100_000] and lengths.tolist() == [400, 100, 100]
    assert [a.size for a in read_ahead.ranges(np.zeros(0, np.int64), 8)] == [0, 0]


def test_a_hint_puts_cold_rows_in_the_page_cache_without_a_gather(tmp_path):
    ds, _ = dataset(tmp_path, None)
    ds._columns(0)
    evict(ds)
    idx = np.random.default_rng(0).choice(ROWS, 40, replace=False)
    if resident(ds, idx):
        pytest.skip("this file system keeps the files cached through POSIX_FADV_DONTNEED")
    assert ds.read_ahead(idx) is None, "no hint before any batch was found cold"
    ds.gather(idx[:5])  # found cold: hints wanted
    assert ds.ahead_wanted
    evict(ds)
    assert ds.read_ahead(idx) is True
    wait_hints(ds)
    deadline = time.monotonic() + 5
    while not resident(ds, idx) and time.monotonic() < deadline:  # the kernel's reads, queued by the hint
        time.sleep(0.01)
    assert resident(ds, idx)
    assert ds._ahead.stats["hints"] == 1 and ds._ahead.stats["requests"] >= 1


def test_hints_stop_while_the_rows_are_cached_and_start_again_when_a_batch_is_cold(tmp_path, monkeypatch):
    ds, _ = dataset(tmp_path, 64)
    idx = np.arange(0, ROWS, 3)
    ds.reads = "read"
    ds.gather(idx)  # found cold ("read": every batch), and its rows cached now
    ds.reads = "auto"
    for _ in range(read_ahead.WARM_HINTS):
        assert ds.read_ahead(idx) is True
        wait_hints(ds)
    assert not ds.ahead_wanted and ds._ahead.stats["cached"] == read_ahead.WARM_HINTS
    assert ds.read_ahead(idx) is None
    ds.gather(idx)  # after hints: read from the files, not looked up
    monkeypatch.setattr(type(ds._columns(0)["obs"]), "resident", lambda self, rows: False)
    ds.gather(idx)  # looked up and found cold
    assert ds.ahead_wanted and ds.read_ahead(idx) is True
    wait_hints(ds)
    assert ds._ahead.stats["hints"] == 1


def test_a_gather_after_a_hint_looks_every_row_up(tmp_path, monkeypatch):
    from rayrb.io import gather

    ds, data = dataset(tmp_path, None)
    idx = np.arange(0, ROWS, 2)
    ds.gather(idx)
    ds.gather(idx)  # cached now, and found so
    made, looked_up = [], []
    real_run, real_resident = gather.ColdReads.run, gather.ColumnFile.resident
    monkeypatch.setattr(gather.ColdReads, "run", lambda self: (made.append(1), real_run(self))[1])
    monkeypatch.setattr(gather.ColumnFile, "resident",
                        lambda self, rows: (looked_up.append(len(rows)), real_resident(self, rows))[1])
    ds._ahead.found_cold()
    assert ds.read_ahead(idx) is True
    wait_hints(ds)
    looked_up.clear()
    ds.gather(idx)  # after a hint: every row looked up; all cached, so copied out of the maps
    assert made == [] and sum(looked_up) == len(data) * idx.size
    monkeypatch.setattr(gather.ColumnFile, "resident", lambda self, rows: int(idx[-1]) not in rows)  # one on its way
    assert ds.read_ahead(idx) is True
    wait_hints(ds)
    got = ds.gather(idx)  # one row not cached: the batch is read, not faulted in
    assert made == [1]
    for k, v in data.items():
        np.testing.assert_array_equal(got[k], v[idx])


def test_map_mode_never_hints(tmp_path):
    ds, _ = dataset(tmp_path, None)
    ds.reads = "read"
    ds.gather(np.arange(10))
    ds.reads = "map"
    assert not ds.ahead_wanted and ds.read_ahead(np.arange(10)) is None


def test_a_caller_ahead_of_the_disk_drops_hints_and_never_waits(tmp_path, monkeypatch):
    ds, _ = dataset(tmp_path, None)
    ds._ahead.found_cold()
    gate = __import__("threading").Event()
    monkeypatch.setattr(read_ahead, "will_need", lambda *a: gate.wait(10) and 0)
    monkeypatch.setattr(read_ahead, "_sampled_rows_cached", lambda *a: False)
    t0 = time.monotonic()
    queued = [ds.read_ahead(np.arange(5)) for _ in range(read_ahead.MAX_PENDING + 3)]
    assert time.monotonic() - t0 < 5  # far less: the hints run on their thread
    assert queued == [True] * read_ahead.MAX_PENDING + [False] * 3
    assert ds._ahead.stats["dropped"] == 3
    gate.set()
    wait_hints(ds)
    assert ds.read_ahead(np.arange(5)) is True  # room again
    wait_hints(ds)


def test_a_hint_over_a_file_cut_short_is_dropped_and_the_gather_reports_it(tmp_path):
    ds, data = dataset(tmp_path, None)
    ds._ahead.found_cold()
    path = next(ds.root.rglob("obs.memmap"))
    os.truncate(path, path.stat().st_size // 2)
    assert ds.read_ahead(np.arange(ROWS)) is None  # the size check before any hint: nothing queued
    with pytest.raises(ChunkError, match="obs"):
        ds.gather(np.arange(ROWS))


def test_a_hint_that_fails_on_its_thread_is_counted_and_changes_nothing(tmp_path, monkeypatch):
    ds, data = dataset(tmp_path, None)
    ds._ahead.found_cold()

    def broken(*a):
        raise OSError(5, "Input/output error")

    ds._columns(0)  # opened (and advised random) before every advice fails
    monkeypatch.setattr(read_ahead, "_sampled_rows_cached", lambda *a: False)
    monkeypatch.setattr(read_ahead.os, "posix_fadvise", broken)
    assert ds.read_ahead(np.arange(ROWS)) is True
    wait_hints(ds)
    assert ds._ahead.stats["failed"] == 1
    monkeypatch.undo()
    np.testing.assert_array_equal(ds.gather(np.arange(ROWS))["obs"], data["obs"])


@pytest.mark.parametrize("sampler", LOCAL_KINDS)
def test_a_local_reader_hints_exactly_the_rows_its_read_then_gathers(tmp_path, sampler, monkeypatch):
    n = 400
    ids = np.repeat(np.arange(n // 8), 8)  # episodes of 8 steps, for the slice samplers
    root = tmp_path / "ds"
    write_dataset({"x": np.arange(n, dtype=np.int64), "episode": ids}, root, chunk_rows=128)
    options = {"slice_len": 4, "slice_key": "episode"} if sampler.startswith("slice") else {}
    reader = OfflineReader(str(root), 100, 300, sampler, options)  # a shard of rows [100, 300)
    reader._ds._ahead.found_cold()
    hinted = []
    monkeypatch.setattr(reader._ds._ahead, "hint", lambda cols, idx, starts: hinted.append(idx.copy()) or True)
    epochs = [Epoch(0, 7, 200 if sampler == "without_replacement" else 50, 0)] if "without" in sampler else None
    args = ([16], [12345], epochs, None)
    assert reader.read_ahead(*args) is True
    out = {"x": np.empty(16, np.int64), "episode": np.empty(16, np.int64)}
    assert reader.read(*args, out=out) is not None
    np.testing.assert_array_equal(hinted[0], out["x"])  # row i holds x == i: the hint named the rows read
    assert ((out["x"] >= 100) & (out["x"] < 300)).all()


def test_a_dataset_not_read_yet_still_pickles_and_its_copy_hints_afresh(tmp_path):
    import pickle

    ds, data = dataset(tmp_path, None)
    ds._ahead.found_cold()
    copy = pickle.loads(pickle.dumps(ds))
    assert not copy.ahead_wanted
    np.testing.assert_array_equal(copy.gather(np.arange(ROWS))["obs"], data["obs"])
