"""Run in a subprocess: a 3-node ray.cluster_utils.Cluster loses the node that runs an offline shard.

Prints one marked JSON line: how long sampling took to resume on the surviving nodes, and what was served.
"""
import os
import sys
import time

import numpy as np
import ray
from cluster_util import local_cluster, report
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

FAST_HEALTH_CHECKS = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                      "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}


def main(tmp: str) -> None:
    from rayrb import OfflineToOnlineReplayBuffer, write_dataset

    with local_cluster(workers=2, system_config=FAST_HEALTH_CHECKS) as (cluster, workers):
        doomed = workers[0]
        # The chunks live on storage every node sees (one machine here); the shard prefers the doomed node.
        src = write_dataset({"x": np.arange(1000, dtype=np.int64)}, os.path.join(tmp, "src"), chunk_rows=100)
        soft = NodeAffinitySchedulingStrategy(doomed.node_id, soft=True)
        head = ray.get_runtime_context().get_node_id()
        t0 = time.monotonic()
        while sum(n["Alive"] for n in ray.nodes()) < 3 and time.monotonic() - t0 < 30:
            time.sleep(0.2)  # the scheduler may not place on a node it has not heard from yet
        for attempt in range(6):  # soft affinity is a preference: try again if the shard landed on the head
            rb = OfflineToOnlineReplayBuffer(src, online_capacity=100, num_offline_shards=1, seed=0, timeout=60,
                                             offline_fraction=1.0, actor_options={"scheduling_strategy": soft},
                                             storage_dir=os.path.join(tmp, "state"))
            node_of = ray.get(rb.rpc.shards[0].__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))
            if node_of != head:
                break
            rb.shutdown()
            time.sleep(1.0)
        else:  # the scheduler kept it on the head, which cannot be removed: say so rather than test nothing
            rb.shutdown()
            report({"placed": False})
            return
        before = rb.sample(64)["x"]
        shard = rb.rpc.shards[0]
        where = ray.get(shard.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))
        # Soft affinity is a preference: remove whichever worker node the shard really runs on.
        doomed = next((w for w in workers if w.node_id == where), doomed)
        cluster.remove_node(doomed, allow_graceful=False)
        t0 = time.monotonic()
        while doomed.node_id in {n["NodeID"] for n in ray.nodes() if n["Alive"]}:
            if time.monotonic() - t0 > 60:
                raise RuntimeError("the removed node was not declared dead within 60 s")
            time.sleep(0.1)
        detected = time.monotonic() - t0
        while True:
            try:
                batch = rb.sample(64)
                break
            except Exception as e:  # the shard's node is gone until Ray restarts it elsewhere
                last = repr(e)
                if time.monotonic() - t0 > 60:
                    raise RuntimeError(f"sampling did not resume within 60 s: {last}") from e
                time.sleep(0.1)
        recovery = time.monotonic() - t0
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        moved_to = ray.get(shard.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))
        result = {"placed": True, "attempts": attempt + 1, "recovery_s": recovery, "detected_s": detected,
                  "sampled": int(batch.batch_size[0]),
                  "was_on_doomed": where == doomed.node_id, "moved_to_doomed": moved_to == doomed.node_id,
                  "rows_ok": bool(((batch["x"] >= 0) & (batch["x"] < 1000)).all()) and len(before) == 64,
                  "doomed_alive": doomed.node_id in alive}
        rb.shutdown()
        report(result)


if __name__ == "__main__":
    main(sys.argv[1])
