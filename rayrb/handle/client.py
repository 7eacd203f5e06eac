"""The handle that collectors and learners hold: ``BufferClient``.

A client holds the coordinator's and shards' actor handles, the row spec and a few
settings; it is small and picklable, so it is passed to collector and learner
actors. It writes, samples and steers, but it does not own the buffer: only the
``OfflineToOnlineReplayBuffer`` that created the actors shuts them
down. Pickling that owner gives a client.

Every remote call goes through its ``Rpc``. Every way of
sampling goes through a ``Stream``: the coordinator plans,
this handle reads the shards. The methods in ``GIVES_BACK_BEFORE`` first give
back what the handle's ``sample()`` loop drew ahead.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from rayrb.core.plans import OFFLINE
from rayrb.core.schema import RowSpec
from rayrb.core.validation import positive_int
from rayrb.errors import (
    BufferUnavailableError,  # noqa: F401  (re-exported: rayrb.client)
    InvalidArgumentError,
    WriteTimeoutError,  # noqa: F401  (re-exported: rayrb.client)
)
from rayrb.handle.learners import LearnerPaths
from rayrb.handle.rpc import Rpc
from rayrb.handle.steering import Steering
from rayrb.handle.stream import BatchIterator, Stream
from rayrb.handle.writes import Writes, _node_id
from rayrb.io.arrays import from_numpy_dict

PREFETCH = 32  # batches a plain sample() loop may draw ahead (rayrb.handle.stream)

# The handle's methods that give back what its sample() loop drew ahead before they run: everything that
# writes, steers, saves, or samples another way must see the stream where the caller left it.
GIVES_BACK_BEFORE = ("extend", "update_priority", "sample_async", "iter_batches", "sample_slices", "feed",
                     "anneal", "set_step", "state_dict", "load_state_dict", "stats", "_set_offline_fraction",
                     "_get_offline_fraction", "_set_base_fraction", "load_side_states")


class BufferClient(Writes, LearnerPaths, Steering):
    """Write, sample and steer a running buffer. Made by ``OfflineToOnlineReplayBuffer.client``."""

    _owner = False

    def __init__(self, coord: Any, shards: list, spec: RowSpec, *, name: str, batch_size: int | None,
                 transform: Any, timeout: float | None, max_batch_bytes: int, prefetch: int = PREFETCH,
                 storage_device: str = "cpu", num_offline: int = 1, transport: str = "object_store",
                 read_device: str | None = "cpu", layout: list | None = None, local_reads: bool = True,
                 limited: bool = False):
        self.rpc = Rpc(coord, shards, num_offline, name=name, timeout=timeout)
        self._spec, self._name, self._batch_size, self._transform = spec, name, batch_size, transform
        self._max_batch_bytes, self._storage_device = max_batch_bytes, storage_device
        self._transport, self._read_device = transport, read_device
        self._prefetch = prefetch  # checked by the owner (rayrb.handle.settings, or client())
        # where each shard's files are (rayrb.handle.local), whether to read them here, whether a limiter counts
        self._layout, self._local_enabled, self._limited = layout, local_reads, limited
        self._local: Any = None  # the LocalReads, made at first use (never pickled)
        self._stream: Stream | None = None  # the sample() loop's, made at the first sample()
        self._routes: Any = None  # rayrb.actors.transport.Routes to the learners connected here
        self._learners: list[Any] = []

    # plumbing -----------------------------------------------------------------
    def give_back(self) -> None:
        """Return what this handle's ``sample()`` loop drew ahead and did not serve."""
        if self._stream is not None and not self.rpc.closed:
            self._stream.give_back()

    def batch(self, batch_size: int | None) -> int:
        """The batch size to draw, refused before anything is planned if its rows cannot fit the cap."""
        if batch_size is None:
            batch_size = self._batch_size
        if batch_size is None:
            raise InvalidArgumentError("batch_size must be provided either in __init__ or sample(), got None in both")
        batch_size = positive_int("batch_size", batch_size)
        nbytes = batch_size * max(1, self._spec.row_bytes)
        if nbytes > self._max_batch_bytes:
            raise InvalidArgumentError(f"batch_size={batch_size} needs {nbytes:,} bytes of rows, over max_batch_bytes="
                                       f"{self._max_batch_bytes:,}; sample smaller batches or raise max_batch_bytes")
        return batch_size

    def finish(self, out: Any, return_info: bool, device: Any = None):
        """Flat numpy batch (and info) from the object store -> TensorDict (and tensors), transformed."""
        rows, info = out if return_info else (out, None)
        td = from_numpy_dict(rows)
        if device is not None:
            td = _to_device(td, device)
        if self._transform is not None:
            td = self._transform(td)
        if not return_info:
            return td
        return td, {k: torch.from_numpy(v) for k, v in info.items()}

    def finish_tensors(self, out: Any, return_info: bool):
        """A ``(TensorDict, info)`` that arrived over Ray Direct Transport, transformed."""
        td, info = out
        if self._transform is not None:
            td = self._transform(td)
        return (td, info) if return_info else td

    # sampling -----------------------------------------------------------------
    @property
    def local_reads(self) -> Any:
        """The shard reads this process makes itself (``rayrb.handle.local.LocalReads``), or None when turned
        off (``local_reads=False``) or the layout is unknown."""
        if self._local is None and self._local_enabled and self._layout and self._storage_device == "cpu":
            from rayrb.handle.local import LocalReads

            rpc = self.rpc
            self._local = LocalReads(self._layout, self._spec, len(rpc.by_side[OFFLINE]), _node_id(), rpc.node_of)
        return self._local

    def _loop(self, batch_size: int) -> Stream:
        if self._stream is None:
            self._stream = Stream(self.rpc, batch_size, depth=self._prefetch, spec=self._spec, follow_version=True,
                                  local=self.local_reads, limited=self._limited)
        return self._stream

    def sample(self, batch_size: int | None = None, return_info: bool = False):
        """Sample one batch: offline rows first, then online rows, with the exact split.

        A loop of ``sample()`` calls draws ahead (``prefetch``) and gives back what it did not
        serve before this handle writes or steers; the stream is the one ``prefetch=0`` gives.

        Args:
            batch_size: rows in the batch (default: the buffer's ``batch_size``).
            return_info: also return per-row provenance.

        Returns:
            A ``[batch_size]`` TensorDict; with ``return_info``, ``(batch, info)``, where ``info`` holds
            per row ``offline`` (bool), ``shard``, ``index`` (within the shard), ``generation`` (times that
            slot was written) and, prioritized, ``weight``.

        Raises:
            ValueError: no batch size, or one whose rows exceed ``max_batch_bytes``; or (``epoch_end="raise"``)
                the epoch cannot fill the batch.
            HeldBackTimeout: the rate limiter held sampling back for longer than ``timeout``.
        """
        batch_size = self.batch(batch_size)
        held = self._loop(batch_size).next(batch_size)
        return self.finish((held.batch, held.info()) if return_info else held.batch, return_info)

    def __iter__(self):
        """Batches of ``batch_size``, as TorchRL's datasets iterate: until the offline side's epoch without
        replacement ends (its last batch short, by default), or without end when it samples with replacement."""
        batch_size = self.batch(None)
        while True:
            held = self._loop(batch_size).next(batch_size)
            yield self.finish(held.batch, False)
            if held.last:
                return

    def to_tensordict(self, flat: Any, return_info: bool = False, device: Any = None):
        """Rebuild a batch from ``sample_async`` / ``sample_slices`` output (applies ``transform``).

        Args:
            flat: a flat dict of numpy arrays (or ``(rows, info)``).
            return_info: whether ``flat`` carries info.
            device: where to move the batch.

        Returns:
            A TensorDict, or ``(TensorDict, info)``.
        """
        return self.finish(flat, return_info, device)

    def iter_batches(self, batch_size: int | None = None, *, prefetch: int = 2, device: Any = None,
                     return_info: bool = False, num_batches: int | None = None):
        """Batches in order, keeping exactly up to ``prefetch`` batches in flight.

        Closing the iterator (``close()``, leaving a ``with`` block, ``break``) gives back the
        batches it drew and did not hand over.

        Args:
            batch_size: rows per batch (default: the buffer's).
            prefetch: batches drawn ahead; once a quarter of them is left, the rest are planned in one group.
                Ray's cost is per call (one plan, one read per shard) whatever the group's size, so small
                batches want a deeper prefetch: at B=256, 64 rather than 16 (``docs/benchmarks.md``).
            device: moves each batch there (through pinned memory for CUDA). Inside an actor that Ray
                gave the GPU the shards hold their rows on (``storage_device="cuda"``), ``"cuda"`` reads
                each group from the shards over CUDA IPC instead.
            return_info: yield ``(batch, info)`` pairs.
            num_batches: stop after this many (default: never).

        Returns:
            An iterator of TensorDicts (or ``(TensorDict, info)`` pairs).
        """
        from rayrb.core.validation import optional_positive_int

        return BatchIterator(self, self.batch(batch_size), prefetch=positive_int("prefetch", prefetch),
                             device=device, return_info=return_info,
                             num_batches=optional_positive_int("num_batches", num_batches),
                             direct=_direct_reads(self, device))

    # introspection --------------------------------------------------------------
    def __len__(self) -> int:
        sizes = self.sizes()
        return int(sum(sizes["offline"]) + sum(sizes["online"]))

    @property
    def write_count(self) -> int:
        """Rows ever written to the online side (overwritten ones included)."""
        return int(sum(self.sizes()["online_written"]))

    def sizes(self) -> dict[str, list[int]]:
        """Per-shard sizes as the coordinator allocates with them."""
        return self.rpc.get(self.rpc.coord.sizes.remote())

    def stats(self) -> dict[str, Any]:
        """Sizes, rates, latencies and restarts of the coordinator and every shard.

        Returns:
            ``{"coordinator": {...}, "shards": [...]}``, plus ``"handle"`` (this handle's drawing ahead).
        """
        out = self.rpc.get(self.rpc.coord.stats.remote())
        if self._stream is not None or self._local is not None:
            out["handle"] = {**(self._stream.stats if self._stream is not None else {}),
                             **({f"{k}_reads": v for k, v in self._local.stats.items()} if self._local else {})}
        return out

    @property
    def spec(self) -> RowSpec:
        return self._spec

    @property
    def batch_size(self) -> int | None:
        return self._batch_size

    @property
    def name(self) -> str:
        return self._name

    @property
    def storage_device(self) -> str:
        """Where the shards hold their rows: ``"cpu"`` or ``"cuda"``."""
        return self._storage_device

    @property
    def closed(self) -> bool:
        return self.rpc.closed

    def shutdown(self) -> None:
        """Close this handle. A client never stops the buffer: its owner does.
        """
        self.rpc.closed = True

    close = shutdown

    def __repr__(self) -> str:
        state = "closed" if self.rpc.closed else "open"
        return f"{type(self).__name__}(name={self._name!r}, {state}, spec={self._spec!r}, batch_size={self._batch_size})"

    def __reduce__(self):
        return _client, (self._client_args(),)

    def _client_args(self) -> dict[str, Any]:
        return {"coord": self.rpc.coord, "shards": self.rpc.shards, "spec": self._spec, "name": self._name,
                "batch_size": self._batch_size, "transform": self._transform, "timeout": self.rpc.timeout,
                "max_batch_bytes": self._max_batch_bytes, "prefetch": self._prefetch,
                "storage_device": self._storage_device, "num_offline": len(self.rpc.by_side[OFFLINE]),
                "transport": self._transport, "read_device": self._read_device, "layout": self._layout,
                "local_reads": self._local_enabled, "limited": self._limited}


