"""The episodes a shard holds, kept up to date write by write instead of found again over every row. Pure math.

A shard's rows are numbered in its write stream (``rayrb.core.episodes``): the ``w``-th row written sits in slot
``w mod capacity`` (an offline shard's ``w``-th row in slot ``w``). A ``Stream`` is the episodes of the rows a
shard holds, in those numbers, found two ways that give the same episodes:

* ``scan``: over every slot, ordered by the row each holds (what a restore, a merge or anything unforeseen leaves).
  Rows missing from the run (a piece still to come, a row being written) cut the episode there: a slice never
  spans a row that is not held;
* ``appended``: a scan's episodes followed by ``k`` new rows ``high .. high + k - 1``: only the new rows are looked
  at, the last episode goes on into them if they continue it (the same trajectory id, or no end flag yet), and the
  rows the capacity overwrote leave the front. Its cost is the write's rows and the number of episodes held
  (arrays of starts and stops), not the shard's rows: a scan of a million rows sorts them; an append of 16 looks
  at 16.

``appended(scan(rows 0..m-1), rows m..n-1)`` equals ``scan(rows 0..n-1)`` cut to the last ``capacity`` rows
(``tests/core/test_episode_stream.py`` checks it on random writes). ``ShardEpisodes`` keeps one shard's stream for
its slice sampler (``rayrb.core.slice_sampling``): appending the rows the shard says it wrote, or, in a handle
reading the shard's files from another process, the rows up to its write count; scanning again whenever those are
not the next rows, each whole (a piece applied ahead of the one before it, a row being written, a restore).

Examples:
    >>> ids = np.array([4, 4, 4, 5, 5, 6, 6, 6])
    >>> s = scan(ids[:5], np.arange(5), ends=False)
    >>> s.episodes.starts.tolist(), s.episodes.stops.tolist()
    ([0, 3], [3, 5])
    >>> t = appended(s, ids[5:], ends=False, capacity=6)  # rows 5..7: rows 0 and 1 overwritten
    >>> t.low, t.high, t.episodes.starts.tolist(), t.episodes.stops.tolist()
    (2, 8, [2, 3, 5], [3, 5, 8])
    >>> u = scan(np.array([4, 4, 5, 5]), np.array([6, 7, 9, 10]), ends=False)  # row 8 missing: cut there too
    >>> u.episodes.starts.tolist(), u.episodes.stops.tolist(), u.contiguous
    ([6, 9], [8, 11], False)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rayrb.core.episodes import Episodes, Slices, episodes_of, per_step
from rayrb.errors import InvalidArgumentError


@dataclass(frozen=True)
class Stream:
    """The episodes (in row numbers) of ``size`` held rows between ``low`` and ``high``; ``contiguous``: they are
    exactly the rows ``low .. high - 1``, each whole (written, in its slot), so rows after ``high`` may be appended.
    ``tail`` is the last row's step of the column episodes come from (None without rows)."""

    low: int
    high: int
    size: int
    episodes: Episodes
    tail: Any
    contiguous: bool
    slots: int = -1  # the slots it was found over, where rows beyond the write count were left out (-1: size)

    @property
    def covers(self) -> int:
        """How many slots a read over this stream names (its ``size``)."""
        return self.size if self.slots < 0 else self.slots

    def prefix(self, size: int) -> Stream:
        """The first ``size`` rows of a stream that starts at row 0 (an online shard before its first wrap): what a
        read planned at an earlier write count draws over."""
        if not (self.contiguous and self.low == 0 and self.size == self.covers and 0 <= size <= self.size):
            raise InvalidArgumentError(f"expected a prefix of at most {self.size} rows of a stream from row 0, got "
                                       f"{size} rows of rows {self.low} .. {self.high - 1}")
        return Stream(0, size, size, _window(self.episodes, 0, size), None, True)


def _step(column: np.ndarray, ends: bool) -> Any:
    """One step's value episodes are found by: its end flag, or its trajectory id."""
    values = per_step(column)[-1]
    return bool(values.any()) if ends else values[0]


