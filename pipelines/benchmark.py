"""rayrb side by side with TorchRL, in one run: sampling, writing, preprocessing, memory, scaling.

Peers: TorchRL's in-process ``OfflineToOnlineReplayBuffer`` (a ``ReplayBuffer`` +
``LazyTensorStorage`` offline side), TorchRL's ``RayReplayBuffer``, and
``torch.index_select`` gathering the same rows in one process (the machine's limit).
rayrb figures are reported as ratios to the peers measured in the same run,
repeated ``--repeats`` times (median and range).

    python pipelines/benchmark.py                  # full run, a few minutes
    python pipelines/benchmark.py --smoke          # tiny sizes (run by the tests)
    ray job submit --working-dir . -- python pipelines/benchmark.py --data-home /path/to/sklearn_data

The offline table is synthetic and covertype-sized (581,012 x 54 float32 + int64
label): NOT the real covertype rows, which are not available offline.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# In a checkout, results go beside the docs; a script run alone (`ray submit` copies it to ~) writes to ./benchmarks.
DEFAULT_OUT = REPO / "benchmarks" if (REPO / "pyproject.toml").is_file() else Path("benchmarks")

SIZES = {
    "full": dict(n_off=581_012, dim=54, n_on=100_000, batch_sizes=[256, 4096, 65536], shards=[1, 2, 4],
                 repeats=3, min_time=1.0, min_iters=5, writer_batches=50, writer_rows=1000, per_row_frames=20_000,
                 prefetch=16, prefetch_sweep=[1, 4, 8, 16, 32], consumers=[1, 2, 4, 8], consumer_batch=4096,
                 draw_batches=[256, 4096], draw_consumers=4, draw_prefetch=[16, 64], online_shards=2, writers=[1, 4],
                 cluster_nodes=[1, 2], idle_s=3.0, settle_s=1.0, start_delay_s=0.5, headline_consumer_s=8.0),
    # every section and key once, with as few actors as that takes (each is a process start on a small machine)
    "smoke": dict(n_off=4000, dim=8, n_on=1000, batch_sizes=[64, 512], shards=[1], repeats=1, min_time=0.02,
                  min_iters=2, writer_batches=3, writer_rows=100, per_row_frames=300, prefetch=2,
                  prefetch_sweep=[1, 2], consumers=[1, 2], consumer_batch=64,
                  draw_batches=[64], draw_consumers=1, draw_prefetch=[4], online_shards=1, writers=[1],
                  cluster_nodes=[2], idle_s=0.2, settle_s=0.1, start_delay_s=0.1, headline_consumer_s=0.1),
}


# ------------------------------------------------------------------ helpers
def timed(fn: Callable[[], Any], min_time: float, min_iters: int, warmup: int = 2) -> list[float]:
    """Per-call latencies (s) of ``fn`` over at least ``min_time`` seconds and ``min_iters`` calls."""
    for _ in range(warmup):
        fn()
    lat, start = [], time.perf_counter()
    while len(lat) < min_iters or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t0)
    return lat


def summarize(lat: list[float], rows_per_call: int) -> dict[str, float]:
    total = sum(lat)
    return {"rows_per_s": rows_per_call * len(lat) / total, "batches_per_s": len(lat) / total,
            "p50_ms": float(np.percentile(lat, 50) * 1e3), "p99_ms": float(np.percentile(lat, 99) * 1e3),
            "calls": len(lat)}


def med_range(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def synthetic_table(n: int, dim: int, seed: int = 0) -> TensorDict:
    """Covertype-shaped random rows. NOT real data."""
    g = torch.Generator().manual_seed(seed)
    return TensorDict({"X": torch.randn(n, dim, generator=g), "y": torch.randint(0, 7, (n,), generator=g)}, [n])


def plasma_mib() -> tuple[float, float]:
    """``(used, needed)`` MiB: ``used`` counts freed objects not yet reclaimed; ``needed`` only referenced ones."""
    import ray
    from ray._private.internal_api import memory_summary

    # Name this job's instance: other Ray instances on the machine would make the lookup ambiguous.
    address = ray.get_runtime_context().gcs_address
    for line in memory_summary(address=address, stats_only=True).splitlines():
        if "Plasma memory usage" in line:
            # "Plasma memory usage 361 MiB, 11 objects, 17.65% full, 0.07% needed"
            used = float(line.split("Plasma memory usage")[1].split("MiB")[0])
            full = float(line.split("% full")[0].rsplit(" ", 1)[1])
            needed = float(line.split("% needed")[0].rsplit(" ", 1)[1])
            return used, (used * needed / full if full else 0.0)
    return float("nan"), float("nan")


# ------------------------------------------------------------------ peers
def torchrl_o2o(offline: TensorDict, online: TensorDict):
    from torchrl.data import LazyTensorStorage, OfflineToOnlineReplayBuffer, ReplayBuffer

    off = ReplayBuffer(storage=LazyTensorStorage(len(offline)))
    off.extend(offline)
    rb = OfflineToOnlineReplayBuffer(offline_dataset=off, online_capacity=len(online), offline_fraction=0.5)
    rb.extend(online)
    return rb


def torchrl_ray(data: TensorDict):
    from torchrl.data import LazyTensorStorage, RayReplayBuffer

    rb = RayReplayBuffer(storage=LazyTensorStorage(len(data)), batch_size=None)
    rb.extend(data)
    return rb


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


# ------------------------------------------------------------------ sections
def bench_sampling(cfg, offline, online, root, results):
    from rayrb import OfflineToOnlineReplayBuffer

    B_list, out = cfg["batch_sizes"], {}
    X, y = offline["X"], offline["y"]
    o2o = torchrl_o2o(offline, online)
    rray = torchrl_ray(offline)
    ds_root = Path(root) / "offline"
    from rayrb import write_dataset

    write_dataset(offline, ds_root)
    buffers = {}
    for m in cfg["shards"]:
        rb = OfflineToOnlineReplayBuffer(str(ds_root), online_capacity=len(online), num_offline_shards=m,
                                         num_online_shards=cfg["online_shards"], offline_fraction=0.5, seed=m)
        rb.extend(online)
        buffers[m] = rb
    prio = OfflineToOnlineReplayBuffer(str(ds_root), online_capacity=len(online), num_offline_shards=1,
                                       num_online_shards=cfg["online_shards"], offline_fraction=0.5, seed=1,
                                       sampler="prioritized")
    prio.extend(online)
    # The same buffer with a rate limiter whose window is never reached: what flow control costs when idle.
    from rayrb.core.rate_limiter import SampleToInsertRatio

    limited = OfflineToOnlineReplayBuffer(str(ds_root), online_capacity=len(online), num_offline_shards=1,
                                          num_online_shards=cfg["online_shards"], offline_fraction=0.5, seed=1,
                                          rate_limiter=SampleToInsertRatio(1.0, 1, 1e15))
    limited.extend(online)
    start_mem = {s["shard"]: s for s in buffers[cfg["shards"][-1]].stats()["shards"] if s["kind"] == "offline"}
    for B in B_list:
        row = {}
        for rep in range(cfg["repeats"]):
            def gather():
                idx = torch.randint(0, len(X), (B,))
                torch.index_select(X, 0, idx), torch.index_select(y, 0, idx)

            entries = {"index_select": summarize(timed(gather, cfg["min_time"], cfg["min_iters"]), B),
                       "torchrl_o2o": summarize(timed(lambda: o2o.sample(B), cfg["min_time"], cfg["min_iters"]), B),
                       "torchrl_ray": summarize(timed(lambda: rray.sample(B), cfg["min_time"], cfg["min_iters"]), B)}
            for m, rb in buffers.items():
                entries[f"rayrb_{m}shard"] = summarize(timed(lambda: rb.sample(B), cfg["min_time"],
                                                             cfg["min_iters"]), B)
                if m == cfg["shards"][0]:  # the same loop drawing nothing ahead: two round trips per batch
                    single = rb.client(prefetch=0)
                    entries[f"rayrb_{m}shard_noahead"] = summarize(timed(lambda: single.sample(B), cfg["min_time"],
                                                                         cfg["min_iters"]), B)
                it = rb.iter_batches(B, prefetch=cfg["prefetch"])
                entries[f"rayrb_{m}shard_prefetch"] = summarize(timed(lambda: next(it), cfg["min_time"],
                                                                      cfg["min_iters"]), B)
            it = prio.iter_batches(B, prefetch=cfg["prefetch"])
            entries["rayrb_1shard_prefetch_prioritized"] = summarize(timed(lambda: next(it), cfg["min_time"],
                                                                           cfg["min_iters"]), B)
            it = limited.iter_batches(B, prefetch=cfg["prefetch"])
            entries["rayrb_1shard_prefetch_limited"] = summarize(timed(lambda: next(it), cfg["min_time"],
                                                                       cfg["min_iters"]), B)
            for k, v in entries.items():
                row.setdefault(k, []).append(v)
            print(f"  B={B} rep {rep}: " + ", ".join(f"{k} {v['rows_per_s']:,.0f}" for k, v in entries.items()),
                  flush=True)
        out[str(B)] = {k: {"rows_per_s": med_range([r["rows_per_s"] for r in v]),
                           "batches_per_s": statistics.median([r["batches_per_s"] for r in v]),
                           "p50_ms": statistics.median([r["p50_ms"] for r in v]),
                           "p99_ms": statistics.median([r["p99_ms"] for r in v])} for k, v in row.items()}
    results["sampling"] = out
    # how throughput depends on the prefetch depth (requests are grouped: one read per shard per group)
    sweep = {}
    rb = buffers[cfg["shards"][0]]
    for B in (B_list[1 if len(B_list) > 1 else 0], B_list[-1]):
        for pf in cfg["prefetch_sweep"]:
            it = rb.iter_batches(B, prefetch=pf)
            sweep[f"B={B} prefetch={pf}"] = summarize(timed(lambda: next(it), cfg["min_time"], cfg["min_iters"]), B)
            print(f"  {cfg['shards'][0]} shard B={B} prefetch={pf}: {sweep[f'B={B} prefetch={pf}']['rows_per_s']:,.0f}"
                  " rows/s", flush=True)
    results["prefetch_sweep"] = sweep
    # object-store use while a prefetching iterator runs: bounded by prefetch x batch bytes
    import threading

    B = B_list[-1]
    rb = buffers[cfg["shards"][-1]]
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
    it = None  # frees its batches
    batch_mib = B * (offline["X"][0].numel() * 4 + 8) / 2**20
    results["object_store"] = {"batch_size": B, "prefetch": cfg["prefetch"], "batch_mib": batch_mib,
                               "baseline_used_mib": base[0], "peak_used_mib": max(u for u, _ in samples),
                               "peak_needed_mib": max(n for _, n in samples), "polls": len(samples)}
    # offline shard memory against the dataset's bytes
    stats = rb.stats()["shards"]
    off = [s for s in stats if s["kind"] == "offline"]
    grow = {k: int(sum(s[k] - start_mem[s["shard"]][k] for s in off)) for k in ("rss_anon_bytes", "rss_file_bytes")}
    results["memory"] = {
        "dataset_bytes": int(len(offline) * (offline["X"][0].numel() * 4 + 8)),
        "offline_shards": len(off),
        "per_actor_overhead_anon_bytes": int(statistics.mean(s["rss_anon_bytes"] for s in start_mem.values())),
        "rss_anon_bytes_total": int(sum(s["rss_anon_bytes"] for s in off)),
        "rss_file_bytes_total": int(sum(s["rss_file_bytes"] for s in off)),
        "anon_growth_while_sampling_bytes": grow["rss_anon_bytes"],
        "file_growth_while_sampling_bytes": grow["rss_file_bytes"],
    }
    for rb in [*buffers.values(), prio, limited]:
        rb.shutdown()
    rray.close() if hasattr(rray, "close") else None
    o2o = rray = None
    gc.collect()


@ray.remote(num_cpus=0)
class Consumer:
    """A learner-like actor that iterates over prefetched batches for a fixed time."""

    def warm(self, rb, batch_size: int) -> None:
        """Import and draw once before a timed run: a cold actor would start its window late and stretch the
        span that all consumers' rows are divided by."""
        it = rb.iter_batches(batch_size, prefetch=1)
        next(it)
        it.close()

    def run(self, rb, batch_size: int, prefetch: int, seconds: float, start: float) -> dict:
        while time.time() < start:  # all consumers begin together
            time.sleep(0.001)
        it = rb.iter_batches(batch_size, prefetch=prefetch)
        next(it)
        t0, rows = time.time(), 0
        while time.time() - t0 < seconds:
            rows += len(next(it))
        return {"rows": rows, "start": t0, "end": time.time()}


