"""The coordinator's counts map: its version, and the write counts its online shards publish on its node. No Ray.

One small file of int64 words, memory-mapped by every process on the coordinator's node that uses it:

    word 0           the coordinator's own version: writes it placed, priority updates, restores, settings
    word 1 + 2 i     online shard i's changes: how many times an append to it was published here
    word 2 + 2 i     online shard i's write count, as of its last published append

The coordinator writes word 0 only; an append to shard ``i`` (by the shard's actor, or by a writer on the node
that appends to the shard's files itself, ``rayrb.durability.appends``) writes shard ``i``'s two words, under the
shard's write lock, so each word has one writer at a time. An append stores the count before it counts the
change, and readers read the changes before the counts, so a change seen is a count seen (x86's store order,
which the local reads already rely on: ``rayrb.handle.local.ordered_stores``).

**The version** a handle compares its draws with is word 0 plus every shard's changes: each word only grows, so
the sum only grows, and an append published here moves it without a call. The coordinator answers the same sum,
taken when it last read the map (``Coordinator`` reads it before every plan and every answer that carries the
version); a handle that sees a larger one gives back what it drew before (``rayrb.handle.policies.Loop``).

Examples:
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "version")
    >>> coordinator = CountsMap.open(path, shards=2, create=True)
    >>> coordinator.own = 7
    >>> shard = CountsMap.open(path, shards=2)
    >>> shard.publish(1, written=16); shard.publish(1, written=32)
    >>> coordinator.version(), coordinator.changes().tolist(), coordinator.written().tolist()
    (9, [0, 2], [0, 32])
"""
from __future__ import annotations

import os

import numpy as np


def words(shards: int) -> int:
    """Words in the map of a coordinator with ``shards`` online shards."""
    return 1 + 2 * int(shards)


class CountsMap:
    """The map (see the module), over a memory map or, for a coordinator without a folder to share, an array."""

    def __init__(self, array: np.ndarray, path: str | None = None):
        self._a, self.path = np.asarray(array), path  # a plain view: numpy's memmap costs microseconds an index
        self._words = memoryview(self._a).cast("B").cast("q")  # version() a few hundred ns: read before each batch
        self.shards = (len(array) - 1) // 2

    @classmethod
    def open(cls, path: str | os.PathLike, shards: int | None = None, create: bool = False) -> CountsMap | None:
        """The map at ``path``: made (zeros) or reopened by its coordinator (``create``), else mapped by another
        process; its shard count read from its size unless given. None where it cannot be mapped (no such file,
        another size, a folder that cannot be written)."""
        path = os.fspath(path)
        try:
            size = os.path.getsize(path) if os.path.exists(path) else None
            n = words(shards) if shards is not None else (None if size is None else size // 8)
            if n is None or n < 1:
                return None
            if create and size != 8 * n:  # new, or one of another layout: made afresh
                array = np.memmap(path, dtype=np.int64, mode="w+", shape=(n,))
            elif size == 8 * n:
                array = np.memmap(path, dtype=np.int64, mode="r+", shape=(n,))
            else:
                return None
        except (OSError, ValueError):
            return None
        return cls(array, path)

    @property
    def own(self) -> int:
        return int(self._a[0])

    @own.setter
    def own(self, value: int) -> None:
        self._a[0] = int(value)

    def publish(self, shard: int, written: int) -> None:
        """An append to ``shard`` left its write count at ``written`` (the count first, then the change)."""
        self._a[2 + 2 * shard] = int(written)
        self._a[1 + 2 * shard] += 1

    def changes(self) -> np.ndarray:
        return np.array(self._a[1::2])

    def written(self) -> np.ndarray:
        return np.array(self._a[2::2])

    def version(self) -> int:
        """Word 0 plus every shard's changes (see the module)."""
        words = self._words
        return words[0] + sum(words[1::2])
