"""Section ``consumers``: 1, 2, 4 and 8 consumer actors iterating at once over one buffer: total rows/s, the
coordinator's load and ceiling, and the machine's CPU by role."""
from __future__ import annotations

from typing import TYPE_CHECKING

import ray
from tensordict import TensorDict

from bench.harness import (
    Consumer,
    coordinator_stats,
    cpu_by_role,
    cpu_times,
    med_range,
    medians_text,
    o2o_buffer,
    rows_and_span,
    run_together,
    warm,
    write_offline,
)

if TYPE_CHECKING:
    from rayrb import OfflineToOnlineReplayBuffer


def bench_consumers(cfg: dict, offline: TensorDict, online: TensorDict, root: str, results: dict) -> None:
    """1, 2, 4 and 8 consumer actors iterating at once over one buffer: total rows/s and the coordinator's load."""
    ds_root = write_offline(offline, root, "offline-consumers")
    B, seconds = cfg["consumer_batch"], cfg["min_time"] * 3
    rb = o2o_buffer(cfg, ds_root, online, 2, seed=0)
    out = {}
    pool = [Consumer.remote() for _ in range(max(cfg["consumers"]))]  # started once: runs are stateless
    warm(pool, rb, B)
    for n in cfg["consumers"]:
        row = [one_run(cfg, rb, pool[:n], B, seconds) for _ in range(cfg["repeats"])]
        out[str(n)] = {k: med_range([r[k] for r in row]) for k in row[0]}
        print(f"  {n} consumer(s), B={B}: " + medians_text(out[str(n)]), flush=True)
    one = out[str(cfg["consumers"][0])]["rows_per_s"]["median"]
    for n in cfg["consumers"]:
        out[str(n)]["speedup_vs_one"] = out[str(n)]["rows_per_s"]["median"] / one
    out["batch_size"], out["prefetch"], out["seconds"] = B, cfg["prefetch"], seconds
    results["consumers"] = out
    for a in pool:
        ray.kill(a)
    rb.shutdown()


def one_run(cfg: dict, rb: OfflineToOnlineReplayBuffer, actors: list, B: int, seconds: float) -> dict[str, float]:
    """``actors`` iterating together once: their rows/s, the coordinator's plans, the machine's CPU by role."""
    import psutil

    before, cpu0 = coordinator_stats(rb), psutil.cpu_times()
    roles0 = cpu_times()
    got = run_together(actors, rb, B, cfg["prefetch"], seconds, cfg["start_delay_s"])
    after, cpu1 = coordinator_stats(rb), psutil.cpu_times()
    roles = cpu_by_role(since=roles0)
    busy = sum(getattr(cpu1, f) - getattr(cpu0, f) for f in ("user", "system", "nice", "irq", "softirq"))
    total = busy + (cpu1.idle - cpu0.idle) + (getattr(cpu1, "iowait", 0) - getattr(cpu0, "iowait", 0))
    plans = after.get("batches", 0) - before.get("batches", 0)
    plan_ms = after.get("plan_ms_total", 0.0) - before.get("plan_ms_total", 0.0)
    rows, span = rows_and_span(got)
    return {"rows_per_s": rows / span,
            "plans_per_s": rows / B / span,
            "coordinator_ms_per_plan": plan_ms / max(plans, 1),
            "coordinator_busy_fraction": rows / B / span * plan_ms / max(plans, 1) / 1e3,
            "coordinator_plans_per_s_ceiling": 1e3 * max(plans, 1) / max(plan_ms, 1e-9),
            "machine_cpu_busy_fraction": busy / total,
            **{f"cpu_share_{k.replace(' ', '_')}": max(v, 0.0) / max(busy, 1e-9) for k, v in roles.items()}}
