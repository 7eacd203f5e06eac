"""Section ``ahead``: a learner's ``sample()`` loop over an offline dataset outside the page cache, with the rows of
the batches planned next read ahead (``rayrb.io.read_ahead``) and without, side by side in one run.

The learner is this driver: it samples a buffer built over a chunk dataset (``offline_fraction=1.0``: every row
offline, gathered here from the shard's files, as a learner on the shard's node does) and then "trains" for
``compute_ms`` (a sleep: a GPU step leaves the CPU free), for ``seconds``. The page cache is dropped before each
measurement and each uses its own seed, so its rows are cold. Hints off: ``rayrb.io.read_ahead.MAX_PENDING = 0``
in this process (every hint dropped, the loop otherwise unchanged). Reported per row size, batch size and
compute time: rows/s, the learner's wait in ``sample()`` per batch (p50), and the disk's limits measured in the same
run (``bench.cold``: 4 KiB random reads from 32 threads, 1 MiB reads in order).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

AHEAD = dict(gib=8.0, row_bytes=[256, 28672], batches=[256, 4096], compute_ms=[0, 20], seconds=4.0,
             drop_caches=True, disk_depth=32, seq_depth=8, deep_depth=256)
AHEAD_SMOKE = dict(gib=0.01, row_bytes=[256], batches=[64], compute_ms=[0, 2], seconds=0.3, drop_caches=False,
                   disk_depth=4, seq_depth=2, deep_depth=8)


def loop(root: Path, batch: int, compute_ms: float, seconds: float, seed: int, hints: bool, c: dict) -> dict:
    """One learner loop: rows/s and the wait in ``sample()`` per batch, cold, hints on or off."""
    from bench.cold import evict
    from rayrb import OfflineToOnlineReplayBuffer
    from rayrb.io import read_ahead

    file = str(root / "chunk-00000" / "obs.memmap")
    rb = OfflineToOnlineReplayBuffer(str(root), online_capacity=batch, offline_fraction=1.0, batch_size=batch,
                                     seed=seed)
    pending = read_ahead.MAX_PENDING
    try:
        read_ahead.MAX_PENDING = pending if hints else 0
        evict(file, c["drop_caches"])
        waits, rows = [], 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            t = time.perf_counter()
            rows += len(rb.sample())
            waits.append(time.perf_counter() - t)
            if compute_ms:
                time.sleep(compute_ms / 1000)
        elapsed = time.perf_counter() - t0
        local = rb.local_reads
        return {"rows_per_s": rows / elapsed, "batches": len(waits), "wait_p50_ms": 1000 * float(np.median(waits)),
                "wait_mean_ms": 1000 * float(np.mean(waits)),
                "local_reads": None if local is None else dict(local.stats)}
    finally:
        read_ahead.MAX_PENDING = pending
        rb.shutdown()


def bench_read_ahead(cfg: dict, root: str, results: dict) -> None:
    from bench.cold import built_with_limits

    c = cfg["ahead"]
    roots, file, built_s, limits = built_with_limits(c, Path(root) / "ahead")
    limit, sequential = limits["random_4k"], limits["sequential"]
    out, seed = {}, 0
    for rb_bytes, ds_root in roots.items():
        for batch in c["batches"]:
            for compute_ms in c["compute_ms"]:
                row = {}
                for hints in (False, True):
                    seed += 1
                    row["on" if hints else "off"] = loop(ds_root, batch, compute_ms, c["seconds"], seed, hints, c)
                row["on_vs_off"] = row["on"]["rows_per_s"] / row["off"]["rows_per_s"]
                row["on_vs_disk_random_reads"] = row["on"]["rows_per_s"] / limit["reads_per_s"]
                row["on_vs_disk_sequential_bytes"] = row["on"]["rows_per_s"] * rb_bytes / 2**20 / sequential[
                    "mib_per_s"]
                print(f"  {rb_bytes} B rows, B={batch}, compute {compute_ms} ms: off {row['off']['rows_per_s']:,.0f} "
                      f"rows/s (wait p50 {row['off']['wait_p50_ms']:.1f} ms), on {row['on']['rows_per_s']:,.0f} "
                      f"(wait p50 {row['on']['wait_p50_ms']:.1f} ms): {row['on_vs_off']:.2f}x", flush=True)
                out[f"{rb_bytes}/{batch}/{compute_ms}"] = row
    results["ahead"] = {
        "dataset_bytes": os.path.getsize(file), "build_s": built_s, "disk_random_4k": limit,
        "disk_sequential": sequential, "loops": out,
        "page_cache_dropped": bool(c["drop_caches"] and os.geteuid() == 0),
        "data": f"one chunk of synthetic uniform float32 rows (NOT real data) viewed as rows of {c['row_bytes']} "
                "bytes; a buffer over it with offline_fraction=1.0, sampled by this driver (local reads)"}
