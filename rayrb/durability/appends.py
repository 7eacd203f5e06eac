"""One append to an online shard's files, by whichever process holds the shard's write lock. No Ray here.

Where the online shards place writes (``rayrb.handle.direct``), a write is appended at the shard's write count,
and any process on the shard's node may append it: the shard's actor (a write sent to it), or the writer itself,
which maps the same files (a write that needs no call at all). Every append takes the same steps, in this order,
under the shard's write lock (``write.lock`` in its directory, a ``flock`` the kernel releases however its
holder dies):

1. **Repair.** An append whose process died midway left its undo record (step 4): rows and generations are put
   back as they were before it, unless its count moved (it finished); the record is cleared.
2. **Journal sync and check.** The shard's journal of write ids (``rayrb.durability.write_ids``) is brought up to
   date with what other processes appended; a piece placed before under its ``(write id, piece)`` is answered
   from it and written once, other rows under it refused.
3. **Journal line**, ``(write id, piece) -> (first, rows, start, digest)``, before the rows.
4. **Undo record** (at most ``UNDO_ROWS`` rows): the slots the rows go to, their generations and rows as they are.
5. **Rows**, key by key, each slot's generation negative meanwhile (``rayrb.durability.storage.store_rows``).
6. **The write count**, moved past the rows: from here the rows count, after a restart too.
7. **Published**: the count and a change counter in the coordinator's counts map, when there is one on this node
   (``rayrb.durability.published``), so that plans and readers there see the rows without a call.
8. The undo record cleared.

So a process killed at any step leaves the shard as it was before the append (steps 1-5: the next lock holder puts
it back; the journal line, its rows never counted, is dropped when read) or with the append whole (from step 6:
kept, published by the next append or when the coordinator takes the shards' counts again). Either way no row is
served torn, and a retry under the write id lands it once. A write of more than ``UNDO_ROWS`` rows keeps no undo
record: only the shard's actor appends those, and a crash midway leaves its slots torn (never served) until the
write, which Ray sends again to the restarted shard, lands over them.

Examples:
    >>> import tempfile, numpy as np
    >>> from rayrb.core.schema import RowSpec
    >>> from rayrb.durability.storage import OnlineStorage
    >>> spec = RowSpec.from_arrays({"x": np.zeros((1, 2), "float32")})
    >>> d = tempfile.mkdtemp()
    >>> shard = Appender(OnlineStorage(spec, 4, d))
    >>> shard.append({"x": np.ones((3, 2), "float32")}, "w1", digest="a")
    Appended(slots=array([0, 1, 2]), written=3, answered=False)
    >>> writer = Appender(OnlineStorage.attach(spec, 4, d), rewrite=False)  # another process on the node
    >>> writer.append({"x": np.ones((3, 2), "float32")}, "w1", digest="a").answered  # the retry: answered
    True
    >>> writer.append({"x": np.full((2, 2), 2, "float32")}, "w2").slots.tolist(), shard.storage.written
    ([3, 0], 5)
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from rayrb.core.schema import SEP
from rayrb.durability.storage import WRITE_LOCK as LOCK
from rayrb.durability.storage import OnlineStorage, store_rows
from rayrb.durability.write_ids import WriteIds
from rayrb.errors import InvalidArgumentError

UNDO = "undo"
UNDO_ROWS = 4096  # rows an undo record holds: larger appends go to the shard's actor, which keeps none

Rows = Mapping[str, np.ndarray]


class Appended(NamedTuple):
    slots: np.ndarray  # where the rows went, in the write's order
    written: int  # the shard's write count after
    answered: bool  # placed before under this write id: answered from the journal, nothing written


class Appender:
    """Appends to one online shard's files (``storage``), as the module says. ``publish(written)`` tells the
    coordinator's counts map the count (None: none on this node); ``rewrite``: the shard's own start, which
    rewrites its journal clean (a writer in another process only reads it)."""

    def __init__(self, storage: OnlineStorage, *, rewrite: bool = True,
                 publish: Callable[[int], None] | None = None, lock: WriteLock | None = None):
        self.storage, self.publish = storage, publish
        d = storage.directory
        self.lock = lock if lock is not None else WriteLock(d)
        self._undo = None if d is None else _Undo(d / UNDO, storage, min(UNDO_ROWS, storage.capacity))
        with self.locked():
            self.ids = WriteIds(d, storage.written, rewrite=rewrite)

    def close(self) -> None:
        self.lock.close()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the shard's write lock, an append a dead process left halfway put back first (step 1)."""
        with self.lock.held():
            if self.lock.depth <= 1 and self._undo is not None:  # never an append of this process in progress
                self._undo.repair()
            yield

    def append(self, rows: Rows, write_id: str, piece: int = 0, start: int = 0, digest: str | None = None,
               store: Callable[[Rows, int, int], Any] | None = None, check: Callable[[], bool] | None = None
               ) -> Appended | None:
        """Append ``rows`` (one piece, which starts at row ``start`` of write ``write_id``) at the write count, or
        answer it from the journal (see the module). ``store(rows, first, n)`` copies the rows in (the shard's
        own, which keeps a device copy too); by default the files alone. ``check()``, asked under the lock
        first: whether these files may be appended to now (else None, nothing done)."""
        n = len(next(iter(rows.values())))
        if n == 0:
            raise InvalidArgumentError("expected a piece of at least one row, got none")
        with self.locked():
            if check is not None and not check():
                return None
            return self._append(rows, n, write_id, int(piece), int(start), digest, store)

    def _append(self, rows: Rows, n: int, write_id: str, piece: int, start: int, digest: str | None,
                store: Callable[[Rows, int, int], Any] | None) -> Appended:
        s = self.storage
        capacity = s.capacity
        self.ids.sync(s.written)
        seen = self.ids.check(write_id, piece, n, start, digest)
        if seen is not None:
            return Appended(positions(seen.first, seen.rows, capacity), s.written, True)
        first = s.written
        self.ids.add(write_id, piece, first=first, rows=n, start=start, digest=digest)  # before the rows
        kept = kept_rows(first, n, capacity, s.generation)
        undo = self._undo is not None and int(kept.sum()) <= self._undo.rows
        if undo:
            self._undo.save(first, positions(first, n, capacity)[kept])
        try:
            if store is not None:
                store(rows, first, n)
            else:
                w = first + np.arange(n, dtype=np.int64)
                store_rows(s.rows, s.generation, (w % capacity)[kept], rows, kept, (w // capacity + 1)[kept])
        except BaseException:
            self.ids.forget((write_id, piece))
            if undo:  # rows half replaced are put back, as a dead process's would be
                self._undo.repair()
            raise
        s.written = first + n  # last: the count is what makes the rows (and the journal line) count
        if self.publish is not None:
            self.publish(s.written)
        if undo:
            self._undo.clear()
        return Appended(positions(first, n, capacity), s.written, False)


class WriteLock:
    """The shard's write lock: an exclusive ``flock`` on ``write.lock`` in its directory (none without one),
    which start-up, appends and every change of the rows in bulk (a merge, a restore, a state taken) hold.
    Re-entrant within one process."""

    def __init__(self, directory: str | os.PathLike | None):
        self._fd = None
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self._fd = os.open(Path(directory) / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        self.depth = 0  # nested holds in this process
        self._threads = threading.RLock()  # flock is per open file, not per thread: threads take turns here

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        if self._fd is None:
            yield
            return
        with self._threads:
            if self.depth == 0:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1
                if self.depth == 0:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def positions(first: int, n: int, capacity: int) -> np.ndarray:
    """The slots of rows ``first .. first + n`` of a shard's write stream: the ``w``-th row goes to ``w mod
    capacity``.

    >>> positions(6, 4, 8).tolist()
    [6, 7, 0, 1]
    """
    return (int(first) + np.arange(int(n), dtype=np.int64)) % int(capacity)


def kept_rows(first: int, n: int, capacity: int, generation: np.ndarray) -> np.ndarray:
    """Which of ``n`` rows written at ``first`` are stored: a write larger than the shard keeps its tail, and a
    slot never goes back to an older generation.

    >>> kept_rows(0, 6, 4, np.zeros(4, np.int64)).tolist()
    [False, False, True, True, True, True]
    """
    w = int(first) + np.arange(int(n), dtype=np.int64)
    return (w >= first + n - capacity) & (generation[w % capacity] < w // capacity + 1)


class _Undo:
    """The undo record of the append in progress (see the module): ``head`` is ``[first + 1, rows]`` while one
    is recorded (``[0, 0]`` otherwise), ``slots``, ``generation`` and each key's ``rows`` what those slots held."""

    def __init__(self, directory: Path, storage: OnlineStorage, rows: int):
        self.rows, self._storage = int(rows), storage
        reopen = (directory / "head.memmap").exists()
        mode = "r+" if reopen else "w+"
        directory.mkdir(exist_ok=True)
        self._head = np.memmap(directory / "head.memmap", np.int64, mode, shape=(2,))
        self._slots = np.memmap(directory / "slots.memmap", np.int64, mode, shape=(self.rows,))
        self._gen = np.memmap(directory / "generation.memmap", np.int64, mode, shape=(self.rows,))
        self._rows = {k: np.memmap(directory / f"{k.replace(SEP, '__')}.memmap", v.dtype, mode,
                                   shape=(self.rows, *v.shape[1:])) for k, v in storage.rows.items()}

    def save(self, first: int, slots: np.ndarray) -> None:
        m = len(slots)
        self._slots[:m] = slots
        self._gen[:m] = self._storage.generation[slots]
        for k, v in self._storage.rows.items():
            self._rows[k][:m] = v[slots]
        self._head[1] = m
        self._head[0] = first + 1  # last: the record counts from here

    def clear(self) -> None:
        self._head[0] = 0

    def repair(self) -> None:
        """Put back the slots of an append that never moved the count; clear the record either way."""
        marked = int(self._head[0])
        if not marked:
            return
        if self._storage.written == marked - 1:  # the append died before its count moved: undo it
            m = int(self._head[1])
            slots, gen = np.array(self._slots[:m]), np.array(self._gen[:m])
            self._storage.generation[slots] = -np.abs(gen) - 1  # being written: no reader serves them meanwhile
            for k, v in self._storage.rows.items():
                v[slots] = self._rows[k][:m]
            self._storage.generation[slots] = gen
        self.clear()


def attach(spec: Any, capacity: int, directory: str | os.PathLike, publish: Callable[[int], None] | None = None
           ) -> Appender | None:
    """An appender over the files of the online shard in ``directory`` for a writer in another process on its
    node, or None where they are not a shard of this spec and capacity."""
    storage = OnlineStorage.attach(spec, capacity, directory)
    return None if storage is None else Appender(storage, rewrite=False, publish=publish)
