"""Section ``writing``: rows/s of ``extend`` from 1 and 4 writer actors at once, into rayrb's buffer and into
TorchRL's ``RayReplayBuffer`` actor."""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch
from tensordict import TensorDict

from bench.harness import med_range, synthetic_table


@ray.remote(num_cpus=0)
class Writer:
    """Writes ``batches`` batches of ``rows`` rows, to a rayrb handle or a TorchRL buffer actor."""

    def __init__(self, dim: int):
        self.dim = dim

    def write(self, target, kind: str, batches: int, rows: int) -> float:
        g = torch.Generator().manual_seed(0)
        data = [TensorDict({"X": torch.randn(rows, self.dim, generator=g), "y": torch.zeros(rows, dtype=torch.int64)},
                           [rows]) for _ in range(batches)]
        t0 = time.perf_counter()
        for td in data:
            if kind == "rayrb":
                target.extend(td)
            else:
                ray.get(target.extend.remote(td))
        return time.perf_counter() - t0


def bench_writing(cfg: dict, root: str, results: dict) -> None:
    from rayrb import OfflineToOnlineReplayBuffer

    offline = synthetic_table(1000, cfg["dim"])
    out = {}
    pool = [Writer.remote(cfg["dim"]) for _ in range(max(cfg["writers"]))]  # started once: writes are stateless
    ray.get([w.__ray_ready__.remote() for w in pool])
    for n_writers in cfg["writers"]:
        runs = {"rayrb": [], "torchrl_ray": []}
        writers = pool[:n_writers]
        for _ in range(cfg["repeats"]):
            capacity = n_writers * cfg["writer_batches"] * cfg["writer_rows"]
            rb = OfflineToOnlineReplayBuffer(offline, online_capacity=capacity, num_online_shards=cfg["online_shards"],
                                             seed=0, dataset_root=Path(tempfile.mkdtemp(dir=root)) / "ds")
            from torchrl.data import LazyTensorStorage, RayReplayBuffer

            rray = RayReplayBuffer(storage=LazyTensorStorage(capacity), batch_size=None)
            ray.get(rray._rb.__ray_ready__.remote())  # its actor's start is not a write (rayrb's buffer is up)
            for kind, target in (("rayrb", rb), ("torchrl_ray", rray._rb)):
                t0 = time.perf_counter()
                ray.get([w.write.remote(target, kind, cfg["writer_batches"], cfg["writer_rows"]) for w in writers])
                runs[kind].append(capacity / (time.perf_counter() - t0))
            assert rb.write_count == capacity
            rb.shutdown()
            ray.kill(rray._rb)
        out[f"{n_writers}_writers"] = {k: {"rows_per_s": med_range(v)} for k, v in runs.items()}
        print(f"  writers={n_writers}: " + ", ".join(f"{k} {statistics.median(v):,.0f} rows/s"
                                                     for k, v in runs.items()), flush=True)
    for w in pool:
        ray.kill(w)
    results["writing"] = out
