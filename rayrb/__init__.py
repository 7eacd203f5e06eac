"""rayrb: offline/online replay buffers sharded over Ray actors.

Names are resolved lazily, so that shard actors importing ``rayrb.shards`` do not
pay for torch.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "OfflineToOnlineReplayBuffer": "rayrb.buffer",
    "BufferClient": "rayrb.client",
    "BufferUnavailableError": "rayrb.client",
    "WriteTimeoutError": "rayrb.client",
    "prefill_replay_buffer": "rayrb.buffer",
    "schedules": "rayrb.schedules",
    "rate_limiter": "rayrb.rate_limiter",
    "RateLimiter": "rayrb.rate_limiter",
    "MinSize": "rayrb.rate_limiter",
    "SampleToInsertRatio": "rayrb.rate_limiter",
    "export_parquet": "rayrb.preprocess",
    "PreprocessError": "rayrb.preprocess",
    "ChunkDataset": "rayrb.chunks",
    "to_ray_dataset": "rayrb.raydata",
    "write_ray_dataset": "rayrb.raydata",
    "write_dataset": "rayrb.chunks",
    "RowSpec": "rayrb.schema",
    "SchemaError": "rayrb.schema",
    "load_dataset": "rayrb.datasets.registry",
    "register_dataset": "rayrb.datasets.registry",
    "load_openml": "rayrb.datasets.openml",
    "OPENML_DATASETS": "rayrb.datasets.openml",
    "OpenMLEnv": "rayrb.integrations.openml_env",  # imports torchrl
}

# The function shadows its module's name on the package, so bind it eagerly (numpy-only import).
from rayrb.preprocess import preprocess  # noqa: E402

__all__ = sorted([*_EXPORTS, "preprocess"])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(_EXPORTS[name])
        return getattr(module, name, module)  # "schedules" is a module; the rest are attributes
    raise AttributeError(f"module 'rayrb' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
