"""Section ``gpu`` (needs CUDA; not in the default sections): GPU shards and CPU shards feeding a GPU actor,
against TorchRL on the GPU and the GPU's gather limit; also written to ``results_gpu.json``."""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import torch
from tensordict import TensorDict

from bench.harness import add_run, med_ranges, medians_text, synthetic_table, write_offline

if TYPE_CHECKING:
    from torchrl.data import OfflineToOnlineReplayBuffer as TorchRLO2O


@ray.remote(num_gpus=0.5, num_cpus=0, enable_tensor_transport=True)
class GPUConsumer:
    """A learner-like GPU actor: rows/s of ``iter_batches(device="cuda")``, batches ready on its GPU."""

    def run(self, rb, batch_size: int, prefetch: int, seconds: float) -> float:
        it = rb.iter_batches(batch_size, prefetch=prefetch, device="cuda")
        for _ in range(3):
            next(it)
        torch.cuda.synchronize()
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            batch = next(it)
            n += batch.batch_size[0]
        torch.cuda.synchronize()
        return n / (time.perf_counter() - t0)


def _rate(fn: Callable[[], Any], rows: int, seconds: float) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        fn()
        n += rows
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def torchrl_peer(offline: TensorDict, online: TensorDict, device: str) -> TorchRLO2O:
    """TorchRL's in-process O2O buffer with both storages on ``device``."""
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.data import OfflineToOnlineReplayBuffer as TorchRLO2O

    off = ReplayBuffer(storage=LazyTensorStorage(len(offline), device=device))
    off.extend(offline)
    rb = TorchRLO2O(offline_dataset=off, online_storage=LazyTensorStorage(len(online), device=device),
                    offline_fraction=0.5)
    rb.extend(online)
    return rb


def bench_gpu(cfg: dict, root: str, out_dir: Path, results: dict) -> None:
    """GPU shards and CPU shards into a GPU actor, against TorchRL on the GPU and the GPU gather limit."""
    g = cfg["gpu"]
    offline, online = synthetic_table(g["n_off"], g["dim"]), synthetic_table(g["n_on"], g["dim"], seed=1)
    ds_root = write_offline(offline, root, "offline-gpu")
    gpu_peer, cpu_peer = torchrl_peer(offline, online, "cuda"), torchrl_peer(offline, online, "cpu")
    X = offline["X"].cuda()
    out: dict[str, Any] = {}
    for B in g["batch_sizes"]:
        row: dict[str, list[float]] = {}
        for _ in range(g["repeats"]):
            idx = torch.randint(0, len(X), (B,), device="cuda")
            add_run(row, {"index_select_cuda": _rate(lambda: torch.index_select(X, 0, idx), B, g["seconds"]),
                          "torchrl_o2o_cuda_storage": _rate(lambda: gpu_peer.sample(B), B, g["seconds"]),
                          "torchrl_o2o_cpu_storage_to_cuda": _rate(
                              lambda: cpu_peer.sample(B).to("cuda", non_blocking=True), B, g["seconds"])})
        rayrb_rates(g, ds_root, offline, online, B, row, out)
        out[str(B)] = med_ranges(row)
        print(f"  B={B}: " + medians_text(out[str(B)], ",.0f"), flush=True)
    out["ratios"] = gpu_ratios(g, out)
    out["device"] = torch.cuda.get_device_name(0)
    results["gpu"] = out
    (out_dir / "results_gpu.json").write_text(json.dumps({**{k: results[k] for k in ("command", "machine", "versions")},
                                                          "gpu": out}, indent=1, default=float))


def rayrb_rates(g: dict, ds_root: Path, offline: TensorDict, online: TensorDict, B: int, row: dict[str, list],
                out: dict[str, Any]) -> None:
    """rayrb's rows/s into a GPU actor at batch size ``B``, shards on the CPU and on the GPU, into ``row``; the GPU
    shards' device memory at the first batch size into ``out["memory"]``."""
    from rayrb import OfflineToOnlineReplayBuffer

    for m in g["shards"]:
        for storage in ("cpu", "cuda"):
            rb = OfflineToOnlineReplayBuffer(str(ds_root), online_capacity=len(online), num_offline_shards=m,
                                             num_online_shards=m, offline_fraction=0.5, seed=m,
                                             storage_device=storage,
                                             max_batch_bytes=max(8 << 30, 4 * B * (g["dim"] * 4 + 8)))
            rb.extend(online)
            consumer = GPUConsumer.remote()
            for _ in range(g["repeats"]):
                rate = ray.get(consumer.run.remote(rb.client(), B, g["prefetch"], g["seconds"]))
                row.setdefault(f"rayrb_{m}shard_{storage}_storage", []).append(rate)
            if storage == "cuda" and B == g["batch_sizes"][0]:
                shards = rb.stats()["shards"]
                out.setdefault("memory", {})[f"{m}shard"] = {
                    "device_bytes": [s["device_bytes"] for s in shards],
                    "rows_bytes": (len(offline) + len(online)) * (g["dim"] * 4 + 8)}
            ray.kill(consumer)
            rb.shutdown()


def gpu_ratios(g: dict, out: dict[str, Any]) -> dict[str, float]:
    ratios = {}
    for B in g["batch_sizes"]:
        r = out[str(B)]
        for m in g["shards"]:
            ratios[f"B={B} {m} GPU shard(s) / torchrl_o2o_cuda_storage"] = (
                r[f"rayrb_{m}shard_cuda_storage"]["median"] / r["torchrl_o2o_cuda_storage"]["median"])
            ratios[f"B={B} {m} CPU shard(s) to cuda / torchrl_o2o_cpu_storage_to_cuda"] = (
                r[f"rayrb_{m}shard_cpu_storage"]["median"] / r["torchrl_o2o_cpu_storage_to_cuda"]["median"])
    return ratios