def coordinator_cpu(rb) -> tuple[float, int]:
    """``(CPU seconds, batches planned)`` of the coordinator so far, as its ``stats()`` reports them."""
    c = ray.get(rb.rpc.coord.stats.remote(False))["coordinator"]
    return float(c.get("cpu_seconds", 0.0)), int(c.get("batches", 0))


def coordinator_idle_cpu(rb, seconds: float) -> float:
    """The coordinator's CPU seconds per second while nothing is asked of it: what a Ray actor process spends
    whatever it serves (an idle trivial actor spends the same), so not a cost of any batch."""
    c0, _ = coordinator_cpu(rb)
    t0 = time.perf_counter()
    time.sleep(seconds)
    c1, _ = coordinator_cpu(rb)
    return (c1 - c0) / (time.perf_counter() - t0)


def bench_draw_path(cfg, offline, online, root, results):
    """What the one draw path is for, side by side in one run: 4 consumer actors against one in-process TorchRL
    OfflineToOnlineReplayBuffer, the coordinator's own CPU per batch, and a plain sample() loop under a rate
    limiter that never binds against the same loop without one."""
    from rayrb import OfflineToOnlineReplayBuffer, SampleToInsertRatio, write_dataset

    ds_root = Path(root) / "offline-draw-path"
    write_dataset(offline, ds_root)
    o2o = torchrl_o2o(offline, online)
    rb = OfflineToOnlineReplayBuffer(str(ds_root), online_capacity=len(online), num_offline_shards=2,
                                     num_online_shards=cfg["online_shards"], offline_fraction=0.5, seed=0)
    rb.extend(online)
    # the first prefetch is the headline; deeper ones show how the per-call cost shrinks with larger groups
    prefetches = list(cfg["draw_prefetch"])
    out: dict[str, Any] = {"consumers": cfg["draw_consumers"], "prefetch": prefetches[0]}
    seconds = cfg["min_time"] * 3
    idle = coordinator_idle_cpu(rb, cfg["idle_s"])
    out["coordinator_idle_cpu_ms_per_s"] = idle * 1e3
    for B, pf in [(B, pf) for pf in prefetches for B in cfg["draw_batches"]]:
        row: dict[str, list] = {}
        for _ in range(cfg["repeats"]):
            o2o_rate = summarize(timed(lambda: o2o.sample(B), cfg["min_time"], cfg["min_iters"]), B)["rows_per_s"]
            actors = [Consumer.remote() for _ in range(cfg["draw_consumers"])]
            ray.get([a.warm.remote(rb.client(), B) for a in actors])
            cpu0, n0 = coordinator_cpu(rb)
            roles0 = cpu_by_role()
            w0 = time.perf_counter()
            got = ray.get([a.run.remote(rb.client(), B, pf, seconds, time.time() + cfg["start_delay_s"])
                           for a in actors])
            roles = {k: v - roles0.get(k, 0.0) for k, v in cpu_by_role().items()}
            cpu1, n1 = coordinator_cpu(rb)
            wall = time.perf_counter() - w0
            for a in actors:
                ray.kill(a)
            span = max(g["end"] for g in got) - min(g["start"] for g in got)
            rate = sum(g["rows"] for g in got) / span
            ms = 1e3 * (cpu1 - cpu0) / max(n1 - n0, 1)
            # above the idle process's own spending: the part that grows with batches, which sets the ceiling
            net = 1e3 * max(0.0, cpu1 - cpu0 - idle * wall) / max(n1 - n0, 1)
            # where the machine's CPU goes per batch served: consumers, shards, coordinator, Ray's own processes
            # (the consumers' figure includes their polling wait for the common start, start_delay_s)
            served = sum(g["rows"] for g in got) / B
            for role, seconds_used in roles.items():
                row.setdefault(f"cpu_ms_per_batch_{role.replace(' ', '_')}", []).append(1e3 * seconds_used / served)
            for k, v in {"consumers_rows_per_s": rate, "torchrl_o2o_rows_per_s": o2o_rate,
                         "ratio_vs_torchrl_o2o": rate / o2o_rate, "coordinator_cpu_ms_per_batch": ms,
                         "coordinator_cpu_ms_per_batch_above_idle": net,
                         "coordinator_batches_per_s_ceiling": 1e3 / max(net, 1e-9)}.items():
                row.setdefault(k, []).append(v)
        key = str(B) if pf == prefetches[0] else f"{B} prefetch={pf}"
        out[key] = {k: med_range(v) for k, v in row.items()}
        print(f"  draw path B={B} prefetch={pf}: " + ", ".join(f"{k} {v['median']:,.3f}" for k, v in out[key].items()),
              flush=True)
    rb.shutdown()
    # the plain sample() loop, with and without a rate limiter whose window is never reached
    plain = OfflineToOnlineReplayBuffer(str(ds_root), online_capacity=len(online), num_offline_shards=1,
                                        num_online_shards=cfg["online_shards"], offline_fraction=0.5, seed=1)
    limited = OfflineToOnlineReplayBuffer(str(ds_root), online_capacity=len(online), num_offline_shards=1,
                                          num_online_shards=cfg["online_shards"], offline_fraction=0.5, seed=1,
                                          rate_limiter=SampleToInsertRatio(1.0, 1, 1e15))
    for b in (plain, limited):
        b.extend(online)
    loop: dict[str, Any] = {}
    for B in cfg["draw_batches"]:
        row = {}
        for _ in range(cfg["repeats"]):
            a = summarize(timed(lambda: plain.sample(B), cfg["min_time"], cfg["min_iters"]), B)["rows_per_s"]
            b = summarize(timed(lambda: limited.sample(B), cfg["min_time"], cfg["min_iters"]), B)["rows_per_s"]
            for k, v in {"no_limiter_rows_per_s": a, "limiter_rows_per_s": b, "ratio": b / a}.items():
                row.setdefault(k, []).append(v)
        loop[str(B)] = {k: med_range(v) for k, v in row.items()}
        print(f"  sample() loop B={B}: " + ", ".join(f"{k} {v['median']:,.3f}" for k, v in loop[str(B)].items()),
              flush=True)
    out["limiter_loop"] = loop
    plain.shutdown()
    limited.shutdown()
    o2o = None
    gc.collect()
    results["draw_path"] = out


