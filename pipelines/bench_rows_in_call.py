"""What rows cost on their way to an actor on another node: one argument (past Ray's inline size, 100 KiB: put in
the object store and fetched by the callee's node) against the same rows cut in parts that Ray carries inside the
call (``rayrb.actors.inline``), sent to the callee and forwarded by it to a third node as a replicated shard does.
A simulated cluster (``ray.cluster_utils.Cluster``: a head and three worker nodes, every process on this machine),
a caller, a callee and a third actor, each on a worker node of its own; calls one after another.

    python pipelines/bench_rows_in_call.py          # 224 KiB and 1 MiB writes (1,000 and 4,600 rows of 224 bytes)
    python pipelines/bench_rows_in_call.py --smoke  # tiny sizes (run by the tests)

Prints one ``RAYRB_RESULT {json}`` line: calls/s and the whole machine's CPU ms per call (``/proc/stat``), medians.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from rayrb.actors.inline import cut, joined  # noqa: E402


def machine_cpu_s() -> float:
    """CPU seconds the whole machine spent busy so far (every node's processes are on it)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


@ray.remote(num_cpus=0.01)
class Callee:
    def take(self, *parts) -> int:
        return len(next(iter(joined(parts).values())))

    def forward(self, other, *parts, ref: list | None = None) -> int:
        """As a primary does: the rows on to its replica, awaited here; in the call, or as the ref the caller put,
        which each copy fetches itself."""
        return ray.get(other.take.remote(*(ref or parts)))


@ray.remote(num_cpus=0.01)
class Caller:
    def run(self, callee, other, calls: int, rows: int, how: str) -> float:
        data = {"X": np.random.default_rng(0).standard_normal((rows, 54), dtype=np.float32),
                "y": np.zeros(rows, np.int64)}
        t0 = time.perf_counter()
        for _ in range(calls):
            if other is None:
                ray.get(callee.take.remote(*(cut(data) if how == "parts" else (data,))))
            elif how == "parts":
                ray.get(callee.forward.remote(other, *cut(data)))
            else:
                ref = ray.put(data)
                ray.get(callee.forward.remote(other, ref, ref=[ref]))
        return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1000,4600", help="rows a call, comma-separated (224 bytes a row)")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.rows, args.calls, args.repeats = "1000", 5, 1
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(3):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
    out: dict = {"config": vars(args)}
    try:
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
        caller, callee, third = (cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                                 .remote() for cls, node in zip((Caller, Callee, Callee), nodes))
        ray.get(caller.run.remote(callee, None, 5, 1000, "parts"))  # warm
        for rows in (int(r) for r in args.rows.split(",")):
            runs: dict[str, list] = {}
            for _ in range(args.repeats):  # alternated, so drift on the machine falls on every way
                for name, other, how in (("one_argument", None, "one"), ("parts", None, "parts"),
                                         ("one_argument_forwarded", third, "one"), ("parts_forwarded", third, "parts")):
                    c0 = machine_cpu_s()
                    seconds = ray.get(caller.run.remote(callee, other, args.calls, rows, how))
                    runs.setdefault(name, []).append((args.calls / seconds, (machine_cpu_s() - c0) / args.calls * 1e3))
            out[str(rows)] = {name: {"calls_per_s": statistics.median(r for r, _ in v),
                                     "cpu_ms_per_call": statistics.median(c for _, c in v)} for name, v in runs.items()}
            out[str(rows)]["kib"] = rows * 224 / 1024
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RAYRB_RESULT " + json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
