"""What the sections share: timing and summaries, the synthetic table, rayrb's and TorchRL's buffers, the consumer
actor, and probes of memory and CPU (the object store, processes' PSS, CPU by role, the coordinator's own)."""
from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
import torch
from tensordict import TensorDict

if TYPE_CHECKING:
    from torchrl.data import OfflineToOnlineReplayBuffer as TorchRLO2O
    from torchrl.data import RayReplayBuffer

    from rayrb import OfflineToOnlineReplayBuffer

COVERTYPE_ROWS = 581_012  # the full mode's offline table has covertype's size (its rows are synthetic)
DEFAULT_PREFETCH = 2  # iter_batches' default


# ------------------------------------------------------------------ timing and summaries
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


def measure(cfg: dict, fn: Callable[[], Any], rows_per_call: int) -> dict[str, float]:
    """``summarize`` of ``fn`` timed for the mode's ``min_time`` and ``min_iters``."""
    return summarize(timed(fn, cfg["min_time"], cfg["min_iters"]), rows_per_call)


def med_range(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def add_run(row: dict[str, list], values: dict[str, float]) -> None:
    """Append one repeat's ``values`` to ``row``'s lists, key by key."""
    for k, v in values.items():
        row.setdefault(k, []).append(v)


def med_ranges(row: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {k: med_range(v) for k, v in row.items()}


def medians_text(summaries: dict[str, dict], fmt: str = ",.3f") -> str:
    """``key median, key median, ...``: a section's progress line."""
    return ", ".join(f"{k} {v['median']:{fmt}}" for k, v in summaries.items())


def one_batch_size(cfg: dict) -> int:
    """The batch size of the sections that measure one: 4096 at full size, else the mode's largest."""
    return 4096 if cfg["n_off"] == COVERTYPE_ROWS else cfg["batch_sizes"][-1]


def result_line(stdout: str) -> dict:
    """The ``RAYRB_RESULT {json}`` line of a subprocess (Ray may print more, e.g. on shutdown)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("RAYRB_RESULT "):
            return json.loads(line[len("RAYRB_RESULT "):])
    raise RuntimeError(f"no RAYRB_RESULT line in the subprocess output:\n{stdout[-2000:]}")


# ------------------------------------------------------------------ data and buffers
def synthetic_table(n: int, dim: int, seed: int = 0) -> TensorDict:
    """Covertype-shaped random rows. NOT real data."""
    g = torch.Generator().manual_seed(seed)
    return TensorDict({"X": torch.randn(n, dim, generator=g), "y": torch.randint(0, 7, (n,), generator=g)}, [n])


def row_bytes(table: TensorDict) -> int:
    """One row's bytes: ``X`` as float32 and an int64 label."""
    return table["X"][0].numel() * 4 + 8


def gather_fn(table: TensorDict, batch_size: int) -> Callable[[], Any]:
    """``torch.index_select`` of ``batch_size`` random rows in this process: the machine's limit."""
    X, y = table["X"], table["y"]

    def gather():
        idx = torch.randint(0, len(X), (batch_size,))
        torch.index_select(X, 0, idx), torch.index_select(y, 0, idx)

    return gather


def write_offline(offline: TensorDict, root: str, name: str) -> Path:
    """``offline`` written as a chunk dataset at ``root/name``, for a section's buffers to map."""
    from rayrb import write_dataset

    where = Path(root) / name
    write_dataset(offline, where)
    return where


def o2o_buffer(cfg: dict, ds_root: Path, online: TensorDict, shards: int, seed: int,
               **options: Any) -> OfflineToOnlineReplayBuffer:
    """rayrb's buffer over ``ds_root``, half offline, holding ``online``: the sections' common setup."""
    from rayrb import OfflineToOnlineReplayBuffer

    rb = OfflineToOnlineReplayBuffer(str(ds_root), online_capacity=len(online), num_offline_shards=shards,
                                     num_online_shards=cfg["online_shards"], offline_fraction=0.5, seed=seed,
                                     **options)
    rb.extend(online)
    return rb


def torchrl_o2o(offline: TensorDict, online: TensorDict) -> TorchRLO2O:
    from torchrl.data import LazyTensorStorage, OfflineToOnlineReplayBuffer, ReplayBuffer

    off = ReplayBuffer(storage=LazyTensorStorage(len(offline)))
    off.extend(offline)
    rb = OfflineToOnlineReplayBuffer(offline_dataset=off, online_capacity=len(online), offline_fraction=0.5)
    rb.extend(online)
    return rb


def torchrl_ray(data: TensorDict) -> RayReplayBuffer:
    from torchrl.data import LazyTensorStorage, RayReplayBuffer

    rb = RayReplayBuffer(storage=LazyTensorStorage(len(data)), batch_size=None)
    rb.extend(data)
    return rb


# ------------------------------------------------------------------ consumer actors
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


def warm(actors: list, rb: OfflineToOnlineReplayBuffer, batch_size: int) -> None:
    ray.get([a.warm.remote(rb.client(), batch_size) for a in actors])


def run_together(actors: list, rb: OfflineToOnlineReplayBuffer, batch_size: int, prefetch: int, seconds: float,
                 delay: float) -> list[dict]:
    """Each consumer's run over its own handle, all starting ``delay`` seconds from now."""
    return ray.get([a.run.remote(rb.client(), batch_size, prefetch, seconds, time.time() + delay) for a in actors])


def rows_and_span(got: list[dict]) -> tuple[int, float]:
    """All consumers' rows, and the span from the first start to the last end: the runs may not overlap fully."""
    return sum(g["rows"] for g in got), max(g["end"] for g in got) - min(g["start"] for g in got)


# ------------------------------------------------------------------ probes
def coordinator_stats(rb: OfflineToOnlineReplayBuffer) -> dict:
    return ray.get(rb.rpc.coord.stats.remote(False))["coordinator"]


def coordinator_cpu(rb: OfflineToOnlineReplayBuffer) -> tuple[float, int]:
    """``(CPU seconds, batches planned)`` of the coordinator so far, as its ``stats()`` reports them."""
    c = coordinator_stats(rb)
    return float(c.get("cpu_seconds", 0.0)), int(c.get("batches", 0))


ROLES = {"consumers": ("ray::Consumer",), "shards": ("ray::OfflineShard", "ray::OnlineShard"),
         "coordinator": ("ray::Coordinator",),
         "ray system": ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "runtime_env",
                        "DashboardAgent")}


def cpu_times(roles: dict[str, tuple[str, ...]] = ROLES) -> dict[tuple[int, float], tuple[str, float]]:
    """CPU seconds each of this machine's processes has used so far, with its role (Ray sets actor titles; a
    process matching none is ``other``), by ``(pid, start time)``: a snapshot for ``cpu_by_role``."""
    import psutil

    out = {}
    for proc in psutil.process_iter(["cmdline", "cpu_times", "create_time"]):
        try:
            line, t = " ".join(proc.info["cmdline"] or []), proc.info["cpu_times"]
        except (psutil.Error, TypeError):
            continue
        if t is not None:
            role = next((r for r, keys in roles.items() if any(k in line for k in keys)), "other")
            out[(proc.pid, proc.info["create_time"])] = (role, t.user + t.system)
    return out


def cpu_by_role(since: dict[tuple[int, float], tuple[str, float]],
                roles: dict[str, tuple[str, ...]] = ROLES) -> dict[str, float]:
    """CPU seconds each role used after the snapshot ``since`` (``cpu_times``), process by process: a process that
    ended in between takes its seconds out of neither snapshot (another Ray instance on the machine stopping must
    not make a role's figure negative); one started in between counts whole."""
    out = dict.fromkeys([*roles, "other"], 0.0)
    for key, (role, used) in cpu_times(roles).items():
        out[role] += used - since.get(key, (role, 0.0))[1]
    return out


def plasma_mib() -> tuple[float, float]:
    """``(used, needed)`` MiB: ``used`` counts freed objects not yet reclaimed; ``needed`` only referenced ones."""
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
