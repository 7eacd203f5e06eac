"""Section ``headline``: what a user gets with default arguments, side by side with the peers at their best in one
run: one process's plain ``sample()`` loop (also with the shards reading, and prioritized), and consumer actors'
``iter_batches()`` with the coordinator's CPU per batch and the consumers' memory."""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import torch
from tensordict import TensorDict

from bench.harness import (
    DEFAULT_PREFETCH,
    Consumer,
    add_run,
    coordinator_cpu,
    gather_fn,
    measure,
    med_ranges,
    medians_text,
    o2o_buffer,
    pss_bytes,
    row_bytes,
    rows_and_span,
    run_together,
    torchrl_o2o,
    torchrl_ray,
    warm,
    write_offline,
)

if TYPE_CHECKING:
    from rayrb import OfflineToOnlineReplayBuffer


def at_threads(n: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` with torch using ``n`` threads (the setting is restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def peers(cfg: dict, offline: TensorDict, online: TensorDict, B: int) -> dict[str, float]:
    """The peers' rows/s at batch size ``B``, each at its best: TorchRL's in-process O2O with 1 and with 2 torch
    threads (on a loaded 2-core machine 2 threads ran its sample() 8x slower), TorchRL's RayReplayBuffer, and
    torch.index_select gathering B random rows with 1 thread, times the cores: the machine's limit."""
    o2o = torchrl_o2o(offline, online)
    out = {f"torchrl_o2o_{t}_threads": at_threads(t, lambda: measure(cfg, lambda: o2o.sample(B), B)["rows_per_s"])
           for t in (1, 2)}
    out["torchrl_o2o_best"] = max(out["torchrl_o2o_1_threads"], out["torchrl_o2o_2_threads"])
    out["index_select_1_thread"] = at_threads(1, lambda: measure(cfg, gather_fn(offline, B), B)["rows_per_s"])
    out["gather_limit"] = out["index_select_1_thread"] * (os.cpu_count() or 1)
    return out


def bench_headline(cfg: dict, offline: TensorDict, online: TensorDict, root: str, results: dict) -> None:
    """What a user gets with default arguments, side by side with the peers in one run: one process's plain
    sample() loop; four consumer actors' iter_batches(), with the coordinator's CPU per batch and the consumers'
    memory (PSS: the mapped dataset's pages are shared, not copied per handle)."""
    ds_root = write_offline(offline, root, "offline-headline")
    rb = o2o_buffer(cfg, ds_root, online, 2, seed=0)
    out = {"loop": sample_loops(cfg, offline, online, ds_root, rb), "consumers": consumers(cfg, offline, online, rb),
           "peers": {}}
    rb.shutdown()
    results["headline"] = out


def sample_loops(cfg: dict, offline: TensorDict, online: TensorDict, ds_root: Path,
                 rb: OfflineToOnlineReplayBuffer) -> dict[str, dict]:
    """One process's sample() loop at each batch size, against the peers measured in the same repeat."""
    # what the local reads are worth, and what prioritized sampling (read by its shards: the sum tree is theirs) pays
    shard_reads = rb.client(local_reads=False)
    prio = o2o_buffer(cfg, ds_root, online, 2, seed=0, sampler="prioritized")
    rray = torchrl_ray(offline)

    def loop_rate(sample, B):
        return at_threads(1, lambda: measure(cfg, lambda: sample(B), B)["rows_per_s"])

    loops = {}
    for B in cfg["batch_sizes"]:
        row: dict[str, list] = {}
        for _ in range(cfg["repeats"]):
            p = peers(cfg, offline, online, B)
            mine = loop_rate(rb.sample, B)
            ray_peer = measure(cfg, lambda: rray.sample(B), B)["rows_per_s"]
            add_run(row, {**p, "rayrb_sample_loop": mine, "torchrl_ray": ray_peer,
                          "rayrb_sample_loop_shard_reads": loop_rate(shard_reads.sample, B),
                          "rayrb_sample_loop_prioritized": loop_rate(prio.sample, B),
                          "ratio_vs_torchrl_o2o_best": mine / p["torchrl_o2o_best"],
                          "ratio_vs_torchrl_ray": mine / ray_peer, "share_of_gather_limit": mine / p["gather_limit"]})
        loops[str(B)] = med_ranges(row)
        print(f"  sample() loop B={B}: " + medians_text(loops[str(B)]), flush=True)
    rray.close() if hasattr(rray, "close") else None
    prio.shutdown()
    return loops


def consumers(cfg: dict, offline: TensorDict, online: TensorDict, rb: OfflineToOnlineReplayBuffer) -> dict[str, Any]:
    """The consumer actors iterating with iter_batches' default prefetch, at each draw batch size."""
    # long enough that what an iterator holds planned when it stops (up to 1.5 plans) is a small share of a run
    seconds = cfg["headline_consumer_s"]
    actors = [Consumer.remote() for _ in range(cfg["draw_consumers"])]
    pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in actors])
    out: dict[str, Any] = {}
    for B in cfg["draw_batches"]:
        row: dict[str, list] = {}
        for _ in range(cfg["repeats"]):
            p = peers(cfg, offline, online, B)
            add_run(row, consumers_once(cfg, rb, actors, pids, B, seconds, p))
        out[str(B)] = med_ranges(row)
        print(f"  {len(actors)} consumers B={B}: " + medians_text(out[str(B)]), flush=True)
    out["dataset_mib"] = len(offline) * row_bytes(offline) / 2**20
    out["count"], out["prefetch"] = len(actors), DEFAULT_PREFETCH
    for a in actors:
        ray.kill(a)
    return out


def consumers_once(cfg: dict, rb: OfflineToOnlineReplayBuffer, actors: list, pids: list[int], B: int, seconds: float,
                   p: dict[str, float]) -> dict[str, float]:
    """One repeat of the consumers against the peers ``p``: rows/s, the coordinator's CPU, the memory they add."""
    warm(actors, rb, B)
    before = pss_bytes(pids)  # imported and read once: what the run adds is the rows it maps and holds
    cpu0, n0 = coordinator_cpu(rb)
    w0 = time.perf_counter()
    got = run_together(actors, rb, B, DEFAULT_PREFETCH, seconds, cfg["start_delay_s"])
    cpu1, n1 = coordinator_cpu(rb)
    mem = pss_bytes(pids)
    rows, span = rows_and_span(got)
    rate = rows / span
    served = rows / B
    return {"consumers_rows_per_s": rate, "torchrl_o2o_best": p["torchrl_o2o_best"],
            "gather_limit": p["gather_limit"], "ratio_vs_torchrl_o2o_best": rate / p["torchrl_o2o_best"],
            "coordinator_cpu_ms_per_batch": 1e3 * (cpu1 - cpu0) / max(served, 1),
            "coordinator_batches_planned_per_served": (n1 - n0) / max(served, 1),
            "coordinator_cpu_ms_per_batch_planned": 1e3 * (cpu1 - cpu0) / max(n1 - n0, 1),
            "wall_s": time.perf_counter() - w0,
            "consumers_pss_growth_mib": (mem["pss"] - before["pss"]) / 2**20,
            "consumers_uss_growth_mib": (mem["uss"] - before["uss"]) / 2**20}
