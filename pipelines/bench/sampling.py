"""Section ``sampling``: rows/s of rayrb's buffers (each offline shard count; ``sample()``, no draws ahead,
``iter_batches`` with prefetch, prioritized, under a rate limiter that never binds) against TorchRL's peers and
``index_select``; then how throughput depends on the prefetch depth, the object store while an iterator prefetches,
and the offline shards' memory against the dataset's bytes."""
from __future__ import annotations

import gc
import statistics
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tensordict import TensorDict

from bench.harness import (
    gather_fn,
    measure,
    med_range,
    o2o_buffer,
    plasma_mib,
    row_bytes,
    torchrl_o2o,
    torchrl_ray,
    write_offline,
)

if TYPE_CHECKING:
    from rayrb import OfflineToOnlineReplayBuffer


@dataclass
class Buffers:
    """What one sampling run measures: TorchRL's two peers, rayrb with each shard count, prioritized, limited."""

    o2o: Any
    rray: Any
    shards: dict[int, Any]
    prio: Any
    limited: Any

    @classmethod
    def start(cls, cfg: dict, offline: TensorDict, online: TensorDict, root: str) -> Buffers:
        from rayrb import SampleToInsertRatio

        o2o, rray = torchrl_o2o(offline, online), torchrl_ray(offline)
        ds_root = write_offline(offline, root, "offline")
        shards = {m: o2o_buffer(cfg, ds_root, online, m, seed=m) for m in cfg["shards"]}
        prio = o2o_buffer(cfg, ds_root, online, 1, seed=1, sampler="prioritized")
        # The same buffer with a rate limiter whose window is never reached: what flow control costs when idle.
        limited = o2o_buffer(cfg, ds_root, online, 1, seed=1, rate_limiter=SampleToInsertRatio(1.0, 1, 1e15))
        return cls(o2o, rray, shards, prio, limited)

    def close(self) -> None:
        for rb in [*self.shards.values(), self.prio, self.limited]:
            rb.shutdown()
        self.rray.close() if hasattr(self.rray, "close") else None
        self.o2o = self.rray = None
        gc.collect()


def bench_sampling(cfg: dict, offline: TensorDict, online: TensorDict, root: str, results: dict) -> None:
    bufs = Buffers.start(cfg, offline, online, root)
    last = bufs.shards[cfg["shards"][-1]]
    start_mem = {s["shard"]: s for s in last.stats()["shards"] if s["kind"] == "offline"}
    results["sampling"] = {str(B): by_batch_size(cfg, offline, bufs, B) for B in cfg["batch_sizes"]}
    results["prefetch_sweep"] = prefetch_sweep(cfg, bufs.shards[cfg["shards"][0]])
    results["object_store"] = object_store(cfg, offline, last)
    results["memory"] = shard_memory(offline, last, start_mem)
    bufs.close()


def by_batch_size(cfg: dict, offline: TensorDict, bufs: Buffers, B: int) -> dict[str, dict]:
    """Every peer and buffer at batch size ``B``, the mode's repeats: rows/s with its range, the rest medians."""
    row: dict[str, list] = {}
    for rep in range(cfg["repeats"]):
        entries = one_repeat(cfg, offline, bufs, B)
        for k, v in entries.items():
            row.setdefault(k, []).append(v)
        print(f"  B={B} rep {rep}: " + ", ".join(f"{k} {v['rows_per_s']:,.0f}" for k, v in entries.items()),
              flush=True)
    return {k: {"rows_per_s": med_range([r["rows_per_s"] for r in v]),
                "batches_per_s": statistics.median([r["batches_per_s"] for r in v]),
                "p50_ms": statistics.median([r["p50_ms"] for r in v]),
                "p99_ms": statistics.median([r["p99_ms"] for r in v])} for k, v in row.items()}