def _window(eps: Episodes, low: int, high: int) -> Episodes:
    """The episodes' steps in ``[low, high)``; found by search, so the cost is the episodes kept, not all."""
    a = int(np.searchsorted(eps.stops, low, side="right"))  # the first episode still holding a step at low or on
    b = int(np.searchsorted(eps.starts, high, side="left"))
    starts, stops = eps.starts[a:b].copy(), eps.stops[a:b].copy()
    if starts.size:
        starts[0], stops[-1] = max(int(starts[0]), low), min(int(stops[-1]), high)
    return Episodes(starts, stops)


def scan(column: np.ndarray, rows: np.ndarray | int, ends: bool, whole: bool = True, slots: int = -1) -> Stream:
    """The stream of held steps ``column`` (in row order) at rows ``rows`` (increasing; an int: the first of rows
    one after another). ``whole=False``: some of them are being written or were left torn, so nothing is appended
    to this stream (it is found again). ``slots``: the slots they were found over, where some were left out."""
    n = len(column)
    if n == 0:
        return Stream(0, 0, 0, Episodes(np.zeros(0, np.int64), np.zeros(0, np.int64)), None, True, slots)
    eps = episodes_of(column, ends)  # positions 0 .. n - 1, every step in one
    if isinstance(rows, (int, np.integer)):
        low = int(rows)
        return Stream(low, low + n, n, Episodes(eps.starts + low, eps.stops + low), _step(column, ends), bool(whole),
                      slots)
    rows = np.asarray(rows, np.int64)
    gaps = np.flatnonzero(np.diff(rows) != 1) + 1  # a row missing before these positions: an episode ends there
    cuts = np.union1d(eps.starts, gaps) if gaps.size else eps.starts
    lengths = np.diff(np.append(cuts, n))
    starts = rows[cuts]
    low, high = int(rows[0]), int(rows[-1]) + 1
    return Stream(low, high, n, Episodes(starts, starts + lengths), _step(column, ends),
                  bool(whole) and high - low == n, slots)


def appended(stream: Stream, column: np.ndarray, ends: bool, capacity: int) -> Stream:
    """``stream`` followed by ``k`` new steps ``column`` at rows ``high .. high + k - 1``, the oldest rows beyond
    ``capacity`` (0: none) dropped."""
    k = len(column)
    if not stream.contiguous or (capacity and k >= capacity):
        raise InvalidArgumentError(f"expected rows appended to a contiguous stream, fewer than the capacity "
                                   f"{capacity}, got {k} rows after a stream contiguous={stream.contiguous}")
    if k == 0:
        return stream
    new = episodes_of(column, ends, first=stream.high)
    starts, stops = new.starts, new.stops
    old = stream.episodes
    if stream.tail is not None and (not stream.tail if ends else stream.tail == _step(column[:1], ends)):
        # the last episode goes on into the new rows
        starts, stops = np.concatenate([old.starts, starts[1:]]), np.concatenate([old.stops[:-1], stops])
    else:
        starts, stops = np.concatenate([old.starts, starts]), np.concatenate([old.stops, stops])
    high = stream.high + k
    low = max(stream.low if stream.size else stream.high, high - capacity) if capacity else stream.low
    eps = Episodes(starts, stops)
    if eps.starts.size and low > int(eps.starts[0]):
        eps = _window(eps, low, high)
    return Stream(low, high, high - low, eps, _step(column, ends), True)


