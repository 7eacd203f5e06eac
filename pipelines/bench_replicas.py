"""What two copies of each online shard cost: write and sample throughput with ``online_replicas=1`` and ``2``, side
by side on one simulated cluster (``ray.cluster_utils.Cluster``: a head and three worker nodes, all processes on
this machine), and the bytes each row takes.

    python pipelines/bench_replicas.py                 # 4 writers x 50 writes x 1,000 rows of 54 float32, 3 repeats
    python pipelines/bench_replicas.py --pipelined     # the same with writes that do not wait (then flush())
    python pipelines/bench_replicas.py --nodes 2       # on a head and two worker nodes
    python pipelines/bench_replicas.py --smoke         # tiny sizes (run by the tests)

Prints one ``RAYRB_RESULT {json}`` line (with the CPU seconds each kind of process used over the timed writes);
``pipelines/benchmark.py --sections replicas`` runs it and keeps it.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import ray  # noqa: E402
from bench.harness import ROLES, cpu_by_role, cpu_times  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

WORKER = {"num_cpus": 0.01}  # every actor asks for a little, so all of them run on the worker nodes
# CPU seconds over the timed writes, by process: with every node's processes on this machine's cores, rows/s
# follow the CPU a row costs in all of them together
WRITE_ROLES = {"writers": ("ray::Writer",), **{role: keys for role, keys in ROLES.items() if role != "consumers"}}


@ray.remote(**WORKER)
class Writer:
    """``batches`` writes of ``rows`` rows each, made before the clock starts."""

    def write(self, rb, batches: int, rows: int, dim: int, seed: int, pipelined: bool = False) -> float:
        rng = np.random.default_rng(seed)
        data = [{"X": rng.standard_normal((rows, dim), dtype=np.float32), "y": np.zeros(rows, np.int64)}
                for _ in range(batches)]
        t0 = time.perf_counter()
        for d in data:
            rb.extend(d, wait=not pipelined)
        rb.flush()
        self.rb = rb
        return time.perf_counter() - t0

    def went(self) -> dict[str, int]:
        """How the last ``write``'s writes went: appended by this process, sent to a shard, told the coordinator."""
        return {k: v for k, v in self.rb.stats().get("handle", {}).items() if k.startswith("writes_")}


def workers_nodes() -> list[str]:
    return [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]


def state_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file() and "/coordinator" not in str(f))


def one(replicas: int, args, writers: list, root: str) -> dict:
    from rayrb import OfflineToOnlineReplayBuffer

    capacity = args.writers * args.batches * args.rows
    offline = {"X": np.zeros((1000, args.dim), np.float32), "y": np.zeros(1000, np.int64)}
    state = Path(tempfile.mkdtemp(dir=root))
    # one copy: each online shard on a worker of its own, as Ray places the first copies of two with STRICT_SPREAD
    placed = {"online_replicas": replicas} if replicas > 1 else {"online_nodes": workers_nodes()[:2]}
    rb = OfflineToOnlineReplayBuffer(offline, online_capacity=capacity, num_online_shards=2, seed=0, **placed,
                                     storage_dir=state, actor_options=WORKER,
                                     dataset_root=Path(tempfile.mkdtemp(dir=root)) / "ds")
    cpu0, t0 = cpu_times(WRITE_ROLES), time.perf_counter()
    ray.get([w.write.remote(rb, args.batches, args.rows, args.dim, i, args.pipelined) for i, w in enumerate(writers)])
    write_rate = capacity / (time.perf_counter() - t0)
    cpu = {f"write_cpu_s_{role.replace(' ', '_')}": used for role, used in cpu_by_role(cpu0, WRITE_ROLES).items()}
    went = ray.get([w.went.remote() for w in writers])
    assert rb.write_count == capacity
    copies = [r for s in rb.stats()["shards"] for r in s.get("replicas", [])]
    assert all(r["status"] == "live" for r in copies), copies
    for _ in range(3):
        rb.sample(args.batch)
    t0, rows = time.perf_counter(), 0
    while time.perf_counter() - t0 < args.seconds:
        rows += len(rb.sample(args.batch))
    sample_rate = rows / (time.perf_counter() - t0)
    disk = state_bytes(state)
    rb.shutdown()
    return {"extend_rows_per_s": write_rate, "sample_rows_per_s": sample_rate, "disk_bytes_per_row": disk / capacity,
            "rebuilds": sum(r["rebuilds"] for r in copies), "pieces_streamed": sum(r.get("streamed", 0) for r in copies),
            **cpu, "write_cpu_s": sum(cpu.values()),
            **{k: sum(w.get(k, 0) for w in went) for k in went[0] if k.startswith("writes_")}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--writers", type=int, default=4)
    p.add_argument("--batches", type=int, default=50)
    p.add_argument("--rows", type=int, default=1000)
    p.add_argument("--dim", type=int, default=54)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nodes", type=int, default=3, help="worker nodes (at least 2: a copy each)")
    p.add_argument("--pipelined", action="store_true", help="writes with extend(..., wait=False), then flush()")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.writers, args.batches, args.rows, args.dim, args.batch, args.seconds, args.repeats = 2, 3, 50, 4, 64, 0.2, 1
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(args.nodes):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
    try:
        writers = [Writer.options(scheduling_strategy="SPREAD").remote() for _ in range(args.writers)]  # as
        # collectors on nodes of their own would: rows cross nodes to every copy
        ray.get([w.__ray_ready__.remote() for w in writers])
        runs: dict[int, list[dict]] = {1: [], 2: []}
        with tempfile.TemporaryDirectory(prefix="rayrb-replicas-") as root:
            one(1, argparse.Namespace(**{**vars(args), "batches": 1, "seconds": 0.1}), writers, root)  # warm-up
            for _ in range(args.repeats):  # alternated, so drift on the machine falls on both
                for replicas in (1, 2):
                    runs[replicas].append(one(replicas, args, writers, root))
        out = {str(r): {k: statistics.median(x[k] for x in v) for k in v[0]} for r, v in runs.items()}
        out["extend_ratio"] = out["2"]["extend_rows_per_s"] / out["1"]["extend_rows_per_s"]
        out["sample_ratio"] = out["2"]["sample_rows_per_s"] / out["1"]["sample_rows_per_s"]
        out["row_bytes"] = args.dim * 4 + 8
        out["config"] = vars(args)
        out["note"] = ("all nodes are processes on this machine: a second copy costs its CPU and page cache here, "
                       "and its network hop is a local one")
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RAYRB_RESULT " + json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
