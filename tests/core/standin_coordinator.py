"""A Coordinator over stand-in shard handles, and samplers reading as its shards read, for the Ray-free core's tests.

Batches are planned by the coordinator's own draw (check, begin_epoch, then per
slice read_args, counts and seeds) over stand-in shard handles, and read as shards
read them (one generator per seed, the read's Epoch token). Nothing here imports Ray.
"""
from __future__ import annotations

import numpy as np

from rayrb.actors.coordinator import Coordinator
from rayrb.core.plans import OFFLINE, ONLINE, SIDES, BatchPlan
from rayrb.core.samplers import Sampler, make_sampler


# ---------------------------------------------------------------------------------------------------------------
# The coordinator over stand-in shard handles
# ---------------------------------------------------------------------------------------------------------------
class _Method:
    def __init__(self, fn):
        self.remote = fn


class StandInShard:
    """What the coordinator calls on a shard handle, recorded."""

    def __init__(self):
        self.updates: list[tuple] = []
        self.mass_stats = _Method(lambda: (1.0, 1.0))
        self.update_priority = _Method(lambda *a: self.updates.append(tuple(np.asarray(x).tolist() for x in a)))



def written_online(coord: Coordinator, rows: list[int]) -> None:
    """Online shard ``i`` holds ``rows[i]`` rows, as the coordinator's write log records them."""
    coord._writing.log.reset(rows)
    assert coord.sizes()[ONLINE] == list(rows)


class Layout:
    """A Coordinator over stand-in shards of these sizes, and one sampler per shard reading as a shard reads."""

    def __init__(self, kind: str, sizes: dict, *, fraction: float = 0.5, seed: int = 0, drop_last: bool | None = None,
                 epoch_end: str | None = None):
        self.kind = kind
        self.sizes = {side: np.asarray(sizes[side], np.int64) for side in SIDES}
        self.coord = Coordinator([StandInShard() for _ in sizes[OFFLINE]], sizes[OFFLINE],
                                 [StandInShard() for _ in sizes[ONLINE]], sizes[ONLINE], offline_fraction=fraction,
                                 sampler=kind, drop_last=drop_last, epoch_end=epoch_end, seed=seed)
        written_online(self.coord, sizes[ONLINE])
        self.samplers = {side: self.fresh_samplers(side) for side in SIDES}

    def fresh_samplers(self, side: str) -> list[Sampler]:
        kind = self.kind[side] if isinstance(self.kind, dict) else self.kind
        return [make_sampler(kind, max(1, int(n))) for n in self.sizes[side]]

    def draw(self, batch_size: int, num_slices: int = 1) -> list[tuple[BatchPlan, list]]:
        """The plans and reads that ``plan`` groups for the handles to submit."""
        drawing, sizes = self.coord._drawing, self.coord._sizes()
        drawing._sync_masses(sizes)
        return drawing._draw(batch_size, sizes, num_slices, None)

    def read(self, plan: BatchPlan, reads: list) -> list[np.ndarray]:
        """Each part's local row indices, as its shard's sampler returns them."""
        return [self.samplers[p.side][p.shard].sample(p.count, int(self.sizes[p.side][p.shard]),
                                                      np.random.default_rng(seed), epoch=kw.get("epoch"))
                for p, (seed, kw) in zip(plan.parts, reads)]

    def rows(self, plan: BatchPlan, reads: list) -> list[tuple[str, int, int]]:
        return [(p.side, p.shard, int(i)) for p, idx in zip(plan.parts, self.read(plan, reads)) for i in idx]

    def batch(self, batch_size: int, num_slices: int = 1) -> list[tuple[str, int, int]]:
        return [row for plan, reads in self.draw(batch_size, num_slices) for row in self.rows(plan, reads)]

    def epochs(self, side: str) -> int:
        return self.coord.stats(include_shards=False)["coordinator"]["epochs"][side]

    def left(self, side: str) -> int:
        return sum(self.coord.state_dict()["allocator"]["left"][side] or [0])


def every_row(sizes, side: str) -> list[tuple[str, int, int]]:
    return sorted((side, s, i) for s, n in enumerate(sizes) for i in range(n))