def one_repeat(cfg: dict, offline: TensorDict, bufs: Buffers, B: int) -> dict[str, dict]:
    entries = {"index_select": measure(cfg, gather_fn(offline, B), B),
               "torchrl_o2o": measure(cfg, lambda: bufs.o2o.sample(B), B),
               "torchrl_ray": measure(cfg, lambda: bufs.rray.sample(B), B)}
    for m, rb in bufs.shards.items():
        entries[f"rayrb_{m}shard"] = measure(cfg, lambda: rb.sample(B), B)
        if m == cfg["shards"][0]:  # the same loop drawing nothing ahead: two round trips per batch
            single = rb.client(prefetch=0)
            entries[f"rayrb_{m}shard_noahead"] = measure(cfg, lambda: single.sample(B), B)
        it = rb.iter_batches(B, prefetch=cfg["prefetch"])
        entries[f"rayrb_{m}shard_prefetch"] = measure(cfg, lambda: next(it), B)
    it = bufs.prio.iter_batches(B, prefetch=cfg["prefetch"])
    entries["rayrb_1shard_prefetch_prioritized"] = measure(cfg, lambda: next(it), B)
    it = bufs.limited.iter_batches(B, prefetch=cfg["prefetch"])
    entries["rayrb_1shard_prefetch_limited"] = measure(cfg, lambda: next(it), B)
    return entries


def prefetch_sweep(cfg: dict, rb: OfflineToOnlineReplayBuffer) -> dict[str, dict]:
    """How throughput depends on the prefetch depth (requests are grouped: one read per shard per group)."""
    sweep, B_list = {}, cfg["batch_sizes"]
    for B in (B_list[1 if len(B_list) > 1 else 0], B_list[-1]):
        for pf in cfg["prefetch_sweep"]:
            it = rb.iter_batches(B, prefetch=pf)
            sweep[f"B={B} prefetch={pf}"] = measure(cfg, lambda: next(it), B)
            print(f"  {cfg['shards'][0]} shard B={B} prefetch={pf}: {sweep[f'B={B} prefetch={pf}']['rows_per_s']:,.0f}"
                  " rows/s", flush=True)
    return sweep


def object_store(cfg: dict, offline: TensorDict, rb: OfflineToOnlineReplayBuffer) -> dict[str, float]:
    """Object-store use while a prefetching iterator runs: bounded by prefetch x batch bytes. Returning frees the
    iterator's batches."""
    B = cfg["batch_sizes"][-1]
    gc.collect()
    time.sleep(cfg["settle_s"])  # let earlier batches' objects be freed
    base, samples, stop = plasma_mib(), [], threading.Event()

    def poll():
        while not stop.is_set():
            samples.append(plasma_mib())
            time.sleep(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    it = rb.iter_batches(B, prefetch=cfg["prefetch"])
    for _ in range(3 * cfg["prefetch"]):
        next(it)
    stop.set()
    poller.join()
    return {"batch_size": B, "prefetch": cfg["prefetch"], "batch_mib": B * row_bytes(offline) / 2**20,
            "baseline_used_mib": base[0], "peak_used_mib": max(u for u, _ in samples),
            "peak_needed_mib": max(n for _, n in samples), "polls": len(samples)}


def shard_memory(offline: TensorDict, rb: OfflineToOnlineReplayBuffer, start_mem: dict[int, dict]) -> dict[str, int]:
    """The offline shards' memory against the dataset's bytes, and what it grew by since ``start_mem``."""
    off = [s for s in rb.stats()["shards"] if s["kind"] == "offline"]
    grow = {k: int(sum(s[k] - start_mem[s["shard"]][k] for s in off)) for k in ("rss_anon_bytes", "rss_file_bytes")}
    return {
        "dataset_bytes": int(len(offline) * row_bytes(offline)),
        "offline_shards": len(off),
        "per_actor_overhead_anon_bytes": int(statistics.mean(s["rss_anon_bytes"] for s in start_mem.values())),
        "rss_anon_bytes_total": int(sum(s["rss_anon_bytes"] for s in off)),
        "rss_file_bytes_total": int(sum(s["rss_file_bytes"] for s in off)),
        "anon_growth_while_sampling_bytes": grow["rss_anon_bytes"],
        "file_growth_while_sampling_bytes": grow["rss_file_bytes"],
    }