# ------------------------------------------------------------------ headline: default arguments
def at_threads(n: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` with torch using ``n`` threads (the setting is restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def peers(cfg, offline, online, B: int) -> dict[str, float]:
    """The peers' rows/s at batch size ``B``, each at its best: TorchRL's in-process O2O with 1 and with 2 torch
    threads (on a loaded 2-core machine 2 threads ran its sample() 8x slower), TorchRL's RayReplayBuffer, and
    torch.index_select gathering B random rows with 1 thread, times the cores: the machine's limit."""
    o2o = torchrl_o2o(offline, online)
    X, y = offline["X"], offline["y"]

    def gather():
        idx = torch.randint(0, len(X), (B,))
        torch.index_select(X, 0, idx), torch.index_select(y, 0, idx)

    out = {f"torchrl_o2o_{t}_threads": at_threads(t, lambda: summarize(timed(lambda: o2o.sample(B), cfg["min_time"],
                                                                             cfg["min_iters"]), B)["rows_per_s"])
           for t in (1, 2)}
    out["torchrl_o2o_best"] = max(out["torchrl_o2o_1_threads"], out["torchrl_o2o_2_threads"])
    out["index_select_1_thread"] = at_threads(1, lambda: summarize(timed(gather, cfg["min_time"], cfg["min_iters"]),
                                                                   B)["rows_per_s"])
    out["gather_limit"] = out["index_select_1_thread"] * (os.cpu_count() or 1)
    return out


def pss_bytes(pids: list[int]) -> dict[str, int]:
    """Proportional and unique set sizes summed over ``pids``: pages the processes share (the dataset's, mapped by
    each) count once in the PSS sum, and not at all in the USS sum."""
    import psutil

    pss = uss = 0
    for pid in pids:
        try:
            m = psutil.Process(pid).memory_full_info()
        except psutil.Error:
            continue
        pss, uss = pss + m.pss, uss + m.uss
    return {"pss": pss, "uss": uss}


def bench_headline(cfg, offline, online, root, results):
    """What a user gets with default arguments, side by side with the peers in one run: one process's plain
    sample() loop; four consumer actors' iter_batches(), with the coordinator's CPU per batch and the consumers'
    memory (PSS: the mapped dataset's pages are shared, not copied per handle)."""
    from rayrb import OfflineToOnlineReplayBuffer, write_dataset

    ds_root = Path(root) / "offline-headline"
    write_dataset(offline, ds_root)
    out: dict[str, Any] = {"loop": {}, "consumers": {}, "peers": {}}
    rb = OfflineToOnlineReplayBuffer(str(ds_root), online_capacity=len(online), num_offline_shards=2,
                                     num_online_shards=cfg["online_shards"], offline_fraction=0.5, seed=0)
    rb.extend(online)
    # what the local reads are worth, and what prioritized sampling (read by its shards: the sum tree is theirs) pays
    shard_reads = rb.client(local_reads=False)
    prio = OfflineToOnlineReplayBuffer(str(ds_root), online_capacity=len(online), num_offline_shards=2,
                                       num_online_shards=cfg["online_shards"], offline_fraction=0.5, seed=0,
                                       sampler="prioritized")
    prio.extend(online)
    rray = torchrl_ray(offline)

    def loop_rate(sample, B):
        return at_threads(1, lambda: summarize(timed(lambda: sample(B), cfg["min_time"], cfg["min_iters"]),
                                               B)["rows_per_s"])

    for B in cfg["batch_sizes"]:
        row: dict[str, list] = {}
        for _ in range(cfg["repeats"]):
            p = peers(cfg, offline, online, B)
            mine = loop_rate(rb.sample, B)
            ray_peer = summarize(timed(lambda: rray.sample(B), cfg["min_time"], cfg["min_iters"]), B)["rows_per_s"]
            for k, v in {**p, "rayrb_sample_loop": mine, "torchrl_ray": ray_peer,
                         "rayrb_sample_loop_shard_reads": loop_rate(shard_reads.sample, B),
                         "rayrb_sample_loop_prioritized": loop_rate(prio.sample, B),
                         "ratio_vs_torchrl_o2o_best": mine / p["torchrl_o2o_best"],
                         "ratio_vs_torchrl_ray": mine / ray_peer, "share_of_gather_limit": mine / p["gather_limit"]}.items():
                row.setdefault(k, []).append(v)
        out["loop"][str(B)] = {k: med_range(v) for k, v in row.items()}
        print(f"  sample() loop B={B}: " + ", ".join(f"{k} {v['median']:,.3f}" for k, v in out["loop"][str(B)].items()),
              flush=True)
    rray.close() if hasattr(rray, "close") else None
    prio.shutdown()
    # long enough that what an iterator holds planned when it stops (up to 1.5 plans) is a small share of a run
    seconds = cfg["headline_consumer_s"]
    actors = [Consumer.remote() for _ in range(cfg["draw_consumers"])]
    pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in actors])
    for B in cfg["draw_batches"]:
        row = {}
        for _ in range(cfg["repeats"]):
            p = peers(cfg, offline, online, B)
            ray.get([a.warm.remote(rb.client(), B) for a in actors])
            before = pss_bytes(pids)  # imported and read once: what the run adds is the rows it maps and holds
            cpu0, n0 = coordinator_cpu(rb)
            w0 = time.perf_counter()
            got = ray.get([a.run.remote(rb.client(), B, 2, seconds, time.time() + cfg["start_delay_s"])
                           for a in actors])  # iter_batches' default prefetch
            cpu1, n1 = coordinator_cpu(rb)
            mem = pss_bytes(pids)
            span = max(g["end"] for g in got) - min(g["start"] for g in got)
            rate = sum(g["rows"] for g in got) / span
            served = sum(g["rows"] for g in got) / B
            for k, v in {"consumers_rows_per_s": rate, "torchrl_o2o_best": p["torchrl_o2o_best"],
                         "gather_limit": p["gather_limit"], "ratio_vs_torchrl_o2o_best": rate / p["torchrl_o2o_best"],
                         "coordinator_cpu_ms_per_batch": 1e3 * (cpu1 - cpu0) / max(served, 1),
                         "coordinator_batches_planned_per_served": (n1 - n0) / max(served, 1),
                         "coordinator_cpu_ms_per_batch_planned": 1e3 * (cpu1 - cpu0) / max(n1 - n0, 1),
                         "wall_s": time.perf_counter() - w0,
                         "consumers_pss_growth_mib": (mem["pss"] - before["pss"]) / 2**20,
                         "consumers_uss_growth_mib": (mem["uss"] - before["uss"]) / 2**20}.items():
                row.setdefault(k, []).append(v)
        out["consumers"][str(B)] = {k: med_range(v) for k, v in row.items()}
        print(f"  {len(actors)} consumers B={B}: " + ", ".join(f"{k} {v['median']:,.3f}"
                                                             for k, v in out["consumers"][str(B)].items()), flush=True)
    out["consumers"]["dataset_mib"] = len(offline) * (offline["X"][0].numel() * 4 + 8) / 2**20
    out["consumers"]["count"], out["consumers"]["prefetch"] = len(actors), 2
    for a in actors:
        ray.kill(a)
    rb.shutdown()
    results["headline"] = out

def cpu_by_role() -> dict[str, float]:
    """CPU seconds used so far by this machine's processes, grouped by what they are (Ray sets actor titles)."""
    import psutil

    roles = {"consumers": ("ray::Consumer",), "shards": ("ray::OfflineShard", "ray::OnlineShard"),
             "coordinator": ("ray::Coordinator",), "ray system": ("raylet", "gcs_server", "dashboard", "log_monitor",
                                                                   "monitor.py", "runtime_env", "DashboardAgent")}
    out = dict.fromkeys([*roles, "other"], 0.0)
    for proc in psutil.process_iter(["cmdline", "cpu_times"]):
        try:
            line = " ".join(proc.info["cmdline"] or [])
            t = proc.info["cpu_times"]
        except (psutil.Error, TypeError):
            continue
        if t is None:
            continue
        role = next((r for r, keys in roles.items() if any(k in line for k in keys)), "other")
        out[role] += t.user + t.system
    return out


@ray.remote(num_cpus=0)
class CallShapes:
    """Stand-in for the coordinator's plan call, to measure what Ray itself costs the callee per call."""

    def cpu(self) -> float:
        return time.process_time()

    def keywords(self, batch_size, k, *, stream=None, served=None, call=None) -> Any:
        return _Answer(self._text)

    def packed(self, request: tuple) -> str:
        return self._text

    def set_text(self, text: str) -> None:
        self._text = text


class _Answer:
    def __init__(self, text: str):
        self.text = text

    def __reduce__(self):  # as a GroupPlan travels: pickled as its text
        return _Answer, (self.text,)


def bench_call_cost(cfg, results):
    """The callee's CPU per call (its process time) for the plan call's two shapes, same answer text: keyword
    arguments answered by an object, and one tuple answered by the text (``Coordinator.plan_packed``)."""
    import uuid

    actor = CallShapes.remote()
    ray.get(actor.set_text.remote("x" * 3800))  # a group of 12 plans' JSON at B=4096 is about this long
    calls = {"keywords_object": lambda i: actor.keywords.remote(4096, 12, stream="s" * 32, served=i,
                                                                call=uuid.uuid4().hex),
             "tuple_text": lambda i: actor.packed.remote((4096, 12, "s" * 32, i, uuid.uuid4().hex, 0.0))}
    n = max(200, 20 * cfg["min_iters"]) if cfg["min_time"] < 0.5 else 2000
    row: dict[str, list] = {}
    for _ in range(cfg["repeats"]):
        for name, fn in calls.items():
            c0, refs = ray.get(actor.cpu.remote()), []
            for i in range(n):
                refs.append(fn(i))
                if len(refs) >= 4:  # a few in flight, as handles keep them
                    ray.get(refs.pop(0))
            ray.get(refs)
            row.setdefault(f"{name}_callee_ms", []).append((ray.get(actor.cpu.remote()) - c0) / n * 1e3)
    results["call_cost"] = {k: med_range(v) for k, v in row.items()}
    print("  " + ", ".join(f"{k} {v['median']:.3f}" for k, v in results["call_cost"].items()), flush=True)
    ray.kill(actor)


def bench_consumers(cfg, offline, online, root, results):
    """1, 2, 4 and 8 consumer actors iterating at once over one buffer: total rows/s and the coordinator's load."""
    import psutil

    from rayrb import OfflineToOnlineReplayBuffer, write_dataset

    ds_root = Path(root) / "offline-consumers"
    write_dataset(offline, ds_root)
    B, seconds = cfg["consumer_batch"], cfg["min_time"] * 3
    rb = OfflineToOnlineReplayBuffer(str(ds_root), online_capacity=len(online), num_offline_shards=2,
                                     num_online_shards=cfg["online_shards"], offline_fraction=0.5, seed=0)
    rb.extend(online)
    out = {}
    pool = [Consumer.remote() for _ in range(max(cfg["consumers"]))]  # started once: runs are stateless
    ray.get([a.warm.remote(rb.client(), B) for a in pool])
    for n in cfg["consumers"]:
        row = []
        actors = pool[:n]
        for _ in range(cfg["repeats"]):
            before, cpu0 = ray.get(rb.rpc.coord.stats.remote(False))["coordinator"], psutil.cpu_times()
            roles0 = cpu_by_role()
            got = ray.get([a.run.remote(rb.client(), B, cfg["prefetch"], seconds, time.time() + cfg["start_delay_s"])
                           for a in actors])
            after, cpu1 = ray.get(rb.rpc.coord.stats.remote(False))["coordinator"], psutil.cpu_times()
            roles = {k: v - roles0.get(k, 0.0) for k, v in cpu_by_role().items()}
            busy = sum(getattr(cpu1, f) - getattr(cpu0, f) for f in ("user", "system", "nice", "irq", "softirq"))
            total = busy + (cpu1.idle - cpu0.idle) + (getattr(cpu1, "iowait", 0) - getattr(cpu0, "iowait", 0))
            plans = after.get("batches", 0) - before.get("batches", 0)
            plan_ms = after.get("plan_ms_total", 0.0) - before.get("plan_ms_total", 0.0)
            # all consumers' rows over the span from the first start to the last end: they may not overlap fully
            span = max(g["end"] for g in got) - min(g["start"] for g in got)
            row.append({"rows_per_s": sum(g["rows"] for g in got) / span,
                        "plans_per_s": sum(g["rows"] for g in got) / B / span,
                        "coordinator_ms_per_plan": plan_ms / max(plans, 1),
                        "coordinator_busy_fraction": sum(g["rows"] for g in got) / B / span * plan_ms / max(plans, 1) / 1e3,
                        "coordinator_plans_per_s_ceiling": 1e3 * max(plans, 1) / max(plan_ms, 1e-9),
                        "machine_cpu_busy_fraction": busy / total,
                        **{f"cpu_share_{k.replace(' ', '_')}": max(v, 0.0) / max(busy, 1e-9) for k, v in roles.items()}})
        out[str(n)] = {k: med_range([r[k] for r in row]) for k in row[0]}
        print(f"  {n} consumer(s), B={B}: " + ", ".join(f"{k} {v['median']:,.3f}" for k, v in out[str(n)].items()),
              flush=True)
    one = out[str(cfg["consumers"][0])]["rows_per_s"]["median"]
    for n in cfg["consumers"]:
        out[str(n)]["speedup_vs_one"] = out[str(n)]["rows_per_s"]["median"] / one
    out["batch_size"], out["prefetch"], out["seconds"] = B, cfg["prefetch"], seconds
    results["consumers"] = out
    for a in pool:
        ray.kill(a)
    rb.shutdown()


GPU = dict(n_off=581_012, dim=54, n_on=100_000, batch_sizes=[4096, 65536, 262144], shards=[1, 2, 4],
           repeats=3, seconds=2.0, prefetch=16)
GPU_SMOKE = dict(n_off=20_000, dim=8, n_on=5_000, batch_sizes=[1024], shards=[1], repeats=1, seconds=0.2,
                 prefetch=4)


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


def bench_gpu(cfg, root, out_dir: Path, results) -> None:
    """GPU shards and CPU shards into a GPU actor, against TorchRL on the GPU and the GPU gather limit."""
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.data import OfflineToOnlineReplayBuffer as TorchRLO2O

    from rayrb import OfflineToOnlineReplayBuffer, write_dataset

    g = cfg["gpu"]
    offline, online = synthetic_table(g["n_off"], g["dim"]), synthetic_table(g["n_on"], g["dim"], seed=1)
    ds_root = Path(root) / "offline-gpu"
    write_dataset(offline, ds_root)

    def torchrl_peer(device: str):
        off = ReplayBuffer(storage=LazyTensorStorage(len(offline), device=device))
        off.extend(offline)
        rb = TorchRLO2O(offline_dataset=off, online_storage=LazyTensorStorage(len(online), device=device),
                        offline_fraction=0.5)
        rb.extend(online)
        return rb

    gpu_peer, cpu_peer = torchrl_peer("cuda"), torchrl_peer("cpu")
    X = offline["X"].cuda()
    out: dict[str, Any] = {}
    for B in g["batch_sizes"]:
        row: dict[str, list[float]] = {}
        for _ in range(g["repeats"]):
            idx = torch.randint(0, len(X), (B,), device="cuda")
            row.setdefault("index_select_cuda", []).append(_rate(lambda: torch.index_select(X, 0, idx), B, g["seconds"]))
            row.setdefault("torchrl_o2o_cuda_storage", []).append(_rate(lambda: gpu_peer.sample(B), B, g["seconds"]))
            row.setdefault("torchrl_o2o_cpu_storage_to_cuda", []).append(
                _rate(lambda: cpu_peer.sample(B).to("cuda", non_blocking=True), B, g["seconds"]))
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
        out[str(B)] = {k: med_range(v) for k, v in row.items()}
        print(f"  B={B}: " + ", ".join(f"{k} {v['median']:,.0f}" for k, v in out[str(B)].items()), flush=True)
    ratios = {}
    for B in g["batch_sizes"]:
        r = out[str(B)]
        for m in g["shards"]:
            ratios[f"B={B} {m} GPU shard(s) / torchrl_o2o_cuda_storage"] = (
                r[f"rayrb_{m}shard_cuda_storage"]["median"] / r["torchrl_o2o_cuda_storage"]["median"])
            ratios[f"B={B} {m} CPU shard(s) to cuda / torchrl_o2o_cpu_storage_to_cuda"] = (
                r[f"rayrb_{m}shard_cpu_storage"]["median"] / r["torchrl_o2o_cpu_storage_to_cuda"]["median"])
    out["ratios"] = ratios
    out["device"] = torch.cuda.get_device_name(0)
    results["gpu"] = out
    (out_dir / "results_gpu.json").write_text(json.dumps({**{k: results[k] for k in ("command", "machine", "versions")},
                                                          "gpu": out}, indent=1, default=float))


def bench_real(cfg, data_home, root, results):
    from rayrb import OfflineToOnlineReplayBuffer, load_dataset

    ds = load_dataset("openml:shuttle", data_home=data_home, root=root)
    offline = ds.to_tensordict()
    online = offline[: min(len(offline), cfg["n_on"])].clone()
    o2o = torchrl_o2o(offline, online)
    rb = OfflineToOnlineReplayBuffer(ds, online_capacity=len(online), num_offline_shards=2, seed=0)
    rb.extend(online)
    B = 4096 if cfg["n_off"] == SIZES["full"]["n_off"] else cfg["batch_sizes"][-1]
    runs = {"torchrl_o2o": [], "rayrb_2shard_prefetch": []}
    for _ in range(cfg["repeats"]):
        runs["torchrl_o2o"].append(summarize(timed(lambda: o2o.sample(B), cfg["min_time"], cfg["min_iters"]), B))
        it = rb.iter_batches(B, prefetch=cfg["prefetch"])
        runs["rayrb_2shard_prefetch"].append(summarize(timed(lambda: next(it), cfg["min_time"], cfg["min_iters"]), B))
    results["sampling_real"] = {"dataset": "openml:shuttle (real, 58,000 x 9)", "batch_size": B,
                                **{k: {"rows_per_s": med_range([r["rows_per_s"] for r in v])} for k, v in runs.items()}}
    rb.shutdown()


def bench_writing(cfg, root, results):
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


def standardize(td):
    """The preprocessing function for both libraries: works on a row or a chunk."""
    td["X"] = (td["X"] - 0.5) / 2.0
    td["norm"] = td["X"].pow(2).sum(-1)
    return td


def bench_preprocess(cfg, offline, root, results):
    from torchrl.data.datasets.common import BaseDatasetExperienceReplay
    from torchrl.data.replay_buffers import TensorStorage

    from rayrb import preprocess, write_dataset

    src = write_dataset(offline, Path(root) / "pp_src", overwrite=True)
    mm = offline.memmap(Path(root) / "pp_trl_src")
    runs = {"rayrb_batched": [], "torchrl": [], "rayrb_per_row": []}
    workers_rss = []
    # Start the workers (imports of torch and tensordict) once, and report that cost on its own.
    t0 = time.perf_counter()
    preprocess(src, standardize, Path(tempfile.mkdtemp(dir=root)) / "warm", batched=True, num_workers=2,
               num_frames=min(len(offline), 2000), chunk_rows=500, pbar=False)
    results["preprocess_cold_start_s"] = time.perf_counter() - t0
    for rep in range(cfg["repeats"]):
        d = Path(tempfile.mkdtemp(dir=root))
        t0 = time.perf_counter()
        out = preprocess(src, standardize, d / "batched", batched=True, num_workers=2, pbar=False)
        runs["rayrb_batched"].append(len(out) / (time.perf_counter() - t0))
        workers_rss.append(max(c.extra.get("worker_rss_bytes", 0) for c in out.chunks))
        # TorchRL's preprocess runs on any TensorStorage-backed dataset object: drive it directly.
        trl = BaseDatasetExperienceReplay.__new__(BaseDatasetExperienceReplay)
        trl._storage = TensorStorage(mm)
        t0 = time.perf_counter()
        ref = trl.preprocess(standardize, num_workers=2, dest=d / "trl", mp_start_method="fork")
        runs["torchrl"].append(len(ref) / (time.perf_counter() - t0))
        n = cfg["per_row_frames"]
        t0 = time.perf_counter()
        preprocess(src, standardize, d / "rows", num_workers=2, num_frames=n, pbar=False)
        runs["rayrb_per_row"].append(n / (time.perf_counter() - t0))
        if rep == 0:
            a, b = out.read(), ref._storage
            results.setdefault("checks", {})["preprocess_equal_to_torchrl"] = bool(
                np.allclose(a["X"], b["X"].numpy()) and np.allclose(a["norm"], b["norm"].numpy()))
        print(f"  preprocess rep {rep}: " + ", ".join(f"{k} {v[-1]:,.0f} rows/s" for k, v in runs.items()), flush=True)
        # Both libraries' outputs go before the next rep, so that no rep writes behind an earlier one's dirty pages.
        del out, ref, trl
        shutil.rmtree(d, ignore_errors=True)
    results["preprocess"] = {k: {"rows_per_s": med_range(v)} for k, v in runs.items()}
    results["preprocess"]["rows"] = len(offline)
    results["preprocess"]["peak_worker_rss_bytes"] = max(workers_rss)


CLUSTER_SCRIPT = r"""
import json, logging, os, sys, time
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
import ray, torch
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tensordict import TensorDict
n, dim, B, min_time = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
node_counts = [int(k) for k in sys.argv[5].split(",")]
loop_batches = [int(b) for b in sys.argv[6].split(",")]
baseline = sys.argv[7] == "baseline"  # an older rayrb (on PYTHONPATH): defaults only, which it has
# One cluster for every count: nodes are added between the runs, each run's buffer is spread over those present.
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
from rayrb import OfflineToOnlineReplayBuffer
data = TensorDict({"X": torch.randn(n, dim), "y": torch.zeros(n, dtype=torch.int64)}, [n])
out, present = {}, 1
for nodes in node_counts:
    for _ in range(nodes - present):
        cluster.add_node(num_cpus=1)
    present = max(present, nodes)
    cluster.wait_for_nodes()
    rb = OfflineToOnlineReplayBuffer(data, online_capacity=1000, num_offline_shards=2, seed=0,
                                     actor_options={"scheduling_strategy": "SPREAD"})
    it = rb.iter_batches(B, prefetch=4)
    for _ in range(3):
        next(it)
    count, t0 = 0, time.perf_counter()
    while count < 5 or time.perf_counter() - t0 < min_time:
        next(it)
        count += 1
    rate = count * B / (time.perf_counter() - t0)
    it = None
    rb.shutdown()
    out[f"{nodes}_node"] = {"nodes": nodes, "rows_per_s": rate}


@ray.remote(num_cpus=0)
class Loop:
    # a learner-like actor running a plain sample() loop with default arguments
    def run(self, rb, batch_size, seconds):
        torch.set_num_threads(1)
        for _ in range(3):
            rb.sample(batch_size)
        t0, k = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            k += len(rb.sample(batch_size))
        return {"rows_per_s": k / (time.perf_counter() - t0),
                "local_reads": rb.stats().get("handle", {}).get("local_reads", 0)}


# Default arguments on the shards' node and on another node, and the shards reading on theirs (the object-store
# path every handle took before local reads), side by side.
if max(node_counts) >= 2:
    first, second = [nd["NodeID"] for nd in ray.nodes() if nd["Alive"]][:2]
    pin = lambda node: {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
    rb = OfflineToOnlineReplayBuffer(data, online_capacity=max(1, n // 4), num_offline_shards=2, num_online_shards=2,
                                     seed=0, offline_fraction=0.5, actor_options=pin(first))
    rb.extend(data[: max(1, n // 4)])
    runs = {"same_node_default": (first, True), "same_node_shard_reads": (first, False),
            "other_node_default": (second, True)}
    if baseline:
        runs = {"same_node_default": (first, None), "other_node_default": (second, None)}
    loops = {}
    for b in loop_batches:
        for name, (node, local) in runs.items():
            loop = Loop.options(**pin(node)).remote()
            got = ray.get(loop.run.remote(rb.client() if local is None else rb.client(local_reads=local), b, min_time))
            loops.setdefault(str(b), {})[name] = got["rows_per_s"]
            loops[str(b)][name + "_local_reads"] = got["local_reads"]
            ray.kill(loop)
        if not baseline:
            loops[str(b)]["other_node_vs_shard_reads"] = (loops[str(b)]["other_node_default"]
                                                          / loops[str(b)]["same_node_shard_reads"])
    rb.shutdown()
    out["loops_by_node"] = loops
import rayrb
@ray.remote(num_cpus=0)
def where():
    import rayrb
    return rayrb.__file__
out["imported"] = {"driver": rayrb.__file__, "worker": ray.get(where.remote())}
print("RAYRB_RESULT " + json.dumps(out), flush=True)
ray.shutdown()
cluster.shutdown()
"""


def result_line(stdout: str) -> dict:
    """The ``RAYRB_RESULT {json}`` line of a subprocess (Ray may print more, e.g. on shutdown)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("RAYRB_RESULT "):
            return json.loads(line[len("RAYRB_RESULT "):])
    raise RuntimeError(f"no RAYRB_RESULT line in the subprocess output:\n{stdout[-2000:]}")


def bench_cluster(cfg, results, baseline: str | None = None):
    """Buffers over one and two simulated nodes, and sample() loops on the shards' node and on another; with
    ``baseline`` (an older rayrb checkout) the same cluster runs again on that code, side by side."""
    out = {}
    n = min(cfg["n_off"], 200_000)
    B = 4096 if cfg["n_off"] == SIZES["full"]["n_off"] else cfg["batch_sizes"][-1]

    def run(env_extra: dict[str, str], flag: str, cwd: str | None = None) -> dict:
        env = {**os.environ, **env_extra}
        env.pop("RAY_ADDRESS", None)
        # `python -c` puts its working directory first on the path, the driver's and (through Ray) the workers'
        p = subprocess.run([sys.executable, "-c", CLUSTER_SCRIPT, str(n), str(cfg["dim"]), str(B),
                            str(cfg["min_time"] * 3), ",".join(map(str, cfg["cluster_nodes"])),
                            ",".join(map(str, cfg["batch_sizes"])), flag],
                           capture_output=True, text=True, env=env, timeout=900, cwd=cwd)
        if p.returncode != 0:
            raise RuntimeError(f"cluster benchmark failed:\n{p.stderr[-2000:]}")
        return result_line(p.stdout)

    out.update(run({}, "current"))
    if baseline:
        where = Path(baseline).resolve()
        old = run({"PYTHONPATH": os.pathsep.join(p for p in (str(where), os.environ.get("PYTHONPATH")) if p)},
                  "baseline", cwd=str(where))
        for who, path in old.pop("imported", {}).items():
            if not Path(path).resolve().is_relative_to(where):
                raise RuntimeError(f"the baseline run's {who} imported rayrb from {path}, expected under {where}")
        out["baseline"] = {"path": str(baseline), **old}
        for b, row in out.get("loops_by_node", {}).items():
            was = old.get("loops_by_node", {}).get(b, {})
            if was:
                row["other_node_vs_baseline"] = row["other_node_default"] / was["other_node_default"]
                row["same_node_vs_baseline"] = row["same_node_default"] / was["same_node_default"]
    out["note"] = ("both 'nodes' are processes on this one 2-core machine: this checks placement and the read path "
                   "(another node's handle reads through the object store as a real one would), not network scaling")
    results["cluster"] = out
    print("  " + json.dumps(out), flush=True)


def bench_replicas(smoke: bool, results) -> None:
    """What a second copy of each online shard costs (``pipelines/bench_replicas.py``, on its own cluster)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    p = subprocess.run([sys.executable, str(REPO / "pipelines" / "bench_replicas.py"), *(["--smoke"] if smoke else [])],
                       capture_output=True, text=True, env=env, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"replicas benchmark failed:\n{p.stderr[-2000:]}")
    results["replicas"] = result_line(p.stdout)
    print("  " + json.dumps(results["replicas"]), flush=True)


# ------------------------------------------------------------------ report
def ratios(results):
    r = {}
    s = results["sampling"]
    for B, row in s.items():
        r[f"B={B} prioritized cost / uniform (1 shard, prefetch)"] = (
            row["rayrb_1shard_prefetch"]["rows_per_s"]["median"]
            / row["rayrb_1shard_prefetch_prioritized"]["rows_per_s"]["median"])
        r[f"B={B} rate limiter configured, never blocking / none (1 shard, prefetch)"] = (
            row["rayrb_1shard_prefetch_limited"]["rows_per_s"]["median"]
            / row["rayrb_1shard_prefetch"]["rows_per_s"]["median"])
        for k, v in row.items():
            if k.startswith("rayrb") and "prioritized" not in k and "limited" not in k and "noahead" not in k:
                med = v["rows_per_s"]["median"]
                r[f"B={B} {k} / torchrl_o2o"] = med / row["torchrl_o2o"]["rows_per_s"]["median"]
                r[f"B={B} {k} / torchrl_ray"] = med / row["torchrl_ray"]["rows_per_s"]["median"]
                r[f"B={B} {k} / index_select"] = med / row["index_select"]["rows_per_s"]["median"]
    w = results.get("writing", {})
    for n, row in w.items():
        r[f"extend {n} rayrb / torchrl_ray"] = row["rayrb"]["rows_per_s"]["median"] / row["torchrl_ray"]["rows_per_s"]["median"]
    p = results.get("preprocess")
    if p:
        r["preprocess batched rayrb / torchrl"] = p["rayrb_batched"]["rows_per_s"]["median"] / p["torchrl"]["rows_per_s"]["median"]
    m = results.get("memory")
    if m:
        r["offline shards: (anon RSS - per-actor overhead) / dataset bytes"] = (
            m["rss_anon_bytes_total"] - m["offline_shards"] * m["per_actor_overhead_anon_bytes"]) / m["dataset_bytes"]
        r["offline shards: RSS (anon + file) growth while sampling / dataset bytes"] = (
            m["anon_growth_while_sampling_bytes"] + m["file_growth_while_sampling_bytes"]) / m["dataset_bytes"]
    return r


def plots(results, out_dir: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    s = results["sampling"]
    Bs = sorted(int(b) for b in s)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k in s[str(Bs[0])]:
        ax.plot(Bs, [s[str(b)][k]["rows_per_s"]["median"] for b in Bs], marker="o", label=k)
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="rows/s (median)", title="Sampling throughput")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "throughput_vs_batch.png", dpi=110)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    shards = sorted({int(k.split("_")[1][:-5]) for k in s[str(Bs[0])] if k.startswith("rayrb") and "prior" not in k})
    for b in Bs:
        for mode in ("", "_prefetch"):
            ax.plot(shards, [s[str(b)][f"rayrb_{m}shard{mode}"]["rows_per_s"]["median"] for m in shards],
                    marker="o", label=f"B={b}{mode}")
    ax.set(yscale="log", xlabel="offline shards", ylabel="rows/s (median)", title="rayrb throughput vs shards")
    ax.set_xticks(shards)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "throughput_vs_shards.png", dpi=110)
    plt.close("all")
    return ["throughput_vs_batch.png", "throughput_vs_shards.png"]


def headline_plot(results, out_dir: Path) -> list[str]:
    """Rows/s against batch size with default arguments: rayrb's plain sample() loop on the shards' node and on
    another node, the shards' reads (the path before local reads), TorchRL's peers and the machine's gather limit."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    loop = results["headline"]["loop"]
    by_node = results.get("cluster", {}).get("loops_by_node", {})
    Bs = sorted(int(b) for b in loop)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = {"rayrb, same node (defaults)": [loop[str(b)]["rayrb_sample_loop"]["median"] for b in Bs],
              "TorchRL O2O, in process (best of 1-2 threads)": [loop[str(b)]["torchrl_o2o_best"]["median"] for b in Bs],
              "rayrb, prioritized (its shards read)": [loop[str(b)]["rayrb_sample_loop_prioritized"]["median"]
                                                       for b in Bs],
              "TorchRL RayReplayBuffer": [loop[str(b)]["torchrl_ray"]["median"] for b in Bs],
              "gather limit (index_select x cores)": [loop[str(b)]["gather_limit"]["median"] for b in Bs]}
    series["rayrb, shards read (local_reads=False)"] = [loop[str(b)]["rayrb_sample_loop_shard_reads"]["median"]
                                                        for b in Bs]
    if all(str(b) in by_node for b in Bs):
        series["rayrb, other node (defaults; simulated node)"] = [by_node[str(b)]["other_node_default"] for b in Bs]
    for label, ys in series.items():
        ax.plot(Bs, ys, marker="o", label=label, linestyle="--" if "limit" in label else "-")
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="rows/s (one sample() loop)",
           title="Sampling throughput with default arguments")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "headline_throughput.png", dpi=110)
    plt.close("all")
    return ["headline_throughput.png"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat (what the tests run)")
    p.add_argument("--data-home", default=os.environ.get("SCIKIT_LEARN_DATA"))
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--sections", default="headline,sampling,draw_path,consumers,real,writing,preprocess,cluster",
                   help="comma-separated; 'call_cost' (Ray's cost per plan call by its shape), 'replicas' (a second copy "
                        "of each online shard, on a cluster of its own) and 'gpu' (needs CUDA, "
                        "writes results_gpu.json) are not in the default")
    p.add_argument("--batch-sizes", default=None, help="comma-separated, overrides the mode's")
    p.add_argument("--repeats", type=int, default=None, help="overrides the mode's")
    p.add_argument("--ray-config", default=None, type=json.loads,
                   help='Ray system settings (JSON) for the instance this starts, e.g. '
                        '\'{"max_direct_call_object_size": 1048576}\'; recorded in the results')
    p.add_argument("--baseline", default=None,
                   help="a checkout of an older rayrb: the cluster section runs again on it, side by side")
    args = p.parse_args(argv)
    cfg = dict(SIZES["smoke" if args.smoke else "full"])
    cfg["gpu"] = dict(GPU_SMOKE if args.smoke else GPU)
    if args.batch_sizes:
        cfg["batch_sizes"] = [int(b) for b in args.batch_sizes.split(",")]
    if args.repeats:
        cfg["repeats"] = args.repeats
    sections = set(args.sections.split(","))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not ray.is_initialized():
        # a submitted job joins its cluster; run alone, it starts its own instance even if a `ray start` one runs here
        address = os.environ.get("RAY_ADDRESS") or "local"
        if args.ray_config and address != "local":
            raise ValueError(f"--ray-config sets up a Ray instance this starts; got RAY_ADDRESS={address!r}")
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
                 object_store_memory=2 << 30 if address == "local" else None, _system_config=args.ray_config)
    results: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "mode": "smoke" if args.smoke else "full",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
        "versions": {m: __import__(m).__version__ for m in ("ray", "torch", "tensordict", "torchrl", "numpy")},
        "config": cfg,
        "ray_config": args.ray_config or {},
        "data": f"synthetic covertype-sized table {cfg['n_off']} x {cfg['dim']} float32 + int64 label (NOT real "
                f"covertype); online {cfg['n_on']} rows",
        "not_measured": [],
    }
    with tempfile.TemporaryDirectory(prefix="rayrb-bench-") as root:
        offline = synthetic_table(cfg["n_off"], cfg["dim"])
        online = synthetic_table(cfg["n_on"], cfg["dim"], seed=1)
        t0 = time.perf_counter()
        if "headline" in sections:
            print("headline (default arguments)...", flush=True)
            bench_headline(cfg, offline, online, root, results)
        if "sampling" in sections:
            print("sampling...", flush=True)
            bench_sampling(cfg, offline, online, root, results)
        if "draw_path" in sections:
            print("draw path...", flush=True)
            bench_draw_path(cfg, offline, online, root, results)
        if "call_cost" in sections:
            print("call cost...", flush=True)
            bench_call_cost(cfg, results)
        if "consumers" in sections:
            print("consumers...", flush=True)
            bench_consumers(cfg, offline, online, root, results)
        if "real" in sections and args.data_home:
            print("real data...", flush=True)
            bench_real(cfg, args.data_home, root, results)
        if "writing" in sections:
            print("writing...", flush=True)
            bench_writing(cfg, root, results)
        if "preprocess" in sections:
            print("preprocess...", flush=True)
            bench_preprocess(cfg, offline, root, results)
        if "gpu" in sections:
            if not torch.cuda.is_available():
                results["not_measured"].append("gpu: torch.cuda.is_available() is False on this machine")
            else:
                print("gpu...", flush=True)
                bench_gpu(cfg, root, out_dir, results)
        ray.shutdown()
        if "cluster" in sections:
            print("cluster...", flush=True)
            bench_cluster(cfg, results, args.baseline)
        if "replicas" in sections:
            print("replicas...", flush=True)
            bench_replicas(args.smoke, results)

        results["seconds"] = time.perf_counter() - t0
    results["ratios"] = ratios(results) if "sampling" in results else {}
    results["plots"] = plots(results, out_dir) if "sampling" in results and not args.smoke else []
    if "headline" in results and not args.smoke:
        results["plots"] += headline_plot(results, out_dir)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=float))
    print(json.dumps(results["ratios"], indent=1))
    return results


if __name__ == "__main__":
    main()
