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
    nested: dict[str, Any] = {}
    for k, a in arrays.items():
        parts = k.split(SEP)
        d = nested
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = _tensor(a)
    if batch_size is None:
        batch_size = next(iter(arrays.values())).shape[0] if arrays else 0
    return TensorDict(nested, batch_size=[batch_size])


def concat(parts: list[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Concatenate flat batches key by key (a single part is returned as is)."""
    parts = [p for p in parts if p and next(iter(p.values())).shape[0] > 0] or parts[:1]
    if len(parts) == 1:
        return dict(parts[0])
    return {k: np.concatenate([p[k] for p in parts], axis=0) for k in parts[0]}


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


def receive(meta: Mapping[str, Any], *parts: Any):
    """A learner's slice from :meth:`OfflineToOnlineReplayBuffer.feed`: ``(TensorDict, info)``.

    ``parts`` are the shard parts as Ray resolved them: ``(rows, info)`` numpy pairs
    (object store) or flat tensor dicts (Ray Direct Transport; tensors stay on the
    device they arrived on).
    """
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
    counts = [p[2] for p in meta["parts"]]
    if len(counts) != len(parts):
        raise ValueError(f"expected {len(counts)} shard parts for this slice, got {len(parts)}")
    flat = {k: torch.cat([r[k] for r in rows]) if len(rows) > 1 else rows[0][k] for k in rows[0]}
    device = next(iter(flat.values())).device
    from rayrb.coordinator import provenance

    info = provenance(meta, infos, cat=torch.cat, as_array=lambda a: torch.from_numpy(a).to(device))
    if "weight" in info:
        info["weight"] = info["weight"].float()
    nested: dict[str, Any] = {}
    for k, t in flat.items():
        *path, leaf = k.split(SEP)
        d = nested
        for p in path:
            d = d.setdefault(p, {})
        d[leaf] = t
    return TensorDict(nested, batch_size=[sum(counts)], device=device if device.type != "cpu" else None), info
