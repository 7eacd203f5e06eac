"""How rows travel: flat dicts of numpy arrays in the object store, TensorDicts at the ends.

numpy arrays are serialized out of band and mapped straight from Ray's object
store, while torch tensors and TensorDicts are pickled into the message and
copied twice (``RAY_NOTES.md``: 2.7 ms against 8-12 ms for a 2 MB batch). So
every batch is shipped as ``{"a/b": ndarray}`` and rebuilt with
``torch.from_numpy`` on the consumer.

Batches rebuilt from a single stored object share its memory: treat them as
read-only and ``.clone()`` before writing in place.
"""
from __future__ import annotations

import warnings
from typing import Any, Mapping

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from rayrb.plans import BatchPlan, concat, nest, provenance
from rayrb.schema import SEP

_TORCH_TO_NUMPY = {
    torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
    torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
    torch.uint8: np.uint8, torch.bool: np.bool_, torch.complex64: np.complex64, torch.complex128: np.complex128,
}


def numpy_dtype(dtype: torch.dtype | str | np.dtype) -> np.dtype:
    """numpy dtype for a torch dtype (or anything numpy understands)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_TO_NUMPY:
            raise TypeError(f"expected a torch dtype with a numpy equivalent, got {dtype}")
        return np.dtype(_TORCH_TO_NUMPY[dtype])
    if isinstance(dtype, str) and dtype.startswith("torch."):
        return numpy_dtype(getattr(torch, dtype[len("torch."):]))
    return np.dtype(dtype)


def to_numpy_dict(data: Any) -> dict[str, np.ndarray]:
    """Flatten a TensorDict, a (nested) dict of tensors/arrays into ``{"a/b": ndarray}``.

    Tensors are moved to CPU; CPU tensors become views, not copies.
    """
    out: dict[str, np.ndarray] = {}

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, (TensorDictBase, Mapping)):
            for k in value.keys():
                visit(f"{prefix}{SEP}{k}" if prefix else str(k), value[k])
        elif isinstance(value, torch.Tensor):
            t = value.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            out[prefix] = t.numpy()
        else:
            out[prefix] = np.asarray(value)

    visit("", data)
    return out


def _tensor(a: np.ndarray) -> torch.Tensor:
    if not a.flags.writeable:
        # A view into the object store: torch warns about it; the module docstring documents it.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(a)
    return torch.from_numpy(a)


def from_numpy_dict(arrays: Mapping[str, np.ndarray], batch_size: int | None = None) -> TensorDict:
    """Rebuild a TensorDict from ``{"a/b": ndarray}`` without copying."""
    if batch_size is None:
        batch_size = next(iter(arrays.values())).shape[0] if arrays else 0
    return TensorDict(nest({k: _tensor(a) for k, a in arrays.items()}), batch_size=[batch_size])


TRANSPORTS = ("object_store", "gloo", "nccl")


def check_transport(transport: str) -> str:
    """Validate ``transport=``; ``nccl`` needs GPUs in the cluster and cupy (Ray's NCCL RDT uses it)."""
    import importlib.util

    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if transport == "nccl":
        import ray

        gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
        if gpus < 1 or importlib.util.find_spec("cupy") is None:
            raise ValueError(
                f"transport='nccl' needs GPUs in the Ray cluster and cupy installed; found {gpus:g} GPUs and "
                f"cupy {'present' if importlib.util.find_spec('cupy') else 'missing'}. "
                "Use transport='gloo' (CPU) or 'object_store'")
    return transport


def connect_group(transport: str, shards: list, learners: list, name: str, previous: Any = None) -> Any:
    """The collective group that carries ``transport`` from ``shards`` to ``learners`` (None for the object store).

    Refuses learners whose class cannot receive RDT refs, instead of letting Ray
    deadlock until its 60 s fetch timeout (ray-project/ray#66264).
    """
    if transport == "object_store":
        return None
    missing = [i for i, a in enumerate(learners) if not getattr(a, "_ray_enable_tensor_transport", False)]
    if missing:
        raise ValueError(
            f"transport={transport!r} needs learner classes declared with "
            f"@ray.remote(enable_tensor_transport=True); learners {missing} are not (without it the "
            "receive deadlocks until Ray's 60 s RDT timeout, ray-project/ray#66264)")
    from ray.experimental.collective import create_collective_group, destroy_collective_group

    if previous is not None:
        destroy_collective_group(previous)
    try:
        return create_collective_group(shards + learners, backend=transport, name=name)
    except Exception as e:
        raise RuntimeError(
            f"could not create a {transport} collective group over the shards and learners: {e}. "
            "An actor can join one group per backend, and gloo RDT cannot share an actor with a "
            "torch.distributed default group (DDP, RLlib remote learners): use transport='object_store' "
            "or 'nccl' for those learners") from e


def receive(plan: BatchPlan, *parts: Any):
    """A learner's slice from :meth:`OfflineToOnlineReplayBuffer.feed`: ``(TensorDict, info)``.

    ``parts`` are the shard parts as Ray resolved them: ``(rows, info)`` numpy pairs
    (object store) or flat tensor dicts (Ray Direct Transport; tensors stay on the
    device they arrived on).
    """
    if len(plan.parts) != len(parts):
        raise ValueError(f"expected {len(plan.parts)} shard parts for this slice, got {len(parts)}")
    rows: list[dict[str, torch.Tensor]] = []
    infos: list[dict[str, torch.Tensor]] = []
    for part in parts:
        if isinstance(part, tuple):
            r, i = part
            rows.append({k: _tensor(v) for k, v in r.items()})
            infos.append({k: _tensor(v) for k, v in i.items()})
        else:
            rows.append({k[len("rows/"):]: v for k, v in part.items() if k.startswith("rows/")})
            infos.append({k[len("info/"):]: v for k, v in part.items() if k.startswith("info/")})
    flat = concat(rows)
    device = next(iter(flat.values())).device
    info = provenance(plan, infos, cat=torch.cat, as_array=lambda a: torch.from_numpy(a).to(device))
    if "weight" in info:
        info["weight"] = info["weight"].float()
    return TensorDict(nest(flat), batch_size=[plan.batch_size], device=device if device.type != "cpu" else None), info
