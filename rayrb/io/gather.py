"""Gathering rows of mapped column files: page-cache hits copied out of the map, other rows read with many requests
in flight.

A random row outside the page cache costs a page fault when it is copied out of a map, and one thread takes its
faults one at a time: a batch of ``B`` cold rows waits ``B`` disk latencies in turn, at queue depth 1. Here a
batch's cold rows are instead read with every request in flight at once, so the disk works at its random-read
limit: through the calling thread's io_uring (``rayrb.io.uring``, one system call to send them all, one to reap),
or, where the kernel refuses it, with ``preadv`` from a small thread pool (the GIL released in each call; up to
``threads`` in flight).

The reads of one key are planned (``plan``) before any is made, over all the chunks' files a batch touches: the rows are sorted by offset and read once
each (a repeat is copied from its first copy afterwards); rows that follow each other on disk and in the batch
form one segment (one buffer); segments at most ``max_gap`` bytes apart share a request, the gap read into a
scratch buffer, so that near rows cost one request, not several. A request covers at most about ``max_bytes``, so
that a long run of rows is spread over the threads. The rows land straight in the batch's buffer.

Whether a batch is read or copied out of the maps is decided per batch (``ReadPolicy``): ``resident`` asks
``mincore`` whether a few of its rows are in the page cache (one call a row, about a microsecond); if all are, the
batch is copied out of the maps as before (a read per row would cost more than the copy), else every row is read
(a cached row read costs a system call and a copy, far less than a fault's wait).

A file cut short under its readers gives ``ChunkError`` naming its chunk and key, never a wrong row and never
SIGBUS: a read past the end returns fewer bytes, which is refused.
"""
from __future__ import annotations

import bisect
import ctypes
import errno
import mmap
import os
import stat
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rayrb.errors import ChunkError, InvalidArgumentError
from rayrb.io import descriptors, uring
from rayrb.io.threads import ProcessThreads

PAGE = mmap.PAGESIZE
READ_THREADS = 32  # requests in flight: this machine's disk serves 4 KiB random reads fastest at depth 8 to 64
# Two rows at most this far apart are read by one request: at 42K random reads/s and 1.4 GiB/s in order (this
# machine's disk, docs/benchmarks.md) a request costs as much time as reading some 35 KiB.
MAX_GAP = 16 << 10
MAX_REQUEST = 1 << 20  # bytes a request covers at most, so that a long run is read by several threads
MAX_SEGMENTS = 500  # segments a request holds at most: with the gaps' buffers, within IOV_MAX (1024 on Linux)
USE_RING = True  # False: every cold batch is read by the threads, as where io_uring is refused (benchmarks compare)
SAMPLE = 4  # rows of a batch whose pages are looked up to tell a cached batch from a cold one
MODES = ("auto", "map", "read")
TRUST = 7  # batches copied out of the maps unlooked-up after a fast copy: a turn to cold is seen within 8 batches
# A copy slower than this a row took page faults (one costs 25 us or more at any queue depth here); cached rows copy
# far faster (0.1 us for 256 B rows, under 17 us for 28 KiB rows with the batch's allocation, docs/benchmarks.md).
FAULT_S = 20e-6

_libc = ctypes.CDLL(None, use_errno=True)
_mincore = _libc.mincore
_mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_mincore.restype = ctypes.c_int
_preadv = os.preadv  # module-level, so that tests can make it fail
_readers = ProcessThreads("rayrb-read")


