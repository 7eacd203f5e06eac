"""Gathers that read rows from the files (rayrb.io.gather) return exactly what a copy out of the maps returns, and a
file cut short or failing under a live dataset is a ChunkError naming chunk and key, never a wrong row: through
io_uring and through the threads (where io_uring is refused), each test once with each."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from rayrb.errors import RowIndexError
from rayrb.io import gather, uring
from rayrb.io.chunks import ChunkDataset, ChunkError, write_dataset

ROWS = 301


@pytest.fixture(autouse=True, params=["ring", "threads"])
def engine(request, monkeypatch) -> str:
    """How cold batches are read in this test: through this thread's io_uring, or by the threads."""
    if request.param == "ring" and not uring.available():
        pytest.skip("io_uring is refused here")
    monkeypatch.setattr(gather, "USE_RING", request.param == "ring")
    return request.param


def columns(rows: int = ROWS) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"obs": rng.standard_normal((rows, 3), dtype=np.float32),
            "act": rng.integers(-2**40, 2**40, rows),  # int64, one value a row
            "img": rng.integers(0, 255, (rows, 5, 7), dtype=np.uint8),  # 35 bytes a row: rows straddle pages
            "q": rng.standard_normal((rows, 2, 2)),
            "done": rng.random(rows) < 0.5}


def dataset(tmp_path, chunk_rows: int | None) -> tuple[ChunkDataset, dict[str, np.ndarray]]:
    data = columns()
    return write_dataset(data, tmp_path / "ds", chunk_rows=chunk_rows), data


def evict(ds: ChunkDataset) -> None:
    """Take every chunk file out of the page cache (its clean pages that no process maps: no root needed)."""
    for path in ds.root.rglob("*.memmap"):
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


INDICES = {
    "random": lambda: np.random.default_rng(1).integers(0, ROWS, 500),
    "sorted": lambda: np.sort(np.random.default_rng(2).integers(0, ROWS, 200)),
    "repeats": lambda: np.array([5, 5, 300, 0, 5, 300, 150, 151, 150, 0]),
    "empty": lambda: np.zeros(0, np.int64),
    "all": lambda: np.arange(ROWS),
    "reversed": lambda: np.arange(ROWS)[::-1].copy(),
    "boundaries": lambda: np.array([6, 7, 13, 14, 20, 21, 299, 300, 0]),
}


@pytest.mark.parametrize("chunk_rows", [None, 7, 64])
@pytest.mark.parametrize("mode", ["read", "auto", "map"])
@pytest.mark.parametrize("name", sorted(INDICES))
def test_a_gather_returns_exactly_the_rows_a_take_returns(tmp_path, chunk_rows, mode, name):
    ds, data = dataset(tmp_path, chunk_rows)
    ds.reads = mode
    idx = INDICES[name]()
    evict(ds)
    got = ds.gather(idx)
    for k, v in data.items():
        want = np.take(v, idx, axis=0)
        assert got[k].dtype == want.dtype and got[k].shape == want.shape, k
        np.testing.assert_array_equal(got[k], want, err_msg=k)


def test_reads_into_a_callers_buffers_of_another_layout_and_with_small_requests(tmp_path):
    ds, data = dataset(tmp_path, 50)
    ds.reads = "read"
    idx = np.random.default_rng(3).integers(0, ROWS, 400)
    out = {k: np.empty((idx.size, *v.shape[1:]), v.dtype) for k, v in data.items()}
    out["obs"] = np.empty((3, idx.size), np.float32).T  # not C-contiguous: read elsewhere, then copied
    out["act"] = np.empty(idx.size, np.float64)  # another dtype: cast as a take into it would
    assert ds.gather(idx, out=out) is out
    for k, v in data.items():
        np.testing.assert_array_equal(out[k], np.take(v, idx, axis=0).astype(out[k].dtype), err_msg=k)
    # requests of a few bytes, few segments and no gaps, from three threads: the same rows
    cols = ds._columns(0)
    local = np.random.default_rng(4).integers(0, 50, 300)
    for max_gap, max_bytes, max_segments in [(0, 16, 1), (64, 40, 3), (1 << 20, 1 << 20, 500)]:
        reads = gather.ColdReads(threads=3, max_gap=max_gap, max_bytes=max_bytes, max_segments=max_segments)
        got = np.empty((local.size, 5, 7), np.uint8)
        reads.add(cols["img"], local, got)
        reads.run()
        np.testing.assert_array_equal(got, data["img"][local])


