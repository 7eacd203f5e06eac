"""The client handle: :class:`OfflineToOnlineReplayBuffer`, TorchRL's class distributed over Ray.

The handle is small and picklable: pass it to collector and learner actors.
It holds the coordinator's actor handle and the row spec; rows never pass
through it on their way between processes except to the caller that asked.
"""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from rayrb.allocation import check_batch_size, check_fraction, row_ranges, split_evenly, write_pieces
from rayrb.chunks import ChunkDataset
from rayrb.samplers import SAMPLERS
from rayrb.schedules import Schedule, make_schedule
from rayrb.schema import RowSpec, strip_bookkeeping
from rayrb.transport import concat, from_numpy_dict, to_numpy_dict


class BufferUnavailableError(RuntimeError):
    """The buffer was shut down, or its coordinator actor died."""


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


class OfflineToOnlineReplayBuffer:
    """An immutable offline dataset plus a growing online buffer, sharded over Ray actors.

    Every :meth:`sample` holds exactly ``n_off = floor(f * B + 1/2)`` offline rows and
    ``B - n_off`` online rows (all offline while the online side is empty), with
    per-shard counts drawn so that the batch has the distribution of sampling the
    union of shards.

    Args:
        offline_dataset: a dataset id (``"openml:adult_num"``), a chunk-dataset
            directory, a :class:`~rayrb.ChunkDataset`, a TensorDict, or a TorchRL
            replay buffer or storage.

    Keyword Args:
        online_capacity (int): rows the online buffer holds, split evenly over
            ``num_online_shards`` circular buffers. Exclusive with ``online_storage``.
        online_storage: a TorchRL storage; its ``max_size`` is the capacity and any rows
            it holds are copied in. Exclusive with ``online_capacity``.
        offline_fraction: a number in ``[0, 1]`` (TorchRL allows only ``(0, 1)``), or a
            schedule (:mod:`rayrb.schedules`, a kind name or a config dict). Default 0.5.
        batch_size (int): default for :meth:`sample`.
        transform (callable): applied to each sampled TensorDict in the caller.
        num_offline_shards (int), num_online_shards (int): actors per side. Default 1.
        sampler (str): ``"uniform"`` (with replacement), ``"without_replacement"``
            (epochs that visit each row once) or ``"prioritized"`` (``p_i = (|priority| + eps)^alpha``,
            per-shard sum trees, counts ~ Multinomial over shard masses; ``info["weight"]`` holds the
            importance weights ``(p_i / min p)^-beta`` over each side's union of shards).
        alpha, beta, eps (float): prioritized sampling's exponents and floor (TorchRL's names).
        drop_last (bool): without replacement, when a side has fewer rows left in its
            epoch than a batch needs, drop them and start the next epoch; when False
            (TorchRL's default) such a call raises.
        seed (int): with a fixed shard layout, the same seed gives the same batches.
        name (str): the coordinator's actor name (default: a unique one).
        dataset_root: where in-memory offline data is written as a chunk dataset.
        actor_options (dict): extra ``.options(...)`` for the actors (default ``num_cpus=0``).
        timeout (float): seconds to wait on any call before raising ``TimeoutError``.
        **dataset_kwargs: forwarded to :func:`~rayrb.load_dataset` for dataset ids.

    Sampled batches are rebuilt from numpy arrays without copying where possible:
    treat them as read-only and ``.clone()`` before in-place changes.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from rayrb import OfflineToOnlineReplayBuffer
        >>> offline = TensorDict({"observation": torch.randn(1000, 4)}, [1000])
        >>> rb = OfflineToOnlineReplayBuffer(offline, online_capacity=500, offline_fraction=0.5,
        ...                                  batch_size=32, seed=0)  # doctest: +SKIP
        >>> _ = rb.extend(TensorDict({"observation": torch.randn(10, 4)}, [10]))  # doctest: +SKIP
        >>> batch, info = rb.sample(return_info=True)  # doctest: +SKIP
        >>> batch.batch_size, int(info["offline"].sum())  # doctest: +SKIP
        (torch.Size([32]), 16)
        >>> rb.shutdown()  # doctest: +SKIP
    """

    def __init__(
        self,
        offline_dataset: Any,
        *,
        online_capacity: int | None = None,
        online_storage: Any = None,
        offline_fraction: float | Schedule | str | dict = 0.5,
        batch_size: int | None = None,
        transform: Callable | None = None,
        num_offline_shards: int = 1,
        num_online_shards: int = 1,
        sampler: str = "uniform",
        drop_last: bool = False,
        seed: int | None = None,
        name: str | None = None,
        dataset_root: str | os.PathLike | None = None,
        actor_options: dict | None = None,
        timeout: float | None = None,
        transport: str = "object_store",
        alpha: float = 0.6,
        beta: float = 0.4,
        eps: float = 1e-8,
        **dataset_kwargs: Any,
    ):
        # Validate everything before any actor exists.
        if (online_capacity is None) == (online_storage is None):
            raise ValueError("provide exactly one of online_capacity or online_storage, got "
                             f"online_capacity={online_capacity!r}, online_storage={type(online_storage).__name__}")
        if online_storage is not None:
            online_capacity = getattr(online_storage, "max_size", None)
        online_capacity = _positive_int("online_capacity", online_capacity)
        num_offline_shards = _positive_int("num_offline_shards", num_offline_shards)
        num_online_shards = _positive_int("num_online_shards", num_online_shards)
        if online_capacity < num_online_shards:
            raise ValueError(f"online_capacity must be at least num_online_shards ({num_online_shards}), "
                             f"got {online_capacity}")
        schedule = make_schedule(offline_fraction)
        if isinstance(offline_fraction, (int, float)):
            check_fraction(offline_fraction)
        if batch_size is not None:
            batch_size = check_batch_size(batch_size)
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
        if not (alpha >= 0 and beta >= 0 and eps > 0):
            raise ValueError(f"expected alpha >= 0, beta >= 0 and eps > 0, got alpha={alpha}, beta={beta}, eps={eps}")
        self._sampler_options = {"alpha": float(alpha), "eps": float(eps)}
        self._beta = float(beta)
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable, got {type(transform).__name__}")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        from rayrb.transport import check_transport

        self._transport = check_transport(transport)

        from rayrb.datasets.registry import as_chunk_dataset

        dataset, owned = as_chunk_dataset(offline_dataset, root=dataset_root, **dataset_kwargs)
        if len(dataset) == 0:
            raise ValueError("expected an offline dataset with at least one row, got 0 rows")
        if num_offline_shards > len(dataset):
            raise ValueError(f"num_offline_shards ({num_offline_shards}) exceeds the dataset's {len(dataset)} rows")

        self._spec = dataset.spec
        self._dataset_root = str(dataset.root)
        self._batch_size = batch_size
        self._transform = transform
        self._timeout = timeout
        self._name = name or f"rayrb-{uuid.uuid4().hex[:12]}"
        self._num_online = num_online_shards
        self._offline_rows = len(dataset)
        self._owned_dirs = [dataset.root.parent] if owned and dataset_root is None else []
        self._closed = False
        try:
            self._start_actors(dataset, online_capacity, num_offline_shards, num_online_shards, schedule,
                               sampler, drop_last, seed, actor_options or {})
        except BaseException:
            self.shutdown()  # no half-built buffer: kill what started, remove what was written
            raise
        if online_storage is not None and len(online_storage) > 0:
            from rayrb.datasets.registry import _torchrl_rows

            self.extend(_torchrl_rows(online_storage))

    def preprocess(self, fn: Callable, dest: str | os.PathLike, **kwargs: Any) -> ChunkDataset:
        """Map the offline dataset through ``fn`` with Ray tasks (see :func:`rayrb.preprocess`).

        Returns the new dataset; pass it as ``offline_dataset`` to a new buffer.
        """
        from rayrb.preprocess import preprocess

        return preprocess(self._dataset_root, fn, dest, **kwargs)

    def _start_actors(self, dataset: ChunkDataset, capacity: int, m: int, k: int, schedule: Schedule,
                      sampler: str, drop_last: bool, seed: int | None, actor_options: dict) -> None:
        import ray

        from rayrb.coordinator import Coordinator
        from rayrb.shards import OfflineShard, OnlineShard

        opts = {"num_cpus": 0, **actor_options}
        device = "cpu"
        # Shards return tensors over RDT: a class-level option, not an .options() one.
        cls_opts = {"enable_tensor_transport": True} if self._transport != "object_store" else {"num_cpus": 0}
        if self._transport == "nccl":
            device = "cuda"
            opts.setdefault("num_gpus", 1.0 / (m + k))
        ranges = row_ranges(len(dataset), m)
        capacities = split_evenly(capacity, k).tolist()
        so = self._sampler_options
        # Offline shards hold no data of their own (a restart re-maps the chunks), so they may restart;
        # online shards may not: their rows would be lost and the coordinator's sizes out of step.
        off_opts = {"max_restarts": 3, "max_task_retries": 3, **opts}
        offline = [ray.remote(**cls_opts)(OfflineShard).options(**_placement(dataset, a, b, off_opts)).remote(
                       str(dataset.root), a, b, f"{self._name}/off-{i}", sampler, sampler_options=so)
                   for i, (a, b) in enumerate(ranges)]
        online = [ray.remote(**cls_opts)(OnlineShard).options(**opts).remote(
                      self._spec.to_json(), c, f"{self._name}/on-{i}", sampler, sampler_options=so)
                  for i, c in enumerate(capacities)]
        self._coord = ray.remote(Coordinator).options(name=self._name, **opts).remote(
            offline, [b - a for a, b in ranges], online, capacities, offline_fraction=schedule,
            sampler=sampler, drop_last=drop_last, seed=seed, name=self._name, transport=self._transport,
            device=device, beta=self._beta)
        self._shards = offline + online
        # Surface construction errors (a missing chunk, a bad spec) here, not at the first sample.
        self._get([s.ping.remote() for s in self._shards] + [self._coord.ping.remote()])

    # plumbing ---------------------------------------------------------------
    def _get(self, refs: Any) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayTaskError

        if self._closed:
            raise BufferUnavailableError(f"buffer {self._name!r} was shut down")
        try:
            return ray.get(refs, timeout=self._timeout)
        except GetTimeoutError as e:
            raise TimeoutError(f"buffer {self._name!r}: no answer within timeout={self._timeout}s") from e
        except (RayActorError, ObjectLostError) as e:  # ObjectLostError: the coordinator died owning the rows
            raise BufferUnavailableError(
                f"buffer {self._name!r}: an actor of this buffer is dead (killed, shut down, or its node failed)"
            ) from e
        except RayTaskError as e:
            if isinstance(e.cause, (ValueError, TypeError, IndexError, PermissionError)):
                raise e.cause from None
            raise

    def _rows(self, data: Any, what: str) -> dict[str, np.ndarray]:
        arrays = strip_bookkeeping(to_numpy_dict(data), keep=self._spec.keys)
        self._spec.validate(arrays, what=what)
        return arrays

    # TorchRL's interface -----------------------------------------------------
    def extend(self, data: Any, *, wait: bool = False) -> torch.Tensor:
        """Copy rows into the online buffer; return their online indices.

        ``data`` (a TensorDict or dict of arrays) is checked against the offline row
        spec before anything ships; a mismatch raises :class:`~rayrb.SchemaError`
        naming the key, and nothing is written.

        Returns once the coordinator has queued the write: every later sample sees
        the rows (the coordinator orders writes before later reads on each shard). With
        ``wait=True`` it also waits for the shards' copies.
        """
        import ray

        arrays = self._rows(data, "online data")
        n = next(iter(arrays.values())).shape[0]
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        sizes = write_pieces(n, self._num_online).tolist()
        ref = ray.put(arrays)  # one object; each shard copies its own contiguous piece out of it
        if not wait:
            return torch.from_numpy(np.array(self._get(self._coord.extend.remote([ref], sizes))))
        indices, acks = self._get(self._coord.extend.remote([ref], sizes, True))
        try:
            self._get(acks)
        except Exception:
            self._get(self._coord.resync.remote())
            raise
        return torch.from_numpy(np.array(indices))  # a writable copy of the (read-only) reply

    def add(self, data: Any) -> int:
        """Add one row (no batch dimension)."""
        arrays = {k: np.asarray(v)[None] for k, v in to_numpy_dict(data).items()}
        return int(self.extend(arrays)[0])

    def sample(self, batch_size: int | None = None, return_info: bool = False):
        """A ``[batch_size]`` TensorDict: offline rows first, then online rows.

        With ``return_info=True`` returns ``(batch, info)``; ``info`` has per row
        ``offline`` (bool), ``shard``, ``index`` (within the shard) and
        ``generation`` (times that slot was written).
        """
        from rayrb.coordinator import assemble

        plan = self._get(self._coord.sample.remote(self._resolve_batch_size(batch_size)))
        results = self._get([p[3] for p in plan["parts"]])
        return self._finish(assemble(plan, results, return_info), return_info)

    def _resolve_batch_size(self, batch_size: int | None) -> int:
        if batch_size is None:
            batch_size = self._batch_size
        if batch_size is None:
            raise ValueError("batch_size must be provided either in __init__ or sample(), got None in both")
        return check_batch_size(batch_size)

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

    def sample_async(self, batch_size: int | None = None, return_info: bool = False):
        """An ObjectRef to the next batch as a flat dict of numpy arrays (``(rows, info)`` with info).

        Does not wait. ``rb.to_tensordict(ray.get(ref))`` rebuilds what :meth:`sample`
        returns; the same seed gives the same batches either way. The rows are
        concatenated by a small task on this node.
        """
        import ray

        batch_size = self._resolve_batch_size(batch_size)
        node = ray.get_runtime_context().get_node_id()
        (ref,) = self._get(self._coord.sample_refs.remote(batch_size, 1, return_info, [node]))
        return ref

    def to_tensordict(self, flat: Any, return_info: bool = False, device: Any = None):
        """Rebuild a batch from :meth:`sample_async` / :meth:`sample_slices` output (applies ``transform``)."""
        return self._finish(flat, return_info, device)

    def iter_batches(self, batch_size: int | None = None, *, prefetch: int = 2, device: Any = None,
                     return_info: bool = False, num_batches: int | None = None) -> "BatchIterator":
        """Batches in order, keeping exactly up to ``prefetch`` sample requests in flight.

        ``device`` moves each batch there (through pinned memory when CUDA is present).
        """
        return BatchIterator(self, self._resolve_batch_size(batch_size), prefetch, device, return_info,
                             num_batches)

    def connect_learners(self, learners: list) -> None:
        """Set the learner actors that :meth:`feed` hands slices to.

        With ``transport="gloo"`` or ``"nccl"`` the coordinator creates a collective
        group over the shards and these learners; their classes must be declared
        ``@ray.remote(enable_tensor_transport=True)`` (checked here: without it Ray
        deadlocks for 60 s). Gloo RDT cannot share an actor with DDP or an RLlib remote
        learner (both use torch.distributed's default group).
        """
        self._get(self._coord.connect_learners.remote(list(learners)))

    def feed(self, method: str = "update", batch_size: int | None = None, *args: Any, wait: bool = True):
        """Sample one global batch and call ``learner_j.method(meta, *parts, *args)`` on each connected learner.

        The learner rebuilds its slice with ``rayrb.transport.receive(meta, *parts)``;
        rows come straight from the shards (as GPU tensors with ``transport="nccl"``).
        Slices follow :meth:`sample_slices`'s rules. Returns the learners' results
        (``wait=True``, bounded by ``timeout``) or their refs.
        """
        refs = self._get(self._coord.feed.remote(method, self._resolve_batch_size(batch_size), args))
        return self._get(refs) if wait else refs

    def sample_slices(self, num_slices: int, batch_size: int | None = None, *, return_info: bool = False,
                      learners: list | None = None) -> list:
        """Sample one global batch and return it as ``num_slices`` ObjectRefs, one per learner.

        Each ref resolves to a flat dict (``rb.to_tensordict`` rebuilds it), so a
        learner actor receives its slice straight from the shards, not through the
        caller: pass ``refs[j]`` to learner ``j`` (RLlib's ``batch_refs`` shape).
        Slices are disjoint parts of the global batch, sizes differ by at most one, and
        the exact offline count holds for the global batch and, to within one row, for
        each slice. With ``learners`` (actor handles), each slice is assembled on its
        learner's node.
        """
        num_slices = _positive_int("num_slices", num_slices)
        batch_size = self._resolve_batch_size(batch_size)
        nodes = None
        if learners is not None:
            if len(learners) != num_slices:
                raise ValueError(f"expected {num_slices} learners, one per slice, got {len(learners)}")
            nodes = _actor_nodes(learners)
        return self._get(self._coord.sample_refs.remote(batch_size, num_slices, return_info, nodes))

    def update_priority(self, info: dict, priority: Any) -> int:
        """Set the priorities of sampled rows (``sampler="prioritized"``), e.g. from TD errors.

        ``info`` is what ``sample(return_info=True)`` returned with the batch; each
        update goes to the shard that owns its row and is dropped there if the slot was
        overwritten since (its generation changed). Returns the number of rows sent.
        """
        def np_(x: Any) -> np.ndarray:
            return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)

        missing = [k for k in ("offline", "shard", "index", "generation") if k not in info]
        if missing:
            raise ValueError(f"info must come from sample(return_info=True); missing keys {missing}")
        priority = np_(priority).reshape(-1)
        return int(self._get(self._coord.update_priority.remote(
            np_(info["offline"]), np_(info["shard"]), np_(info["index"]), np_(info["generation"]), priority)))

    @property
    def offline_fraction(self) -> float:
        """The fraction the next batch will use (after any schedule or annealing)."""
        return float(self._get(self._coord.offline_fraction.remote()))

    @offline_fraction.setter
    def offline_fraction(self, value: float | Schedule | str | dict) -> None:
        if isinstance(value, (int, float)):
            check_fraction(value)
        self._get(self._coord.set_offline_fraction.remote(make_schedule(value)))

    def anneal(self, step: int, total_steps: int) -> None:
        """Linearly decay ``offline_fraction`` from its base value to 0 over ``total_steps`` (TorchRL's)."""
        _positive_int("total_steps", total_steps)
        self._get(self._coord.anneal.remote(step, total_steps))

    def set_step(self, step: int) -> None:
        """Set the step that schedules read (by default, the number of sample calls so far)."""
        self._get(self._coord.set_step.remote(step))

    def __len__(self) -> int:
        sizes = self._get(self._coord.sizes.remote())
        return int(sum(sizes["offline"]) + sum(sizes["online"]))

    @property
    def write_count(self) -> int:
        """Rows ever written to the online side (overwritten ones included)."""
        return int(sum(self._get(self._coord.sizes.remote())["online_written"]))

    def sizes(self) -> dict[str, list[int]]:
        """Per-shard sizes as the coordinator allocates with them."""
        return self._get(self._coord.sizes.remote())

    @property
    def spec(self) -> RowSpec:
        return self._spec

    @property
    def batch_size(self) -> int | None:
        return self._batch_size

    @property
    def name(self) -> str:
        return self._name

    def state_dict(self) -> dict[str, Any]:
        """Sampling state (step, schedule, RNG) to resume the same batch stream."""
        return self._get(self._coord.state_dict.remote())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._get(self._coord.load_state_dict.remote(state))

    def dumps(self, path: str | os.PathLike) -> None:
        """Save the online rows, priorities and sampling state under ``path`` (TorchRL's name).

        The offline dataset is not copied: the saved state records where it is.
        ``path`` must be readable by the shard actors (shared storage on a cluster).
        """
        import json

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._get([s.dump.remote(str(path / f"shard-{i}")) for i, s in enumerate(self._shards)])
        meta = {"format": "rayrb.buffer", "version": 1, "dataset": self._dataset_root, "spec": self._spec.to_json(),
                "sizes": self.sizes(), "coordinator": self.state_dict()}
        (path / "buffer.json").write_text(json.dumps(meta, default=int))

    def loads(self, path: str | os.PathLike) -> None:
        """Restore what :meth:`dumps` saved into this buffer (same dataset spec and shard layout)."""
        import json

        path = Path(path)
        meta = json.loads((path / "buffer.json").read_text())
        mine = self.sizes()
        if RowSpec.from_json(meta["spec"]) != self._spec or [len(meta["sizes"][k]) for k in ("offline", "online")] \
                != [len(mine[k]) for k in ("offline", "online")] or meta["sizes"]["online_capacity"] != mine["online_capacity"]:
            raise ValueError(f"saved buffer at {path} has spec {meta['spec']} and layout {meta['sizes']}; "
                             f"this buffer has {self._spec.to_json()} and {mine}")
        self._get([s.load.remote(str(path / f"shard-{i}")) for i, s in enumerate(self._shards)])
        self._get(self._coord.resync.remote())
        self.load_state_dict(meta["coordinator"])

    dump, load = dumps, loads

    def stats(self) -> dict[str, Any]:
        """Sizes, rates and latencies of the coordinator and every shard."""
        return self._get(self._coord.stats.remote())

    def shutdown(self) -> None:
        """Kill the buffer's actors and remove offline data it wrote itself. Idempotent."""
        import ray

        if self._closed:
            return
        self._closed = True
        for actor in [*getattr(self, "_shards", []), getattr(self, "_coord", None)]:
            if actor is not None:
                try:
                    ray.kill(actor)
                except Exception:
                    pass
        for d in self._owned_dirs:
            shutil.rmtree(d, ignore_errors=True)

    def __repr__(self) -> str:
        state = "shut down" if self._closed else f"offline_rows={self._offline_rows}"
        return f"{type(self).__name__}(name={self._name!r}, {state}, spec={self._spec!r}, batch_size={self._batch_size})"

    # pickling: a handle for collectors and learners ----------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_owned_dirs"] = []  # only the creator cleans up
        return state


