"""``rb.offline_buffer`` and ``rb.online_buffer``: one side of a buffer, as TorchRL's sub-buffers are used.

TorchRL's trainer hooks and many scripts read ``len(rb.offline_buffer)``, call
``rb.offline_buffer.sample(n)`` or save ``rb.online_buffer.state_dict()``. A
``SideView`` answers those from the shards: it holds no rows, sampling
draws from a stream of its own (uniformly over the side's rows) and leaves the
buffer's batches, epochs and rate limiter untouched, and rows travel only when
asked for.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from rayrb.core.plans import OFFLINE, ONLINE, assemble
from rayrb.core.validation import one_of
from rayrb.errors import SavedStateError


class _Storage:
    """What callers read off ``buffer.storage``: its size and where rows live."""

    device = "cpu"

    def __init__(self, view: "SideView"):
        self._view = view

    def __len__(self) -> int:
        return len(self._view)

    @property
    def max_size(self) -> int:
        return self._view.capacity


class SideView:
    """One side (``"offline"`` or ``"online"``) of an ``OfflineToOnlineReplayBuffer``."""

    def __init__(self, rb: Any, side: str):
        self._rb, self.side = rb, one_of("side", side, (OFFLINE, ONLINE))
        self.storage = _Storage(self)

    def __len__(self) -> int:
        return int(sum(self._rb.sizes()[self.side]))

    @property
    def capacity(self) -> int:
        sizes = self._rb.sizes()
        return int(sum(sizes["offline"])) if self.side == OFFLINE else int(sum(sizes["online_capacity"]))

    @property
    def write_count(self) -> int:
        return self._rb.write_count if self.side == ONLINE else len(self)

    def sample(self, batch_size: int | None = None, return_info: bool = False):
        """``batch_size`` rows of this side, uniformly with replacement (a TensorDict; with info if asked), from
        the views' own stream; without the buffer's ``transform``, as TorchRL's side buffers give their rows (its
        ``OfflineToOnlineReplayBufferHook`` reads the offline keys from them)."""
        rpc = self._rb.rpc
        plan, indices = rpc.get(rpc.coord.plan_side.remote(self.side, self._rb.output.size(batch_size)))
        refs = [rpc.by_side[p.side][p.shard].gather.remote(idx) for p, idx in zip(plan.parts, indices)]
        # uniform rows, not slices: never trimmed as short slices
        return self._rb.output.finish(assemble(plan, rpc.get(refs), return_info), return_info, sliced=False,
                                      transform=False)

    def extend(self, data: Any):
        if self.side == OFFLINE:
            from rayrb.io.chunks import ReadOnlyError

            raise ReadOnlyError("the offline dataset is immutable: extend the online buffer instead")
        return self._rb.extend(data)

    def add(self, data: Any) -> int:
        if self.side == OFFLINE:
            self.extend(data)  # raises
        return self._rb.add(data)

    def state_dict(self) -> dict[str, Any]:
        """The side's shard states (rows, generations, write counts, priorities), copied to the caller."""
        rpc = self._rb.rpc
        return {"side": self.side, "shards": rpc.get(rpc.get(rpc.coord.shard_states.remote(self.side)))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("side") != self.side:
            raise SavedStateError(f"expected a state_dict of the {self.side} side, got one of {state.get('side')!r}")
        states = [{k: np.asarray(v) for k, v in st.items()} for st in state["shards"]]
        self._rb.give_back()  # batches drawn ahead hold rows this replaces
        rpc = self._rb.rpc  # every shard checks its state before any applies it; then their counts are taken
        rpc.get(rpc.get(rpc.coord.load_shard_states.remote(self.side, states)))
        rpc.get(rpc.coord.resync.remote())

    def __repr__(self) -> str:
        return f"SideView({self.side}, buffer={self._rb.name!r})"
