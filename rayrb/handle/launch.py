"""What starting a buffer takes besides its actors' options: the offline data as chunks, the online shards and
their copies, where each shard's rows lie for handles that read them themselves, and killing or cleaning up what
started. Used by ``rayrb.handle.owner``; Ray is imported only where an actor is started or killed."""
from __future__ import annotations

import os
import shutil
from dataclasses import replace
from typing import Any

from rayrb.core.layout import ShardLayout
from rayrb.errors import InvalidArgumentError
from rayrb.handle.settings import BufferSettings, default_offline_kind, is_dataset_id
from rayrb.io.chunks import ChunkDataset


def start_online(layout: ShardLayout, spec: dict, so: dict, on_opts: dict, cls_opts: dict, table: str | None,
                 groups: list, started: list) -> tuple[list, list]:
    """Start the online shards of ``layout``, each after its copies (which it looks up by name), all of a shard's
    in its placement group of ``groups`` (else on its node hint); returns the shards and their copies. Every actor
    is appended to ``started`` as it starts, for the caller to kill should a later start fail."""
    from rayrb.actors.lifecycle import actor_class
    from rayrb.actors.online_shard import OnlineShard
    from rayrb.actors.placement import in_group, on_node

    shards, copies = [], []
    for p in layout.online:
        for r, copy in enumerate(p.copies, 1):
            copies.append(actor_class(OnlineShard, **cls_opts).options(
                name=copy.name, **in_group(on_opts, groups[p.index], r)).remote(
                spec, p.capacity, copy.name, p.sampler, sampler_options=so, state_dir=copy.directory, device=table))
            started.append(copies[-1])
        place = in_group(on_opts, groups[p.index], 0) if groups else on_node(on_opts, p.node)
        shards.append(actor_class(OnlineShard, **cls_opts).options(name=p.name, **place).remote(
            spec, p.capacity, p.name, p.sampler, sampler_options=so, state_dir=p.directory, device=table,
            replicas=[c.name for c in p.copies], coordinator=layout.buffer))
        started.append(shards[-1])
    return shards, copies


def kill(actor: Any) -> None:
    """Kill an actor, or remove a placement group with the actors in it."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    try:
        if isinstance(actor, PlacementGroup):
            remove_placement_group(actor)
        else:
            ray.kill(actor)
    except Exception:  # already gone
        pass


def stop(rpc: Any, copies: list) -> None:
    """Close and kill a buffer's actors (``rpc``'s shards and coordinator, and the ``copies`` they own); ``rpc`` is
    marked closed. Idempotent."""
    import ray

    shards, coord = (rpc.shards, rpc.coord) if rpc is not None else ([], None)
    if rpc is not None:
        rpc.closed = True
    closing = [s.close.remote() for s in shards] + ([coord.close.remote()] if coord is not None else [])
    try:  # shards remove their state files, the coordinator its version file; a stuck one is killed anyway
        ray.wait(closing, num_returns=len(closing), timeout=5)
    except Exception:
        pass
    for actor in [*shards, coord, *copies]:  # the shards close their copies; the groups go with them
        if actor is not None:
            kill(actor)


def offline_chunks(offline_dataset: Any, s: BufferSettings, own_sampler: bool, dataset_root: Any,
                   dataset_kwargs: dict) -> tuple[ChunkDataset, list, BufferSettings]:
    """The offline dataset as chunks, the directories the buffer then owns (removed at shutdown), and ``s``.

    A dataset id goes to its loader (with ``batch_size``, as TorchRL forwards it); a TorchRL dataset's own sampler
    becomes the offline side's unless one was asked for (in the settings returned). Refused, it leaves nothing.
    """
    from rayrb.io.datasets.registry import as_chunk_dataset, load_dataset

    if isinstance(offline_dataset, (str, os.PathLike)):  # options such as root= go to the dataset's loader
        if s.batch_size is not None and is_dataset_id(offline_dataset):
            dataset_kwargs = {"batch_size": s.batch_size, **dataset_kwargs}
        offline_dataset, dataset_kwargs = load_dataset(offline_dataset, **dataset_kwargs), {}
        if not own_sampler and not isinstance(offline_dataset, ChunkDataset):
            s = replace(s, offline_sampler=default_offline_kind(offline_dataset))  # a TorchRL dataset's own sampler
    dataset, owned = as_chunk_dataset(offline_dataset, root=dataset_root, **dataset_kwargs)
    owned_dirs = [dataset.root.parent] if owned and dataset_root is None else []
    problem = None
    if len(dataset) == 0:
        problem = "expected an offline dataset with at least one row, got 0 rows"
    elif s.num_offline_shards > len(dataset):
        problem = f"num_offline_shards ({s.num_offline_shards}) exceeds the dataset's {len(dataset)} rows"
    if problem is not None:
        for d in owned_dirs:
            shutil.rmtree(d, ignore_errors=True)
        raise InvalidArgumentError(problem)
    return dataset, owned_dirs, s


def check_nccl_gpus(shards: int) -> None:
    """NCCL gives each shard a GPU of its own: refuse a cluster with fewer GPUs than shards."""
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    if gpus < shards:
        raise InvalidArgumentError(f"transport='nccl' gives each shard a GPU of its own (NCCL needs one GPU per rank): "
                                   f"{shards} shards need {shards} GPUs, the cluster has {gpus:g}; use fewer shards, "
                                   "transport='cuda_ipc' within a node, or 'auto'")


def remove_leftovers(storage_dir: Any) -> None:
    """What buffers whose owner died without shutdown() left on this node (rayrb.durability.leftovers)."""
    from rayrb.actors.lifecycle import leftovers
    from rayrb.durability.leftovers import remove

    try:
        remove(leftovers([storage_dir] if storage_dir is not None else []))
    except Exception:  # a clean-up: never a reason not to start
        pass


def slicing(settings: BufferSettings, dataset: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A slice sampler's options for the shards and the coordinator (``SliceSampler.resolve``: none without one),
    and the layout's: the key episodes are found by, whether it holds end flags, and the offline rows that begin
    an episode (``ShardLayout.build``)."""
    from rayrb.core.episodes import episodes_of

    if settings.slices is None:
        return {}, {}
    options = settings.slices.resolve({k: f.shape for k, f in dataset.spec.items()}, settings.batch_size)
    key, ends = options["slice_key"], options["slice_ends"]
    return options, {"episodes": (key, ends), "slice_len": options["slice_len"],
                     "strict_length": options.get("slice_strict", True),
                     "episode_starts": episodes_of(dataset.column(key, 0, len(dataset)), ends).starts}