class ColumnFile:
    """One key's file in one chunk: an open descriptor and a read-only map of the same file (so both always see
    the same inode), ``rows`` rows of ``shape[1:]`` ``dtype`` each. ``label`` names it in errors."""

    def __init__(self, path: str | os.PathLike, shape: tuple[int, ...], dtype: np.dtype, label: str):
        self.label, self.shape, self.dtype = label, tuple(shape), np.dtype(dtype)
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * self.dtype.itemsize
        self.row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * self.dtype.itemsize
        self.fd, self.map = -1, None
        if self.nbytes == 0:  # nothing to map (a zero-width key may have no file)
            self.array = np.zeros(shape, self.dtype)
            return
        try:
            descriptors.make_room(2)
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            info = os.fstat(self.fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size < self.nbytes:
                raise ChunkError(f"{label}: expected a file of {self.nbytes} bytes at {path}, found "
                                 f"{info.st_size if stat.S_ISREG(info.st_mode) else 'no plain file'}")
            self.map = mmap.mmap(self.fd, self.nbytes, access=mmap.ACCESS_READ)
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead for this descriptor's reads
        except OSError as e:
            self.close()
            if e.errno == errno.EMFILE:
                raise ChunkError(descriptors.too_many(label)) from None
            raise ChunkError(f"{label}: expected a readable file at {path}, got {e}") from None
        except ChunkError:
            self.close()
            raise
        self.array = np.frombuffer(self.map, self.dtype).reshape(shape)
        self._address = self.array.ctypes.data  # page-aligned: the map starts at offset 0
        self._vec = ctypes.create_string_buffer(self.row_bytes // PAGE + 2)  # mincore's answer: a byte a page
        descriptors.held(2)  # this descriptor and the map's own
        weakref.finalize(self, _closed, self.fd)

    def close(self) -> None:
        if self.fd >= 0 and self.map is None:  # opened, never mapped: no finalizer closes it
            os.close(self.fd)
            self.fd = -1

    def size_now(self) -> int:
        """The file's size now (one ``fstat``): shorter than ``nbytes`` once cut short under its map."""
        return self.map.size() if self.map is not None else self.nbytes  # the map's own descriptor: this file

    def resident(self, rows: list[int]) -> bool:
        """True when every page of each of ``rows`` is in the page cache (one ``mincore`` call a row, about a
        microsecond: this is on every batch's path)."""
        if self.fd < 0:
            return True
        vec, rb, address = self._vec, self.row_bytes, self._address
        for r in rows:
            start = r * rb
            first = start - start % PAGE
            if _mincore(address + first, start + rb - first, vec) != 0:
                return False  # the range is not mapped: let the reads report what is wrong
            if not vec[0][0] & 1 or (start + rb - first > PAGE
                                     and not all(b & 1 for b in vec.raw[:-(-(start + rb - first) // PAGE)])):
                return False
        return True


class ReadPolicy:
    """Whether a batch is read from the files or copied out of the maps: ``mode`` ``"read"`` or ``"map"`` always,
    ``"auto"`` by the page cache. One of ``SAMPLE`` rows spread over the batch with a page outside the page cache
    makes it read. After a cached batch one row is looked up, not ``SAMPLE``, and after a fast copy none for
    ``TRUST`` batches: the lookups (about a microsecond each) would cost a small cached batch's copy several per
    cent. A copy that took page faults' time (``FAULT_S`` a row) has the next batch looked up again."""

    def __init__(self, mode: str = "auto"):
        self.mode, self._last_cached, self._trusted, self._looked_up = "auto", False, 0, False
        self.set_mode(mode)

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise InvalidArgumentError(f"reads must be one of {MODES}, got {mode!r}")
        self.mode = mode  # a plain attribute: read on every batch's path

    def cold(self, indices: np.ndarray, cols: dict[int, dict[str, ColumnFile]], starts: list[int]) -> bool:
        """Whether to read the batch at global ``indices``, whose chunks' files are ``cols`` (by chunk), chunk
        ``c`` starting at global row ``starts[c]``."""
        if self.mode != "auto" or indices.size == 0:
            return self.mode == "read" and indices.size > 0
        self._looked_up = self._trusted <= 0
        if not self._looked_up:  # recent batches were cached and copied fast: this one is not looked up
            self._trusted -= 1
            return False
        picked = [int(indices[0])] if self._last_cached else indices[::max(1, indices.size // SAMPLE)][:SAMPLE].tolist()
        one = next(iter(cols)) if len(cols) == 1 else None
        for row in picked:
            c = bisect.bisect_right(starts, row) - 1 if one is None else one
            local = [row - starts[c]]
            for col in cols[c].values():
                if not col.resident(local):
                    self._last_cached, self._trusted = False, 0
                    return True
        self._last_cached = True
        return False

    def copied(self, rows: int, seconds: float) -> None:
        """After a batch of ``rows`` copied out of the maps in ``seconds``: trust is granted only after a lookup."""
        if seconds > rows * FAULT_S:
            self._last_cached, self._trusted = False, 0
        elif self._looked_up and self.mode == "auto":
            self._trusted = TRUST


@dataclass
class Plan:
    """A column's reads for one batch: segment ``s`` is ``lens[s]`` rows from row ``rows[s]`` into the batch's
    positions ``pos[s]...``; request ``q`` reads segments ``starts[q]`` to ``starts[q + 1]`` (exclusive) in one
    call, in file ``files[q]``. After the reads, position ``dup_to[i]`` is copied from position ``dup_from[i]``
    (a repeated row)."""

    rows: list[int]
    pos: list[int]
    lens: list[int]
    starts: list[int]
    dup_to: np.ndarray
    dup_from: np.ndarray
    files: list[int]


def plan(rows: np.ndarray, positions: np.ndarray, row_bytes: int, max_gap: int = MAX_GAP,
         max_bytes: int = MAX_REQUEST, max_segments: int = MAX_SEGMENTS, bounds: np.ndarray | None = None) -> Plan:
    """The reads that put row ``rows[i]`` at batch position ``positions[i]`` for every ``i`` (see ``Plan``).
    With ``bounds`` (each file's first row, ascending), rows are counted over the files one after another and no
    segment or request crosses from one file to the next; ``Plan.files`` names each request's file.

    >>> p = plan(np.array([7, 3, 4, 3]), np.arange(4), row_bytes=8, max_gap=16)
    >>> p.rows, p.pos, p.lens, p.starts, p.dup_to.tolist(), p.dup_from.tolist()
    ([3, 7], [1, 0], [2, 1], [0, 2], [3], [1])
    >>> plan(np.array([4, 5, 6]), np.arange(3), row_bytes=8, bounds=np.array([0, 5])).files
    [0, 1]
    """
    rows, positions = np.asarray(rows, np.int64), np.asarray(positions, np.int64)
    order = np.argsort(rows, kind="stable")
    r, p = rows[order], positions[order]
    first = np.ones(r.size, bool)
    first[1:] = r[1:] != r[:-1]
    head = np.maximum.accumulate(np.where(first, np.arange(r.size), 0))  # each row's first copy
    dup_to, dup_from = p[~first], p[head[~first]]
    r, p = r[first], p[first]
    window = r * row_bytes // max_bytes
    file = np.zeros(r.size, np.int64) if bounds is None else np.searchsorted(bounds, r, side="right") - 1
    seg = np.ones(r.size, bool)
    seg[1:] = (r[1:] != r[:-1] + 1) | (p[1:] != p[:-1] + 1) | (window[1:] != window[:-1]) | (file[1:] != file[:-1])
    s = np.flatnonzero(seg)
    lens = np.diff(np.append(s, r.size))
    gap = (r[s[1:]] - r[s[:-1]] - lens[:-1]) * row_bytes
    req = np.ones(s.size, bool)
    req[1:] = (gap > max_gap) | (window[s[1:]] != window[s[:-1]]) | (file[s[1:]] != file[s[:-1]])
    q = np.flatnonzero(req)
    k = np.arange(s.size) - np.repeat(q, np.diff(np.append(q, s.size)))  # a segment's place in its request
    starts = np.flatnonzero(req | (k % max_segments == 0)) if s.size else q
    return Plan(r[s].tolist(), p[s].tolist(), lens.tolist(), [*starts.tolist(), int(s.size)], dup_to, dup_from,
                file[s[starts]].tolist())


class ColdReads:
    """Reads of one batch, from any number of columns, made together by one pool of threads.

    ``add`` plans a column's rows into a destination array; ``run`` makes every request and then the copies
    (repeats, destinations that could not be read into directly). Nothing of a failed batch is returned: ``run``
    raises ``ChunkError`` naming the chunk and key."""

    def __init__(self, threads: int = READ_THREADS, max_gap: int = MAX_GAP, max_bytes: int = MAX_REQUEST,
                 max_segments: int = MAX_SEGMENTS):
        self.threads, self.max_gap = max(1, int(threads)), max_gap
        self.max_bytes, self.max_segments = max_bytes, max_segments
        self._jobs: list[tuple[Mapping[int, ColumnFile], list[int], Plan, np.ndarray]] = []
        self._after: list = []

    def add(self, columns: ColumnFile | Mapping[int, ColumnFile], rows: np.ndarray, out: np.ndarray,
            positions: np.ndarray | None = None, starts: Sequence[int] | None = None) -> None:
        """Plan reading ``rows`` into ``out[positions]`` (``out[:len(rows)]`` without positions): from one column,
        or from one key's columns by chunk, chunk ``c`` holding rows from ``starts[c]`` (one plan for them all)."""
        columns = {0: columns} if isinstance(columns, ColumnFile) else columns
        one = next(iter(columns.values()))
        if one.row_bytes == 0 or rows.size == 0:  # a zero-width key or no rows: nothing to read
            return
        direct = out.dtype == one.dtype and out.flags.c_contiguous and out.shape[1:] == one.shape[1:]
        dest = out if direct else np.empty((rows.size, *one.shape[1:]), one.dtype)
        at = positions if direct and positions is not None else np.arange(rows.size)
        flat = dest.reshape(-1).view(np.uint8)
        bounds = None if starts is None else np.asarray(starts, np.int64)
        pl = plan(rows, at, one.row_bytes, self.max_gap, self.max_bytes, self.max_segments, bounds)
        self._jobs.append((columns, [0] * len(columns) if starts is None else list(starts), pl, flat))
        if pl.dup_to.size:
            bytes2d = flat.reshape(-1, one.row_bytes)
            self._after.append(lambda b=bytes2d, t=pl.dup_to, f=pl.dup_from: b.__setitem__(t, b[f]))
        if not direct:
            self._after.append(lambda: out.__setitem__(slice(None) if positions is None else positions, dest))

    def run(self) -> None:
        """Make every planned request, then the copies: through this thread's io_uring (``rayrb.io.uring``) where
        the kernel allows it, every request in flight at once up to the ring's size, else from the threads (at most
        ``threads`` in flight)."""
        work = [(j, q) for j, (_, _, pl, _) in enumerate(self._jobs) for q in range(len(pl.starts) - 1)]
        ring = uring.ring() if work and USE_RING else None
        if ring is not None:
            self._ring_reads(ring, work)
        elif work:
            self._thread_reads(work)
        for step in self._after:
            step()
        self._jobs, self._after = [], []

    def _thread_reads(self, work: list[tuple[int, int]]) -> None:
        parts = np.array_split(np.arange(len(work)), min(self.threads, len(work)))
        pool = _readers.get(self.threads)
        futures = [pool.submit(self._read, [work[i] for i in part]) for part in parts[1:]]
        errors: list[BaseException] = []
        try:
            self._read([work[i] for i in parts[0]])  # the caller reads a share too
        except BaseException as e:  # noqa: BLE001  (raised below, once no thread writes into the batch)
            errors.append(e)
        for f in futures:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        if errors:
            raise errors[0]

    def _ring_reads(self, ring: uring.Ring, work: list[tuple[int, int]]) -> None:
        """Every request at once through ``ring``. A request that failed or came short is made again by ``_read``,
        which finishes a short read or raises the ``ChunkError`` naming its column."""
        scratch = np.empty(self.max_gap, np.uint8)  # the gaps' bytes: read, not kept (requests may share it)
        parts = [_requests(self._jobs[j], scratch.ctypes.data) for j in range(len(self._jobs))]
        iov = np.concatenate([p[0] for p in parts])
        before = np.cumsum([0] + [len(p[0]) for p in parts])  # each job's entries after the jobs before it
        first_iov = np.concatenate([p[2] + before[i] for i, p in enumerate(parts)])
        fds, offsets, counts, want = (np.concatenate([p[k] for p in parts]) for k in (1, 3, 4, 5))
        try:
            got = ring.read(fds, offsets, (iov.ctypes.data + 16 * first_iov).astype(np.uint64), counts)
        except uring.RingError:  # the ring itself failed (not a read): every read waited for, made by threads
            self._thread_reads(work)
            return
        for i in np.flatnonzero(got != want).tolist():
            self._read([work[i]])

    def _read(self, work: list[tuple[int, int]]) -> None:
        scratch = memoryview(bytearray(self.max_gap))  # the gaps between rows of one request: read, not kept
        for j, q in work:
            columns, starts, pl, flat = self._jobs[j]
            dest = memoryview(flat)
            column = columns[pl.files[q]]
            rb, first = column.row_bytes, starts[pl.files[q]]
            a, b = pl.starts[q], pl.starts[q + 1]
            offset = end = (pl.rows[a] - first) * rb
            bufs = []
            for s in range(a, b):
                at = (pl.rows[s] - first) * rb
                if at > end:
                    bufs.append(scratch[:at - end])
                n = pl.lens[s] * rb
                bufs.append(dest[pl.pos[s] * rb:pl.pos[s] * rb + n])
                end = at + n
            read_fully(column, bufs, offset)


def copy_out(cols: Mapping[int, Mapping[str, ColumnFile]], chunks: list[int], chunk_of: np.ndarray | None,
             indices: np.ndarray, starts: Sequence[int], out: Mapping[str, np.ndarray]) -> None:
    """Copy the rows at global ``indices`` out of the maps into ``out``: chunk ``c`` (files ``cols[c]``) holds rows
    from ``starts[c]``, row ``i`` lies in chunk ``chunk_of[i]`` (None: all in ``chunks[0]``), and must (``take``'s
    ``mode="clip"`` copies straight into ``out``; its default ``"raise"`` buffers ``out`` first: 2-7x slower)."""
    if len(chunks) == 1:
        local = indices - starts[chunks[0]] if chunks[0] else indices
        for k in out:
            cols[chunks[0]][k].array.take(local, axis=0, out=out[k], mode="clip")
        return
    order = np.argsort(chunk_of, kind="stable")
    a = 0
    for c, b in zip(chunks, np.searchsorted(chunk_of[order], chunks, side="right").tolist()):
        sel, a = order[a:b], b
        local = indices[sel] - starts[c]
        for k in out:
            out[k][sel] = cols[c][k].array.take(local, axis=0, mode="clip")


def _requests(job: tuple[Mapping[int, ColumnFile], list[int], Plan, np.ndarray], scratch: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One job's requests as a ring takes them (``rayrb.io.uring.requests``), with each request's descriptor.

    >>> col = ColumnFile.__new__(ColumnFile); col.fd, col.row_bytes = 9, 4
    >>> pl = plan(np.array([0, 2, 9]), np.arange(3), row_bytes=4, max_gap=8)
    >>> iov, fds, first, off, count, want = _requests(({0: col}, [0], pl, np.zeros(12, np.uint8)), scratch=0)
    >>> iov[:, 1].tolist(), fds.tolist(), first.tolist(), off.tolist(), count.tolist(), want.tolist()
    ([4, 4, 4, 4], [9, 9], [0, 3], [0, 36], [3, 1], [12, 4])
    """
    columns, starts, pl, flat = job
    rb = next(iter(columns.values())).row_bytes
    bounds = np.asarray(pl.starts, np.int64)
    files = np.asarray(pl.files, np.int64)
    req = np.repeat(np.arange(bounds.size - 1), np.diff(bounds))  # each segment's request
    at = (np.asarray(pl.rows, np.int64) - np.asarray(starts, np.int64)[files[req]]) * rb  # each segment's offset
    dest = flat.ctypes.data + np.asarray(pl.pos, np.int64) * rb
    iov, first, offsets, count, want = uring.requests(at, np.asarray(pl.lens, np.int64) * rb, dest, bounds, scratch)
    return iov, np.array([columns[f].fd for f in pl.files], np.int32), first, offsets, count, want


def read_fully(column: ColumnFile, bufs: list[memoryview], offset: int) -> None:
    """Fill ``bufs`` from ``column``'s file at ``offset``, refusing a read that ends early (the file was cut
    short under its readers) or fails, with ``ChunkError`` naming the column."""
    want = sum(len(b) for b in bufs)
    done = 0
    while bufs:
        try:
            n = _preadv(column.fd, bufs, offset + done)
        except OSError as e:
            raise ChunkError(f"{column.label}: expected to read {want} bytes at offset {offset}, the read failed: "
                             f"{e}") from None
        if n <= 0:
            raise ChunkError(f"{column.label}: expected {column.nbytes} bytes in its file, reading {want} bytes at "
                             f"offset {offset} found the end after {done}: the file was changed under its readers "
                             "(the dataset is immutable); prepare it again")
        done += n
        while bufs and n >= len(bufs[0]):  # a short read (rare): go on after what came
            n -= len(bufs[0])
            bufs = bufs[1:]
        if bufs and n:
            bufs = [bufs[0][n:], *bufs[1:]]


def _closed(fd: int) -> None:
    """A mapped ``ColumnFile`` gone: its descriptor closed, and its two no longer counted (the map's closes with
    the map, at the latest when its last view goes)."""
    os.close(fd)
    descriptors.held(-2)


def open_columns(files: dict[str, tuple[Path, tuple, np.dtype]], chunk: str) -> dict[str, ColumnFile]:
    """Each key's ``ColumnFile`` in one chunk, from ``(path, shape, dtype)`` as the manifest gives them."""
    return {k: ColumnFile(path, shape, dtype, f"chunk {chunk}: key {k!r}") for k, (path, shape, dtype) in files.items()}
