"""Section ``writing``: ``extend`` from 1 and 4 writer actors at once, R rows a call, into rayrb's buffer with
default arguments (each call waited for; pipelined: ``wait=False``, flushed at the end; and each write sent to its
shard, ``local_reads=False``, the path of a writer on another node than the shard; and placed by the coordinator,
``write_path="coordinator"``, the path under a rate limiter that admits each write), into TorchRL's
``RayReplayBuffer`` actor (``ray.get(actor.extend.remote(td))``), and into a TorchRL ``ReplayBuffer`` in the
writer's own process (the local limit: no other process involved); rows/s of all writers together and p50 / p99
ms per call."""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import ray
import torch
from tensordict import TensorDict

from bench.harness import med_range, synthetic_table

KINDS = ("rayrb", "rayrb_pipelined", "rayrb_sent", "rayrb_coordinator", "torchrl_ray", "torchrl_local")


@ray.remote(num_cpus=0)
class Writer:
    """Writes ``batches`` batches of ``rows`` rows, to a rayrb handle or a TorchRL buffer actor."""

    def __init__(self, dim: int):
        self.dim = dim

    def write(self, target, kind: str, batches: int, rows: int) -> tuple[float, list[float]]:
        """Seconds for every write to be acknowledged, and each call's seconds (for a pipelined writer: how long
        each call held the caller)."""
        torch.set_num_threads(1)  # a collector's share of a 2-core machine; TorchRL's copies are fastest so
        g = torch.Generator().manual_seed(0)
        if kind == "torchrl_local":
            from torchrl.data import LazyTensorStorage, ReplayBuffer

            target = ReplayBuffer(storage=LazyTensorStorage(batches * rows), batch_size=None)
        data = [TensorDict({"X": torch.randn(rows, self.dim, generator=g), "y": torch.zeros(rows, dtype=torch.int64)},
                           [rows]) for _ in range(batches)]
        calls = []
        t0 = time.perf_counter()
        for td in data:
            t = time.perf_counter()
            if kind in ("rayrb", "rayrb_sent", "rayrb_coordinator", "torchrl_local"):
                target.extend(td)
            elif kind == "rayrb_pipelined":
                target.extend(td, wait=False)
            else:
                ray.get(target.extend.remote(td))
            calls.append(time.perf_counter() - t)
        if kind == "rayrb_pipelined":
            target.flush()
        return time.perf_counter() - t0, calls


def bench_writing(cfg: dict, root: str, results: dict) -> None:
    from rayrb import OfflineToOnlineReplayBuffer

    offline = synthetic_table(1000, cfg["dim"])
    out = {}
    pool = [Writer.remote(cfg["dim"]) for _ in range(max(cfg["writers"]))]  # started once: writes are stateless
    ray.get([w.__ray_ready__.remote() for w in pool])
    for rows in cfg["writer_rows"]:
        for n_writers in cfg["writers"]:
            runs: dict[str, list] = {k: [] for k in KINDS}
            calls: dict[str, list] = {k: [] for k in KINDS}
            writers = pool[:n_writers]
            capacity = n_writers * cfg["writer_batches"] * rows
            for _ in range(cfg["repeats"]):  # the peers alternate within each repeat
                from torchrl.data import LazyTensorStorage, RayReplayBuffer

                for kind in KINDS:
                    if kind == "torchrl_ray":
                        rray = RayReplayBuffer(storage=LazyTensorStorage(capacity), batch_size=None)
                        target = rray._rb
                        ray.get(target.__ray_ready__.remote())  # its actor's start is not a write
                    elif kind == "torchrl_local":
                        target = None  # each writer's own buffer, made in its process
                    else:
                        placed = {"write_path": "coordinator"} if kind == "rayrb_coordinator" else {}
                        rb = OfflineToOnlineReplayBuffer(offline, online_capacity=capacity, seed=0,
                                                         num_online_shards=cfg["online_shards"], **placed,
                                                         dataset_root=Path(tempfile.mkdtemp(dir=root)) / "ds")
                        target = rb.client(local_reads=kind != "rayrb_sent")
                    t0 = time.perf_counter()
                    got = ray.get([w.write.remote(target, kind, cfg["writer_batches"], rows) for w in writers])
                    runs[kind].append(capacity / (time.perf_counter() - t0))
                    calls[kind] += [c for _, cs in got for c in cs]
                    if kind == "torchrl_ray":
                        ray.kill(target)
                    elif kind != "torchrl_local":
                        assert rb.write_count == capacity, (rb.write_count, capacity)
                        rb.shutdown()
            out[f"{n_writers}x{rows}"] = {k: {"rows_per_s": med_range(runs[k]),
                                              "p50_ms": float(np.percentile(calls[k], 50) * 1e3),
                                              "p99_ms": float(np.percentile(calls[k], 99) * 1e3)} for k in KINDS}
            print(f"  writers={n_writers} rows={rows}: " + ", ".join(
                f"{k} {statistics.median(runs[k]):,.0f} rows/s (p50 {out[f'{n_writers}x{rows}'][k]['p50_ms']:.2f} ms)"
                for k in KINDS), flush=True)
    for w in pool:
        ray.kill(w)
    results["writing"] = out
