"""Section ``cluster``: buffers over one and two simulated nodes (``ray.cluster_utils.Cluster``: all processes on
this machine), and ``sample()`` loops on the shards' node and on another; with ``--baseline`` the same again on an
older rayrb checkout. It runs in a subprocess of its own, after this driver's Ray instance has shut down."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.harness import one_batch_size, result_line

# Run as `python -c CLUSTER_SCRIPT` with its own cluster: self-contained, it imports only Ray, torch, tensordict and
# rayrb (the current checkout's, or the baseline's).
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


def bench_cluster(cfg: dict, results: dict, baseline: str | None = None) -> None:
    """Buffers over one and two simulated nodes, and sample() loops on the shards' node and on another; with
    ``baseline`` (an older rayrb checkout) the same cluster runs again on that code, side by side."""
    out = {}
    n = min(cfg["n_off"], 200_000)
    B = one_batch_size(cfg)

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
