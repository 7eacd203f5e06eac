"""Run in a subprocess: a 2-node ray.cluster_utils.Cluster preprocesses a dataset; prints the manifest's nodes."""
import os
import sys

import numpy as np
import ray
from cluster_util import local_cluster, report


def slow_double(td):
    import time

    time.sleep(0.3)  # long enough that both nodes get chunks
    td["x"] = td["x"] * 2
    return td


def main(tmp: str) -> None:
    from rayrb import OfflineToOnlineReplayBuffer, preprocess, write_dataset

    with local_cluster(workers=1):
        src = write_dataset({"x": np.arange(80, dtype=np.float32)}, os.path.join(tmp, "src"), chunk_rows=10)
        out = preprocess(src, slow_double, os.path.join(tmp, "out"), batched=True, num_workers=2, chunk_rows=10,
                         pbar=False)
        nodes = [c.node for c in out.chunks]
        ok = bool(np.array_equal(out.read()["x"], np.arange(80, dtype=np.float32) * 2))
        # offline shards prefer the node that wrote their rows
        rb = OfflineToOnlineReplayBuffer(out, online_capacity=10, num_offline_shards=2, seed=0)
        batch = rb.sample(16)
        rb.shutdown()
        alive = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        result = {"nodes": nodes, "alive": alive, "values_ok": ok, "sampled": int(batch.batch_size[0])}
        report(result)


if __name__ == "__main__":
    main(sys.argv[1])