class ShardEpisodes:
    """The episodes of one shard's rows and their valid slices, kept up to date write by write (see the module).

    ``bind`` gives it the column episodes come from and, online, the slots' generations (``rows``: the row each
    slot holds) and, where another process writes them (a handle reading the shard's files), the write count's
    one-element map. The shard says which slots it wrote (``wrote``); a reader of its files watches the count.
    ``moved(before, after)`` is told each append, with the ``(stream, slices)`` before and after."""

    def __init__(self, capacity: int, slice_len: int, strict: bool, ends: bool,
                 moved: Callable[[tuple[Stream, Slices], tuple[Stream, Slices]], None] | None = None):
        self.capacity, self.slice_len, self.strict, self.ends = int(capacity), slice_len, strict, ends
        self._moved = moved
        self.column: np.ndarray | None = None
        self.generation: np.ndarray | None = None
        self.written: np.ndarray | None = None
        self.count: np.ndarray | None = None  # the shard's write count (one-element array): no row at or past it
        self._main: tuple[Stream, Slices] | None = None  # the episodes held, kept up to date write by write
        self._touched: list[np.ndarray] = []  # slots written since (the shard's own writes)
        self._touched_rows = 0
        self._rescan = True  # rows changed otherwise (bind, restore, many writes): the episodes are found again
        self._at = -1  # the write count the main stream holds every acknowledged row of (-1: no count bound)
        self._other: tuple = (None, None)  # a read over another size than the main stream's: (key, slices)

    def bind(self, column: np.ndarray, generation: np.ndarray | None, written: np.ndarray | None = None,
             count: np.ndarray | None = None) -> None:
        """``written``: the write count of a shard another process writes (followed; ``count`` too); ``count``: the
        count of the shard itself, which says what it wrote (``wrote``). Rows at or past it (a piece stored ahead of
        one still to come, a row being written) are never held: they are not acknowledged."""
        self.column, self.generation, self.written = column, generation, written
        self.count = written if written is not None else count
        self.forget()

    def wrote(self, idx: np.ndarray) -> None:
        """Slots the shard wrote: the next read appends their rows to the episodes, if they follow the last."""
        idx = np.asarray(idx, np.int64).reshape(-1)
        self._touched_rows += idx.size
        if self._touched_rows >= max(self.capacity, 1):
            self.forget()  # as many rows as the shard holds: finding them all again costs no more
        elif idx.size:
            self._touched.append(idx)

    def forget(self) -> None:
        """The rows changed otherwise than by appends: their episodes are found again at the next read."""
        self._rescan, self._touched, self._touched_rows, self._other = True, [], 0, (None, None)

    def rows(self, slots: np.ndarray, generation: np.ndarray | None = None) -> np.ndarray:
        """The row of the write stream each slot holds (offline: the slot), by ``generation`` (the slots' as a read
        found them) or the slots' generations now."""
        if self.generation is None or self.capacity <= 0:
            return slots
        gen = self.generation[slots] if generation is None else np.asarray(generation, np.int64)
        return (np.abs(gen) - 1) * self.capacity + slots

    def held_size(self) -> int:
        """The slots holding rows the write count acknowledged (an offline shard's: all bound)."""
        if self.generation is None or self.capacity <= 0 or self.count is None:
            return len(self.column)
        return min(int(self.count[0]), self.capacity, len(self.column))

    def slots(self, rows: np.ndarray) -> np.ndarray:
        """The slot each row of the write stream sits in."""
        return rows % self.capacity if self.generation is not None and self.capacity > 0 else rows

    def _scan(self, size: int) -> Stream:
        """The episodes of the first ``size`` slots, ordered by the row each holds (``scan``), without rows at or
        past the write count. A ring written in order (generation ``g`` from slot ``p`` on, ``g + 1`` before it)
        holds rows one after another from slot ``p``'s: it is read in that order without sorting."""
        if size > len(self.column):
            raise InvalidArgumentError(f"expected at most the {len(self.column)} slots bound, got a read over {size}")
        if self.generation is None or self.capacity <= 0:
            return scan(self.column[:size], 0, self.ends)
        gen = self.generation[:size]
        count = self._count()
        if size:
            g = int(gen[0])
            p = int(np.argmax(gen != g))  # the first slot of another generation (0: none)
            low = (g - 1) * self.capacity if p == 0 else (g - 2) * self.capacity + p
            if count is None or low + size <= count:
                if g > 0 and p == 0:  # one generation: slots are rows in order
                    return scan(self.column[:size], low, self.ends)
                if g > 1 and size == self.capacity and p > 0 and (gen[p:] == g - 1).all():  # wrapped at slot p
                    return scan(np.concatenate([self.column[p:size], self.column[:p]]), low, self.ends)
        slots = np.arange(size, dtype=np.int64)
        rows = self.rows(slots)
        if count is not None:  # rows not acknowledged (ahead of a piece still to come, being written): left out
            keep = (rows < count) & (rows >= count - self.capacity)
            if not keep.all():
                slots, rows, gen = slots[keep], rows[keep], gen[keep]
        order = np.argsort(rows, kind="stable")
        return scan(self.column[slots[order]], rows[order], self.ends, whole=bool((gen > 0).all()), slots=size)

    def _count(self) -> int | None:
        return None if self.count is None else int(self.count[0])

    def _catch_up(self) -> None:
        """Bring the main stream to the rows written since it was found: the shard's own writes (``on_write``) or,
        read from another process, its write count's move; found again unless they are the next rows, whole."""
        if self._rescan or self._main is None:
            return
        stream = self._main[0]
        if self.written is not None:  # another process writes: the rows up to its count
            count = int(self.written[0])
            if count == self._at:
                return  # (a piece stored ahead of the count since is caught by the reader's copy: ``forget``)
            rows = np.arange(stream.high, count, dtype=np.int64)
            slots = self.slots(rows)
            fine = (stream.contiguous and count > stream.high and rows.size < max(self.capacity, 1)
                    and (self.generation is None or (self.generation[slots] == rows // self.capacity + 1).all()
                         and self._in_order(count)))
        else:
            count = self._count()
            if not self._touched:
                if count is not None and count != self._at:
                    self._rescan = True  # the count passed rows held ahead of it, whose writes said so earlier
                return
            slots = np.unique(np.concatenate(self._touched))
            self._touched, self._touched_rows = [], 0
            fine = stream.contiguous and (self.generation is None or (self.generation[slots] > 0).all())
            if fine:
                rows = np.sort(self.rows(slots))
                # the rows up to the count exactly: one at or past it is not acknowledged, and a count beyond
                # them passed rows stored ahead of it earlier (found again with them)
                fine = bool(rows[0] == stream.high and rows[-1] == stream.high + rows.size - 1
                            and (count is None or rows[-1] + 1 == count))
                slots = self.slots(rows)
        if not fine:
            self._rescan = True
            return
        new = appended(stream, self.column[slots], self.ends, self.capacity if self.generation is not None else 0)
        self._at = -1 if count is None else count
        before, self._other = self._main, (None, None)
        self._main = (new, Slices(new.episodes, self.slice_len, self.strict))
        if self._moved is not None:
            self._moved(before, self._main)

    def _in_order(self, count: int) -> bool:
        """Whether every slot holds the row a ring written in order holds at write count ``count`` (generation
        ``g + 1`` before slot ``count mod capacity``, ``g`` from it on, once wrapped): a reader's check that no
        piece stored ahead of the count overwrote rows it holds (the shard is told of those by ``wrote``)."""
        gen = self.generation
        if count <= self.capacity:  # rows 0 .. count - 1 in their slots; a piece ahead may have wrapped over some
            return bool((gen[:count] == 1).all())
        g, p = divmod(count, self.capacity)
        return bool((gen[:p] == g + 1).all() and (gen[p:] == g).all())

    def slices(self, size: int) -> Slices:
        """The valid slices over the first ``size`` slots in write order: the main stream's, kept up to date, or
        a prefix of it (a read planned at an earlier count, before the shard wrapped), else found for that size."""
        self._catch_up()
        if self._rescan or self._main is None:
            count = self._count()  # read first: a count moved during the scan only finds the rows again
            stream = self._scan(size)
            self.forget()
            self._main, self._rescan = (stream, Slices(stream.episodes, self.slice_len, self.strict)), False
            self._at = -1 if count is None else count
        stream, slices = self._main
        if size == stream.covers:
            return slices
        key = (size, id(stream))
        if self._other[0] != key:
            if size > stream.covers:  # more slots than the stream was found over, with no write said: again
                self._rescan = True
                return self.slices(size)
            whole = stream.low == 0 and stream.contiguous and stream.size == stream.covers
            part = stream.prefix(size) if whole else self._scan(size)
            self._other = (key, Slices(part.episodes, self.slice_len, self.strict))
        return self._other[1]
