"""The owner of a buffer: ``OfflineToOnlineReplayBuffer``, TorchRL's class distributed over Ray.

It starts the coordinator and shard actors, and is the one object that shuts
them down, saves and restores them. Everything else (writing, sampling,
steering) it inherits from ``BufferClient``, the handle
that ``OfflineToOnlineReplayBuffer.client`` and pickling give to collectors
and learners.
"""
from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rayrb.core.layout import ShardLayout
from rayrb.core.names import directory_name
from rayrb.core.schedules import Schedule
from rayrb.core.validation import ALPHA, BETA, EPS
from rayrb.handle import launch
from rayrb.handle.client import PREFETCH, BufferClient, BufferUnavailableError, gives_back
from rayrb.handle.launch import remove_leftovers as _remove_leftovers  # its name here since it moved
from rayrb.handle.prefill import prefill_replay_buffer  # its home before it had a module of its own
from rayrb.handle.settings import (
    DEFAULT_MAX_BATCH_BYTES,
    DEFAULT_STORAGE,
    BufferSettings,
    checked_settings,
    client_options,
)
from rayrb.io.chunks import ChunkDataset

__all__ = ["OfflineToOnlineReplayBuffer", "BufferUnavailableError", "prefill_replay_buffer"]

# Times Ray re-sends a call whose actor died while it ran. A call that kills its actor every time (a read that
# runs the node out of memory) then fails to its caller instead of killing the actor for ever; a call caught by
# that many crashes of other causes in a row is as unlikely as it is harmless to fail (writes are retried by id).
CALL_RETRIES = 10


