"""The handle that collectors and learners hold: :class:`BufferClient`, a thin client over the coordinator.

A client holds the coordinator's actor handle, the row spec and a few settings;
it is small and picklable, so it is passed to collector and learner actors. It can
write, sample and read settings, but it does not own the buffer: only the
:class:`~rayrb.OfflineToOnlineReplayBuffer` that created the actors shuts them
down. Pickling that owner gives a client.

Every remote call goes through :meth:`BufferClient._get`, which bounds the wait
by ``timeout`` and turns Ray's failures into ``TimeoutError``,
:class:`BufferUnavailableError` or the actor's own ``ValueError``.
"""
from __future__ import annotations

import functools
import time
import uuid
from typing import Any

import numpy as np
import torch

from rayrb.core.plans import Blocked, assemble
from rayrb.core.schedules import Schedule, make_schedule
from rayrb.core.schema import RowSpec, strip_bookkeeping
from rayrb.io.arrays import from_numpy_dict, to_numpy_dict
from rayrb.core.validation import fraction, non_negative_int, positive_int
from rayrb.errors import BufferUnavailableError, WriteTimeoutError  # noqa: F401  (re-exported)




PREFETCH = 32  # batches a plain sample() loop may draw ahead (rayrb.handle.lookahead)


def _numpy(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


class BufferClient:
    """Write, sample and steer a running buffer. Made by :meth:`OfflineToOnlineReplayBuffer.client`."""

    _owner = False

    def __init__(self, coord: Any, shards: list, spec: RowSpec, *, name: str, batch_size: int | None,
                 transform: Any, timeout: float | None, max_batch_bytes: int, prefetch: int = PREFETCH,
                 storage_device: str = "cpu"):
        from rayrb.handle.lookahead import Lookahead

        self._coord, self._shards, self._spec, self._name = coord, shards, spec, name
        self._batch_size, self._transform, self._timeout = batch_size, transform, timeout
        self._max_batch_bytes = max_batch_bytes
        self._storage_device = storage_device
        self._closed = False
        self._lookahead = Lookahead(self, prefetch)

    # plumbing ---------------------------------------------------------------
    def _get(self, refs: Any, timeout: float | None | str = "call") -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayTaskError

        if self._closed:
            raise BufferUnavailableError(f"buffer {self._name!r} was shut down")
        timeout = self._timeout if timeout == "call" else timeout
        try:
            return ray.get(refs, timeout=timeout)
        except GetTimeoutError as e:
            raise TimeoutError(f"buffer {self._name!r}: no answer within timeout={timeout}s") from e
        except (RayActorError, ObjectLostError) as e:  # ObjectLostError: the coordinator died owning the rows
            raise BufferUnavailableError(
                f"buffer {self._name!r}: an actor of this buffer is dead (killed, shut down, or its node failed)"
            ) from e
        except RayTaskError as e:
            if isinstance(e.cause, (ValueError, TypeError, IndexError, PermissionError)):
                raise e.cause from None
            raise

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """``method.remote(*args, **kwargs)``, asked again while the rate limiter holds it back.

        The wait is bounded by ``timeout``; past it, ``TimeoutError`` is raised and nothing
        was drawn or written. The call that goes through reports how long it waited.
        """
        t0, delay = time.monotonic(), 0.001
        while True:
            waited = time.monotonic() - t0 if delay > 0.001 else 0.0
            out = self._get(method.remote(*args, **kwargs, **({"waited": waited} if waited else {})))
            if not isinstance(out, Blocked):
                return out
            if self._timeout is not None and time.monotonic() - t0 + delay > self._timeout:
                raise TimeoutError(f"buffer {self._name!r}: waited {self._timeout}s for the rate limiter: "
                                   f"{out.reason}")
            time.sleep(delay)
            delay = min(2 * delay, 0.05)

    def _backoff(self, waited: float, blocked: Blocked) -> float:
        """Sleep before asking again a call the rate limiter held back; past ``timeout``, raise (nothing changed)."""
        delay = min(0.05, 0.001 + waited)
        if self._timeout is not None and waited + delay > self._timeout:
            raise TimeoutError(f"buffer {self._name!r}: waited {self._timeout}s for the rate limiter: {blocked.reason}")
        time.sleep(delay)
        return waited + delay

    def _rows(self, data: Any, what: str) -> dict[str, np.ndarray]:
        if isinstance(data, (list, tuple)):
            raise TypeError(f"expected one TensorDict or dict of arrays for {what}, got a {type(data).__name__} "
                            f"of {len(data)}: concatenate them first (torch.cat)")
        arrays = strip_bookkeeping(to_numpy_dict(data), keep=self._spec.keys)
        self._spec.validate(arrays, what=what)
        return arrays

    def _batch(self, batch_size: int | None) -> int:
        """The batch size to draw, refused before anything is planned if its rows cannot fit the cap."""
        if batch_size is None:
            batch_size = self._batch_size
        if batch_size is None:
            raise ValueError("batch_size must be provided either in __init__ or sample(), got None in both")
        batch_size = positive_int("batch_size", batch_size)
        nbytes = batch_size * max(1, self._spec.row_bytes)
        if nbytes > self._max_batch_bytes:
            raise ValueError(f"batch_size={batch_size} needs {nbytes:,} bytes of rows, over max_batch_bytes="
                             f"{self._max_batch_bytes:,}; sample smaller batches or raise max_batch_bytes")
        return batch_size

    def _finish(self, out: Any, return_info: bool, device: Any = None):
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

    def _transformed(self, out: Any, return_info: bool):
        """A batch that arrived as a TensorDict (over Ray Direct Transport), transformed."""
        td, info = out if return_info else (out, None)
        if self._transform is not None:
            td = self._transform(td)
        return (td, info) if return_info else td

    # writing ----------------------------------------------------------------
    def extend(self, data: Any, *, write_id: str | None = None, prefill: bool = False, wait: bool = True
               ) -> torch.Tensor:
        """Copy rows into the online buffer; return their online indices once the shards hold them.

        ``data`` (a TensorDict or dict of arrays) is checked against the offline row
        spec before anything ships; a mismatch raises :class:`~rayrb.SchemaError`
        naming the key, and nothing is written. When this returns, the rows are in
        the buffer until capacity evicts them, whatever happens to the caller next.

        ``write_id`` names the write (one is made up when not given): a retry with the
        same id is applied once and returns the same indices. A write that times out
        raises :class:`WriteTimeoutError` carrying its ``write_id``.

        With a rate limiter, a write that runs ahead of the learners waits (up to
        ``timeout``); ``prefill=True`` writes past the limiter, to seed the online side.
        ``wait`` is accepted for older callers: every write waits for the shards' copies.
        """
        import ray

        self._lookahead.give_back()
        arrays = self._rows(data, "online data")
        n = next(iter(arrays.values())).shape[0]
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        write_id = write_id if write_id is not None else uuid.uuid4().hex
        ref = ray.put(arrays)  # one object; each shard copies its own contiguous piece out of it
        try:
            indices, acks = self._call(self._coord.extend, [ref], n, write_id=write_id, prefill=bool(prefill),
                                       node=_node_id())
            self._get(acks)
        except TimeoutError as e:  # the write may still land: name it, so that a retry lands it once
            raise WriteTimeoutError(f"{e}; the write may still be applied: retry it with write_id={write_id!r} "
                                    "to apply it once", write_id) from e
        except (BufferUnavailableError, RuntimeError):
            try:  # the shards' own counts, so the next write goes where the rows really are
                self._get(self._coord.resync.remote())
            except Exception:
                pass
            raise
        return torch.from_numpy(np.array(indices))  # a writable copy of the (read-only) reply

    def add(self, data: Any) -> int:
        """Add one row (no batch dimension)."""
        arrays = {k: np.asarray(v)[None] for k, v in to_numpy_dict(data).items()}
        return int(self.extend(arrays)[0])

    def update_priority(self, info: dict, priority: Any) -> int:
        """Set the priorities of sampled rows (``sampler="prioritized"``), e.g. from TD errors.

        ``info`` is what ``sample(return_info=True)`` returned with the batch; each
        update goes to the shard that owns its row and is dropped there if the slot was
        overwritten since (its generation changed). The whole call is checked before any
        shard applies it. Returns the number of rows sent.
        """
        self._lookahead.give_back()
        missing = [k for k in ("offline", "shard", "index", "generation") if k not in info]
        if missing:
            raise ValueError(f"info must come from sample(return_info=True); missing keys {missing}")
        n, acks = self._get(self._coord.update_priority.remote(
            _numpy(info["offline"]), _numpy(info["shard"]), _numpy(info["index"]), _numpy(info["generation"]),
            _numpy(priority).reshape(-1)))
        self._get(acks)
        return int(n)

    # sampling ---------------------------------------------------------------
    def sample(self, batch_size: int | None = None, return_info: bool = False):
        """A ``[batch_size]`` TensorDict: offline rows first, then online rows.

        With ``return_info=True`` returns ``(batch, info)``; ``info`` has per row
        ``offline`` (bool), ``shard``, ``index`` (within the shard) and
        ``generation`` (times that slot was written), and ``weight`` when prioritized.
        """
        out, _ = self._lookahead.next(self._batch(batch_size), bool(return_info))
        return self._finish(out, return_info)

    def __iter__(self):
        """Batches of ``batch_size``, as TorchRL's datasets iterate: until the offline side's epoch without
        replacement ends (its last batch short, by default), or without end when it samples with replacement."""
        batch_size = self._batch(None)
        while True:
            out, last = self._lookahead.next(batch_size, False)
            yield self._finish(out, False)
            if last:
                return

    def sample_async(self, batch_size: int | None = None, return_info: bool = False):
        """An ObjectRef to the next batch as a flat dict of numpy arrays (``(rows, info)`` with info).

        Does not wait for the rows. ``rb.to_tensordict(ray.get(ref))`` rebuilds what
        :meth:`sample` returns; the same seed gives the same batches either way.
        """
        self._lookahead.give_back()
        import ray

        node = ray.get_runtime_context().get_node_id()
        (ref,) = self._call(self._coord.sample_slices, self._batch(batch_size), return_info=return_info,
                            node_ids=[node])
        return ref

    def to_tensordict(self, flat: Any, return_info: bool = False, device: Any = None):
        """Rebuild a batch from :meth:`sample_async` / :meth:`sample_slices` output (applies ``transform``)."""
        return self._finish(flat, return_info, device)

    def iter_batches(self, batch_size: int | None = None, *, prefetch: int = 2, device: Any = None,
                     return_info: bool = False, num_batches: int | None = None):
        """Batches in order, keeping exactly up to ``prefetch`` sample requests in flight.

        ``device`` moves each batch there (through pinned memory when CUDA is present).
        Inside an actor that Ray gave the GPU on which the shards hold their rows
        (``storage_device="cuda"``), ``device="cuda"`` reads each group of batches from
        the shards over CUDA IPC instead: rows never pass through host memory.
        """
        self._lookahead.give_back()
        from rayrb.handle.iterator import BatchIterator

        return BatchIterator(self, self._batch(batch_size), prefetch=prefetch, device=device,
                             return_info=return_info, num_batches=num_batches)

    def sample_slices(self, num_slices: int, batch_size: int | None = None, *, return_info: bool = False,
                      learners: list | None = None, postprocess: Any = None, split_info: bool = False) -> list:
        """Sample one global batch and return it as ``num_slices`` ObjectRefs, one per learner.

        Each ref resolves to a flat dict (``rb.to_tensordict`` rebuilds it), so a learner
        actor receives its slice straight from the shards, not through the caller: pass
        ``refs[j]`` to learner ``j`` (RLlib's ``batch_refs`` shape). Slices are disjoint
        parts of the global batch, sizes differ by at most one, and the exact offline
        count holds for the global batch and, to within one row, for each slice. With
        ``learners`` (actor handles), each slice is assembled on its learner's node.
        ``postprocess(rows)`` (``postprocess(rows, info)`` with info) runs in that task;
        with ``split_info`` each slice is a pair of refs ``(rows, info)``.
        """
        self._lookahead.give_back()
        from rayrb.actors.placement import actor_nodes

        num_slices = positive_int("num_slices", num_slices)
        batch_size = self._batch(batch_size)
        nodes = None
        if learners is not None:
            if len(learners) != num_slices:
                raise ValueError(f"expected {num_slices} learners, one per slice, got {len(learners)}")
            nodes = actor_nodes(learners)
        return self._call(self._coord.sample_slices, batch_size, num_slices=num_slices, return_info=return_info,
                          node_ids=nodes, postprocess=postprocess, split_info=split_info)

    def connect_learners(self, learners: list) -> dict[str, int]:
        """Set the learner actors that :meth:`feed` hands slices to; return how many shard-learner pairs take
        each route.

        ``transport`` decides how rows travel: ``"object_store"``; ``"gloo"`` (CPU tensors);
        ``"nccl"`` (GPU tensors between different GPUs); ``"cuda_ipc"`` (GPU shards to learners
        that Ray gave the same GPU); ``"auto"``, per pair: CUDA IPC on a shared GPU, NCCL
        between GPUs, the object store where an end has no GPU. An RDT transport needs
        learner classes declared ``@ray.remote(enable_tensor_transport=True)`` (checked
        here: without it Ray deadlocks for 60 s); an NCCL group in which two members share
        one GPU is refused here, before it is created. Gloo RDT cannot share an actor with
        DDP or an RLlib remote learner (both use torch.distributed's default group).
        """
        return self._get(self._coord.connect_learners.remote(list(learners)))

    def feed(self, method: str = "update", batch_size: int | None = None, *args: Any, wait: bool = True):
        """Sample one global batch and call ``learner_j.method(plan, *parts, *args)`` on each connected learner.

        The learner rebuilds its slice with ``rayrb.actors.transport.receive(plan, *parts)``;
        rows come straight from the shards (as GPU tensors with ``transport="nccl"``).
        Slices follow :meth:`sample_slices`'s rules. Returns the learners' results
        (``wait=True``, bounded by ``timeout``) or their refs.
        """
        self._lookahead.give_back()
        refs = self._call(self._coord.feed, method, self._batch(batch_size), args)
        return self._get(refs) if wait else refs

    # TorchRL's sub-buffers --------------------------------------------------
    @property
    def offline_buffer(self):
        """The offline side, buffer-like (``len``, ``sample``, ``state_dict``); see :mod:`rayrb.handle.views`."""
        from rayrb.handle.views import SideView

        return SideView(self, "offline")

    @property
    def online_buffer(self):
        """The online side, buffer-like (``len``, ``sample``, ``extend``, ``state_dict``)."""
        from rayrb.handle.views import SideView

        return SideView(self, "online")

    # settings ---------------------------------------------------------------
    @property
    def offline_fraction(self) -> float:
        """The fraction the next batch will use (after any schedule or annealing)."""
        self._lookahead.give_back()
        return float(self._get(self._coord.offline_fraction.remote()))

    @offline_fraction.setter
    def offline_fraction(self, value: float | Schedule | str | dict) -> None:
        if isinstance(value, (int, float)):
            fraction("offline_fraction", value)
        self._lookahead.give_back()
        self._get(self._coord.set_offline_fraction.remote(make_schedule(value)))

    # TorchRL's private names, which its trainer hooks read and assign
    @property
    def _offline_fraction(self) -> float:
        return self.offline_fraction

    @_offline_fraction.setter
    def _offline_fraction(self, value: float) -> None:
        self.offline_fraction = value

    @property
    def _base_offline_fraction(self) -> float:
        return float(self._get(self._coord.base_fraction.remote()))

    @_base_offline_fraction.setter
    def _base_offline_fraction(self, value: float) -> None:
        self._lookahead.give_back()
        self._get(self._coord.base_fraction.remote(fraction("base_offline_fraction", value)))

    def anneal(self, step: int, total_steps: int) -> None:
        """Linearly decay ``offline_fraction`` from its base value to 0 over ``total_steps`` (TorchRL's)."""
        step, total_steps = non_negative_int("step", step), positive_int("total_steps", total_steps)
        self._lookahead.give_back()
        self._get(self._coord.anneal.remote(step, total_steps))

    def set_step(self, step: int) -> None:
        """Set the step that schedules read (by default, the number of sample calls so far)."""
        self._lookahead.give_back()
        self._get(self._coord.set_step.remote(non_negative_int("step", step)))

    def state_dict(self) -> dict[str, Any]:
        """Sampling state (step, schedule, RNG, epochs) to resume the same batch stream."""
        from rayrb.handle.iterator import report_served

        self._lookahead.give_back()
        report_served(self)  # what iterators drew ahead is left out, what they handed over is not
        return self._get(self._coord.state_dict.remote())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._lookahead.give_back()
        self._get(self._coord.load_state_dict.remote(state))

    # introspection ----------------------------------------------------------
    def __len__(self) -> int:
        sizes = self.sizes()
        return int(sum(sizes["offline"]) + sum(sizes["online"]))

    @property
    def write_count(self) -> int:
        """Rows ever written to the online side (overwritten ones included)."""
        return int(sum(self.sizes()["online_written"]))

    def sizes(self) -> dict[str, list[int]]:
        """Per-shard sizes as the coordinator allocates with them."""
        return self._get(self._coord.sizes.remote())

    def stats(self) -> dict[str, Any]:
        """Sizes, rates and latencies of the coordinator and every shard (batches drawn ahead given back first)."""
        self._lookahead.give_back()
        return self._get(self._coord.stats.remote())

    @property
    def spec(self) -> RowSpec:
        return self._spec

    @property
    def batch_size(self) -> int | None:
        return self._batch_size

    @property
    def name(self) -> str:
        return self._name

    def shutdown(self) -> None:
        """Close this handle. A client never stops the buffer: its owner does."""
        self._closed = True

    close = shutdown

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"{type(self).__name__}(name={self._name!r}, {state}, spec={self._spec!r}, batch_size={self._batch_size})"

    def __reduce__(self):
        return _client, (self._client_args(),)

    def _client_args(self) -> dict[str, Any]:
        return {"coord": self._coord, "shards": self._shards, "spec": self._spec, "name": self._name,
                "batch_size": self._batch_size, "transform": self._transform, "timeout": self._timeout,
                "max_batch_bytes": self._max_batch_bytes, "prefetch": self._lookahead.depth,
                "storage_device": self._storage_device}


def _client(args: dict[str, Any]) -> BufferClient:
    return BufferClient(**args)


def _to_device(td: Any, device: Any):
    device = torch.device(device)
    if device.type == "cuda":
        return td.pin_memory().to(device, non_blocking=True)
    return td.to(device)


@functools.cache
def _node_id() -> str | None:
    """This process's node, which writes prefer (None where Ray does not say)."""
    import ray

    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:
        return None
