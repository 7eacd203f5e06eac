"""The handle that collectors and learners hold: ``BufferClient``.

A client holds the coordinator's and shards' actor handles, the row spec and a few
settings; it is small and picklable, so it is passed to collector and learner
actors. It writes, samples and steers, but it does not own the buffer: only the
``OfflineToOnlineReplayBuffer`` that created the actors shuts them down. Pickling
that owner gives a client.

Every public method is here. The longer ones hand their work to plain objects:
``Rpc`` (every remote call), ``Writer`` (writes), ``Learners`` (slices and feeding),
``Output`` (batch sizes, TensorDicts), ``Stream`` (every way of sampling: the
coordinator plans, this handle reads the shards). A method marked ``@gives_back``
first returns what the ``sample()`` loop drew ahead (``rayrb.handle.stream``): it
writes, steers, saves or samples another way, so it must see the stream where the
caller left it. ``stats`` gives back too (its counts are of batches served) but keeps
how far the loop plans ahead; reads of sizes and the fraction do not give back.
"""
from __future__ import annotations

import functools
from typing import Any

from rayrb.core.layout import ShardLayout
from rayrb.core.plans import OFFLINE, ONLINE
from rayrb.core.schedules import Schedule, make_schedule
from rayrb.core.schema import RowSpec
from rayrb.core.validation import fraction, non_negative_int, optional_positive_int, positive_int
from rayrb.errors import (
    BufferUnavailableError,  # noqa: F401  (re-exported: rayrb.client)
    WriteTimeoutError,  # noqa: F401  (re-exported: rayrb.client)
)
from rayrb.handle.learners import Learners, direct_reads
from rayrb.handle.output import Output
from rayrb.handle.rpc import Rpc, node_id
from rayrb.handle.sampling import BatchIterator, Sampling
from rayrb.handle.views import SideView
from rayrb.handle.writes import Writer, Written

PREFETCH = 32  # batches a plain sample() loop may draw ahead (rayrb.handle.stream)
MAX_WRITES_IN_FLIGHT = 8  # writes extend(..., wait=False) keeps on their way per handle


