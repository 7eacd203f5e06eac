"""The read side of a ``Stream`` (``rayrb.handle.stream``): each planned batch's parts gathered in this
process from a shard's files (``rayrb.handle.local``) or read by their shards, one read per shard for a run of
consecutive batches, copied into the batch's own arrays."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from rayrb.core.plans import GroupPlan, offline_epoch, provenance, reads_by_plan


class Held:
    """A batch handed over: its rows (for direct reads, ``(TensorDict, info)``), whether it ends an epoch (and
    which: ``epoch``, the offline epoch's number), the version it was planned at, its number; ``info()`` builds its
    provenance when asked for."""

    __slots__ = ("batch", "last", "epoch", "version", "number", "_plan", "_infos")

    def __init__(self, batch: Any, last: bool, version: int, number: int, plan: Any = None, infos: Any = None,
                 epoch: int | None = None):
        self.batch, self.last, self.version, self.number, self.epoch = batch, last, version, number, epoch
        self._plan, self._infos = plan, infos

    def info(self) -> dict[str, np.ndarray]:
        """Per-row provenance (``rayrb.core.plans.provenance``): built only when a caller wants it."""
        info = provenance(self._plan, self._infos)
        if "weight" in info:
            info["weight"] = info["weight"].astype(np.float32)
        return info


class Remote:
    """One shard read covering parts of consecutive batches: its call, then its ``(rows, info)``."""

    __slots__ = ("read", "ref", "result", "batches")

    def __init__(self, read: tuple, ref: Any, batches: int):
        self.read, self.ref, self.result, self.batches = read, ref, None, batches


class Planned:
    """A batch planned and not handed over: its plan, version, number, group, and per part its read
    ``(side, shard, args)`` and, once submitted, the shard read carrying it ``(Remote, offset)``."""

    __slots__ = ("plan", "version", "number", "group", "reads", "sources", "remote", "hinted")

    def __init__(self, plan: Any, version: int, number: int, group: int, reads: list):
        self.plan, self.version, self.number, self.group, self.reads = plan, version, number, group, reads
        self.sources: list[Any] | None = None
        self.remote = False  # a shard read carries one of its parts
        self.hinted = False  # its parts read here were named to the kernel ahead (Reads.hint)


def planned(group: GroupPlan, number: int) -> list[Planned]:
    """The batches of plan answer ``group``, the ``number``-th a stream took, as ``Planned`` (numbered from the
    group's first draw, or -1 when the coordinator keeps no log of them)."""
    numbered = group.first >= 0
    return [Planned(plan, group.version, group.first + j if numbered else -1, number, reads)
            for j, (plan, reads) in enumerate(zip(group.plans, reads_by_plan(group)))]


def orphans(batches: Any) -> list[tuple[int, str, int, int]]:
    """Batches planned and not handed over, as the coordinator keeps them for another handle when they stand
    (``rayrb.core.ahead.AheadLog.orphan``): ``(batch size, one-batch group, rows, online rows)``."""
    out = []
    for b in batches:
        group = GroupPlan([b.plan], [(side, shard) for side, shard, _ in b.reads], [args for _, _, args in b.reads],
                          version=b.version)
        out.append((b.plan.batch_size, group.encoded(), b.plan.batch_size, b.plan.n_online))
    return out


class Reads:
    """The read side of a stream: each planned batch's parts gathered here (``local``) or read by their shards,
    into the batch's own arrays. ``direct`` (shard handles by side) reads GPU shards into this actor's GPU."""

    def __init__(self, rpc: Any, spec: Any, direct: dict[str, list] | None, local: Any, stats: dict[str, int]):
        self.rpc, self._direct, self._stats = rpc, direct, stats
        self._local = None if direct is not None else local
        self._shapes = spec.shapes

    def submit(self, batches: list[Planned]) -> int:
        """Submit the shard reads of ``batches`` that this process does not read itself: per shard, one read for
        each run of consecutive batches of one group. Returns how many batches have a shard read."""
        runs: dict[tuple, list[tuple[Planned, int]]] = {}
        for b in batches:
            b.sources = [None] * len(b.reads)
            for i, (side, shard, args) in enumerate(b.reads):
                if self._local is not None and self._local.reader(side, shard) is not None:
                    continue  # gathered here when served
                runs.setdefault((side, shard, b.group), []).append((b, i))
        for (side, shard, _), parts in runs.items():
            counts, seeds, epochs = [], [], []
            for b, i in parts:
                c, s, e, _written = b.reads[i][2]
                counts += c
                seeds += s
                epochs += e
            read = (side, shard, (counts, seeds, epochs, parts[0][0].reads[parts[0][1]][2][3]))
            remote = Remote(read, self.rpc.read(*read, direct=self._direct), len(parts))
            offset = 0
            for b, i in parts:
                b.sources[i] = (remote, offset)
                b.remote = True
                offset += b.reads[i][2][0][0]
            self._stats["reads"] += 1
        return sum(b.remote for b in batches)

    def hints_wanted(self) -> bool:
        """Whether a dataset this process reads itself wants the rows it reads next named ahead (``hint``)."""
        return self._local is not None and self._local.ahead_wanted()

    def hint(self, batches: Iterable[Planned]) -> None:
        """Name the rows of ``batches`` (planned next, in order) that this process will read itself to the kernel
        ahead of their reads (``rayrb.io.read_ahead``: cold datasets only); stops at a hint dropped because the disk
        is behind, to try that batch again after the next one served."""
        if self._local is None:
            return
        for b in batches:
            if b.hinted:
                continue
            for side, shard, args in b.reads:
                if self._local.read_ahead(side, shard, args) is False:
                    return
            b.hinted = True

    def all_local(self) -> bool:
        """Whether every part is read here: no shard read to submit ahead."""
        return self._local is not None and self._local.all_local()

    def _remote_part(self, b: Planned, i: int) -> Any:
        """Part ``i`` of batch ``b`` from its shard: ``(rows, info)`` (numpy, or tensors for direct reads)."""
        side, shard, args = b.reads[i]
        source = b.sources[i] if b.sources is not None else None
        if source is None:  # not submitted ahead, or a read here that could not go: the shard reads it now
            source = (Remote((side, shard, args), self.rpc.read(side, shard, args, direct=self._direct), 1), 0)
            self._stats["reads"] += 1
        remote, offset = source
        if remote.result is None:
            remote.result = self.rpc.fetch_read(remote.read, remote.ref, self._direct)
            if self._direct is not None:
                from rayrb.actors.transport import split_flat

                remote.result = split_flat(remote.result)
        if remote.batches == 1 and offset == 0:
            return remote.result
        count = args[0][0]
        rows, info = remote.result
        return {k: v[offset:offset + count] for k, v in rows.items()}, {k: v[offset:offset + count]
                                                                      for k, v in info.items()}

    def read(self, b: Planned) -> Held:
        """Batch ``b``: each part read here into the batch's own arrays, or copied there from its shard read
        (one copy of every row, and nothing that pins a shard read's object); provenance left for ``info()``."""
        last = bool(b.plan.last_of_epoch)
        epoch = offline_epoch(b.reads) if last else None
        if self._direct is not None:
            from rayrb.actors.transport import receive

            return Held(receive(b.plan, *(self._remote_part(b, i) for i in range(len(b.reads)))), last,
                        b.version, b.number, epoch=epoch)
        rows: dict[str, np.ndarray] = {}
        infos, offset = [], 0
        for i, (side, shard, args) in enumerate(b.reads):
            count = args[0][0]
            if not rows:
                rows = {k: np.empty((b.plan.batch_size, *shape), dtype) for k, (shape, dtype) in self._shapes.items()}
            out = {k: v[offset:offset + count] for k, v in rows.items()}
            info = None
            if self._local is not None and (b.sources is None or b.sources[i] is None):
                info = self._local.read_into(side, shard, args, out)
            if info is None:
                part_rows, info = self._remote_part(b, i)
                for k, v in out.items():
                    v[...] = part_rows[k]
            infos.append(info)
            offset += count
        return Held(rows, last, b.version, b.number, b.plan, infos, epoch)
