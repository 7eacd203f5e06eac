"""How rows reach learners: the object store, or Ray Direct Transport (gloo on CPU; NCCL and CUDA IPC on GPU).

Which route each shard-learner pair takes (``plan_routes``), the checks that
refuse a route before Ray would deadlock or NCCL would hang, the collective group
that carries RDT refs, and ``receive``, which turns a learner's parts back
into a TensorDict. Array conversion lives in ``rayrb.io.arrays``.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict

from rayrb.core.plans import BatchPlan, concat, nest, provenance
from rayrb.errors import InvalidArgumentError, InvalidStateError
from rayrb.io.arrays import _tensor

TRANSPORTS = ("object_store", "gloo", "nccl", "cuda_ipc", "auto")
RDT = ("gloo", "nccl", "cuda_ipc")  # the Ray Direct Transport backends
STORAGE_DEVICES = ("cpu", "cuda")


def _cluster_gpus() -> float:
    import ray

    if not ray.is_initialized():
        ray.init()  # as the first actor would; the check needs the cluster's resources
    return float(ray.cluster_resources().get("GPU", 0))


def check_transport(transport: str) -> str:
    """Validate ``transport=``; ``nccl`` needs GPUs in the cluster and cupy (Ray's NCCL RDT uses it)."""
    import importlib.util

    if transport not in TRANSPORTS:
        raise InvalidArgumentError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if transport == "nccl":
        gpus = _cluster_gpus()
        if gpus < 1 or importlib.util.find_spec("cupy") is None:
            raise InvalidArgumentError(
                f"transport='nccl' needs GPUs in the Ray cluster and cupy installed; found {gpus:g} GPUs and "
                f"cupy {'present' if importlib.util.find_spec('cupy') else 'missing'}. "
                "Use transport='gloo' (CPU) or 'object_store'")
    return transport


def check_storage_device(device: str) -> str:
    """Validate ``storage_device=``: ``"cuda"`` needs GPUs in the Ray cluster (else its shards never start)."""
    if device not in STORAGE_DEVICES:
        raise InvalidArgumentError(f"storage_device must be one of {STORAGE_DEVICES}, got {device!r}")
    if device == "cuda":
        gpus = _cluster_gpus()
        if gpus <= 0:
            raise InvalidArgumentError(f"storage_device='cuda' needs GPUs in the Ray cluster, found {gpus:g}; "
                                       "use storage_device='cpu'")
    return device


class Place(NamedTuple):
    """Where an actor runs: its name (for errors), its node, and the GPU ids Ray gave it there."""

    name: str
    node: str
    gpus: tuple[str, ...] = ()


def shared_gpu(places: Sequence[Place]) -> tuple[Place, Place, str] | None:
    """The first two members that Ray gave one GPU (same node, a common GPU id), or None."""
    seen: dict[tuple[str, str], Place] = {}
    for p in places:
        for g in p.gpus:
            other = seen.get((p.node, g))
            if other is not None:
                return other, p, g
            seen[(p.node, g)] = p
    return None


def refuse_shared_gpus(places: Sequence[Place]) -> None:
    """NCCL needs one GPU per rank: refuse a group in which two members share one, before it is created."""
    hit = shared_gpu(places)
    if hit is not None:
        a, b, g = hit
        raise InvalidArgumentError(
            f"an NCCL group cannot hold {a.name} and {b.name}: both run on GPU {g} of node {a.node[:12]} "
            "(NCCL needs one GPU per rank and refuses two ranks on one device). Use transport='cuda_ipc' "
            "between actors that share a GPU, or 'auto'")


def choose(src: Place, dst: Place) -> str:
    """How rows travel from shard ``src`` to learner ``dst`` under ``transport="auto"``.

    CUDA IPC when the receiver was given the GPU the sender's rows are on (the
    sender's first GPU) on the same node, NCCL between GPUs that differ, the object
    store where either end has no GPU.

    Examples:
        >>> choose(Place("shard", "n1", ("0",)), Place("learner", "n1", ("0",)))
        'cuda_ipc'
        >>> choose(Place("shard", "n1", ("0",)), Place("learner", "n2", ("0",)))
        'nccl'
        >>> choose(Place("shard", "n1"), Place("learner", "n1", ("0",)))
        'object_store'
    """
    if not src.gpus or not dst.gpus:
        return "object_store"
    if src.node == dst.node and src.gpus[0] in dst.gpus:  # the sender's rows are on its first GPU
        return "cuda_ipc"
    return "nccl"


def plan_routes(transport: str, shards: Sequence[Place], learners: Sequence[Place]
                ) -> tuple[dict[tuple[int, int], str], list[int], list[int]]:
    """Per (shard, learner) pair, the transport its rows take; and the shards and learners an NCCL or gloo
    group must hold. Raises, naming the pair, where an explicit transport cannot work.

    ``"auto"`` never refuses: a pair that would need NCCL falls back to the object
    store when the NCCL members would share a GPU.
    """
    pairs = [(i, j) for i in range(len(shards)) for j in range(len(learners))]
    if transport in ("object_store", "gloo"):
        routes = {pair: transport for pair in pairs}
    elif transport == "cuda_ipc":
        for i, j in pairs:
            if choose(shards[i], learners[j]) != "cuda_ipc":
                raise InvalidArgumentError(
                    f"transport='cuda_ipc' carries rows only between actors that Ray gave the same GPU of one node; "
                    f"{shards[i].name} (node {shards[i].node[:12]}, GPUs {list(shards[i].gpus)}) and "
                    f"{learners[j].name} (node {learners[j].node[:12]}, GPUs {list(learners[j].gpus)}) do not share "
                    "one. Give the learners num_gpus on the shards' GPU, or use transport='auto'")
        routes = {pair: "cuda_ipc" for pair in pairs}
    elif transport == "nccl":
        for p in (*shards, *learners) if pairs else ():
            if not p.gpus:
                raise InvalidArgumentError(f"transport='nccl' carries rows between GPUs, but Ray gave {p.name} (node "
                                           f"{p.node[:12]}) none; give it num_gpus, or use transport='auto'")
        refuse_shared_gpus([*shards, *learners])
        routes = {pair: "nccl" for pair in pairs}
    elif transport == "auto":
        routes = {(i, j): choose(shards[i], learners[j]) for i, j in pairs}
        group: dict[tuple[str, int], Place] = {}
        for (i, j), t in routes.items():  # admit NCCL pairs while the group's members keep a GPU each
            if t != "nccl":
                continue
            grown = {**group, ("s", i): shards[i], ("l", j): learners[j]}
            if shared_gpu(list(grown.values())) is None:
                group = grown
            else:
                routes[(i, j)] = "object_store"
    else:
        raise InvalidArgumentError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    shard_ids, learner_ids = _members(routes, "nccl" if transport in ("nccl", "auto") else "gloo")
    return routes, shard_ids, learner_ids


def _members(routes: Mapping[tuple[int, int], str], backend: str) -> tuple[list[int], list[int]]:
    pairs = [pair for pair, t in routes.items() if t == backend]
    return sorted({i for i, _ in pairs}), sorted({j for _, j in pairs})


def _place_of(actor: Any) -> tuple[str, list[str]]:  # runs inside the actor, through __ray_call__
    import ray

    return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]


