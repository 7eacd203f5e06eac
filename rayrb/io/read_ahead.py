"""Reading ahead: the rows of batches planned next put in the page cache while the caller works on this one.

A batch's rows are known before it is served: plans are drawn ahead (``rayrb.handle.stream``), and the read rule
(``rayrb.core.reads``) turns a plan into indices wherever it runs. Rows outside the page cache cost the disk's
latency when the batch is gathered (``rayrb.io.gather``). Here, once a batch has been found cold, the rows of the
batches planned next are named to the kernel with ``posix_fadvise(POSIX_FADV_WILLNEED)``: it queues their reads and
returns, so the disk reads them while the caller trains on the batch it has, and their gather finds them cached.

A hint changes no row and no stream: the gather reads the rows as it always does, from the cache or the files.
Hints go to one thread per process, in order, at most ``MAX_PENDING`` a dataset waiting: a caller that outruns the
disk drops hints, never waits for them. A hint that fails (a file cut short, gone) is dropped: the gather of that
batch reports it. A gather after a hint looks every row up (``cached``), not a few: copied out of the maps only if
all are cached, else read from the files, since a fault on each row still on its way, behind the hinted reads in
the disk's queue, would cost far more. Hints stop while the data is cached: after ``WARM_HINTS`` hints in a row
that found a dataset's sampled rows in the page cache, and start again when a gather finds a batch cold; a dataset
never found cold (a warm one) costs its reader one attribute lookup a batch.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence

import numpy as np

from rayrb.io.gather import MAX_GAP, SAMPLE, ColumnFile, ReadPolicy
from rayrb.io.threads import ProcessThreads

MAX_PENDING = 4  # hints of one dataset waiting for the thread: beyond that the caller is ahead of the disk
WARM_HINTS = 8  # hints in a row that found their rows cached before hints stop
_hinter = ProcessThreads("rayrb-ahead")  # one thread: hints queue behind each other, never behind a gather


def ranges(rows: np.ndarray, row_bytes: int, max_gap: int = MAX_GAP) -> tuple[np.ndarray, np.ndarray]:
    """Byte ranges ``(offsets, lengths)`` covering ``rows`` of ``row_bytes`` each, in file order, rows at most
    ``max_gap`` bytes apart sharing one range (one request, as ``rayrb.io.gather.plan`` joins them).

    >>> ranges(np.array([9, 0, 1, 4, 9]), row_bytes=8, max_gap=16)
    (array([ 0, 72]), array([40,  8]))
    """
    r = np.unique(np.asarray(rows, np.int64))
    if r.size == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    start, end = r * row_bytes, (r + 1) * row_bytes
    cut = np.flatnonzero(start[1:] - end[:-1] > max_gap) + 1
    first, last = np.concatenate(([0], cut)), np.concatenate((cut - 1, [r.size - 1]))
    return start[first], end[last] - start[first]


def will_need(cols: Mapping[int, Mapping[str, ColumnFile]], indices: np.ndarray, starts: Sequence[int]) -> int:
    """Ask the kernel to read the pages of the rows at global ``indices`` (chunk ``c``'s files ``cols[c]``, its rows
    from global row ``starts[c]``) into the page cache, without waiting for them. Returns the requests made."""
    bounds = np.asarray(starts, np.int64)
    chunk_of = np.searchsorted(bounds, indices, side="right") - 1
    made = 0
    for c, files in cols.items():
        local = indices[chunk_of == c] - bounds[c]
        for col in files.values():
            if col.fd < 0 or local.size == 0:
                continue
            offsets, lengths = ranges(local, col.row_bytes)
            for off, n in zip(offsets.tolist(), lengths.tolist()):
                os.posix_fadvise(col.fd, off, n, os.POSIX_FADV_WILLNEED)  # queues the reads; the GIL is released
            made += offsets.size
    return made


class Ahead:
    """One dataset's hints: whether they are wanted, how many wait, what they did (``stats``: queued and made,
    requests, found cached, dropped, failed), and how its gathers reach their rows (``reads``)."""

    def __init__(self) -> None:
        self.wanted = False  # set by a cold gather, cleared after WARM_HINTS hints found the rows cached
        self._pending = 0
        self._asked = False  # a hint was asked for since the last gather (``reads``)
        self._warm_in_a_row = 0
        self._lock = threading.Lock()
        self.stats = {"hints": 0, "requests": 0, "dropped": 0, "cached": 0, "failed": 0}

    def __reduce__(self):
        return Ahead, ()  # a dataset sent elsewhere starts its hints afresh there (a lock does not travel)

    def found_cold(self) -> None:
        """A gather found a batch outside the page cache: hint the batches after it."""
        self._warm_in_a_row, self.wanted = 0, True

    def reads(self, policy: ReadPolicy, cols: Mapping[int, Mapping[str, ColumnFile]], indices: np.ndarray,
              starts: Sequence[int]) -> bool:
        """Whether a gather reads its batch from the files (else it copies it out of the maps). After a hint every
        row is looked up (``cached``): some may still be on their way, and a fault on each, behind the hinted reads
        in the disk's queue, would cost far more than reading the batch. Else ``policy`` decides; a batch it finds
        cold turns hints on."""
        asked, self._asked = self._asked, False
        if asked and policy.mode == "auto":
            return not cached(cols, indices, starts)
        cold = policy.cold(indices, cols, starts)
        if cold:
            self.found_cold()
        return cold

    def hint(self, cols: Mapping[int, Mapping[str, ColumnFile]], indices: np.ndarray, starts: Sequence[int]) -> bool:
        """Queue a hint for the rows at ``indices`` (``will_need``); False if it was dropped (too many wait)."""
        self._asked = True
        with self._lock:
            if self._pending >= MAX_PENDING:
                self.stats["dropped"] += 1
                return False
            self._pending += 1
        _hinter.get().submit(self._run, cols, np.asarray(indices, np.int64), list(starts))
        return True

    def _run(self, cols: Mapping[int, Mapping[str, ColumnFile]], indices: np.ndarray, starts: list[int]) -> None:
        try:
            if _sampled_rows_cached(cols, indices, starts):
                self.stats["cached"] += 1
                self._warm_in_a_row += 1
                if self._warm_in_a_row >= WARM_HINTS:
                    self.wanted = False
                return
            self._warm_in_a_row = 0
            self.stats["requests"] += will_need(cols, indices, starts)
            self.stats["hints"] += 1
        except Exception:  # noqa: BLE001  (a hint is advice: the batch's own gather reports what is wrong)
            self.stats["failed"] += 1
        finally:
            with self._lock:
                self._pending -= 1


def cached(cols: Mapping[int, Mapping[str, ColumnFile]], rows: np.ndarray, starts: Sequence[int]) -> bool:
    """Whether every page of each of the rows at global ``rows`` is in the page cache (``ColumnFile.resident``:
    about a microsecond a row and key)."""
    bounds = np.asarray(starts, np.int64)
    chunk_of = np.searchsorted(bounds, rows, side="right") - 1
    for c, files in cols.items():
        local = (rows[chunk_of == c] - bounds[c]).tolist()
        if local and not all(col.resident(local) for col in files.values()):
            return False
    return True


def _sampled_rows_cached(cols: Mapping[int, Mapping[str, ColumnFile]], indices: np.ndarray,
                         starts: list[int]) -> bool:
    """Whether ``SAMPLE`` rows spread over ``indices`` are all in the page cache."""
    return cached(cols, indices[::max(1, indices.size // SAMPLE)][:SAMPLE], starts)
