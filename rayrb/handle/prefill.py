"""TorchRL's ``prefill_replay_buffer``: seed a mutable buffer with rows of an offline dataset."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from rayrb.core.validation import positive_int
from rayrb.handle.client import BufferClient
from rayrb.io.arrays import from_numpy_dict


def prefill_replay_buffer(rb: Any, dataset: Any, n_samples: int | None = None, chunk_size: int = 1000,
                          seed: int | None = None) -> Any:
    """Copy up to ``n_samples`` distinct rows of an offline dataset into a mutable buffer (TorchRL's helper).

    ``rb`` is anything with ``extend`` (a rayrb buffer's online side, a TorchRL
    replay buffer); ``dataset`` is any offline source
    ``OfflineToOnlineReplayBuffer`` accepts. Rows are taken in a random order
    (``seed``), without repeats.
    """
    from rayrb.io.datasets.registry import as_chunk_dataset

    chunk_size = positive_int("chunk_size", chunk_size)
    # TorchRL builds a dataset id with batch_size=chunk_size; rayrb's own loaders ignore it
    ds, owned = as_chunk_dataset(dataset, **({"batch_size": chunk_size} if isinstance(dataset, str) else {}))
    try:
        total = len(ds) if n_samples is None else min(positive_int("n_samples", n_samples), len(ds))
        order = np.random.default_rng(seed).permutation(len(ds))[:total]
        for start in range(0, total, chunk_size):
            rows = ds.gather(order[start:start + chunk_size])
            if isinstance(rb, BufferClient):
                rb.extend(rows, prefill=True)  # seeding the online side: past any rate limiter
            else:
                rb.extend(from_numpy_dict(rows))
    finally:
        if owned:
            shutil.rmtree(Path(ds.root).parent, ignore_errors=True)
    return rb
