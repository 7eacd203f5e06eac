"""A small job end to end, as a user runs it, with Ray relaying every actor's output (``log_to_driver=True``):
a buffer on every kind of actor, writes, sampling, an iterator, restarts of the coordinator and a shard, a
checkpoint, a preprocess map. ``tests/test_console.py`` runs it and reads what it printed."""
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch
from tensordict import TensorDict

from rayrb import OfflineToOnlineReplayBuffer, preprocess


def rows(start: int, n: int) -> TensorDict:
    ids = torch.arange(start, start + n)
    return TensorDict({"obs": ids.float()[:, None].expand(n, 3).contiguous(), "id": ids}, [n])


def kill_and_wait(actor) -> None:
    before = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    ray.kill(actor, no_restart=False)
    while True:
        try:
            if ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=10) != before:
                return
        except Exception:
            time.sleep(0.05)


def main(root: Path) -> None:
    ray.init(address="local", num_cpus=2, object_store_memory=256 << 20, include_dashboard=False, log_to_driver=True,
             logging_level=logging.WARNING)
    rb = OfflineToOnlineReplayBuffer(rows(0, 400), online_capacity=200, num_offline_shards=2, num_online_shards=2,
                                     batch_size=16, seed=0, dataset_root=root / "ds", storage_dir=root / "state")
    rb.extend(rows(1000, 50))
    for _ in range(5):
        rb.sample()
    kill_and_wait(rb.rpc.coord)
    kill_and_wait(rb.rpc.by_side["online"][0])
    kill_and_wait(rb.rpc.by_side["offline"][1])
    rb.extend(rows(2000, 50))
    assert sum(len(b) for b in rb.iter_batches(prefetch=8, num_batches=10)) == 160
    rb.dumps(root / "ckpt")
    rb.loads(root / "ckpt")
    out = preprocess(rb.dataset_root, lambda td: td.set("obs", td["obs"] * 2), root / "doubled", batched=True)
    assert len(out) == 400
    rb.shutdown()
    time.sleep(1.5)  # let Ray relay what the actors printed last
    ray.shutdown()
    print("RAYRB_JOB_DONE", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()))