def gives_back(method):
    """Mark a handle method that first gives back what the ``sample()`` loop drew ahead (see the module)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        self.give_back()
        return method(self, *args, **kwargs)

    return wrapper


class BufferClient:
    """Write, sample and steer a running buffer. Made by ``OfflineToOnlineReplayBuffer.client``."""

    def __init__(self, coord: Any, shards: list, spec: RowSpec, *, name: str, batch_size: int | None,
                 transform: Any, timeout: float | None, max_batch_bytes: int, prefetch: int = PREFETCH,
                 storage_device: str = "cpu", num_offline: int = 1, transport: str = "object_store",
                 read_device: str | None = "cpu", layout: ShardLayout | None = None, local_reads: bool = True,
                 limited: bool = False, max_writes_in_flight: int = MAX_WRITES_IN_FLIGHT, shards_place: bool = False):
        self.rpc = Rpc(coord, shards, num_offline, name=name, timeout=timeout)
        self.output = Output(spec, batch_size, transform, max_batch_bytes, layout)
        self._spec, self._name = spec, name
        self._sampling = Sampling(self.rpc, spec, prefetch=prefetch, layout=layout,  # checked by the owner
                                  local_reads=local_reads, limited=limited, storage_device=storage_device)
        self._writer = Writer(self.rpc, spec, max_writes_in_flight, ordered_one_by_one=limited, shards_place=shards_place,
                              layout=layout, local=local_reads and storage_device == "cpu")
        self._learners = Learners(self.rpc, self.output, name, transport, read_device, layout)

    # writing ------------------------------------------------------------------
    @gives_back
    def extend(self, data: Any, *, write_id: str | None = None, prefill: bool = False, wait: bool = True) -> Written:
        """Copy rows into the online buffer; their global online indices (int64, in order) once the shards hold
        them. From then on the rows are in the buffer until capacity evicts them, whatever happens to the caller.
        With a rate limiter, a write that runs ahead of the learners waits, up to ``timeout``.

        Args:
            data: a TensorDict, or a (nested) dict of tensors or arrays, with a batch dimension, checked against
                the row spec before anything ships (``SchemaError``: nothing was written).
            write_id: names the write (made up when not given); a retry with the same id and rows is applied
                once and returns the same indices; other rows under a used id are refused (``WriteIdError``).
                ``WriteTimeoutError`` (no answer within ``timeout``) carries it: a retry with it lands once.
            prefill: write past the rate limiter, to seed the online side; wait: ``False`` returns at once a
                ``PendingWrite``, a ``Future`` of the indices (``rayrb.handle.writes``); ``flush()`` waits for them.
        """
        return self._writer.extend(data, write_id=write_id, prefill=prefill, wait=wait)

    def flush(self) -> None:
        """Wait for every ``extend(..., wait=False)`` since the last flush; raise the first that failed."""
        self._writer.flush()

    def add(self, data: Any) -> int:
        """Add one row (no batch dimension), as ``extend`` takes rows; return its global online index."""
        return int(self.extend(self._writer.one_row(data))[0])

    @gives_back
    def update_priority(self, info: dict, priority: Any) -> int:
        """Set the priorities of sampled rows (``sampler="prioritized"``; slices' steps, ``"prioritized_slice"``),
        e.g. ``|td_error|``; the number of rows sent. ``info`` is what ``sample(return_info=True)`` returned with
        the batch, ``priority`` one value per row. Each update goes to the shard that owns its row and is dropped
        there if the slot was overwritten since. The whole call is checked before any shard applies it:
        ``ValueError`` (no provenance, lengths differ, a priority not finite, a buffer that does not sample by
        priority), ``IndexError`` (an index beyond its shard's rows)."""
        return self._writer.update_priority(info, priority)

    # sampling -----------------------------------------------------------------
    def sample(self, batch_size: int | None = None, return_info: bool = False):
        """One batch: offline rows first, then online rows, with the exact split.

        A loop of ``sample()`` calls draws ahead (``prefetch``) and gives back what it did not serve before this
        handle writes or steers; the stream is the one ``prefetch=0`` gives.

        Args:
            batch_size: rows in the batch (default: the buffer's). ``ValueError`` if none, if its rows exceed
                ``max_batch_bytes``, or (``epoch_end="raise"``) if the epoch cannot fill it.
            return_info: return ``(batch, info)``, with per row ``offline``, ``shard``, ``index`` (in the shard),
                ``generation`` (its slot's writes), prioritized ``weight``, with slices ``episode_start``.
        """
        batch_size = self.output.size(batch_size)
        held = self._sampling.loop(batch_size).next(batch_size)
        return self.output.finish_held(held, return_info)

    def iter_epoch(self, return_info: bool = False):
        """Batches as ``for batch in rb`` (TorchRL's iteration) gives them: to the end of the offline epoch without
        replacement (a short last batch, by default), else without end; ``return_info``: ``(batch, info)`` pairs."""
        batch_size, held = self.output.size(None), None
        while held is None or not self._sampling.ends_epoch(held):
            held = self._sampling.loop(batch_size).next(batch_size)
            yield self.output.finish_held(held, return_info)

    __iter__ = iter_epoch

    @gives_back
    def iter_batches(self, batch_size: int | None = None, *, prefetch: int = 2, device: Any = None,
                     return_info: bool = False, num_batches: int | None = None) -> BatchIterator:
        """Batches in order, keeping up to ``prefetch`` batches in flight; closing the iterator (``close()``,
        leaving a ``with`` block, ``break``) gives back the batches it drew and did not hand over.

        Args:
            prefetch: batches drawn ahead. Ray's cost is per call whatever a group's size, so small batches want a
                deeper prefetch: at B=256, 64 rather than 16 (``docs/benchmarks.md``).
            device: moves each batch there (pinned memory for CUDA). In an actor Ray gave the GPU the shards hold
                their rows on (``storage_device="cuda"``), ``"cuda"`` reads over CUDA IPC instead.
            batch_size, return_info: as ``sample``'s; num_batches: stop after this many (default: never).
        """
        return self._sampling.iterator(self.output, self.output.size(batch_size),
                                       prefetch=positive_int("prefetch", prefetch), device=device,
                                       return_info=return_info,
                                       num_batches=optional_positive_int("num_batches", num_batches),
                                       direct=direct_reads(self.rpc, self.storage_device, device))

    @gives_back
    def sample_async(self, batch_size: int | None = None, return_info: bool = False):
        """An ObjectRef to the next batch as a flat dict of numpy arrays (``(rows, info)`` with ``return_info``),
        without waiting for the rows; ``rb.to_tensordict(ray.get(ref))`` rebuilds what ``sample`` returns."""
        return self._learners.sample_async(batch_size, return_info, node_id())

    @gives_back
    def sample_slices(self, num_slices: int, batch_size: int | None = None, *, return_info: bool = False,
                      learners: list | None = None, postprocess: Any = None, split_info: bool = False) -> list:
        """One global batch as ``num_slices`` ObjectRefs, one per learner (RLlib's ``batch_refs`` shape), each a
        flat dict read straight from the shards (``rb.to_tensordict`` rebuilds it). Slices are disjoint, their
        sizes differ by at most one, and the exact offline count holds for the batch and, to a row, per slice.

        Args:
            return_info: slices resolve to ``(rows, info)``; ``split_info``: to a pair of refs.
            learners: actor handles, one per slice (else ``ValueError``): each slice is assembled on its node.
            postprocess: ``postprocess(rows)`` (``postprocess(rows, info)`` with info), run in that task.
        """
        return self._learners.sample_slices(num_slices, batch_size, return_info=return_info, learners=learners,
                                            postprocess=postprocess, split_info=split_info)

    def connect_learners(self, learners: list) -> dict[str, int]:
        """Set the learner actors ``feed`` hands slices to; how many shard-learner pairs take each route.

        ``transport`` decides how rows travel: ``"object_store"``, ``"gloo"`` (CPU tensors), ``"nccl"`` (GPU
        tensors between GPUs), ``"cuda_ipc"`` (GPU shards to learners on the same GPU), ``"auto"`` (per pair).
        RDT routes need ``@ray.remote(enable_tensor_transport=True)`` learner classes and distinct GPUs for NCCL
        (else ``ValueError``, before any group exists); only this handle, the group's creator, may ``feed``."""
        return self._learners.connect(learners)

    @gives_back
    def feed(self, method: str = "update", batch_size: int | None = None, *args: Any, wait: bool = True):
        """Sample one global batch and call ``learner_j.method(plan, *parts, *args)`` on each connected learner,
        which rebuilds its slice with ``rayrb.actors.transport.receive(plan, *parts)`` (slices as in
        ``sample_slices``). Returns the learners' results (bounded by ``timeout``), or with ``wait=False`` their
        refs. Raises ``RuntimeError`` when no learners were connected."""
        return self._learners.feed(method, batch_size, *args, wait=wait)

    def to_tensordict(self, flat: Any, return_info: bool = False, device: Any = None):
        """A TensorDict (or ``(TensorDict, info)``) from ``sample_async`` / ``sample_slices`` output, transformed
        and moved to ``device``."""
        return self.output.finish(flat, return_info, device)

    # steering -----------------------------------------------------------------
    @property
    def offline_fraction(self) -> float:
        """The fraction the next batch has (after any schedule or annealing); setting it gives back first."""
        planned = self._sampling.next_fraction()
        return planned if planned is not None else float(self.rpc.get(self.rpc.coord.offline_fraction.remote()))

    @offline_fraction.setter
    @gives_back
    def offline_fraction(self, value: float | Schedule | str | dict) -> None:
        self.rpc.get(self.rpc.coord.set_offline_fraction.remote(make_schedule(value)))

    _offline_fraction = offline_fraction  # TorchRL's private name, which its trainer hooks read and assign

    _base_offline_fraction = property(  # a base change alone leaves the next batch as it is: nothing to give back
        lambda self: float(self.rpc.get(self.rpc.coord.base_fraction.remote())),
        lambda self, v: self.rpc.get(self.rpc.coord.set_base_fraction.remote(fraction("base_offline_fraction", v))),
        doc="The fraction ``anneal`` decays from (TorchRL's name).")

    @gives_back
    def anneal(self, step: int, total_steps: int) -> None:
        """Decay ``offline_fraction`` linearly to 0 over ``total_steps`` (TorchRL's) from its base: the fraction the
        buffer was made with, or ``_base_offline_fraction`` as set (setting ``offline_fraction`` leaves it)."""
        step, total_steps = non_negative_int("step", step), positive_int("total_steps", total_steps)
        self.rpc.get(self.rpc.coord.anneal.remote(step, total_steps))

    @gives_back
    def set_step(self, step: int) -> None:
        """Set the step that schedules read (by default, the number of sample calls so far)."""
        self.rpc.get(self.rpc.coord.set_step.remote(non_negative_int("step", step)))

    @gives_back
    def state_dict(self) -> dict[str, Any]:
        """The sampling state (step, schedule, RNG, epochs, rate limiter) that resumes the same stream, as plain
        data for ``load_state_dict``. Batches drawn ahead and not handed over are left out."""
        self.report_served()
        return self.rpc.get(self.rpc.coord.state_dict.remote())

    @gives_back
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rpc.get(self.rpc.coord.load_state_dict.remote(state))

    offline_buffer = property(lambda self: SideView(self, OFFLINE), doc="The offline side, buffer-like (``len``, "
                              "``sample``, ``state_dict``), as TorchRL's sub-buffers are used (``rayrb.handle.views``).")
    online_buffer = property(lambda self: SideView(self, ONLINE), doc="The online side, buffer-like (``len``, "
                             "``sample``, ``extend``, ``state_dict``).")

    # the stream ---------------------------------------------------------------
    def give_back(self) -> None:
        """Return what this handle's ``sample()`` loop drew ahead and did not serve."""
        self._sampling.give_back()

    def report_served(self) -> None:
        """Tell the coordinator what this buffer's streams in this process handed over, before a save counts it."""
        self._sampling.report_served()

    local_reads = property(lambda self: self._sampling.local, doc="The shard reads this process makes itself "
                           "(``rayrb.handle.local.LocalReads``); None when off (``local_reads=False``) or unknown.")

    # introspection --------------------------------------------------------------
    def __len__(self) -> int:
        return self._writer.rows_held(self.sizes)

    @property
    def write_count(self) -> int:
        """Rows ever written to the online side (overwritten ones included)."""
        return int(sum(self.sizes()["online_written"]))

    def sizes(self) -> dict[str, list[int]]:
        """Per-shard sizes as the coordinator allocates with them."""
        return self.rpc.get(self.rpc.coord.sizes.remote())

    def stats(self) -> dict[str, Any]:
        """Sizes, rates, latencies and restarts: ``{"coordinator": {...}, "shards": [...]}``, plus ``"handle"``
        (this handle's drawing ahead, local reads and writes by how they went: ``Writer.stats``)."""
        self._sampling.give_back(pace=False)  # counts are of batches served; how far the loop plans is kept
        out = self.rpc.get(self.rpc.coord.stats.remote())
        handle = {**(self._sampling.stats() or {}), **self._writer.stats()}
        return {**out, "handle": handle} if handle else out

    spec = property(lambda self: self._spec, doc="The row spec.")
    batch_size = property(lambda self: self.output.batch_size, doc="The default batch size (None: every call says).")
    name = property(lambda self: self._name, doc="The buffer's name.")
    storage_device = property(lambda self: self._sampling.storage_device,
                              doc="Where the shards hold their rows: ``\"cpu\"`` or ``\"cuda\"``.")
    closed = property(lambda self: self.rpc.closed, doc="Whether this handle was closed.")

    def shutdown(self) -> None:
        """Close this handle. A client never stops the buffer: its owner does."""
        self.rpc.closed = True
        self._sampling.close_reads()

    close = shutdown

    def __repr__(self) -> str:
        state = "closed" if self.rpc.closed else "open"
        return f"{type(self).__name__}(name={self._name!r}, {state}, spec={self._spec!r}, batch_size={self.batch_size})"

    def __reduce__(self):
        return _client, (self._client_args(),)
    def _client_args(self) -> dict[str, Any]:
        return {"coord": self.rpc.coord, "shards": self.rpc.shards, "spec": self._spec, "name": self._name,
                "batch_size": self.batch_size, "transform": self.output.transform, "timeout": self.rpc.timeout,
                "max_batch_bytes": self.output.max_batch_bytes, "prefetch": self._sampling.prefetch,
                "storage_device": self.storage_device, "num_offline": len(self.rpc.by_side[OFFLINE]),
                "transport": self._learners.transport, "read_device": self._learners.read_device,
                "layout": self._sampling.layout, "local_reads": self._sampling.local_enabled, "shards_place": self._writer.shards_place,
                "limited": self._sampling.limited, "max_writes_in_flight": self._writer.max_in_flight}


def _client(args: dict[str, Any]) -> BufferClient:
    return BufferClient(**args)
