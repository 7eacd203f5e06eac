"""Shard actors: thin shells around storage and a sampler.

* :class:`OfflineShard` maps a contiguous row range of a chunk dataset read-only
  (memory maps; nothing copied into the heap or through the object store).
* :class:`OnlineShard` is a circular buffer that copies rows on insert, so it never
  keeps a view into an object-store buffer (pinned plasma memory, ray#8234).

Both return rows as flat dicts of numpy arrays plus provenance (local index and
the slot's generation: how many times it has been written). They import numpy
only, not torch, so each costs little memory and starts fast.

The coordinator is their only caller for data paths; Ray runs a caller's tasks on
a sync actor in submission order, which is what keeps the coordinator's view of
shard sizes exact.
"""
from __future__ import annotations

import os
import time
from typing import Any, Mapping

import numpy as np

from rayrb.chunks import ChunkDataset, ReadOnlyError
from rayrb.metrics import ActorMetrics
from rayrb.samplers import make_sampler
from rayrb.schema import RowSpec

Rows = dict[str, np.ndarray]
Info = dict[str, np.ndarray]


def _memory() -> dict[str, int]:
    """Resident memory split into private (``rss_anon``: copies) and file-backed (``rss_file``: mapped chunks)."""
    out = {"rss_bytes": 0, "rss_anon_bytes": 0, "rss_file_bytes": 0, "rss_peak_bytes": 0}
    names = {"VmRSS:": "rss_bytes", "RssAnon:": "rss_anon_bytes", "RssFile:": "rss_file_bytes",
             "VmHWM:": "rss_peak_bytes"}
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                parts = line.split()
                if parts and parts[0] in names:
                    out[names[parts[0]]] = int(parts[1]) * 1024
    except OSError:
        pass
    return out


class _Shard:
    kind = "shard"

    def __init__(self, shard_id: str, sampler: str, export_metrics: bool = True, capacity: int = 0,
                 sampler_options: Mapping[str, float] | None = None):
        self.shard_id = shard_id
        opts = dict(sampler_options or {})
        self._sampler = make_sampler(sampler, capacity, opts.get("alpha", 0.6), opts.get("eps", 1e-8))
        self._prioritized = sampler == "prioritized"
        self._metrics = ActorMetrics("shard", {"shard": shard_id, "kind": self.kind}, export=export_metrics)

    # storage hooks ------------------------------------------------------------
    def size(self) -> int:
        raise NotImplementedError

    def _gather(self, idx: np.ndarray) -> Rows:
        raise NotImplementedError

    def _generation(self, idx: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    # sampling -----------------------------------------------------------------
    def begin_epoch(self, seed: int) -> int:
        self._sampler.begin_epoch(self.size(), np.random.default_rng(seed))
        return self._sampler.remaining()

    def sample(self, count: int, seed: int) -> tuple[Rows, Info]:
        """``count`` local rows drawn by this shard's sampler from ``seed``, with their provenance."""
        return self.sample_many([count], [seed])

    def _info(self, idx: np.ndarray) -> Info:
        info = {"index": idx, "generation": self._generation(idx)}
        if self._prioritized:
            info["priority"] = self._sampler.tree.values(idx)  # p_i, for importance weights
        return info

    def mass_stats(self) -> tuple[float, float]:
        """``(total mass, smallest p_i)`` under prioritized sampling; ``(size, 1)`` otherwise."""
        if self._prioritized:
            return self._sampler.mass(self.size())
        return float(self.size()), 1.0

    def update_priority(self, idx: np.ndarray, generation: np.ndarray, priority: np.ndarray) -> int:
        """Set priorities of rows still holding the written generation; return how many were set.

        An update for a slot overwritten since it was sampled is dropped.
        """
        if not self._prioritized:
            raise ValueError(f"shard {self.shard_id}: update_priority needs sampler='prioritized'")
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.size()):
            raise IndexError(f"shard {self.shard_id}: expected indices in [0, {self.size()}), got {idx.min()}..{idx.max()}")
        keep = self._generation(idx) == np.asarray(generation, dtype=np.int64)
        self._sampler.set_priority(idx[keep], np.asarray(priority, dtype=np.float64)[keep])
        self._metrics.count("priority_updates", int(keep.sum()))
        self._metrics.count("priority_updates_dropped", int((~keep).sum()))
        return int(keep.sum())

    def sample_many(self, counts: list[int], seeds: list[int]) -> tuple[Rows, Info]:
        """The rows of several :meth:`sample` calls, in order, gathered in one pass into one object."""
        t0 = time.perf_counter()
        idx = np.concatenate([self._sampler.sample(int(c), self.size(), np.random.default_rng(s))
                              for c, s in zip(counts, seeds)]) if counts else np.empty(0, np.int64)
        rows, info = self._gather(idx), self._info(idx)
        self._metrics.count("rows_sampled", len(idx))
        self._metrics.observe("sample_ms", (time.perf_counter() - t0) * 1e3)
        return rows, info

    def sample_tensors(self, count: int, seed: int, device: str = "cpu") -> dict[str, Any]:
        """:meth:`sample` as one flat dict of torch tensors (``rows/..``, ``info/..``), for Ray Direct Transport.

        Called with ``.options(tensor_transport="gloo" | "nccl")``; torch is imported only here.
        """
        import torch

        rows, info = self.sample(count, seed)
        out = {f"rows/{k}": torch.from_numpy(v) for k, v in rows.items()}
        out.update({f"info/{k}": torch.from_numpy(v) for k, v in info.items()})
        if device != "cpu":
            out = {k: v.to(device, non_blocking=True) for k, v in out.items()}
        return out

    def dump(self, path: str) -> None:
        """Write this shard's mutable state (rows for online shards, priorities) under ``path``."""
        os.makedirs(path, exist_ok=True)
        state = self._state()
        if self._prioritized:
            state["priority"] = self._sampler.tree.values(np.arange(self._sampler.tree.capacity))
            state["max_priority"] = np.float64(self._sampler.max_priority)
        np.savez(os.path.join(path, "state.npz"), **state)

    def load(self, path: str) -> None:
        with np.load(os.path.join(path, "state.npz")) as f:
            state = dict(f)
        self._set_state(state)
        if self._prioritized:
            self._sampler.tree.update(np.arange(self._sampler.tree.capacity), state["priority"])
            self._sampler.max_priority = float(state["max_priority"])

    def _state(self) -> dict[str, np.ndarray]:
        return {}

    def _set_state(self, state: dict[str, np.ndarray]) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        self._metrics.gauge("size", self.size())
        for name, value in _memory().items():
            self._metrics.gauge(name, value)
        return self._metrics.snapshot()

    def ping(self) -> str:
        return self.shard_id