def test_the_plan_reads_each_row_once_within_its_limits():
    rng = np.random.default_rng(5)
    rows = np.concatenate([rng.integers(0, 20000, 3000), np.arange(500, 700)])  # scattered, and a run
    bounds = np.array([0, 333, 600, 601, 7000])  # five files, one of a single row
    p = gather.plan(rows, np.arange(rows.size), row_bytes=12, max_gap=48, max_bytes=256, max_segments=4,
                    bounds=bounds)
    got = np.full(rows.size, -1)
    for r, at, n in zip(p.rows, p.pos, p.lens):
        got[at:at + n] = np.arange(r, r + n)
    got[p.dup_to] = got[p.dup_from]
    np.testing.assert_array_equal(got, rows)
    assert sum(p.lens) == np.unique(rows).size  # each distinct row is read once
    assert 1 < len(p.starts) - 1 < len(p.lens)  # some requests hold several segments
    for q, (a, b) in enumerate(zip(p.starts[:-1], p.starts[1:])):
        assert 1 <= b - a <= 4
        file = np.searchsorted(bounds, [p.rows[a], p.rows[b - 1] + p.lens[b - 1] - 1], side="right") - 1
        assert file.tolist() == [p.files[q]] * 2  # a request reads one file
        assert (p.rows[b - 1] + p.lens[b - 1] - p.rows[a]) * 12 <= 256 + 12  # one window and its last row
        assert all((p.rows[s + 1] - p.rows[s] - p.lens[s]) * 12 <= 48 for s in range(a, b - 1))


@pytest.mark.parametrize("mode", ["read", "auto", "map"])
def test_a_file_cut_short_under_a_live_dataset_is_refused_naming_chunk_and_key(tmp_path, mode):
    ds, _ = dataset(tmp_path, 100)
    ds.reads = mode
    ds.gather(np.arange(ROWS))  # every chunk opened and mapped
    os.truncate(tmp_path / "ds" / "chunk-00001" / "img.memmap", 35 * 10)
    with pytest.raises(ChunkError, match=r"chunk chunk-00001: key 'img' expected 3500 bytes, its file holds 350"):
        ds.gather(np.array([150]))
    np.testing.assert_array_equal(ds.gather(np.array([3]))["img"], columns()["img"][[3]])  # other chunks still read


def test_a_file_cut_after_the_size_check_is_a_chunk_error_not_a_wrong_row(tmp_path, monkeypatch):
    ds, _ = dataset(tmp_path, None)
    ds.reads = "read"
    ds.gather(np.array([0]))
    os.truncate(tmp_path / "ds" / "chunk-00000" / "q.memmap", 32 * 100)
    monkeypatch.setattr(gather.ColumnFile, "size_now", lambda self: self.nbytes)  # cut between check and read
    # rows 7 and 200 are near enough to share one request, which ends early
    with pytest.raises(ChunkError, match=r"chunk chunk-00000: key 'q': expected 9632 bytes in its file, reading 6208 "
                                         r"bytes at offset 224 found the end after 2976: the file was changed"):
        ds.gather(np.array([7, 200]))


def test_a_read_error_is_a_chunk_error_naming_chunk_and_key(tmp_path, monkeypatch):
    ds, _ = dataset(tmp_path, 100)
    ds.reads = "read"
    real, real_ring = gather._preadv, uring.Ring.read

    def obs(fd: int) -> bool:
        return os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) == "obs.memmap"

    def failing(fd, bufs, offset):
        if obs(fd):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, bufs, offset)

    def failing_ring(self, fds, *args):  # the kernel's answer for a request that failed: -errno
        got = real_ring(self, fds, *args)
        got[[obs(int(fd)) for fd in fds]] = -errno.EIO
        return got

    monkeypatch.setattr(gather, "_preadv", failing)
    monkeypatch.setattr(uring.Ring, "read", failing_ring)
    with pytest.raises(ChunkError, match=r"chunk chunk-0000[0-3]: key 'obs': expected to read \d+ bytes at offset "
                                         r"\d+, the read failed: \[Errno 5\] Input/output error"):
        ds.gather(np.arange(0, ROWS, 3))


