"""Section ``draw_path``: what the one draw path is for, side by side in one run: consumer actors against one
in-process TorchRL ``OfflineToOnlineReplayBuffer``, the coordinator's own CPU per batch, where the machine's CPU goes
per role, and a plain ``sample()`` loop under a rate limiter that never binds against the same loop without one."""
from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from tensordict import TensorDict

from bench.harness import (
    Consumer,
    add_run,
    coordinator_cpu,
    cpu_by_role,
    cpu_times,
    measure,
    med_ranges,
    medians_text,
    o2o_buffer,
    rows_and_span,
    run_together,
    torchrl_o2o,
    warm,
    write_offline,
)

if TYPE_CHECKING:
    from torchrl.data import OfflineToOnlineReplayBuffer as TorchRLO2O

    from rayrb import OfflineToOnlineReplayBuffer


def coordinator_idle_cpu(rb: OfflineToOnlineReplayBuffer, seconds: float) -> float:
    """The coordinator's CPU seconds per second while nothing is asked of it: what a Ray actor process spends
    whatever it serves (an idle trivial actor spends the same), so not a cost of any batch."""
    c0, _ = coordinator_cpu(rb)
    t0 = time.perf_counter()
    time.sleep(seconds)
    c1, _ = coordinator_cpu(rb)
    return (c1 - c0) / (time.perf_counter() - t0)


def bench_draw_path(cfg: dict, offline: TensorDict, online: TensorDict, root: str, results: dict) -> None:
    """What the one draw path is for, side by side in one run: 4 consumer actors against one in-process TorchRL
    OfflineToOnlineReplayBuffer, the coordinator's own CPU per batch, and a plain sample() loop under a rate
    limiter that never binds against the same loop without one."""
    ds_root = write_offline(offline, root, "offline-draw-path")
    o2o = torchrl_o2o(offline, online)
    rb = o2o_buffer(cfg, ds_root, online, 2, seed=0)
    # the first prefetch is the headline; deeper ones show how the per-call cost shrinks with larger groups
    prefetches = list(cfg["draw_prefetch"])
    out: dict[str, Any] = {"consumers": cfg["draw_consumers"], "prefetch": prefetches[0]}
    idle = coordinator_idle_cpu(rb, cfg["idle_s"])
    out["coordinator_idle_cpu_ms_per_s"] = idle * 1e3
    for B, pf in [(B, pf) for pf in prefetches for B in cfg["draw_batches"]]:
        row: dict[str, list] = {}
        for _ in range(cfg["repeats"]):
            add_run(row, consumers_once(cfg, rb, o2o, B, pf, idle))
        key = str(B) if pf == prefetches[0] else f"{B} prefetch={pf}"
        out[key] = med_ranges(row)
        print(f"  draw path B={B} prefetch={pf}: " + medians_text(out[key]), flush=True)
    rb.shutdown()
    out["limiter_loop"] = limiter_loop(cfg, ds_root, online)
    o2o = None
    gc.collect()
    results["draw_path"] = out


def consumers_once(cfg: dict, rb: OfflineToOnlineReplayBuffer, o2o: TorchRLO2O, B: int, pf: int,
                   idle: float) -> dict[str, float]:
    """One repeat: fresh consumer actors iterating together, against TorchRL's in-process rate measured just
    before, with the coordinator's CPU per batch and every role's."""
    seconds = cfg["min_time"] * 3
    o2o_rate = measure(cfg, lambda: o2o.sample(B), B)["rows_per_s"]
    actors = [Consumer.remote() for _ in range(cfg["draw_consumers"])]
    warm(actors, rb, B)
    cpu0, n0 = coordinator_cpu(rb)
    roles0 = cpu_times()
    w0 = time.perf_counter()
    got = run_together(actors, rb, B, pf, seconds, cfg["start_delay_s"])
    roles = cpu_by_role(since=roles0)
    cpu1, n1 = coordinator_cpu(rb)
    wall = time.perf_counter() - w0
    for a in actors:
        ray.kill(a)
    rows, span = rows_and_span(got)
    rate = rows / span
    ms = 1e3 * (cpu1 - cpu0) / max(n1 - n0, 1)
    # above the idle process's own spending: the part that grows with batches, which sets the ceiling
    net = 1e3 * max(0.0, cpu1 - cpu0 - idle * wall) / max(n1 - n0, 1)
    # where the machine's CPU goes per batch served: consumers, shards, coordinator, Ray's own processes
    # (the consumers' figure includes their polling wait for the common start, start_delay_s)
    served = rows / B
    by_role = {f"cpu_ms_per_batch_{role.replace(' ', '_')}": 1e3 * used / served for role, used in roles.items()}
    return {**by_role, "consumers_rows_per_s": rate, "torchrl_o2o_rows_per_s": o2o_rate,
            "ratio_vs_torchrl_o2o": rate / o2o_rate, "coordinator_cpu_ms_per_batch": ms,
            "coordinator_cpu_ms_per_batch_above_idle": net,
            "coordinator_batches_per_s_ceiling": 1e3 / max(net, 1e-9)}


def limiter_loop(cfg: dict, ds_root: Path, online: TensorDict) -> dict[str, dict]:
    """The plain sample() loop, with and without a rate limiter whose window is never reached."""
    from rayrb import SampleToInsertRatio

    plain = o2o_buffer(cfg, ds_root, online, 1, seed=1)
    limited = o2o_buffer(cfg, ds_root, online, 1, seed=1, rate_limiter=SampleToInsertRatio(1.0, 1, 1e15))
    loop: dict[str, Any] = {}
    for B in cfg["draw_batches"]:
        row: dict[str, list] = {}
        for _ in range(cfg["repeats"]):
            a = measure(cfg, lambda: plain.sample(B), B)["rows_per_s"]
            b = measure(cfg, lambda: limited.sample(B), B)["rows_per_s"]
            add_run(row, {"no_limiter_rows_per_s": a, "limiter_rows_per_s": b, "ratio": b / a})
        loop[str(B)] = med_ranges(row)
        print(f"  sample() loop B={B}: " + medians_text(loop[str(B)]), flush=True)
    plain.shutdown()
    limited.shutdown()
    return loop