def places(actors: Sequence[Any], names: Sequence[str], timeout: float = 60.0) -> list[Place]:
    """Each actor's ``Place``, asked of the actor itself."""
    import ray

    got = ray.get([a.__ray_call__.remote(_place_of) for a in actors], timeout=timeout)
    return [Place(name, node, tuple(gpus)) for name, (node, gpus) in zip(names, got)]


class Routes(NamedTuple):
    """How a buffer's shards reach its connected learners: ``route[(shard, learner)]`` and the group, if any."""

    route: dict[tuple[int, int], str]
    group: Any = None


def connect_group(transport: str, shards: list, learners: list, name: str, previous: Any = None,
                  shard_names: Sequence[str] | None = None, timeout: float = 60.0) -> Routes:
    """The routes from ``shards`` to ``learners`` under ``transport``, with the collective group that carries
    them, created here (None for the object store and CUDA IPC, which need none).

    Refuses learners whose class cannot receive RDT refs, instead of letting Ray
    deadlock until its 60 s fetch timeout (ray-project/ray#66264), and an NCCL group
    in which two members share one GPU, before it is created.
    """
    if transport == "object_store":
        return Routes({(i, j): "object_store" for i in range(len(shards)) for j in range(len(learners))})
    shard_names = list(shard_names or [f"shard {i}" for i in range(len(shards))])
    if transport == "gloo":
        s_places = [Place(n, "") for n in shard_names]
        l_places = [Place(f"learner {j}", "") for j in range(len(learners))]
    else:
        s_places = places(shards, shard_names, timeout)
        l_places = places(learners, [f"learner {j}" for j in range(len(learners))], timeout)
    route, shard_ids, learner_ids = plan_routes(transport, s_places, l_places)
    rdt = sorted({j for (_, j), t in route.items() if t in RDT})
    missing = [j for j in rdt if not getattr(learners[j], "_ray_enable_tensor_transport", False)]
    if missing:
        raise InvalidArgumentError(
            f"transport={transport!r} needs learner classes declared with "
            f"@ray.remote(enable_tensor_transport=True); learners {missing} are not (without it the "
            "receive deadlocks until Ray's 60 s RDT timeout, ray-project/ray#66264)")
    backend = "gloo" if transport == "gloo" else "nccl"
    if previous is not None and previous.group is not None:  # only now: a refused call keeps the old group
        from ray.experimental.collective import destroy_collective_group

        destroy_collective_group(previous.group)
    if not shard_ids:
        return Routes(route)
    from ray.experimental.collective import create_collective_group

    try:
        group = create_collective_group([shards[i] for i in shard_ids] + [learners[j] for j in learner_ids],
                                        backend=backend, name=name)
    except Exception as e:
        raise InvalidStateError(
            f"could not create a {backend} collective group over the shards and learners: {e}. "
            "An actor can join one group per backend, and gloo RDT cannot share an actor with a "
            "torch.distributed default group (DDP, RLlib remote learners): use transport='object_store' "
            "or 'nccl' for those learners") from e
    return Routes(route, group)


