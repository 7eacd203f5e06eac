"""The main job: prepare an OpenML dataset on Ray, serve it with a sharded online buffer, train on it.

1. A Ray task prepares the dataset (TorchRL's recipe) as a chunk dataset.
2. An OfflineToOnlineReplayBuffer maps it over offline shard actors; collector
   actors stream new rows (here: noisy copies of dataset rows, labelled as such)
   into online shard actors through the picklable handle.
3. The driver trains a softmax classifier on batches whose offline share is
   annealed from 1.0 to 0.25, and checks every batch's split through provenance.

    python pipelines/demo.py --dataset openml:shuttle --data-home ../shared/data
    ray job submit --working-dir . -- python pipelines/demo.py --data-home /path/to/sklearn_data
"""
from __future__ import annotations

import argparse
import logging
import os
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402


@ray.remote(num_cpus=0)
class Collector:
    """Stands in for an environment worker: writes rows through the buffer handle."""

    def __init__(self, rb, root: str, seed: int):
        import numpy as np

        from rayrb import ChunkDataset

        self.rb, self.ds, self.rng = rb, ChunkDataset.open(root), np.random.default_rng(seed)

    def collect(self, steps: int, rows: int) -> int:

        for _ in range(steps):
            batch = self.ds.gather(self.rng.integers(0, len(self.ds), rows))
            batch["X"] = (batch["X"] + 0.05 * self.rng.standard_normal(batch["X"].shape)).astype(batch["X"].dtype)
            self.rb.extend(batch)
        return steps * rows


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="openml:shuttle")
    p.add_argument("--data-home", default=os.environ.get("SCIKIT_LEARN_DATA"),
                   help="scikit-learn data home holding the OpenML cache (offline copy)")
    p.add_argument("--root", default=None, help="where prepared datasets are written (default ~/.cache/rayrb)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--offline-shards", type=int, default=2)
    p.add_argument("--online-shards", type=int, default=2)
    p.add_argument("--collectors", type=int, default=2)
    return p.parse_args(argv)


def train(rb, ds, args: argparse.Namespace) -> tuple[dict[str, int], float]:
    """Softmax regression on ``rb``'s batches, the offline fraction annealed to 0.25; every batch's split checked."""
    import torch

    from rayrb.core.allocation import offline_count

    n_classes = int(ds.read()["y"].max()) + 1
    model = torch.nn.Linear(ds.spec["X"].shape[0], n_classes)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    counts = {"offline": 0, "online": 0}
    t0 = time.perf_counter()
    for step in range(args.steps):
        rb.anneal(step, args.steps)  # 1.0 -> 0 linearly; floored at 0.25 below
        if rb.offline_fraction < 0.25:
            rb.offline_fraction = 0.25
        f = rb.offline_fraction
        batch, info = rb.sample(return_info=True)
        n_off = int(info["offline"].sum())
        assert n_off == offline_count(args.batch_size, f), (n_off, f)  # exact, every batch
        counts["offline"] += n_off
        counts["online"] += args.batch_size - n_off
        loss = torch.nn.functional.cross_entropy(model(batch["X"]), batch["y"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % max(1, args.steps // 5) == 0 or step == args.steps - 1:
            acc = (model(batch["X"]).argmax(-1) == batch["y"]).float().mean().item()
            print(f"step {step:4d}  offline_fraction {f:.3f}  offline/online rows {n_off}/{args.batch_size - n_off}"
                  f"  loss {loss.item():.4f}  batch acc {acc:.3f}")
    return counts, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    # a submitted job joins its cluster; run alone, it starts its own instance even if a `ray start` one runs here
    ray.init(address=os.environ.get("RAY_ADDRESS") or "local", include_dashboard=False, logging_level=logging.WARNING)

    @ray.remote(num_cpus=1)
    def prepare(dataset: str, data_home: str | None, root: str | None) -> str:
        from rayrb import load_dataset

        kw = {"data_home": data_home, "root": root} if dataset.startswith("openml:") else {}
        return str(load_dataset(dataset, **kw).root)

    from rayrb import ChunkDataset, OfflineToOnlineReplayBuffer

    t0 = time.perf_counter()
    data_home = os.path.abspath(args.data_home) if args.data_home else None
    root = ray.get(prepare.remote(args.dataset, data_home, args.root))
    ds = ChunkDataset.open(root, verify=True)
    print(f"prepared {args.dataset} in {time.perf_counter() - t0:.1f}s: {ds}")

    rb = OfflineToOnlineReplayBuffer(root, online_capacity=20_000, offline_fraction=1.0, batch_size=args.batch_size,
                                     num_offline_shards=args.offline_shards, num_online_shards=args.online_shards,
                                     seed=0)
    collectors = [Collector.remote(rb, root, seed) for seed in range(args.collectors)]
    warmup = sum(ray.get([c.collect.remote(1, 256) for c in collectors]))  # online side non-empty from step 0
    pending = [c.collect.remote(args.steps // 4, 64) for c in collectors]

    counts, elapsed = train(rb, ds, args)
    written = warmup + sum(ray.get(pending))
    print(f"trained {args.steps} steps in {elapsed:.1f}s ({args.steps * args.batch_size / elapsed:,.0f} rows/s)"
          f"; provenance totals {counts}; collectors wrote {written} rows; buffer holds {len(rb)} rows")
    print("sample batch:", rb.sample(4))
    stats = rb.stats()["coordinator"]
    print(f"coordinator: {stats['batches']} batches, plan p50 {stats['plan_ms_p50']:.2f} ms, sizes "
          f"offline {stats['offline']} online {stats['online']}")
    rb.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
