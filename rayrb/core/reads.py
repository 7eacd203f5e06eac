"""The read rule: what a shard's read draws, applied alike by the shard and by a handle reading the shard's files
on its node (``rayrb.handle.local``), so a read gives the same rows wherever it runs. No Ray.

A plan names, per shard, the reads' counts, seeds and (without replacement) epochs, and the write count it was
planned at. ``read_size`` says which rows the read draws over (or that the rows it was planned over have not
landed yet), ``read_indices`` which of them; ``rayrb.durability.storage.whole`` which slots may be served.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from rayrb.core.plans import Epoch
from rayrb.core.samplers import read_rng

if TYPE_CHECKING:
    from rayrb.core.samplers import Sampler


def read_indices(sampler: "Sampler", counts: Sequence[int], seeds: Sequence[int],
                 epochs: Sequence[Epoch | None] | None, size: int) -> np.ndarray:
    """The local indices a shard's reads draw: ``counts[j]`` rows from ``seeds[j]`` (and ``epochs[j]``) each,
    over ``size`` rows, in order. Shards and the handles that read their files (``rayrb.handle.local``) both
    use this, so a read gives the same rows wherever it runs."""
    epochs = epochs or [None] * len(counts)
    if not counts:
        return np.empty(0, np.int64)
    parts = [sampler.sample(int(c), size, read_rng(s), epoch=e) for c, s, e in zip(counts, seeds, epochs)]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def read_size(held: int, capacity: int, written: int | None) -> int | None:
    """The rows a read planned at write count ``written`` draws over, in a shard that has had ``held`` rows
    written (its write count; an offline shard's rows) into ``capacity`` slots: those there were at the plan,
    still at the same slots (a circular shard's ``w``-th row sits at ``w mod capacity``), even if later rows
    overwrote some since. None: the rows it was planned over have not all landed here yet (the caller asks again).
    The rule every reader of a shard applies, the shard and a handle reading its files alike.

    >>> read_size(100, 64, None), read_size(100, 64, 40), read_size(100, 64, 80), read_size(30, 64, 40)
    (64, 40, 64, None)
    """
    if written is not None and held < written:
        return None
    return min(held, capacity) if written is None else min(held, int(written), capacity)
