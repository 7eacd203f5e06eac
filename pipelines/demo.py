"""The main job: prepare an OpenML dataset on Ray, serve it with an online buffer, sample.

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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="openml:shuttle")
    p.add_argument("--data-home", default=os.environ.get("SCIKIT_LEARN_DATA"),
                   help="scikit-learn data home holding the OpenML cache (offline copy)")
    p.add_argument("--root", default=None, help="where prepared datasets are written (default ~/.cache/rayrb)")
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args(argv)

    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=True,
             logging_level=logging.WARNING)

    @ray.remote(num_cpus=1)
    def prepare(dataset: str, data_home: str | None, root: str | None) -> str:
        from rayrb import load_dataset

        kw = {"data_home": data_home, "root": root} if dataset.startswith("openml:") else {}
        return str(load_dataset(dataset, **kw).root)

    t0 = time.perf_counter()
    data_home = os.path.abspath(args.data_home) if args.data_home else None
    root = ray.get(prepare.remote(args.dataset, data_home, args.root))
    print(f"prepared {args.dataset} at {root} in {time.perf_counter() - t0:.1f}s")

    import numpy as np

    from rayrb import ChunkDataset
    from rayrb.transport import from_numpy_dict

    ds = ChunkDataset.open(root, verify=True)
    print(ds)
    idx = np.random.default_rng(0).integers(0, len(ds), args.batch_size)
    print(from_numpy_dict(ds.gather(idx)))
    ray.shutdown()


if __name__ == "__main__":
    main()
