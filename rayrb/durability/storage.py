"""Shard state that outlives the shard's process: memory maps in a directory on the shard's node. No Ray here.

An online shard's rows, slot generations and write count, and any shard's
priorities, live in files under one directory per shard:

    rows/<key>.memmap        capacity rows per key
    generation.memmap        int64[capacity]: times each slot was written
    written.memmap           int64[1]: rows ever written (the cursor is this mod capacity)
    priority.memmap          float64[capacity]: p_i per slot (prioritized sampling)
    max_priority.memmap      float64[1]
    restores.memmap          int64[1]: the restore epoch, how many times a restore replaced the rows whole
                             (``rayrb.durability.copies.copy_order``); made when a directory from before it lacks it
    layout.json              spec and capacity; written last, so a half-made directory is never reopened

A write stores rows, then generations, then priorities, and the write count
last: the count is what makes rows visible. The pages are in the kernel's page
cache the moment they are stored, so **a process crash loses nothing** that a
returned call stored: the restarted shard reopens the files and finds every
acknowledged row, generation and priority. **A node loss loses the directory**
(it is on that node's disk): a shard restarted elsewhere starts empty. Without a
directory the same arrays live in process memory.

Examples:
    >>> import tempfile, numpy as np
    >>> from rayrb.core.schema import RowSpec
    >>> spec = RowSpec.from_arrays({"x": np.zeros((1, 2), "float32")})
    >>> d = tempfile.mkdtemp()
    >>> s = OnlineStorage(spec, 4, d)
    >>> s.rows["x"][0] = [1, 2]; s.written = 1
    >>> again = OnlineStorage(spec, 4, d)  # a restarted process
    >>> again.written, again.rows["x"][0].tolist(), again.reopened
    (1, [1.0, 2.0], True)
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from rayrb.core.schema import SEP, RowSpec
from rayrb.durability.lease import FILE as LEASE_FILE
from rayrb.durability.restarts import FILE as RESTARTS_FILE
from rayrb.io.files import replace_file

LAYOUT = "layout.json"
WRITE_LOCK = "write.lock"  # the shard's write lock (rayrb.durability.appends)


def _array(directory: Path | None, name: str, shape: tuple, dtype: Any, fresh: bool, mode: str | None = None
           ) -> np.ndarray:
    if directory is None:
        return np.zeros(shape, dtype)
    path = directory / f"{name}.memmap"
    if mode is None:
        path.parent.mkdir(parents=True, exist_ok=True)
    n = int(np.prod(shape, dtype=np.int64))
    if n == 0:
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype=dtype, mode=mode or ("w+" if fresh else "r+"), shape=shape)


class OnlineStorage:
    """Rows, generations, write count and priorities of one circular shard, memory-mapped under ``directory``."""

    def __init__(self, spec: RowSpec, capacity: int, directory: str | os.PathLike | None = None,
                 priorities: bool = True):
        self.spec, self.capacity = spec, int(capacity)
        self.directory = None if directory is None else Path(directory)
        layout = {"spec": spec.to_json(), "capacity": self.capacity}
        self.reopened = self.directory is not None and _layout(self.directory) == layout
        fresh = not self.reopened
        if fresh:
            _clear(self.directory)  # a half-made or foreign directory: start over
        d = self.directory
        self.rows = {k: _array(d, "rows/" + k.replace(SEP, "__"), (self.capacity, *f.shape), f.dtype, fresh)
                     for k, f in spec.items()}
        self.generation = _array(d, "generation", (self.capacity,), np.int64, fresh)
        self._written = _array(d, "written", (1,), np.int64, fresh)
        self.priority = _array(d, "priority", (self.capacity,), np.float64, fresh) if priorities else None
        self.max_priority = _array(d, "max_priority", (1,), np.float64, fresh) if priorities else None
        made = fresh or d is None or not (d / "restores.memmap").exists()  # a directory from before the epoch
        self._restores = _array(d, "restores", (1,), np.int64, made)
        if fresh and d is not None:
            replace_file(d / LAYOUT, json.dumps(layout))

    @classmethod
    def attach(cls, spec: RowSpec, capacity: int, directory: str | os.PathLike) -> OnlineStorage | None:
        """The files a shard of this spec and capacity keeps in ``directory``, mapped for writing by another
        process on its node (``rayrb.durability.appends``); None where the directory holds no such shard (gone,
        half-made, another layout). Nothing is made or cleared."""
        d = Path(directory)
        if _layout(d) != {"spec": spec.to_json(), "capacity": int(capacity)}:
            return None
        self = cls.__new__(cls)
        self.spec, self.capacity, self.directory, self.reopened = spec, int(capacity), d, True
        try:
            self.rows = {k: _array(d, "rows/" + k.replace(SEP, "__"), (self.capacity, *f.shape), f.dtype, False,
                                   mode="r+") for k, f in spec.items()}
            self.generation = _array(d, "generation", (self.capacity,), np.int64, False, mode="r+")
            self._written = _array(d, "written", (1,), np.int64, False, mode="r+")
            self._restores = _array(d, "restores", (1,), np.int64, False, mode="r+")
        except (OSError, ValueError):  # a file missing or short: being made afresh
            return None
        self.priority = self.max_priority = None  # the shard's sampler keeps them
        return self

    @property
    def written(self) -> int:
        return int(self._written[0])

    @written.setter
    def written(self, value: int) -> None:
        self._written[0] = int(value)

    @property
    def count_map(self) -> np.ndarray:
        """The write count as the one-element array it is kept in (read where it moves, by a slice sampler)."""
        return self._written

    @property
    def restores(self) -> int:
        """The restore epoch of these rows: orders two copies of one shard across restores, which generations
        cannot (rows written after a restore take the generations of those it removed)."""
        return int(self._restores[0])

    @restores.setter
    def restores(self, value: int) -> None:
        self._restores[0] = int(value)

    @property
    def size(self) -> int:
        return min(self.written, self.capacity)

    def remove(self) -> None:
        """Delete the files (the buffer is being shut down)."""
        _remove(self.directory)


def whole(generation: np.ndarray) -> bool:
    """Whether every slot with these generations holds a row that may be served: one whose write finished.

    A write makes its slots' generations negative while it copies their rows in, key by key, and positive once
    every key holds them (``OnlineShard.extend``); a process killed in between leaves them negative and the rows
    torn (some keys new, the rest old) until the write is sent again, which lands over them. Zero is a slot never
    written. This is the one rule for a slot being written: the shard's own reads and the readers of its files on
    its node (``rayrb.handle.local``) serve only slots it passes.

    >>> whole(np.array([1, 3, 2])), whole(np.array([1, -3, 2])), whole(np.array([1, 0])), whole(np.zeros(0))
    (True, False, False, True)
    """
    return bool(generation.size == 0 or generation.min() > 0)


def store_rows(rows: dict[str, np.ndarray], generation: np.ndarray, slots: np.ndarray,
               new: dict[str, np.ndarray], keep: np.ndarray, gen: np.ndarray) -> None:
    """Copy ``new[k][keep]`` into ``rows[k]`` at ``slots``, key by key, under generations ``gen``, each slot's
    generation negative from before its first key is copied until after its last: readers in other processes on
    the node (``rayrb.handle.local``) compare it before and after their copy, and a crash in between leaves it
    negative, so a slot half copied is never served (``whole``). A copy that raises once a key was replaced leaves
    the slots so marked, torn, as a crash would, until the write's retry lands over them; one that raises before
    leaves them as they were.

    >>> rows, g = {"a": np.zeros(3), "b": np.zeros(3)}, np.array([1, 1, 1])
    >>> new = {"a": np.array([5., 6.]), "b": np.array([7., 8.])}
    >>> store_rows(rows, g, np.array([0, 2]), new, np.array([True, True]), np.array([2, 2]))
    >>> g.tolist(), rows["b"].tolist()
    ([2, 1, 2], [7.0, 0.0, 8.0])
    """
    before = generation[slots].copy()
    generation[slots] = -gen
    copied = 0
    try:
        for k, dst in rows.items():
            dst[slots] = new[k][keep]
            copied += 1
    except BaseException:
        if not copied:  # no key replaced: the rows are whole, as they were
            generation[slots] = before
        raise
    generation[slots] = gen


def read_only(spec: RowSpec, capacity: int, directory: str | os.PathLike) -> dict[str, Any] | None:
    """An online shard's files mapped read-only, for a reader in another process on the shard's node
    (``rayrb.handle.local``): ``{"rows", "generation", "written", "identity"}``, or None where the directory
    does not hold a shard of this spec and capacity (gone, half-made, another layout).

    ``identity`` is that of ``layout.json``, which a shard that makes its files afresh writes anew: a reader
    compares it with ``identity(layout_path(directory))`` to know it still maps the shard's current files.
    """
    d = Path(directory)
    before = identity(layout_path(d))
    if before is None or _layout(d) != {"spec": spec.to_json(), "capacity": int(capacity)}:
        return None
    try:  # plain arrays over the maps: np.memmap's own indexing costs more than the rows of a small read
        rows = {k: np.asarray(_array(d, "rows/" + k.replace(SEP, "__"), (int(capacity), *f.shape), f.dtype, False,
                                     mode="r")) for k, f in spec.items()}
        out = {"rows": rows,
               "generation": np.asarray(_array(d, "generation", (int(capacity),), np.int64, False, mode="r")),
               "written": np.asarray(_array(d, "written", (1,), np.int64, False, mode="r")), "identity": before}
    except (OSError, ValueError):  # a file missing or short: being made afresh
        return None
    return out if identity(layout_path(d)) == before else None


def layout_path(directory: str | os.PathLike) -> str:
    """The file whose ``identity`` tells a shard directory's files apart from those made afresh since."""
    return os.path.join(os.fspath(directory), LAYOUT)


