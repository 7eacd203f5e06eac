"""Section ``preprocess``: rows/s of ``rayrb.preprocess`` (batched and per row) against TorchRL's ``preprocess``
with the same function and 2 workers, the workers' cold start on its own, and a check that both wrote the same."""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from tensordict import TensorDict

from bench.harness import med_range


def standardize(td: TensorDict) -> TensorDict:
    """The preprocessing function for both libraries: works on a row or a chunk."""
    td["X"] = (td["X"] - 0.5) / 2.0
    td["norm"] = td["X"].pow(2).sum(-1)
    return td


def bench_preprocess(cfg: dict, offline: TensorDict, root: str, results: dict) -> None:
    from torchrl.data.datasets.common import BaseDatasetExperienceReplay
    from torchrl.data.replay_buffers import TensorStorage

    from rayrb import preprocess, write_dataset

    src = write_dataset(offline, Path(root) / "pp_src", overwrite=True)
    mm = offline.memmap(Path(root) / "pp_trl_src")
    runs = {"rayrb_batched": [], "torchrl": [], "rayrb_per_row": []}
    workers_rss = []
    # Start the workers (imports of torch and tensordict) once, and report that cost on its own.
    t0 = time.perf_counter()
    preprocess(src, standardize, Path(tempfile.mkdtemp(dir=root)) / "warm", batched=True, num_workers=2,
               num_frames=min(len(offline), 2000), chunk_rows=500, pbar=False)
    results["preprocess_cold_start_s"] = time.perf_counter() - t0
    for rep in range(cfg["repeats"]):
        d = Path(tempfile.mkdtemp(dir=root))
        t0 = time.perf_counter()
        out = preprocess(src, standardize, d / "batched", batched=True, num_workers=2, pbar=False)
        runs["rayrb_batched"].append(len(out) / (time.perf_counter() - t0))
        workers_rss.append(max(c.extra.get("worker_rss_bytes", 0) for c in out.chunks))
        # TorchRL's preprocess runs on any TensorStorage-backed dataset object: drive it directly.
        trl = BaseDatasetExperienceReplay.__new__(BaseDatasetExperienceReplay)
        trl._storage = TensorStorage(mm)
        t0 = time.perf_counter()
        ref = trl.preprocess(standardize, num_workers=2, dest=d / "trl", mp_start_method="fork")
        runs["torchrl"].append(len(ref) / (time.perf_counter() - t0))
        n = cfg["per_row_frames"]
        t0 = time.perf_counter()
        preprocess(src, standardize, d / "rows", num_workers=2, num_frames=n, pbar=False)
        runs["rayrb_per_row"].append(n / (time.perf_counter() - t0))
        if rep == 0:
            a, b = out.read(), ref._storage
            results.setdefault("checks", {})["preprocess_equal_to_torchrl"] = bool(
                np.allclose(a["X"], b["X"].numpy()) and np.allclose(a["norm"], b["norm"].numpy()))
        print(f"  preprocess rep {rep}: " + ", ".join(f"{k} {v[-1]:,.0f} rows/s" for k, v in runs.items()), flush=True)
        # Both libraries' outputs go before the next rep, so that no rep writes behind an earlier one's dirty pages.
        del out, ref, trl
        shutil.rmtree(d, ignore_errors=True)
    results["preprocess"] = {k: {"rows_per_s": med_range(v)} for k, v in runs.items()}
    results["preprocess"]["rows"] = len(offline)
    results["preprocess"]["peak_worker_rss_bytes"] = max(workers_rss)
