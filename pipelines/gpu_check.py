"""GPU check: NCCL Ray Direct Transport and device placement, end to end. Run on a machine with GPUs.

    pip install cupy-cuda12x && python pipelines/gpu_check.py

Prints one JSON line per check with its measurements; exits non-zero if a check fails.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402


def report(name: str, ok: bool, **fields) -> bool:
    print(json.dumps({"check": name, "ok": ok, **fields}), flush=True)
    return ok


@ray.remote(num_gpus=0.25, enable_tensor_transport=True)
class GPULearner:
    def update(self, meta, *parts):
        from rayrb.transport import receive

        td, info = receive(meta, *parts)
        return str(td["obs"].device), int(td.batch_size[0]), float(td["obs"].sum().item()), int(info["offline"].sum())


def main() -> int:
    ok = report("cuda", torch.cuda.is_available(), devices=torch.cuda.device_count(),
                name=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    if not ok:
        return 1
    ray.init(include_dashboard=False, logging_level=logging.WARNING)
    from rayrb import OfflineToOnlineReplayBuffer

    n, dim, B = 200_000, 64, 8192
    data = TensorDict({"obs": torch.randn(n, dim), "id": torch.arange(n)}, [n])
    root = tempfile.mkdtemp()
    failures = 0

    # 1. device placement through the prefetching iterator (pinned memory -> cuda)
    rb = OfflineToOnlineReplayBuffer(data, online_capacity=10_000, batch_size=B, seed=0, dataset_root=f"{root}/a")
    it = rb.iter_batches(prefetch=4, device="cuda")
    next(it)
    t0 = time.perf_counter()
    for _ in range(50):
        batch = next(it)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / 50
    failures += not report("iter_batches(device='cuda')", batch["obs"].is_cuda, batch=B, ms_per_batch=dt * 1e3,
                           rows_per_s=B / dt)
    rb.shutdown()

    # 2. NCCL RDT: shards on GPUs send slices straight to GPU learners
    try:
        rb = OfflineToOnlineReplayBuffer(data, online_capacity=10_000, batch_size=B, seed=0, transport="nccl",
                                         num_offline_shards=2, dataset_root=f"{root}/b")
        rb.extend(TensorDict({"obs": torch.randn(1000, dim), "id": torch.arange(n, n + 1000)}, [1000]))
        learners = [GPULearner.remote() for _ in range(2)]
        t0 = time.perf_counter()
        rb.connect_learners(learners)
        setup = time.perf_counter() - t0
        out = rb.feed("update")
        t0 = time.perf_counter()
        for _ in range(20):
            out = rb.feed("update")
        dt = (time.perf_counter() - t0) / 20
        good = all(o[0].startswith("cuda") for o in out) and sum(o[1] for o in out) == B
        failures += not report("nccl feed", good, group_setup_s=setup, ms_per_global_batch=dt * 1e3,
                               rows_per_s=B / dt, slices=[o[:2] for o in out],
                               offline_rows=sum(o[3] for o in out))
        rb.shutdown()
    except Exception as e:  # report, keep going
        failures += not report("nccl feed", False, error=f"{type(e).__name__}: {e}")
    ray.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
