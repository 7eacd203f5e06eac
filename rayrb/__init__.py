"""rayrb: offline/online replay buffers sharded over Ray actors.

Names are resolved lazily, so that shard actors importing ``rayrb.actors.shards``
do not pay for torch. The package's layers (``docs/architecture.md``), lowest first:
``errors``, ``core`` (pure decisions), ``io`` (data at rest), ``durability``,
``actors``, ``handle`` (what users hold), ``integrations``, ``cli``.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the path users import, for type checkers and the API reference (resolved lazily at run time)
    from rayrb.handle.owner import OfflineToOnlineReplayBuffer  # noqa: F401

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
    "write_batches": "rayrb.io.streaming",
    "RowSpec": "rayrb.core.schema",
    "SliceSampler": "rayrb.core.slice_sampling",
    "SchemaError": "rayrb.errors",
    "load_dataset": "rayrb.io.datasets.registry",
    "register_dataset": "rayrb.io.datasets.registry",
    "load_openml": "rayrb.io.datasets.openml",
    "OPENML_DATASETS": "rayrb.io.datasets.openml",
    "OpenMLEnv": "rayrb.integrations.openml_env",  # imports torchrl
    "OpenMLExperienceReplay": "rayrb.integrations.openml_replay",  # imports torchrl
}

from rayrb.io.preprocess import preprocess  # noqa: E402, F401  (rayrb.preprocess is the function)

__all__ = sorted([*_EXPORTS, "preprocess"])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(_EXPORTS[name])
        return getattr(module, name, module)  # "schedules" is a module; the rest are attributes
    raise AttributeError(f"module 'rayrb' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
