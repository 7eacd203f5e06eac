"""rayrb: offline/online replay buffers sharded over Ray actors.

Names are resolved lazily, so that shard actors importing ``rayrb.actors.shards``
do not pay for torch. The package's layers (``docs/architecture.md``), lowest first:
``errors``, ``core`` (pure decisions), ``io`` (data at rest), ``durability``,
``actors``, ``handle`` (what users hold), ``integrations``, ``cli``.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "OfflineToOnlineReplayBuffer": "rayrb.handle.owner",
    "BufferClient": "rayrb.handle.client",
    "BufferUnavailableError": "rayrb.errors",
    "WriteTimeoutError": "rayrb.errors",
    "RayrbError": "rayrb.errors",
    "prefill_replay_buffer": "rayrb.handle.prefill",
    "schedules": "rayrb.core.schedules",
    "rate_limiter": "rayrb.core.rate_limiter",
    "RateLimiter": "rayrb.core.rate_limiter",
    "MinSize": "rayrb.core.rate_limiter",
    "SampleToInsertRatio": "rayrb.core.rate_limiter",
    "export_parquet": "rayrb.io.preprocess",
    "PreprocessError": "rayrb.errors",
    "ChunkDataset": "rayrb.io.chunks",
    "to_ray_dataset": "rayrb.io.raydata",
    "write_ray_dataset": "rayrb.io.raydata",
    "write_dataset": "rayrb.io.chunks",
    "RowSpec": "rayrb.core.schema",
    "SchemaError": "rayrb.errors",
    "load_dataset": "rayrb.io.datasets.registry",
    "register_dataset": "rayrb.io.datasets.registry",
    "load_openml": "rayrb.io.datasets.openml",
    "OPENML_DATASETS": "rayrb.io.datasets.openml",
    "OpenMLEnv": "rayrb.integrations.openml_env",  # imports torchrl
}

# Module paths of releases before the layers, kept as aliases of the same module objects.
_MOVED = {
    **{m: "core." + m for m in ("plans", "allocation", "allocators", "samplers", "planner", "rate_limiter",
                                "schedules", "schema", "validation")},
    **{m: "durability." + m for m in ("writelog", "storage")},
    **{m: "actors." + m for m in ("coordinator", "shards", "placement", "transport", "metrics")},
    **{m: "handle." + m for m in ("client", "views", "checkpoint")},
    "buffer": "handle.owner",
    **{m: "io." + m for m in ("chunks", "device_table", "arrow", "raydata", "datasets", "datasets.openml",
                              "datasets.registry")},
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``rayrb.<old path>`` as the module that now lives at its new path (the same object)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        old = fullname[len("rayrb."):] if fullname.startswith("rayrb.") else None
        if old not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=old == "datasets")

    def create_module(self, spec):
        module = importlib.import_module("rayrb." + _MOVED[spec.name[len("rayrb."):]])
        sys.modules[spec.name] = module
        return module

    def exec_module(self, module) -> None:
        pass


if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.append(_Alias())

# The function shadows its module's name on the package: alias the module first, then bind it.
import rayrb.io.preprocess as _preprocess_module  # noqa: E402

sys.modules.setdefault("rayrb.preprocess", _preprocess_module)
from rayrb.io.preprocess import preprocess  # noqa: E402, F401  (rayrb.preprocess is the function)

__all__ = sorted([*_EXPORTS, "preprocess"])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(_EXPORTS[name])
        return getattr(module, name, module)  # "schedules" is a module; the rest are attributes
    raise AttributeError(f"module 'rayrb' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
