"""Section ``startup``: how long a buffer with default arguments takes to be ready to sample, and what its start
costs the machine, beside TorchRL's ``RayReplayBuffer`` (one actor) and an empty Ray actor (what Ray itself costs
for each actor a buffer starts).

Ready means the constructor returned: rayrb's has started its coordinator and shards and heard from each
(``OfflineToOnlineReplayBuffer.__init__``), and written its offline rows to chunks first; TorchRL's actor and the
empty one are ready once they answer ``__ray_ready__``. CPU is the machine's (``/proc/stat``, every process: the
new workers, the raylet and the GCS as well as this driver), from the call to ready; run it on a quiet machine.
"""
from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import ray

from bench.harness import add_run, med_ranges, medians_text, synthetic_table

KINDS = ("empty_actor", "torchrl_ray", "rayrb_default")


@ray.remote(num_cpus=0)
class Empty:
    pass


def machine_cpu_seconds() -> float:
    """CPU seconds every process on the machine has spent, from the kernel's counters (busy time, all CPUs)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, *rest = (int(v) for v in f.readline().split()[1:])
    return (user + nice + system + sum(rest)) / os.sysconf("SC_CLK_TCK")


def start(kind: str, offline, root: str) -> Callable[[], None]:
    """Start one ``kind`` and wait until it is ready; the call that stops it."""
    if kind == "empty_actor":
        actor = Empty.remote()
        ray.get(actor.__ray_ready__.remote())
        return lambda: ray.kill(actor)
    if kind == "torchrl_ray":
        from torchrl.data import LazyTensorStorage, RayReplayBuffer

        rb = RayReplayBuffer(storage=LazyTensorStorage(10_000), batch_size=None)
        ray.get(rb._rb.__ray_ready__.remote())
        return lambda: ray.kill(rb._rb)
    from rayrb import OfflineToOnlineReplayBuffer

    rb = OfflineToOnlineReplayBuffer(offline, online_capacity=10_000, dataset_root=Path(tempfile.mkdtemp(dir=root)))
    return rb.shutdown


def bench_startup(cfg: dict, root: str, results: dict) -> None:
    """Each kind started and stopped in turn, ``repeats`` times: seconds to ready and the machine's CPU seconds."""
    offline = synthetic_table(1000, cfg["dim"])
    row: dict[str, list] = {}
    for i in range(cfg["repeats"] + 1):  # the first round is not counted: it imports what the driver needs
        got = {}
        for kind in KINDS:
            time.sleep(1.0)  # what the last one's stop set going settles first
            c0, t0 = machine_cpu_seconds(), time.perf_counter()
            stop = start(kind, offline, root)
            got[f"{kind}_ready_s"] = time.perf_counter() - t0
            got[f"{kind}_machine_cpu_s"] = machine_cpu_seconds() - c0
            stop()
        if i:
            add_run(row, got)
    results["startup"] = med_ranges(row)
    print("  " + medians_text(results["startup"], ".2f"), flush=True)