def _gives_back(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        self.give_back()
        return method(self, *args, **kwargs)

    return wrapper


for _name in GIVES_BACK_BEFORE:
    setattr(BufferClient, _name, _gives_back(getattr(BufferClient, _name)))


def _client(args: dict[str, Any]) -> BufferClient:
    return BufferClient(**args)


def _to_device(td: Any, device: Any):
    device = torch.device(device)
    if device.type == "cuda":
        return td.pin_memory().to(device, non_blocking=True)
    return td.to(device)


def _direct_reads(handle: BufferClient, device: Any) -> dict[str, list] | None:
    """The shard handles by side, when batches can go from GPU shards to this process's GPU over CUDA IPC:
    ``device`` is CUDA, the shards hold their rows on a GPU, and Ray gave this actor that GPU. Else None."""
    if device is None or handle.storage_device == "cpu" or torch.device(device).type != "cuda":
        return None
    import ray

    from rayrb.actors.transport import Place, choose

    try:
        mine = Place("consumer", ray.get_runtime_context().get_node_id(), tuple(str(g) for g in ray.get_gpu_ids()))
    except Exception:
        return None
    shard_places = handle.rpc.get([s.place.remote() for s in handle.rpc.shards])
    if not all(choose(Place(str(i), p["node"], tuple(p["gpus"])), mine) == "cuda_ipc"
               for i, p in enumerate(shard_places)):
        return None
    return handle.rpc.by_side
