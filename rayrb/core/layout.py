"""The buffer's shape, decided once: each shard's side, id, actor name, state directory, rows, sampler, node hint
and copies, and the coordinator's name and directory. No Ray.

The owner builds it from the checked settings when the buffer starts (``ShardLayout.build``); start-up, the
coordinator's arguments, the handles' local reads and writes, and checkpoints take it, so nothing computes a name
or a directory twice (a mismatch would silently turn a handle's local reads off). It is frozen and small:
handles carry it when pickled.

* a shard's **id** is ``off-<i>`` or ``on-<i>``, and a replica's ``on-<i>.r<copy>``;
* its **actor name** is ``<buffer>/<id>``, and the coordinator's is the buffer's name;
* its **state directory** is ``<storage_dir>/<instance>/<id>`` (None without a ``storage_dir``: rows in process
  memory), the coordinator's ``<storage_dir>/<instance>/coordinator``; ``instance`` is the buffer's name as a
  directory name and a random suffix, so two buffers of one name never share files;
* offline shards take contiguous row ranges of the dataset, as even as possible; online shards split the
  capacity as evenly (larger ones first).

Examples:
    >>> lay = ShardLayout.build("buf", "buf-1a2b3c4d", "/state", dataset_root="/data/ds", offline_rows=10,
    ...                         num_offline=2, online_capacity=7, num_online=2, samplers=("uniform", "uniform"),
    ...                         replicas=2)
    >>> [(s.id, s.name, s.start, s.stop) for s in lay.offline]
    [('off-0', 'buf/off-0', 0, 5), ('off-1', 'buf/off-1', 5, 10)]
    >>> [(s.id, s.capacity, s.directory, [c.name for c in s.copies]) for s in lay.online]
    [('on-0', 4, '/state/buf-1a2b3c4d/on-0', ['buf/on-0.r1']), ('on-1', 3, '/state/buf-1a2b3c4d/on-1', ['buf/on-1.r1'])]
    >>> lay.coordinator_dir, lay.online[1].copies[0].directory
    ('/state/buf-1a2b3c4d/coordinator', '/state/buf-1a2b3c4d/on-1.r1')
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rayrb.core.allocation import row_ranges, split_evenly
from rayrb.core.episodes import whole_ranges
from rayrb.core.plans import OFFLINE, ONLINE


def shard_id(side: str, i: int, copy: int = 0) -> str:
    """Shard ``i`` of a side within its buffer, and copy ``copy`` of an online shard.

    >>> shard_id(OFFLINE, 3), shard_id(ONLINE, 1), shard_id(ONLINE, 1, copy=2)
    ('off-3', 'on-1', 'on-1.r2')
    """
    return f"{'off' if side == OFFLINE else 'on'}-{i}" + (f".r{copy}" if copy else "")


def state_directory(storage_dir: str | os.PathLike | None, instance: str, actor: str) -> str | None:
    """Where actor ``actor`` (a shard id, or ``coordinator``) of buffer instance ``instance`` keeps its files."""
    return None if storage_dir is None else str(Path(storage_dir) / instance / actor)


@dataclass(frozen=True)
class Copy:
    """A replica of an online shard: its actor name and state directory."""

    name: str
    directory: str | None


@dataclass(frozen=True)
class Shard:
    """One shard's place (see the module). Offline: rows ``[start, stop)`` of the dataset at ``root``; online:
    ``capacity`` slots, a node hint (``online_nodes``) and its replicas."""

    side: str
    index: int
    id: str
    name: str
    directory: str | None
    sampler: str
    start: int = 0
    stop: int = 0
    root: str | None = None
    capacity: int = 0
    node: str | None = None
    copies: tuple[Copy, ...] = ()

    @property
    def rows(self) -> int:
        """Rows an offline shard holds, slots an online one has."""
        return self.stop - self.start if self.side == OFFLINE else self.capacity


@dataclass(frozen=True)
class ShardLayout:
    """Every shard of a buffer, offline first, and its coordinator (see the module)."""

    buffer: str
    instance: str
    coordinator_dir: str | None
    shards: tuple[Shard, ...]
    # slices: the flat key episodes are found by and whether it holds end flags, and the slices' length (None:
    # rows are drawn one by one)
    episodes: tuple[str, bool] | None = None
    slice_len: int | None = None
    strict_length: bool = True  # False: episodes shorter than a slice are slices too (read padded)

    @property
    def offline(self) -> tuple[Shard, ...]:
        return tuple(s for s in self.shards if s.side == OFFLINE)

    @property
    def online(self) -> tuple[Shard, ...]:
        return tuple(s for s in self.shards if s.side == ONLINE)

    def side(self, side: str) -> tuple[Shard, ...]:
        return self.offline if side == OFFLINE else self.online

    @classmethod
    def build(cls, buffer: str, instance: str, storage_dir: str | os.PathLike | None, *, dataset_root: str,
              offline_rows: int, num_offline: int, online_capacity: int, num_online: int, samplers: Sequence[str],
              replicas: int = 1, online_nodes: Sequence[str | None] | None = None,
              episodes: tuple[str, bool] | None = None, episode_starts: Sequence[int] | None = None,
              slice_len: int | None = None, strict_length: bool = True) -> ShardLayout:
        """The layout of buffer ``buffer`` (its coordinator's actor name) for these checked settings;
        ``samplers``: the offline side's and the online side's. With slices, ``episodes`` says where episodes are
        found, and ``episode_starts`` (the offline rows that begin one) move each offline shard's first row to an
        episode's first, so that an offline shard holds whole episodes (``rayrb.core.episodes.whole_ranges``)."""
        def place(side: str, i: int, **more) -> Shard:
            sid = shard_id(side, i)
            return Shard(side, i, sid, f"{buffer}/{sid}", state_directory(storage_dir, instance, sid),
                         samplers[0 if side == OFFLINE else 1], **more)

        ranges = row_ranges(offline_rows, num_offline)
        if episode_starts is not None:
            ranges = whole_ranges(ranges, episode_starts)
        offline = [place(OFFLINE, i, start=a, stop=b, root=str(dataset_root)) for i, (a, b) in enumerate(ranges)]
        nodes = list(online_nodes) if online_nodes is not None else [None] * num_online
        online = [place(ONLINE, i, capacity=int(c), node=nodes[i],
                        copies=tuple(Copy(f"{buffer}/{shard_id(ONLINE, i, r)}",
                                          state_directory(storage_dir, instance, shard_id(ONLINE, i, r)))
                                     for r in range(1, replicas)))
                  for i, c in enumerate(split_evenly(online_capacity, num_online))]
        return cls(buffer, instance, state_directory(storage_dir, instance, "coordinator"), tuple(offline + online),
                   episodes, slice_len, strict_length)
