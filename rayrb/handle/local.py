"""Reads a handle makes itself: a shard's rows gathered in the handle's process, from the files the shard maps.

A plan names, per shard, the reads' counts, seeds, epochs and the online write count
they were planned at; the shard turns those into indices and gathers. On the shard's
node the handle can do the same without an actor call: it computes the indices the
shard would (the same sampler, the same seeds) and copies the rows out of the same
files, which the kernel shares between the processes that map them (no copy of the
dataset per handle). Across nodes, and for what only the shard can do, the shard reads
and sends, as before.

* **Offline shards**: the chunk files are immutable, so a mapped chunk is never stale;
  a handle maps them once its node is the shard's.
* **Online shards**: the shard's memory maps under ``storage_dir`` (or a replica's, on a node where the
  shard has a replica and not itself: ``online_replicas``). A read goes
  locally only while the shard's process is alive on this node (it holds its lease's
  lock, ``rayrb.durability.lease.held``: released by the kernel however the process
  dies), its files are those this handle maps (``rayrb.durability.storage.identity``:
  a shard that made its files afresh is mapped again; both checks hold for ``TRUST``
  seconds, far less than a shard's new process takes to start, and are made again after
  a copy that outlasted them), and the shard holds the rows the read was planned over
  (its write count). Each row's
  generation is read before and after its copy; the shard makes it negative while it
  writes the row, so a row being overwritten, or torn, is never served: the read then
  goes to the shard, which serializes it with its writes and applies the same rule
  (``rayrb.durability.storage.whole``) to a row a crash left torn: it waits for the
  row's write, sent again, to land.
* **Not local**: online rows on machines whose stores another process may see out of
  order (``ordered_stores``: the generation check needs x86's store order), prioritized
  sampling (the sum tree lives in the shard), rows held on
  a GPU (``storage_device="cuda"``), shards on another node, files this node cannot
  open. ``local_reads=False`` turns the path off; the stream is the same either way.

A local read that cannot go (any check above) returns None, and the caller reads that
part from the shard instead.
"""
from __future__ import annotations

import os
import platform
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rayrb.core.layout import Shard, ShardLayout
from rayrb.core.plans import OFFLINE, OFFLINE_GENERATION, Epoch
from rayrb.core.reads import read_indices, read_size
from rayrb.core.samplers import make_sampler
from rayrb.core.schema import RowSpec
from rayrb.durability.storage import whole

# samplers whose indices need no shard state
LOCAL_KINDS = ("uniform", "without_replacement", "slice", "slice_without_replacement")
TRUST = 0.005  # seconds a check of an online shard's process and files holds (OnlineReader._current)