def _to_device(td: Any, device: Any):
    device = torch.device(device)
    if device.type == "cuda":
        return td.pin_memory().to(device, non_blocking=True)
    return td.to(device)


def _actor_nodes(actors: list) -> list[str | None]:
    """The node each actor runs on (None where Ray does not say)."""
    import ray
    from ray.util.state import list_actors

    want = {a._actor_id.hex(): i for i, a in enumerate(actors)}
    nodes: list[str | None] = [None] * len(actors)
    try:
        for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10_000):
            if a.actor_id in want:
                nodes[want[a.actor_id]] = a.node_id
    except Exception:  # the state API needs the dashboard; placement is only a hint
        pass
    return nodes


def _copy_batch(out: Any) -> Any:
    if isinstance(out, tuple):
        return tuple(_copy_batch(o) for o in out)
    return {k: np.array(v) for k, v in out.items()}


class BatchIterator:
    """Iterates over sampled batches with a bounded number of requests in flight.

    Batches are requested in groups of ``ceil(prefetch / 2)`` (one read task per
    shard per group), and a new group goes out as soon as it fits, so
    ``in_flight`` (batches requested and not yet handed over) never exceeds
    ``prefetch``. The stream is the one consecutive :meth:`sample` calls give.
    """

    def __init__(self, rb: "OfflineToOnlineReplayBuffer", batch_size: int, prefetch: int, device: Any,
                 return_info: bool, num_batches: int | None):
        from collections import deque

        self._rb, self._batch_size = rb, batch_size
        self.prefetch = _positive_int("prefetch", prefetch)
        if num_batches is not None:
            _positive_int("num_batches", num_batches)
        self._device, self._return_info, self._left = device, return_info, num_batches
        self._group = max(1, -(-self.prefetch // 2))
        self._pending: deque = deque()  # (group ref, batches in it)
        self._ready: deque = deque()  # batches fetched and copied out, not handed over
        self.max_in_flight = 0

    @property
    def in_flight(self) -> int:
        return sum(k for _, k in self._pending) + len(self._ready)

    def _fill(self) -> None:
        while True:
            k = min(self._group, self.prefetch - self.in_flight)
            if self._left is not None:
                k = min(k, self._left - self.in_flight)
            if k <= 0 or (k < self._group and self._pending):
                break
            self._pending.append((self._rb._coord.sample_group.remote(self._batch_size, k), k))
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def __iter__(self) -> "BatchIterator":
        return self

    def __next__(self):
        from rayrb.coordinator import assemble, split_group

        if self._left is not None and self._left <= 0:
            raise StopIteration
        self._fill()
        if not self._ready:
            ref, _ = self._pending[0]
            group = self._rb._get(ref)
            results = self._rb._get([r[2] for r in group["reads"]])
            self._pending.popleft()
            # Copy every batch out of the group's objects now, so the object store holds no more
            # than the requests in flight (a view would pin a whole group).
            for plan, parts in split_group(group, results):
                out = assemble(plan, parts, self._return_info)
                if len(parts) == 1:
                    out = _copy_batch(out)
                self._ready.append(out)
            del group, results  # a without-replacement group may hold fewer than k batches
        out = self._ready.popleft()
        if self._left is not None:
            self._left -= 1
        self._fill()  # request more before handing the batch over, so sampling overlaps training
        return self._rb._finish(out, self._return_info, self._device)


def _placement(dataset: ChunkDataset, start: int, stop: int, opts: dict) -> dict:
    """Actor options that prefer the node holding most of rows ``[start, stop)`` (a soft hint)."""
    if "scheduling_strategy" in opts:
        return opts
    rows_by_node: dict[str, int] = {}
    for c, a in zip(dataset.chunks, dataset.offsets[:-1]):
        overlap = min(stop, a + c.rows) - max(start, a)
        if c.node and overlap > 0:
            rows_by_node[c.node] = rows_by_node.get(c.node, 0) + int(overlap)
    if not rows_by_node:
        return opts
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    node = max(rows_by_node, key=rows_by_node.get)
    if node not in alive:
        return opts
    return {**opts, "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=True)}


def prefill_replay_buffer(rb: Any, dataset: Any, n_samples: int | None = None, chunk_size: int = 1000,
                          seed: int | None = None) -> Any:
    """Copy up to ``n_samples`` distinct rows of an offline dataset into a mutable buffer (TorchRL's helper).

    ``rb`` is anything with ``extend`` (a rayrb buffer's online side, a TorchRL
    replay buffer); ``dataset`` is any offline source
    :class:`OfflineToOnlineReplayBuffer` accepts. Rows are taken in a random order
    (``seed``), without repeats.
    """
    from rayrb.datasets.registry import as_chunk_dataset

    chunk_size = _positive_int("chunk_size", chunk_size)
    ds, owned = as_chunk_dataset(dataset)
    try:
        total = len(ds) if n_samples is None else min(_positive_int("n_samples", n_samples), len(ds))
        order = np.random.default_rng(seed).permutation(len(ds))[:total]
        for start in range(0, total, chunk_size):
            rows = ds.gather(order[start:start + chunk_size])
            rb.extend(from_numpy_dict(rows) if not isinstance(rb, OfflineToOnlineReplayBuffer) else rows)
    finally:
        if owned:
            shutil.rmtree(Path(ds.root).parent, ignore_errors=True)
    return rb