def test_a_file_replaced_under_a_live_dataset_still_gives_the_rows_it_opened(tmp_path):
    ds, data = dataset(tmp_path, None)
    ds.gather(np.array([0]))
    path = tmp_path / "ds" / "chunk-00000" / "obs.memmap"
    (tmp_path / "other").write_bytes(np.ones_like(data["obs"]).tobytes())
    os.replace(tmp_path / "other", path)
    for mode in ("read", "map", "auto"):
        ds.reads = mode
        np.testing.assert_array_equal(ds.gather(np.arange(ROWS))["obs"], data["obs"])


def test_auto_reads_a_cold_batch_and_copies_a_cached_one(tmp_path, monkeypatch):
    ds, data = dataset(tmp_path, None)
    made = []
    real = gather.ColdReads.run
    monkeypatch.setattr(gather.ColdReads, "run", lambda self: (made.append(len(self._jobs)), real(self))[1])
    idx = np.random.default_rng(6).integers(0, ROWS, 64)
    ds._columns(0)  # opens the files (pages copied out of a map stay mapped, out of an eviction's reach)
    evict(ds)
    got = ds.gather(idx)
    assert made == [len(data)], "a batch out of the page cache is read, each key's file once"
    again = ds.gather(idx)  # its pages now cached: out of the maps
    assert made == [len(data)]
    # the page cache dropped (its pages are mapped here now: out of an eviction's reach, so the lookup says so):
    # seen within TRUST + 1 batches, sooner if a copy was slow
    monkeypatch.setattr(gather.ColumnFile, "resident", lambda self, rows: False)
    for _ in range(gather.TRUST + 1):
        ds.gather(idx)
    assert len(made) == 2, made
    for k, v in data.items():
        np.testing.assert_array_equal(got[k], v[idx])
        np.testing.assert_array_equal(again[k], v[idx])


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")
def test_after_the_page_cache_is_dropped_the_same_rows_come(tmp_path):
    ds, data = dataset(tmp_path, 64)
    idx = np.random.default_rng(7).integers(0, ROWS, 1000)
    ds.reads = "read"  # pages read, not mapped here: a mapped page would stay through the drop
    warm = ds.gather(idx)
    ds.reads = "auto"
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1")
    assert not ds._columns(0)["q"].resident(list(range(64))), "expected the page cache dropped"
    cold = ds.gather(idx)
    for k in data:
        np.testing.assert_array_equal(cold[k], warm[k])


def test_an_unknown_read_mode_is_refused(tmp_path):
    ds, _ = dataset(tmp_path, None)
    with pytest.raises(ValueError, match=r"reads must be one of \('auto', 'map', 'read'\), got 'mmap'"):
        ds.reads = "mmap"


def test_a_ring_that_fails_leaves_the_batch_to_the_threads(tmp_path, monkeypatch, engine):
    if engine != "ring":
        pytest.skip("the ring's own failure")
    ds, data = dataset(tmp_path, 64)
    ds.reads = "read"
    entered = []

    def broken(self, submit, wait):  # the first call submits, then fails: what the kernel took is waited for
        entered.append(submit)
        if len(entered) == 1:
            real_enter(self, submit, 0)
            raise uring.RingError(errno.ENOMEM, "io_uring_enter: out of memory")
        return real_enter(self, submit, wait)

    real_enter = uring.Ring._enter
    monkeypatch.setattr(uring.Ring, "_enter", broken)
    idx = np.random.default_rng(8).integers(0, ROWS, 300)
    got = ds.gather(idx)
    assert len(entered) >= 2, "expected the requests in flight waited for after the failure"
    for k, v in data.items():
        np.testing.assert_array_equal(got[k], v[idx], err_msg=k)


@pytest.mark.parametrize("chunk_rows", [None, 64])
@pytest.mark.parametrize("bad", [ROWS, ROWS + 40, -1])
def test_an_unchecked_index_out_of_range_is_an_error_not_a_clipped_row(tmp_path, bad, chunk_rows):
    ds, _ = dataset(tmp_path, chunk_rows)
    ds.reads = "map"  # copied out of the maps, where a clipped index would be a wrong row
    with pytest.raises(RowIndexError, match=r"expected row indices in \[0, 301\)"):
        ds.gather(np.array([0, bad, 5]), checked=False)
