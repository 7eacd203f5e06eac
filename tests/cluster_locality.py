"""Run in a subprocess: a 3-node ray.cluster_utils.Cluster with an online shard on each worker node and a
collector pinned beside each one. Prints one marked JSON line: where the shards ran, and where each
collector's rows landed."""
import os
import sys
import time

import numpy as np
import ray
from cluster_util import local_cluster, report
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


@ray.remote(num_cpus=0)
class Collector:
    def write(self, rb, first: int, writes: int, rows: int) -> list[int]:
        import torch
        from tensordict import TensorDict

        out = []
        for w in range(writes):
            ids = torch.arange(first + w * rows, first + (w + 1) * rows)
            out += rb.extend(TensorDict({"x": ids}, [rows])).tolist()
        return out


def main(tmp: str) -> None:
    from rayrb import OfflineToOnlineReplayBuffer

    with local_cluster(workers=2) as (cluster, workers):
        t0 = time.monotonic()
        while sum(n["Alive"] for n in ray.nodes()) < 3 and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        nodes = [w.node_id for w in workers]
        capacity = 4000  # 2000 rows per shard; a shard may run 250 rows ahead of the other
        for attempt in range(3):  # soft affinity is a preference: a node the scheduler has not heard from yet
            rb = OfflineToOnlineReplayBuffer({"x": np.arange(100, dtype=np.int64)}, online_capacity=capacity,
                                             num_online_shards=2, online_nodes=nodes, seed=0,
                                             storage_dir=os.path.join(tmp, "state"), timeout=60)
            m = len(rb.sizes()["offline"])
            placed = ray.get([s.place.remote() for s in rb.rpc.shards[m:]])
            if [p["node"] for p in placed] == nodes:
                break
            rb.shutdown()
            time.sleep(1.0)
        else:
            report({"asked": nodes, "attempts": attempt + 1, "placed": [p["node"] for p in placed]})
            return
        collectors = [Collector.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
                      for n in nodes]
        # unequal rates: the first collector writes twice as many rows
        indices = ray.get([c.write.remote(rb, 10_000 * (i + 1), 10 * (2 - i), 50) for i, c in enumerate(collectors)])
        per_shard = capacity // 2
        result = {"asked": nodes, "attempts": attempt + 1, "placed": [p["node"] for p in placed],
                  "local": [float(np.mean(np.asarray(ix) // per_shard == i)) for i, ix in enumerate(indices)],
                  "sizes": rb.sizes()["online"], "written": rb.write_count,
                  "local_rows": int(sum((np.asarray(ix) // per_shard == i).sum() for i, ix in enumerate(indices)))}
        rb.shutdown()
        report(result)


if __name__ == "__main__":
    main(sys.argv[1])
