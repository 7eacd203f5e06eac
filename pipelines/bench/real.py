"""Section ``real`` (runs with ``--data-home``): rayrb and TorchRL's in-process buffer over real rows, OpenML's
shuttle, at one batch size."""
from __future__ import annotations

from bench.harness import measure, med_range, one_batch_size, torchrl_o2o


def bench_real(cfg: dict, data_home: str, root: str, results: dict) -> None:
    from rayrb import OfflineToOnlineReplayBuffer, load_dataset

    ds = load_dataset("openml:shuttle", data_home=data_home, root=root)
    offline = ds.to_tensordict()
    online = offline[: min(len(offline), cfg["n_on"])].clone()
    o2o = torchrl_o2o(offline, online)
    rb = OfflineToOnlineReplayBuffer(ds, online_capacity=len(online), num_offline_shards=2, seed=0)
    rb.extend(online)
    B = one_batch_size(cfg)
    runs = {"torchrl_o2o": [], "rayrb_2shard_prefetch": []}
    for _ in range(cfg["repeats"]):
        runs["torchrl_o2o"].append(measure(cfg, lambda: o2o.sample(B), B))
        it = rb.iter_batches(B, prefetch=cfg["prefetch"])
        runs["rayrb_2shard_prefetch"].append(measure(cfg, lambda: next(it), B))
    results["sampling_real"] = {"dataset": "openml:shuttle (real, 58,000 x 9)", "batch_size": B,
                                **{k: {"rows_per_s": med_range([r["rows_per_s"] for r in v])} for k, v in runs.items()}}
    rb.shutdown()
