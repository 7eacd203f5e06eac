"""The two ways a handle samples, as policies over one ``Stream`` (``rayrb.handle.stream``): how far it plans
and reads ahead, and what it does around each batch it serves.

* ``Loop``, the handle's ``sample()`` loop. The caller may write or steer between any
  two batches, and each of those gives back what was drawn ahead, so the loop plans as
  far ahead as the caller sampled between its last two give-backs, and reads within
  ``max_bytes`` of rows. Other handles write and steer too: before each batch the loop
  reads the coordinator's version and gives back batches planned at an older one.
  Under a rate limiter (or without the version map) it reports each batch served, so
  the limiter's window is the one single calls would see.
* ``Ahead``, an iterator. It serves every batch it plans unless closed, so it plans
  deep and reads ``depth`` batches ahead, and nothing else happens between its batches.
"""
from __future__ import annotations

from typing import Any

MAX_BYTES = 64 << 20  # rows a sample() loop holds read ahead
MAX_DEPTH = 100  # batches a sample() loop reads ahead


class Ahead:
    """An iterator's policy: plan deep, read ``depth`` ahead (see the module)."""

    def target(self, deep: int, now: bool) -> int:
        """Batches to keep planned ahead, of ``deep`` that one plan call may cover."""
        return deep

    def window(self, depth: int, batch_size: int) -> int:
        """Batches whose shard reads may be submitted ahead."""
        return depth

    def before(self, stream: Any) -> None:
        """Before a batch is served: nothing changes between an iterator's batches."""

    def after(self, stream: Any, number: int) -> None:
        """After a batch is served."""

    def gave_back(self, count: int) -> None:
        """``count`` batches were given back."""


class Loop:
    """The ``sample()`` loop's policy (see the module). ``row_bytes`` of a row bound its reads ahead to
    ``max_bytes``; ``limited``: the buffer has a rate limiter, whose window needs each batch's report."""

    def __init__(self, row_bytes: int, *, limited: bool = False, max_bytes: int = MAX_BYTES):
        self.row_bytes, self.limited, self.max_bytes = max(1, row_bytes), limited, max_bytes
        self.served = 0  # since the last give-back
        self.run: int | None = None  # served between the last two give-backs
        self.version_ref: Any = None  # the coordinator's version, asked for with the previous batch's report

    def target(self, deep: int, now: bool) -> int:
        return int(min(deep, self.expected(now)))

    def expected(self, now: bool) -> int | float:
        """``sample()`` calls expected before the next give-back, the one being asked for ``now`` included.

        That is what is left of the last run between give-backs. Past its end a give-back
        may come any time, so nothing is planned before it is asked for, unless this run
        is already twice as long as the last.

        >>> loop = Loop(8)
        >>> loop.expected(True)  # no give-back yet: as deep as a plan call goes
        inf
        >>> loop.served = 3; loop.gave_back(0); loop.served = 1
        >>> loop.expected(False), loop.target(240, False)
        (2, 2)
        >>> loop.served = 3; loop.expected(False), loop.expected(True)
        (0, 1)
        """
        if self.run is None:
            return float("inf")
        left = self.run - self.served
        if left > 0:
            return left
        return float("inf") if self.served >= 2 * max(1, self.run) else int(now)

    def window(self, depth: int, batch_size: int) -> int:
        """``depth`` batches, at most ``MAX_DEPTH`` and ``max_bytes`` of rows.

        >>> Loop(1024).window(32, 256), Loop(1024).window(32, 32768)
        (32, 1)
        """
        return min(depth, MAX_DEPTH, max(0, self.max_bytes // max(1, batch_size * self.row_bytes) - 1))

    def before(self, stream: Any) -> None:
        """Give back what is planned if anyone changed the buffer since it was planned, as of the previous batch
        (``Stream.catch_up``): the version from the memory map on the coordinator's node, else from the answer
        to the previous batch's report."""
        told = stream.rpc.told_version()
        if told is not None:  # this handle's own write, which its shard placed (rayrb.handle.direct)
            stream.catch_up(told)
        ref, self.version_ref = self.version_ref, None
        version = stream.rpc.version()
        if version is None:
            if ref is None:
                return
            version = lambda: stream.rpc.get(ref)  # noqa: E731  (waited for only if something is planned)
        stream.catch_up(version)

    def after(self, stream: Any, number: int) -> None:
        self.served += 1
        if stream.depth and number >= 0 and (self.limited or stream.rpc.version() is None):
            # answered at the next batch: what changed (another node), or served rows the limiter counts
            self.version_ref = stream.report(always=True)

    def gave_back(self, count: int) -> None:
        if self.served or count:
            self.run = self.served
        self.served = 0