class Reader:
    """A shard's reads, made here (see the module)."""

    def __init__(self, sampler: str, capacity: int, options: Mapping[str, Any] | None = None):
        """``options``: the kind's own (a slice sampler's, ``slice_options``)."""
        self._sampler = make_sampler(sampler, max(1, capacity), **(options or {}))
        self._epochs = sampler in ("without_replacement", "slice_without_replacement")
        self._key = getattr(self._sampler, "key", None)  # slices: the column episodes are found by

    def _indices(self, counts: Sequence[int], seeds: Sequence[int], epochs: Sequence[Epoch | None] | None,
                 size: int) -> np.ndarray | None:
        if self._epochs and (not epochs or any(e is None for e in epochs)):
            return None  # the shard's own place in an epoch: only the shard knows it
        try:
            return read_indices(self._sampler, counts, seeds, epochs, size)
        except ValueError:  # an empty shard, an epoch it cannot serve: the shard says why
            return None

    def read(self, counts: Sequence[int], seeds: Sequence[int], epochs: Sequence[Epoch | None] | None,
             written: int | None, out: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """The rows the shard would read for these arguments, copied into ``out``; their info (index,
        generation), or None if they cannot be read here (see the module)."""
        raise NotImplementedError

    ahead_wanted = False  # rows named ahead of their read (``read_ahead``): an offline dataset read cold

    def read_ahead(self, counts: Sequence[int], seeds: Sequence[int], epochs: Sequence[Epoch | None] | None,
                   written: int | None) -> bool | None:
        """Name the rows these arguments will read to the kernel ahead of the read (``rayrb.io.read_ahead``): True
        if queued, False if dropped (ask again later), None if there is nothing to do (rows in memory, or cached)."""
        return None

    def close(self) -> None:
        """Let go of what this reader holds open (its maps go with the last reference to them)."""


class OfflineReader(Reader):
    """Rows ``[start, stop)`` of the chunk dataset at ``root``, as the offline shard maps them."""

    def __init__(self, root: str, start: int, stop: int, sampler: str, options: Mapping[str, Any] | None = None):
        from rayrb.io.chunks import ChunkDataset

        super().__init__(sampler, stop - start, options)
        self._ds = ChunkDataset.open(root)  # raises where this node cannot see the chunks
        self._start, self._size = int(start), int(stop - start)
        if self._key is not None:  # immutable rows: the episodes found once, as the shard finds them
            self._sampler.bind({self._key: self._ds.column(self._key, self._start, stop)}, None)

    @property
    def ahead_wanted(self) -> bool:
        return self._ds.ahead_wanted

    def read_ahead(self, counts, seeds, epochs, written):
        if not self._ds.ahead_wanted:  # the dataset's batches are cached: no indices drawn for nothing
            return None
        idx = self._indices(counts, seeds, epochs, self._size)
        return None if idx is None else self._ds.read_ahead(idx + self._start)

    def read(self, counts, seeds, epochs, written, out):
        idx = self._indices(counts, seeds, epochs, self._size)
        if idx is None:
            return None
        self._ds.gather(idx + self._start, out=out, checked=False)  # drawn in [0, size): within the rows
        return {"index": idx, "generation": np.full(idx.shape, OFFLINE_GENERATION, np.int64),
                **self._sampler.info(idx)}


class OnlineReader(Reader):
    """An online shard's memory maps in ``directory``, read while its process lives on this node."""

    def __init__(self, directory: str, spec: RowSpec, capacity: int, sampler: str,
                 options: Mapping[str, Any] | None = None):
        from rayrb.durability.lease import FILE

        super().__init__(sampler, capacity, options)
        from rayrb.durability.storage import layout_path

        self._dir, self._spec, self._capacity = directory, spec, int(capacity)
        self._layout = layout_path(directory)
        self._lease_fd = os.open(os.path.join(directory, FILE), os.O_RDONLY)  # raises if not here
        self._maps: dict[str, Any] | None = None
        self._checked = -TRUST  # when the shard's process and files were last found as mapped

    def close(self) -> None:
        self._maps = None
        if self._lease_fd >= 0:
            os.close(self._lease_fd)
            self._lease_fd = -1

    def _current(self, now: float) -> dict[str, Any] | None:
        """The shard's files as mapped here, mapped again if the shard made them afresh; None if it cannot say.
        A check holds for ``TRUST`` seconds: a shard's new process takes far longer than that to start and make
        its files afresh after the old one died (at least a process start; Ray's restart takes ~0.5 s)."""
        from rayrb.durability.lease import held
        from rayrb.durability.storage import identity, read_only

        if self._maps is not None and now - self._checked < TRUST:
            return self._maps
        if not held(None, self._lease_fd):  # the shard's process is gone from this node (restarting, or moved)
            self._checked = -TRUST
            return None
        if self._maps is None or identity(self._layout) != self._maps["identity"]:
            self._maps = read_only(self._spec, self._capacity, self._dir)
            if self._maps is not None and self._key is not None:  # slices: episodes found in these maps
                self._sampler.bind(self._maps["rows"], self._maps["generation"], self._maps["written"])
        self._checked = now if self._maps is not None else -TRUST
        return self._maps

    def read(self, counts, seeds, epochs, written, out):
        maps = self._current(time.monotonic())
        if maps is None:
            return None
        count = int(maps["written"][0])
        size = read_size(count, self._capacity, written)
        if size is None:
            return None  # planned after writes that have not landed yet: the shard waits for them
        idx = self._indices(counts, seeds, epochs, size)
        if idx is None:
            return None
        gen = maps["generation"]
        before = gen[idx]
        if not whole(before):
            return None  # a row being written, or left torn by a crash: the shard applies the same rule
        if idx.size and int(((before - 1) * self._capacity + idx).max()) >= count:
            # a row of a piece stored ahead of the write count (not acknowledged) where an older one was: the
            # shard, which leaves such rows out, reads; with slices the episodes here are found again first
            if self._key is not None:
                self._sampler.forget()
            return None
        for k, v in maps["rows"].items():  # idx in range (gen[idx] above): "clip" copies straight into out
            v.take(idx, axis=0, out=out[k], mode="clip")
        if not (gen[idx] == before).all():
            return None  # overwritten during the copy
        if self._key is not None and not self._sampler.whole((before - 1) * self._capacity + idx, out[self._key]):
            return None  # the episodes moved under the draw (a write between them and the copy): the shard reads
        now = time.monotonic()
        if now - self._checked >= TRUST and self._current(now) is not maps:
            return None  # the copy outlasted the check: the files may have been made afresh meanwhile
        return {"index": idx, "generation": before, **self._sampler.info(idx, before)}


def slice_options(layout: ShardLayout) -> dict[str, Any]:
    """A slice sampler's options as the shards were given them, from the layout (none without slices)."""
    if layout.episodes is None:
        return {}
    strict = {} if layout.strict_length else {"slice_strict": False}  # as SliceSampler.resolve gives them
    return {"slice_len": layout.slice_len, "slice_key": layout.episodes[0], "slice_ends": layout.episodes[1],
            **strict}


def ordered_stores(machine: str | None = None) -> bool:
    """Whether this machine makes another process's stores visible in the order it made them (x86's total store
    order), which reading the generations around a copy relies on: numpy puts no fences between the shard's
    stores, nor between the reader's loads. Elsewhere (ARM, POWER) online rows are read by their shard.

    >>> ordered_stores("x86_64"), ordered_stores("AMD64"), ordered_stores("aarch64")
    (True, True, False)
    """
    return (machine if machine is not None else platform.machine()).lower() in ("x86_64", "amd64", "i686", "i386")


class LocalReads:
    """The readers of one handle, made at first use for the shards this process can read (see the module).

    ``layout`` is the buffer's (``rayrb.core.layout.ShardLayout``). ``node`` is this process's node; ``place(j)``
    asks shard ``j`` (offline first) for its node, ``place(name)`` the actor of that name.
    """

    def __init__(self, layout: ShardLayout, spec: RowSpec, node: str | None, place: Any):
        self._layout, self._spec, self._node, self._place = layout, spec, node, place
        self._options = slice_options(layout)
        self._m = len(layout.offline)
        self._readers: dict[int, Reader | None] = {}
        self._all: bool | None = None
        self.stats = {"local": 0, "fell_back": 0}

    def reader(self, side: str, shard: int) -> Reader | None:
        j = shard if side == OFFLINE else self._m + shard
        if j not in self._readers:
            self._readers[j] = self._make(j)
        return self._readers[j]

    def all_local(self) -> bool:
        """Whether this process reads every shard itself."""
        if self._all is None:
            self._all = all(self.reader(d.side, d.index) is not None for d in self._layout.shards)
        return self._all

    def forget(self, side: str, shard: int) -> None:
        """Ask again at the next read (the shard may have moved to this node, or away from it)."""
        reader = self._readers.pop(shard if side == OFFLINE else self._m + shard, None)
        if reader is not None:
            reader.close()
        self._all = None

    def close(self) -> None:
        """Close every reader (a closed handle's): their lease descriptors and maps go now, not at exit."""
        for reader in self._readers.values():
            if reader is not None:
                reader.close()
        self._readers.clear()
        self._all = None

    def _make(self, j: int) -> Reader | None:
        d = self._layout.shards[j] if j < len(self._layout.shards) else None
        if d is None or d.sampler not in LOCAL_KINDS or self._node is None:
            return None
        try:
            if d.side != OFFLINE and (d.directory is None or not ordered_stores()):
                return None
            if self._place(j) != self._node:
                return None if d.side == OFFLINE else self._copy(d)
            if d.side == OFFLINE:
                return OfflineReader(d.root, d.start, d.stop, d.sampler, self._options)
            return OnlineReader(d.directory, self._spec, d.capacity, d.sampler, self._options)
        except Exception:  # files this node cannot open, a shard that does not answer: the shard reads
            return None

    def _copy(self, d: Shard) -> Reader | None:
        """A replica of online shard ``d`` on this node (``online_replicas`` ≥ 2), read as the shard itself is:
        it holds every row its primary acknowledged, and a read it cannot serve goes to the primary."""
        for copy in d.copies:
            try:
                if self._place(copy.name) == self._node:
                    return OnlineReader(copy.directory, self._spec, d.capacity, d.sampler, self._options)
            except Exception:  # gone, restarting, or its files not here
                continue
        return None

    def ahead_wanted(self) -> bool:
        """Whether a reader made here wants the rows it reads next named ahead (``Reader.ahead_wanted``)."""
        return any(reader is not None and reader.ahead_wanted for reader in self._readers.values())

    def read_ahead(self, side: str, shard: int, args: tuple) -> bool | None:
        """``args`` (counts, seeds, epochs, written) named to the kernel ahead of their read here
        (``Reader.read_ahead``); None where this process does not read that shard."""
        reader = self._readers.get(shard if side == OFFLINE else self._m + shard)
        return None if reader is None else reader.read_ahead(*args)

    def read_into(self, side: str, shard: int, args: tuple, out: Mapping[str, np.ndarray]) -> dict | None:
        """``args`` (counts, seeds, epochs, written) read here into ``out`` (arrays of the rows' length); their
        info, or None: the shard must read them (``out`` then holds nothing of use)."""
        reader = self.reader(side, shard)
        if reader is None:
            return None
        info = reader.read(*args, out=out)
        self.stats["local" if info is not None else "fell_back"] += 1
        return info