def split_flat(flat: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A shard's flat ``{"rows/k": t, "info/k": t}`` tensors as the ``(rows, info)`` pair the object store carries."""
    rows = {k[len("rows/"):]: v for k, v in flat.items() if k.startswith("rows/")}
    info = {k[len("info/"):]: v for k, v in flat.items() if k.startswith("info/")}
    return rows, info


def receive(plan: BatchPlan, *parts: Any):
    """A learner's slice from ``OfflineToOnlineReplayBuffer.feed``: ``(TensorDict, info)``.

    ``parts`` are the shard parts as Ray resolved them: ``(rows, info)`` numpy pairs
    (object store) or flat tensor dicts (Ray Direct Transport; tensors stay on the
    device they arrived on).
    """
    if len(plan.parts) != len(parts):
        raise InvalidArgumentError(f"expected {len(plan.parts)} shard parts for this slice, got {len(parts)}")
    rows: list[dict[str, torch.Tensor]] = []
    infos: list[dict[str, torch.Tensor]] = []
    for part in parts:
        if isinstance(part, tuple):
            r, i = part
            rows.append({k: _tensor(v) for k, v in r.items()})
            infos.append({k: _tensor(v) for k, v in i.items()})
        else:
            r, i = split_flat(part)
            rows.append(r)
            infos.append(i)
    devices = [t.device for r in rows for t in r.values() if t.device.type != "cpu"]
    if devices:  # parts over the object store arrive on the host: join the others on their device
        rows = [{k: v.to(devices[0]) for k, v in r.items()} for r in rows]
        infos = [{k: v.to(devices[0]) for k, v in i.items()} for i in infos]
    flat = concat(rows)
    device = next(iter(flat.values())).device
    info = provenance(plan, infos, cat=torch.cat, as_array=lambda a: torch.from_numpy(a).to(device))
    if "weight" in info:
        info["weight"] = info["weight"].float()
    return TensorDict(nest(flat), batch_size=[plan.batch_size], device=device if device.type != "cpu" else None), info