class OfflineToOnlineReplayBuffer(BufferClient):
    """An immutable offline dataset plus a growing online buffer, sharded over Ray actors.

    Every ``sample`` holds exactly ``n_off = floor(f * B + 1/2)`` offline rows and
    ``B - n_off`` online rows (all offline while the online side is empty), with
    per-shard counts drawn so that the batch has the distribution of sampling the
    union of shards.

    Args:
        offline_dataset: a dataset id (``"openml:adult_num"``), a chunk-dataset
            directory, a ``ChunkDataset``, a TensorDict, or a TorchRL
            replay buffer or storage (its rows are copied into chunks once, through the
            buffer's own transforms, such as a TorchRL dataset's ``DoubleToFloat``).

    Keyword Args:
        online_capacity (int): rows the online buffer holds, split evenly over
            ``num_online_shards`` circular buffers. Exclusive with ``online_storage``.
        online_storage: a TorchRL storage; its ``max_size`` is the capacity and any rows
            it holds are copied in. Exclusive with ``online_capacity``.
        offline_fraction: a number in ``[0, 1]`` (TorchRL allows only ``(0, 1)``), or a
            schedule (``rayrb.core.schedules``, a kind name or a config dict). Default 0.5.
        batch_size (int): default for ``sample``; required with a dataset id, as in
            TorchRL (which builds the dataset with it).
        transform (callable): applied to each sampled TensorDict in the caller.
        **dataset_kwargs: forwarded to ``load_dataset`` for dataset ids.

    Sampling:
        - ``sampler`` (str, default None): both sides' sampler, unless ``offline_sampler`` / ``online_sampler``
          name one: ``"uniform"`` (with replacement), ``"without_replacement"`` (epochs that visit each row once) or
          ``"prioritized"`` (``p_i = (|priority| + eps)^alpha``, per-shard sum trees, counts ~ Multinomial over
          shard masses; ``info["weight"]`` holds the importance weights ``(p_i / min p)^-beta`` over each side's
          union of shards); by default (TorchRL's) an OpenML id without replacement, else uniformly, online uniformly.
          ``"slice"`` / ``"slice_without_replacement"`` (offline; online with replacement) / ``"prioritized_slice"``:
          slices of episodes on both sides, with TorchRL's ``SliceSampler`` keywords ``slice_len`` or
          ``num_slices``, ``traj_key`` or ``end_key``, ``strict_length``; or ``sampler=rayrb.SliceSampler(...)``.
        - ``offline_sampler``, ``online_sampler`` (str, default None): one side's sampler.
        - ``alpha`` (0.6), ``beta`` (0.4), ``eps`` (1e-8): prioritized sampling's exponents and floor (TorchRL's).
        - ``epoch_end`` (str, default ``"short"``): without replacement, what a batch does when a side has fewer
          rows left in its epoch than it needs: ``"short"`` (TorchRL's) returns a short final batch, split
          exactly (a batch larger than a whole epoch is that epoch), and the next call begins the next epoch; ``"drop"`` drops those rows and begins the next epoch
          at once; ``"raise"`` refuses the call. ``drop_last`` (bool, TorchRL's name): ``True`` is ``"drop"``,
          ``False`` is ``"short"``.
        - ``seed`` (int, default None): with a fixed shard layout, the same seed gives the same batches.
        - ``rate_limiter`` (default ``MinSize(1)``, no limit): flow control between collectors and learners,
          counted in online rows only (``rayrb.core.rate_limiter``): a ``RateLimiter`` such as
          ``SampleToInsertRatio(samples_per_insert, min_size_to_sample, error_buffer)`` or ``MinSize(n)``, or its
          config dict. Sampling and writing wait (up to ``timeout``) while they run ahead.
        - ``prefetch`` (32): batches a plain ``sample`` loop may draw ahead (at most 64 MiB of rows; ``0``: none),
          given back before this handle writes, steers or saves, so the stream is the one unprefetched calls give.
        - ``max_batch_bytes`` (8 GiB): the largest batch a call may ask for, in bytes of rows; larger requests
          are refused before anything is drawn.

    Placement:
        - ``num_offline_shards``, ``num_online_shards`` (1 each): actors per side.
        - ``name`` (str, default a unique one): the coordinator's actor name, any string (docs/guarantees.md).
        - ``online_nodes`` (list, default None): a node id (or None) per online shard, to place it beside the
          collectors that feed it (a soft preference). A write prefers the online shards on the writer's node
          while they are at most an eighth of a shard ahead of the others, wherever they were placed.
        - ``actor_options`` (dict, default None: ``num_cpus=0``): extra ``.options(...)`` for the actors.
        - ``dataset_root`` (default None: a folder of its own): where in-memory offline data is written as a
          chunk dataset.

    Durability:
        - ``storage_dir`` (default ``$TMPDIR/rayrb-state``): a directory on each node's local disk where shards
          keep their mutable state as memory maps, so a shard whose process dies restarts with every acknowledged
          write. ``None``: process memory, and online shards do not restart.
        - ``online_replicas`` (1): copies of each online shard, each on another node. With 2 or more, a write is
          acknowledged once every live copy holds it, a lost copy is rebuilt on another node, and the
          coordinator's files are kept off its node too, so a node loss loses no acknowledged row
          (docs/durability.md). Needs a ``storage_dir`` and that many nodes.
        - ``max_restarts`` (-1: without end): restarts of each actor over the buffer's life. A start that keeps
          crashing backs off (up to 30 s). ``stats()`` counts each actor's restarts.
        - ``write_path`` (default None): who places each write. ``"shards"`` (the default where it can be): the
          writer appends to a shard's files itself on its node, else sends the write to the shard, one call, the
          coordinator off the path (``rayrb.handle.direct``). ``"coordinator"`` (the default with a rate limiter
          that bounds samples per insert): the coordinator admits, places and sends each write.
        - ``timeout`` (float, default None: no bound): seconds to wait on any call before raising
          ``TimeoutError``.

    Transport:
        - ``local_reads`` (True): handles on a shard's node gather its rows themselves, from the files the shard
          maps, without an actor call, and append their writes there (``rayrb.handle.local``). The stream is the
          same either way.
        - ``storage_device`` (``"cpu"``): where shards hold their rows: ``"cpu"`` (host memory maps) or
          ``"cuda"`` (loaded into GPU memory once, gathered there; the memory maps still keep every acknowledged
          write). See docs/gpu.md.
        - ``transport`` (``"object_store"``): how ``feed`` hands rows to learners (see ``connect_learners``):
          ``"object_store"``, ``"gloo"``, ``"nccl"``, ``"cuda_ipc"`` or ``"auto"``.

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

    _owner = True

    def __init__(
        self, offline_dataset: Any, *, online_capacity: int | None = None, online_storage: Any = None,
        offline_fraction: float | Schedule | str | dict = 0.5, batch_size: int | None = None,
        transform: Callable | None = None, num_offline_shards: int = 1, num_online_shards: int = 1,
        sampler: str | None = None, offline_sampler: str | None = None, online_sampler: str | None = None,
        epoch_end: str | None = None, drop_last: bool | None = None, seed: int | None = None, name: str | None = None,
        dataset_root: str | os.PathLike | None = None, actor_options: dict | None = None,
        online_nodes: Sequence[str | None] | None = None, online_replicas: int = 1, timeout: float | None = None,
        transport: str = "object_store", alpha: float = ALPHA, beta: float = BETA, eps: float = EPS,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES, storage_dir: str | os.PathLike | None = DEFAULT_STORAGE,
        rate_limiter: Any = None, prefetch: int = PREFETCH, storage_device: str = "cpu", max_restarts: int = -1,
        local_reads: bool = True, write_path: str | None = None, slice_len: int | None = None,
        num_slices: int | None = None, traj_key: Any = None, end_key: Any = None, strict_length: bool = True,
        **dataset_kwargs: Any,
    ):
        self.rpc, self._owned_dirs, self._copies = None, [], []  # until the actors run, nothing is usable or owned
        s = checked_settings(  # every option checked once, before any actor exists; trusted from here on
            offline_dataset, online_capacity=online_capacity, online_storage=online_storage,
            offline_fraction=offline_fraction, batch_size=batch_size, transform=transform,
            num_offline_shards=num_offline_shards, num_online_shards=num_online_shards, sampler=sampler,
            offline_sampler=offline_sampler, online_sampler=online_sampler, epoch_end=epoch_end, drop_last=drop_last,
            actor_options=actor_options, online_nodes=online_nodes, online_replicas=online_replicas, timeout=timeout,
            transport=transport, alpha=alpha, beta=beta, eps=eps, max_batch_bytes=max_batch_bytes,
            storage_dir=storage_dir, rate_limiter=rate_limiter, prefetch=prefetch, storage_device=storage_device,
            max_restarts=max_restarts, local_reads=local_reads, name=name, write_path=write_path, seed=seed,
            dataset_root=dataset_root, slice_len=slice_len, num_slices=num_slices, traj_key=traj_key, end_key=end_key,
            strict_length=strict_length)
        dataset, self._owned_dirs, s = launch.offline_chunks(  # a sampler asked for wins over a TorchRL dataset's
            offline_dataset, s, sampler is not None or offline_sampler is not None, s.dataset_root, dataset_kwargs)
        self._dataset_root, self._offline_rows, self._settings = str(dataset.root), len(dataset), s
        name = s.name
        try:
            coord, shards, read_device, layout, self._copies = _start_actors(dataset, name, s)
        except BaseException:
            self._remove_owned()  # no half-built buffer: what started is killed in _start_actors
            raise
        _remove_leftovers(s.storage_dir)
        BufferClient.__init__(self, coord, shards, dataset.spec, name=name, batch_size=s.batch_size,
                              num_offline=s.num_offline_shards, read_device=read_device, layout=layout,
                              **s.handle_options())
        try:  # construction errors (a missing chunk, a bad spec) surface here, not at the first sample
            wait = None if self.rpc.timeout is None else max(self.rpc.timeout, 300.0)  # starting takes seconds
            self.rpc.get([a.ping.remote() for a in self.rpc.shards] + [self.rpc.coord.ping.remote()], timeout=wait)
            if online_storage is not None and len(online_storage) > 0:
                from rayrb.io.datasets.registry import torchrl_rows

                self.extend(torchrl_rows(online_storage))
        except BaseException:
            self.shutdown()
            raise

    def client(self, *, timeout: float | None | str = "same", prefetch: int | str = "same",
               local_reads: bool | str = "same", max_writes_in_flight: int | str = "same") -> BufferClient:
        """A picklable ``BufferClient`` for collectors and learners: it writes and samples, but cannot shut the
        buffer down.

        Args:
            timeout: bounds this handle's waits (default: the buffer's).
            prefetch: how far its plain ``sample()`` loop may draw ahead (default: the buffer's).
            local_reads: whether it gathers the rows of shards on its node itself, and appends its writes to
                their files itself (default: the buffer's).
            max_writes_in_flight: its ``extend(..., wait=False)`` writes on their way at once (default 8).
        """
        options = client_options(timeout, prefetch, local_reads, max_writes_in_flight)
        return BufferClient(**{**self._client_args(), **options})

    def preprocess(self, fn: Callable, dest: str | os.PathLike, **kwargs: Any) -> ChunkDataset:
        """Map the offline dataset through ``fn`` with Ray tasks (see ``rayrb.preprocess``).

        Args:
            fn: one row in, one row out (a TensorDict); with ``batched=True`` one chunk in, one out.
            dest: the new dataset's directory.
            **kwargs: passed to ``rayrb.preprocess``.

        Returns:
            The new ``ChunkDataset``; pass it as ``offline_dataset`` to a new buffer.
        """
        from rayrb.io.preprocess import preprocess

        return preprocess(self._dataset_root, fn, dest, **kwargs)

    @gives_back
    def dumps(self, path: str | os.PathLike) -> None:
        """Save the online rows, priorities and sampling state under ``path`` (TorchRL's name).

        The cut is consistent: every write acknowledged before this call is in it. It is written into
        ``path`` (through a link), its shard files in a directory of their own, and takes effect when its
        manifest ``buffer.json`` replaces the previous one; only the previous checkpoint's files are removed,
        nothing else in ``path``. The offline dataset is not copied, the checkpoint records which one it was.

        Args:
            path: a directory the shard actors can write (shared storage on a cluster).
        """
        from rayrb.handle.checkpoint import save

        self.report_served()
        save(self, Path(path))

    @gives_back
    def loads(self, path: str | os.PathLike, *, priority_exponents: dict[str, float] | None = None) -> None:
        """Restore what ``dumps`` saved into this buffer, whole, or leave the buffer as it was; ``path`` is only read.

        Every part is checked before any actor changes (manifest digest, files' checksums, spec, sampler, dataset,
        layout, the coordinator's section); if applying still fails halfway, the buffer is put back as it was
        (``docs/durability.md``). The buffer's settings stay its own: a checkpoint saved under another rate limiter,
        or (sampling by priority) other ``alpha`` or ``eps``, is refused, naming the difference. The sampling state
        (the offline fraction's schedule and step included) becomes the checkpoint's; ``beta`` stays the buffer's.

        Args:
            path: a checkpoint directory ``dumps`` wrote.
            priority_exponents: ``{"alpha": ..., "eps": ...}`` an older checkpoint that does not record them was written with.

        Raises:
            ValueError: the checkpoint is damaged or does not fit this buffer: another row spec, sampler,
                dataset, total online capacity, rate limiter, or priority exponents (nothing changed).
            BufferUnavailableError: applying failed halfway and putting the buffer back failed too.
        """
        from rayrb.handle.checkpoint import restore

        restore(self, Path(path), priority_exponents)

    dump, load = dumps, loads

    @property
    def dataset_root(self) -> str:
        """The offline dataset's chunk directory."""
        return self._dataset_root

    @property
    def sampler_name(self) -> str | dict[str, str]:
        """The sampler kind (or one per side), as checkpoints record it."""
        s = self._settings
        return s.offline_sampler if s.offline_sampler == s.online_sampler else s.samplers

    @property
    def priority_options(self) -> dict[str, float]:
        """Prioritized sampling's ``alpha`` and ``eps``, under which stored priorities are kept."""
        return {"alpha": self._settings.alpha, "eps": self._settings.eps}

    @property
    def rate_limiter_config(self) -> dict[str, Any]:
        """The rate limiter's config (``rayrb.core.rate_limiter``), which checkpoints must match to load."""
        return dict(self._settings.rate_limiter)

    def shutdown(self) -> None:
        """Kill the buffer's actors, remove their state files and offline data it wrote itself. Idempotent."""
        if getattr(self, "_sampling", None) is not None:
            self._sampling.close_reads()
        launch.stop(getattr(self, "rpc", None), self._copies)
        self._copies = []
        self._remove_owned()

    def _remove_owned(self) -> None:
        for d in self._owned_dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._owned_dirs = []

    def __repr__(self) -> str:
        state = "shut down" if self.rpc is None or self.rpc.closed else f"offline_rows={self._offline_rows}"
        return f"{type(self).__name__}(name={self._name!r}, {state}, spec={self._spec!r}, batch_size={self.batch_size})"


def _start_actors(dataset: ChunkDataset, name: str, s: BufferSettings) -> tuple[Any, list, str | None, ShardLayout,
                                                                                 list]:
    """Start the offline shards, the online shards and the coordinator as ``s`` says, where the buffer's layout
    places them; kill them all if one fails to start. Returns them, the device reads go to, the layout and what the
    shards own besides (their copies and placement groups)."""

    import ray

    from rayrb.actors.coordinator import Coordinator
    from rayrb.actors.lifecycle import actor_class
    from rayrb.actors.placement import beside_copies, group_options, replica_groups, shard_placement
    from rayrb.actors.shards import OfflineShard

    if not ray.is_initialized():  # the one place a buffer starts Ray, as its first actor's start would
        ray.init()
    actor_options = dict(s.actor_options)
    if s.transport == "nccl" and "num_gpus" not in actor_options:
        launch.check_nccl_gpus(s.num_offline_shards + s.num_online_shards)
    slices, episodes = launch.slicing(s, dataset)  # a slice sampler's options, and where episodes are
    layout = ShardLayout.build(name, f"{directory_name(name)}-{uuid.uuid4().hex[:8]}", s.storage_dir,
                               dataset_root=str(dataset.root), offline_rows=len(dataset),
                               num_offline=s.num_offline_shards, online_capacity=s.online_capacity,
                               num_online=s.num_online_shards, samplers=(s.offline_sampler, s.online_sampler),
                               replicas=s.online_replicas, online_nodes=s.online_nodes, **episodes)
    cls_opts, opts, coord_opts, device = group_options(actor_options, s.transport, len(layout.shards), s.storage_device)
    table = None if s.storage_device == "cpu" else s.storage_device  # shards keep rows in a DeviceTable there
    so = {"alpha": s.alpha, "eps": s.eps, **slices}
    # A restarted offline shard re-maps its chunks; its priorities, and an online shard's rows, come back
    # from its state files. Without those files an online shard's rows would be lost, so it does not restart.
    restart = {"max_restarts": s.max_restarts, "max_task_retries": CALL_RETRIES if s.max_restarts else 0}
    off_opts = {**restart, **opts}
    on_opts = {**restart, **opts} if s.storage_dir is not None else opts
    started: list = []  # everything started, killed if one start fails
    try:
        # first: a cluster that cannot hold the copies refuses the buffer before any actor starts
        groups = replica_groups(s.num_online_shards, s.online_replicas, on_opts) if s.online_replicas > 1 else []
        started += groups
        offline = [actor_class(OfflineShard, **cls_opts).options(
            name=p.name, **shard_placement(dataset, p.start, p.stop, off_opts)).remote(
            p.root, p.start, p.stop, p.name, p.sampler, sampler_options=so, state_dir=p.directory, device=table)
            for p in layout.offline]
        started += offline
        online, copies = launch.start_online(layout, dataset.spec.to_json(), so, on_opts, cls_opts, table, groups,
                                             started)
        # The coordinator restarts too when it can keep its state on disk: the stream, settings and
        # version there, the write counts in the shards.
        coord_restart = restart if s.storage_dir is not None else {}
        # Shards by name, not handle: a handle in the arguments would live in the object store, and a restart
        # needs its arguments for as long as the buffer lives (ray#53727).
        coord = actor_class(Coordinator).options(name=name, **coord_restart, **beside_copies(coord_opts, groups)).remote(
            [p.name for p in layout.offline], [p.rows for p in layout.offline], [p.name for p in layout.online],
            [p.capacity for p in layout.online], offline_fraction=s.offline_fraction, sampler=s.samplers,
            epoch_end=s.epoch_end, seed=s.seed, name=name, beta=s.beta, rate_limiter=dict(s.rate_limiter),
            alpha=s.alpha, eps=s.eps, state_dir=layout.coordinator_dir, replicated=s.online_replicas > 1,
            shards_place=s.shards_place, slice_len=slices.get("slice_len"))
    except BaseException:
        for actor in started:
            launch.kill(actor)
        raise
    return coord, offline + online, device, layout, groups + copies