class OfflineShard(_Shard):
    """Rows ``[start, stop)`` of a chunk dataset, mapped read-only."""

    kind = "offline"

    def __init__(self, root: str, start: int, stop: int, shard_id: str, sampler: str = "uniform",
                 export_metrics: bool = True, sampler_options: Mapping[str, float] | None = None):
        super().__init__(shard_id, sampler, export_metrics, capacity=max(1, stop - start),
                         sampler_options=sampler_options)
        self._ds = ChunkDataset.open(root)
        if not 0 <= start < stop <= len(self._ds):
            raise ValueError(f"shard {shard_id}: expected 0 <= start < stop <= {len(self._ds)}, got [{start}, {stop})")
        self._start, self._stop = int(start), int(stop)
        if self._prioritized:
            self._sampler.add(np.arange(self.size()))
        self._metrics.gauge("dataset_bytes", (stop - start) * self._ds.spec.row_bytes)

    def size(self) -> int:
        return self._stop - self._start

    def _gather(self, idx: np.ndarray) -> Rows:
        return self._ds.gather(idx + self._start)

    def _generation(self, idx: np.ndarray) -> np.ndarray:
        return np.ones(idx.shape, dtype=np.int64)  # written once, never again

    def extend(self, *args: Any, **kwargs: Any):
        raise ReadOnlyError(f"offline shard {self.shard_id} is immutable: write to the online buffer instead")


class OnlineShard(_Shard):
    """A circular buffer of ``capacity`` rows; the oldest rows are overwritten first."""

    kind = "online"

    def __init__(self, spec_json: Mapping[str, Any], capacity: int, shard_id: str, sampler: str = "uniform",
                 export_metrics: bool = True, sampler_options: Mapping[str, float] | None = None):
        if capacity <= 0:
            raise ValueError(f"shard {shard_id}: capacity must be a positive integer, got {capacity}")
        super().__init__(shard_id, sampler, export_metrics, capacity=capacity, sampler_options=sampler_options)
        self._spec = RowSpec.from_json(spec_json)
        self._capacity = int(capacity)
        self._data = self._spec.empty(self._capacity)
        self._gen = np.zeros(self._capacity, dtype=np.int64)
        self._cursor = 0
        self._written = 0

    def size(self) -> int:
        return min(self._written, self._capacity)

    def written(self) -> int:
        """Rows ever written (the write count); ``size()`` is this capped at the capacity."""
        return self._written

    def extend(self, rows: Mapping[str, np.ndarray], start: int = 0, stop: int | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """Copy ``rows[start:stop]`` in; return their slots and generations."""
        t0 = time.perf_counter()
        rows = {k: v[start:stop] for k, v in rows.items()}
        n = self._spec.validate(rows, what=f"rows for shard {self.shard_id}")
        pos = (self._cursor + np.arange(n, dtype=np.int64)) % self._capacity
        keep = slice(max(0, n - self._capacity), n)  # a write larger than the shard keeps its tail
        for k, dst in self._data.items():
            dst[pos[keep]] = rows[k][keep]  # copies out of the object store
        np.add.at(self._gen, pos, 1)
        if self._prioritized:
            self._sampler.add(pos)
        self._cursor = int((self._cursor + n) % self._capacity)
        self._written += n
        self._metrics.count("rows_written", n)
        self._metrics.observe("extend_ms", (time.perf_counter() - t0) * 1e3)
        return pos, self._gen[pos]

    def _gather(self, idx: np.ndarray) -> Rows:
        return {k: v[idx] for k, v in self._data.items()}

    def _state(self) -> dict[str, np.ndarray]:
        return {**{f"rows/{k}": v for k, v in self._data.items()}, "generation": self._gen,
                "cursor": np.int64(self._cursor), "written": np.int64(self._written)}

    def _set_state(self, state: dict[str, np.ndarray]) -> None:
        rows = {k[len("rows/"):]: v for k, v in state.items() if k.startswith("rows/")}
        if set(rows) != set(self._data) or state["generation"].shape != self._gen.shape:
            raise ValueError(f"shard {self.shard_id}: saved state has keys {sorted(rows)} and capacity "
                             f"{state['generation'].shape[0]}, expected {sorted(self._data)} and {self._capacity}")
        self._spec.validate(rows, what="saved rows")
        for k in self._data:
            self._data[k][...] = rows[k]
        self._gen[...] = state["generation"]
        self._cursor, self._written = int(state["cursor"]), int(state["written"])

    def _generation(self, idx: np.ndarray) -> np.ndarray:
        return self._gen[idx]

    def stats(self) -> dict[str, Any]:
        self._metrics.gauge("write_count", self._written)
        self._metrics.gauge("capacity", self._capacity)
        return super().stats()
