"""rayrb side by side with TorchRL, in one run: sampling, writing, preprocessing, memory, scaling.

Peers: TorchRL's in-process ``OfflineToOnlineReplayBuffer`` (a ``ReplayBuffer`` +
``LazyTensorStorage`` offline side), TorchRL's ``RayReplayBuffer``, and
``torch.index_select`` gathering the same rows in one process (the machine's limit).
rayrb figures are reported as ratios to the peers measured in the same run,
repeated ``--repeats`` times (median and range).

    python pipelines/benchmark.py                  # full run, a few minutes
    python pipelines/benchmark.py --smoke          # tiny sizes (run by the tests)
    ray job submit --working-dir . -- python pipelines/benchmark.py --data-home /path/to/sklearn_data

The offline table is synthetic and covertype-sized (581,012 x 54 float32 + int64
label): NOT the real covertype rows, which are not available offline.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# The sections live in the package ``bench`` beside this file. `python pipelines/benchmark.py` (a job's too) puts
# this folder first on the driver's path; `rayrb bench` (runpy) and a test loading this file by its path do not.
# Ray's workers never import ``bench``: what it sends them goes pickled by value (see bench/__init__.py).
HERE = Path(__file__).resolve().parent
if not (HERE / "bench" / "__init__.py").is_file():
    sys.exit(f"{__file__} needs the package pipelines/bench/ beside it; run it from a checkout, e.g. as "
             "`ray job submit --working-dir . -- python pipelines/benchmark.py`")
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import ray  # noqa: E402
import torch  # noqa: E402
from bench.call_cost import bench_call_cost  # noqa: E402
from bench.cluster import bench_cluster  # noqa: E402
from bench.cold import COLD, COLD_SMOKE, bench_cold  # noqa: E402
from bench.consumers import bench_consumers  # noqa: E402
from bench.draw_path import bench_draw_path  # noqa: E402
from bench.gpu import bench_gpu  # noqa: E402
from bench.harness import COVERTYPE_ROWS, synthetic_table  # noqa: E402
from bench.headline import bench_headline  # noqa: E402
from bench.preprocess import bench_preprocess  # noqa: E402
from bench.read_ahead import AHEAD, AHEAD_SMOKE, bench_read_ahead  # noqa: E402
from bench.real import bench_real  # noqa: E402
from bench.replicas import bench_on_a_cluster  # noqa: E402
from bench.report import headline_plot, plots, ratios  # noqa: E402
from bench.sampling import bench_sampling  # noqa: E402
from bench.slices import bench_slices  # noqa: E402
from bench.startup import bench_startup  # noqa: E402
from bench.writing import bench_writing  # noqa: E402

REPO = HERE.parent
# In a checkout, results go beside the docs; a copy of pipelines/ alone writes to ./benchmarks.
DEFAULT_OUT = REPO / "benchmarks" if (REPO / "pyproject.toml").is_file() else Path("benchmarks")

SIZES = {
    "full": dict(n_off=COVERTYPE_ROWS, dim=54, n_on=100_000, batch_sizes=[256, 4096, 65536], shards=[1, 2, 4],
                 repeats=3, min_time=1.0, min_iters=5, writer_batches=300, writer_rows=[1, 16, 256, 1024],
                 per_row_frames=20_000,
                 prefetch=16, prefetch_sweep=[1, 4, 8, 16, 32], consumers=[1, 2, 4, 8], consumer_batch=4096,
                 draw_batches=[256, 4096], draw_consumers=4, draw_prefetch=[16, 64], online_shards=2, writers=[1, 4],
                 cluster_nodes=[1, 2], idle_s=3.0, settle_s=1.0, start_delay_s=0.5, headline_consumer_s=8.0),
    # every section and key once, with as few actors as that takes (each is a process start on a small machine)
    "smoke": dict(n_off=4000, dim=8, n_on=1000, batch_sizes=[64, 512], shards=[1], repeats=1, min_time=0.02,
                  min_iters=2, writer_batches=3, writer_rows=[16], per_row_frames=300, prefetch=2,
                  prefetch_sweep=[1, 2], consumers=[1, 2], consumer_batch=64,
                  draw_batches=[64], draw_consumers=1, draw_prefetch=[4], online_shards=1, writers=[1],
                  cluster_nodes=[2], idle_s=0.2, settle_s=0.1, start_delay_s=0.1, headline_consumer_s=0.1,
                  slice_lens=[8], slice_write_steps=[4000]),
}
GPU = dict(n_off=COVERTYPE_ROWS, dim=54, n_on=100_000, batch_sizes=[4096, 65536, 262144], shards=[1, 2, 4],
           repeats=3, seconds=2.0, prefetch=16)
GPU_SMOKE = dict(n_off=20_000, dim=8, n_on=5_000, batch_sizes=[1024], shards=[1], repeats=1, seconds=0.2,
                 prefetch=4)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat (what the tests run)")
    p.add_argument("--data-home", default=os.environ.get("SCIKIT_LEARN_DATA"))
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--sections", default="headline,sampling,draw_path,consumers,real,writing,preprocess,cluster",
                   help="comma-separated; 'call_cost' (Ray's cost per plan call by its shape), 'startup' (seconds and "
                        "CPU to a ready buffer, beside TorchRL's RayReplayBuffer), 'slices' (a slice sampler "
                        "against TorchRL's), 'replicas' (a second copy "
                        "of each online shard, on a cluster of its own), 'rows_in_call' (rows in the call against "
                        "the object store, on a cluster of its own), 'cold' and 'ahead' (an offline dataset "
                        "outside the page cache; 'ahead': a learner's loop with and without read-ahead) and 'gpu' "
                        "(needs CUDA, writes results_gpu.json) are not in the default")
    p.add_argument("--batch-sizes", default=None, help="comma-separated, overrides the mode's")
    p.add_argument("--repeats", type=int, default=None, help="overrides the mode's")
    p.add_argument("--ray-config", default=None, type=json.loads,
                   help='Ray system settings (JSON) for the instance this starts, e.g. '
                        '\'{"max_direct_call_object_size": 1048576}\'; recorded in the results')
    p.add_argument("--gpu-config", default=None, type=json.loads,
                   help='overrides of the gpu section\'s sizes (JSON), e.g. \'{"shards": [1, 2], "repeats": 2}\'')
    p.add_argument("--baseline", default=None,
                   help="a checkout of an older rayrb: the cluster section runs again on it, side by side")
    return p.parse_args(argv)


def config(args: argparse.Namespace) -> dict:
    """The mode's sizes with the command line's overrides: stored in results.json as ``config``."""
    cfg = dict(SIZES["smoke" if args.smoke else "full"])
    cfg["gpu"] = dict(GPU_SMOKE if args.smoke else GPU)
    cfg["cold"] = dict(COLD_SMOKE if args.smoke else COLD)
    cfg["ahead"] = dict(AHEAD_SMOKE if args.smoke else AHEAD)
    if args.gpu_config:
        unknown = set(args.gpu_config) - set(cfg["gpu"])
        if unknown:
            raise ValueError(f"--gpu-config takes keys of {sorted(cfg['gpu'])}; got {sorted(unknown)}")
        cfg["gpu"].update(args.gpu_config)
    if args.batch_sizes:
        cfg["batch_sizes"] = [int(b) for b in args.batch_sizes.split(",")]
    if args.repeats:
        cfg["repeats"] = args.repeats
    return cfg


def start_ray(args: argparse.Namespace) -> None:
    if not ray.is_initialized():
        # a submitted job joins its cluster; run alone, it starts its own instance even if a `ray start` one runs here
        address = os.environ.get("RAY_ADDRESS") or "local"
        if args.ray_config and address != "local":
            raise ValueError(f"--ray-config sets up a Ray instance this starts; got RAY_ADDRESS={address!r}")
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
                 object_store_memory=2 << 30 if address == "local" else None, _system_config=args.ray_config)


def header(args: argparse.Namespace, cfg: dict) -> dict[str, Any]:
    """What results.json says of the run before any figure: the command, the machine, versions, sizes."""
    return {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "mode": "smoke" if args.smoke else "full",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
        "versions": {m: __import__(m).__version__ for m in ("ray", "torch", "tensordict", "torchrl", "numpy")},
        "config": cfg,
        "ray_config": args.ray_config or {},
        "data": f"synthetic covertype-sized table {cfg['n_off']} x {cfg['dim']} float32 + int64 label (NOT real "
                f"covertype); online {cfg['n_on']} rows",
        "not_measured": [],
    }


def run_sections(args: argparse.Namespace, cfg: dict, sections: set[str], out_dir: Path, results: dict) -> None:
    """The sections asked for, in their order: those on this driver's Ray instance, then (that instance shut down)
    those that start clusters of their own."""
    if "gpu" in sections and not torch.cuda.is_available():
        results["not_measured"].append("gpu: torch.cuda.is_available() is False on this machine")
        sections = sections - {"gpu"}
    if not args.data_home:  # the real rows come from the OpenML cache
        sections = sections - {"real"}
    with tempfile.TemporaryDirectory(prefix="rayrb-bench-") as root:
        offline = synthetic_table(cfg["n_off"], cfg["dim"])
        online = synthetic_table(cfg["n_on"], cfg["dim"], seed=1)
        tables = (cfg, offline, online, root, results)
        t0 = time.perf_counter()
        run_steps(sections, {
            "headline": ("headline (default arguments)", lambda: bench_headline(*tables)),
            "sampling": ("sampling", lambda: bench_sampling(*tables)),
            "draw_path": ("draw path", lambda: bench_draw_path(*tables)),
            "call_cost": ("call cost", lambda: bench_call_cost(cfg, results)),
            "startup": ("startup", lambda: bench_startup(cfg, root, results)),
            "consumers": ("consumers", lambda: bench_consumers(*tables)),
            "real": ("real data", lambda: bench_real(cfg, args.data_home, root, results)),
            "writing": ("writing", lambda: bench_writing(cfg, root, results)),
            "preprocess": ("preprocess", lambda: bench_preprocess(cfg, offline, root, results)),
            "slices": ("slices", lambda: bench_slices(cfg, root, results)),
            "cold": ("cold reads", lambda: bench_cold(cfg, root, results)),
            "ahead": ("read ahead", lambda: bench_read_ahead(cfg, root, results)),
            "gpu": ("gpu", lambda: bench_gpu(cfg, root, out_dir, results))})
        ray.shutdown()
        run_steps(sections, {"cluster": ("cluster", lambda: bench_cluster(cfg, results, args.baseline)),
                             "replicas": ("replicas", lambda: bench_on_a_cluster("replicas", args.smoke, results)),
                             "rows_in_call": ("rows in the call",
                                              lambda: bench_on_a_cluster("rows_in_call", args.smoke, results))})
        results["seconds"] = time.perf_counter() - t0


def run_steps(sections: set[str], steps: dict[str, tuple[str, Callable[[], None]]]) -> None:
    """Each step whose section is asked for, in the order of ``steps``, announced as it starts."""
    for name, (label, step) in steps.items():
        if name in sections:
            print(f"{label}...", flush=True)
            step()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = config(args)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    start_ray(args)
    results = header(args, cfg)
    run_sections(args, cfg, set(args.sections.split(",")), out_dir, results)
    results["ratios"] = ratios(results)
    results["plots"] = plots(results, out_dir) if not args.smoke else []
    if "headline" in results and not args.smoke:
        results["plots"] += headline_plot(results, out_dir)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=float))
    print(json.dumps(results["ratios"], indent=1))
    return results


if __name__ == "__main__":
    main()