def identity(layout: str) -> tuple[int, int, int] | None:
    """``(device, inode, change time)`` of a shard directory's ``layout.json`` (``layout_path``), or None."""
    try:
        st = os.stat(layout)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


class PriorityStore:
    """Just the priorities of a shard whose rows live elsewhere (an offline shard's mapped chunks)."""

    def __init__(self, capacity: int, directory: str | os.PathLike | None = None):
        self.directory = None if directory is None else Path(directory)
        layout = {"capacity": int(capacity)}
        self.reopened = self.directory is not None and _layout(self.directory) == layout
        fresh = not self.reopened
        if fresh:
            _clear(self.directory)
        self.priority = _array(self.directory, "priority", (int(capacity),), np.float64, fresh)
        self.max_priority = _array(self.directory, "max_priority", (1,), np.float64, fresh)
        if fresh and self.directory is not None:
            replace_file(self.directory / LAYOUT, json.dumps(layout))

    def remove(self) -> None:
        _remove(self.directory)


def _clear(directory: Path | None) -> None:
    """Empty a shard's directory for a fresh start, but for what its actor keeps of its own life there: the
    restart record (a start that crashes now must still back off), the lease (clean-up must see it live) and
    the write lock (``rayrb.durability.appends``: a writer holding it holds it on this file)."""
    if directory is None or not directory.exists():
        return
    for p in directory.iterdir():
        if p.name in (RESTARTS_FILE, LEASE_FILE, WRITE_LOCK):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def remove_directory(directory: str | os.PathLike | None) -> None:
    """Delete an actor's state directory, and its buffer's once no actor is left in it (at shutdown)."""
    _remove(None if directory is None else Path(directory))


def _remove(directory: Path | None) -> None:
    """Delete a shard's directory, and its buffer's directory once no shard is left in it."""
    if directory is None:
        return
    shutil.rmtree(directory, ignore_errors=True)
    try:
        directory.parent.rmdir()
    except OSError:
        pass  # other shards of the buffer still have files there


def _layout(directory: Path) -> dict | None:
    try:
        return json.loads((directory / LAYOUT).read_text())
    except (OSError, ValueError):
        return None
