"""Section ``cold``: uniform random batches from an offline dataset larger than memory, the page cache dropped before
each measurement, rayrb's gather (``ChunkDataset.gather``, which shards and local reads use) against the disk's
limits measured in the same run, the same gather with its reads made by threads instead of io_uring
(``rayrb_threads``: where the kernel refuses io_uring, and rayrb's gather before it), TorchRL's
``LazyMemmapStorage`` on the same file and the plain ``np.take`` out of the map (``reads="map"``, rayrb's gather
before cold reads); then the same with a range of rows in the page cache.

The dataset is one chunk of one float32 key, written once; a second manifest views the same bytes (a hard link to the
file) with larger rows. Each measurement runs in a process of its own (this file, run as a script), started before
the cache is dropped, and reports its private memory (``/proc/self/smaps_rollup``) before and after.
Dropping the whole page cache needs root (``drop_caches``); without it, and in smoke mode, only the dataset's file
is evicted (``POSIX_FADV_DONTNEED``).
"""
from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

COLD = dict(gib=36.0, row_bytes=[256, 28672], batches=[256, 4096], seconds=4.0, warm_mib=1024, drop_caches=True,
            disk_depth=32, seq_depth=8, deep_depth=256)
COLD_SMOKE = dict(gib=0.01, row_bytes=[256, 28672], batches=[256], seconds=0.05, warm_mib=2, drop_caches=False,
                  disk_depth=4, seq_depth=2, deep_depth=8)
PEERS = ("rayrb", "rayrb_threads", "take", "torchrl_1_threads", "torchrl_2_threads")
REPO = Path(__file__).resolve().parents[2]


def build(root: Path, gib: float, row_sizes: list[int]) -> dict[int, Path]:
    """One chunk of random float32 rows, ``gib`` GiB, viewed with each row size (one dataset each, hard-linked)."""
    from rayrb.core.schema import RowSpec
    from rayrb.io.chunks import ChunkInfo, ContentHash, write_manifest
    from rayrb.io.files import pwrite_all

    unit = int(np.lcm.reduce(row_sizes))
    total = int(gib * 2**30) // unit * unit
    specs = {rb: RowSpec.from_arrays({"obs": np.zeros((1, rb // 4), np.float32)}) for rb in row_sizes}
    roots = {rb: root / f"rows{rb}" for rb in row_sizes}
    hashes = {rb: ContentHash() for rb in row_sizes}
    for rb, h in hashes.items():
        (roots[rb] / "chunk-00000").mkdir(parents=True)
        h.header("obs", np.dtype(np.float32), (total // rb, rb // 4))
    first = roots[row_sizes[0]] / "chunk-00000" / "obs.memmap"
    fd = os.open(first, os.O_WRONLY | os.O_CREAT, 0o644)
    rng, block = np.random.default_rng(0), 64 << 20
    try:
        for at in range(0, total, block):
            data = rng.random(min(block, total - at) // 4, dtype=np.float32).view(np.uint8)
            pwrite_all(fd, data, at)
            for h in hashes.values():
                h.update(data)
            if at % (1 << 30) == 0:  # written out and evicted as it goes: no build-up of dirty pages
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, at, os.POSIX_FADV_DONTNEED)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    for rb in row_sizes:
        if rb != row_sizes[0]:
            os.link(first, roots[rb] / "chunk-00000" / "obs.memmap")
        write_manifest(roots[rb], specs[rb], [ChunkInfo("chunk-00000", total // rb, hashes[rb].hexdigest())],
                       source="synthetic uniform float32 (NOT real data)")
    return roots


def private_mib() -> dict[str, float]:
    """This process's private memory (``smaps_rollup``): file pages it alone maps, and its dirty/anonymous pages."""
    got = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("Rss", "Private_Clean", "Private_Dirty", "Anonymous"):
            got[name.lower()] = int(rest.split()[0]) / 1024
    got["private"] = got["private_clean"] + got["private_dirty"]
    return got


def evict(path: str, drop_caches: bool) -> None:
    """The dataset's file out of the page cache (and, as root with ``drop_caches``, every clean page)."""
    os.sync()
    if drop_caches and os.geteuid() == 0:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def sampler(p: dict):
    """The measured call for peer ``p["peer"]``: one batch of ``p["batch"]`` uniform rows in ``[0, p["rows"])``."""
    rng = np.random.default_rng(p.get("seed", 0))
    if p["peer"] in ("rayrb", "rayrb_threads", "take"):
        from rayrb.io import gather
        from rayrb.io.chunks import ChunkDataset

        ds = ChunkDataset.open(p["root"])
        ds.reads = "map" if p["peer"] == "take" else "auto"
        gather.USE_RING = p["peer"] == "rayrb"
        return lambda: ds.gather(rng.integers(0, p["rows"], p["batch"]), checked=False)
    import torch
    from tensordict import MemoryMappedTensor, TensorDict
    from torchrl.data import LazyMemmapStorage, RandomSampler, ReplayBuffer

    torch.set_num_threads(int(p["peer"].split("_")[1]))
    n = p["rows"]
    storage = LazyMemmapStorage(n, auto_cleanup=False)  # the file is the dataset's: never removed at exit
    storage._storage = TensorDict({"obs": MemoryMappedTensor.from_filename(
        p["file"], dtype=torch.float32, shape=torch.Size([p["all_rows"], p["row_bytes"] // 4]))[:n]}, [n])
    storage.initialized, storage._len = True, n  # the file as the storage's (nothing written)
    rb = ReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=p["batch"])
    return rb.sample


def probe(p: dict) -> dict:
    """One measurement in this process: the sampler built, the cache dropped (cold), batches for ``seconds``."""
    if p["peer"] == "disk_random":
        return disk(p, random=True)
    if p["peer"] == "disk_random_rows":
        return disk(dict(p, disk_depth=p.get("depth", p["disk_depth"])), random=True, block=max(p["row_bytes"]))
    if p["peer"] == "disk_sequential":
        return disk(p, random=False)
    fn = sampler(p)
    before = private_mib()
    if p["cold"]:
        evict(p["file"], p["drop_caches"])
    fn()  # code and libraries paged in again (a batch's rows are a negligible part of the file)
    lat, start = [], time.perf_counter()
    while len(lat) < 2 or time.perf_counter() - start < p["seconds"]:
        t0 = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t0)
    return {"rows_per_s": p["batch"] * len(lat) / sum(lat), "batches": len(lat),
            "p50_ms": float(np.median(lat) * 1e3), "private_mib_before": before, "private_mib_after": private_mib()}


def disk(p: dict, random: bool, block: int = 4096) -> dict:
    """The disk's limit, ``O_DIRECT`` (no page cache): ``block``-byte reads at random aligned offsets, ``disk_depth``
    in flight (reads/s), or 1 MiB reads in order, ``seq_depth`` in flight (bytes/s). Through io_uring where the
    kernel allows it (the depth held all along, no GIL per read: the disk's figure, not Python's), else threads."""
    from rayrb.io import uring

    size, depth = os.path.getsize(p["file"]), p["disk_depth" if random else "seq_depth"]
    block = block if random else 1 << 20
    fd = os.open(p["file"], os.O_RDONLY | os.O_DIRECT)
    stop = time.perf_counter() + p["seconds"]
    rng = np.random.default_rng(1)
    nxt = int(rng.integers(0, max(1, size // 2 // block))) * block
    t0, done = time.perf_counter(), 0
    if uring.available():
        ring, buf = uring.Ring(entries=depth), mmap.mmap(-1, block * depth)  # page-aligned, as O_DIRECT needs
        iov = np.empty((depth, 2), np.uint64)
        iov[:, 0] = np.frombuffer(buf, np.uint8).ctypes.data + np.arange(depth, dtype=np.uint64) * block
        iov[:, 1] = block
        n = depth * 16  # requests a call: the ring keeps ``depth`` in flight, refilling as each completes
        slot = np.arange(n) % depth
        addrs = (iov.ctypes.data + 16 * slot).astype(np.uint64)
        while time.perf_counter() < stop:
            if random:
                at = rng.integers(0, size // block, n) * block
            else:
                at = (nxt + np.arange(n, dtype=np.int64) * block) % (size // block * block)
                nxt = int(at[-1]) + block
            got = ring.read(np.full(n, fd, np.int32), at.astype(np.uint64), addrs, np.ones(n, np.uint32))
            done += int(got[got > 0].sum())
        ring.close()
        engine = "io_uring"
    else:
        counts, lock = [0] * depth, threading.Lock()
        cursor = [nxt]

        def run(t: int) -> None:
            buf, trng = mmap.mmap(-1, block), np.random.default_rng(100 + t)  # page-aligned, as O_DIRECT needs
            while time.perf_counter() < stop:
                if random:
                    at = int(trng.integers(0, size // block)) * block
                else:
                    with lock:
                        at, cursor[0] = cursor[0], (cursor[0] + block) % (size // block * block)
                counts[t] += os.preadv(fd, [buf], at)

        workers = [threading.Thread(target=run, args=(t,)) for t in range(depth)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        done, engine = sum(counts), "threads"
    took = time.perf_counter() - t0
    os.close(fd)
    return {"reads_per_s": done / block / took, "mib_per_s": done / 2**20 / took, "depth": depth,
            "block_bytes": block, "engine": engine}


def run_probe(p: dict) -> dict:
    """``probe(p)`` in a process of its own (a fresh interpreter: its memory and torch threads are its own)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__, json.dumps(p)], capture_output=True, text=True, timeout=900,
                          env=env)
    if done.returncode != 0:
        raise RuntimeError(f"cold probe {p['peer']} failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def warm_up(path: str, nbytes: int) -> None:
    """The first ``nbytes`` of the file into the page cache."""
    fd = os.open(path, os.O_RDONLY)
    for at in range(0, nbytes, 16 << 20):
        os.pread(fd, min(16 << 20, nbytes - at), at)
    os.close(fd)


def measure(c: dict, roots: dict[int, Path], cold: bool) -> dict:
    """Rows/s of each peer at each row size and batch size, cold (cache dropped) or warm (the first ``warm_mib``
    MiB in the page cache, rows drawn there)."""
    out = {}
    for rb, root in roots.items():
        file = str(root / "chunk-00000" / "obs.memmap")
        all_rows = os.path.getsize(file) // rb
        rows = all_rows if cold else max(1, min(all_rows, (c["warm_mib"] << 20) // rb))
        for batch in c["batches"]:
            row = {}
            for peer in PEERS:
                row[peer] = run_probe(dict(c, peer=peer, root=str(root), file=file, row_bytes=rb, rows=rows,
                                           all_rows=all_rows, batch=batch, cold=cold))
                print(f"  {'cold' if cold else 'warm'} {rb} B rows, B={batch}, {peer}: "
                      f"{row[peer]['rows_per_s']:,.0f} rows/s", flush=True)
            row["torchrl_best"] = max(row["torchrl_1_threads"]["rows_per_s"], row["torchrl_2_threads"]["rows_per_s"])
            row["rayrb_vs_torchrl"] = row["rayrb"]["rows_per_s"] / row["torchrl_best"]
            row["rayrb_vs_take"] = row["rayrb"]["rows_per_s"] / row["take"]["rows_per_s"]
            row["rayrb_vs_threads"] = row["rayrb"]["rows_per_s"] / row["rayrb_threads"]["rows_per_s"]
            out[f"{rb}/{batch}"] = row
    return out


def built_with_limits(c: dict, root: Path) -> tuple[dict[int, Path], str, float, dict[str, dict]]:
    """A section's dataset built under ``root`` (``build``: its views by row size), its file, the seconds the build
    took, and the disk's limits measured on that file: ``random_4k`` (reads/s), ``sequential`` (MiB/s) and
    ``random_rows`` (random reads of the largest row size: what uniform rows of that size can get at best),
    with ``disk_depth`` reads in flight and (``random_rows_deep``) with ``deep_depth``, as many as rayrb's ring."""
    t0 = time.perf_counter()
    roots = build(root, c["gib"], c["row_bytes"])
    built_s = time.perf_counter() - t0
    file = str(roots[c["row_bytes"][0]] / "chunk-00000" / "obs.memmap")
    print(f"  built {os.path.getsize(file) / 2**30:.1f} GiB in {built_s:.0f} s", flush=True)
    base = dict(c, file=file)
    limits = {"random_4k": run_probe(dict(base, peer="disk_random")),
              "sequential": run_probe(dict(base, peer="disk_sequential")),
              "random_rows": run_probe(dict(base, peer="disk_random_rows")),
              "random_rows_deep": run_probe(dict(base, peer="disk_random_rows", depth=c["deep_depth"]))}
    print(f"  disk: {limits['random_4k']['reads_per_s']:,.0f} random 4 KiB reads/s, "
          f"{limits['sequential']['mib_per_s']:,.0f} MiB/s in order, random reads of "
          f"{limits['random_rows']['block_bytes']:,} bytes: {limits['random_rows']['mib_per_s']:,.0f} MiB/s "
          f"({c['disk_depth']} in flight), {limits['random_rows_deep']['mib_per_s']:,.0f} MiB/s "
          f"({c['deep_depth']} in flight)", flush=True)
    return roots, file, built_s, limits


def bench_cold(cfg: dict, root: str, results: dict) -> None:
    c = cfg["cold"]
    roots, file, built_s, limits = built_with_limits(c, Path(root) / "cold")
    cold = measure(c, roots, cold=True)
    warm_up(file, c["warm_mib"] << 20)
    warm = measure(c, roots, cold=False)
    small, large = min(c["row_bytes"]), max(c["row_bytes"])
    for key, row in cold.items():
        rb = int(key.split("/")[0])
        row["rayrb_vs_disk_random_reads"] = row["rayrb"]["rows_per_s"] / limits["random_4k"]["reads_per_s"]
        row["rayrb_vs_disk_sequential_bytes"] = row["rayrb"]["rows_per_s"] * rb / 2**20 / limits["sequential"][
            "mib_per_s"]
        if rb == limits["random_rows"]["block_bytes"]:
            row["rayrb_vs_disk_random_row_reads"] = row["rayrb"]["rows_per_s"] / max(
                limits["random_rows"]["reads_per_s"], limits["random_rows_deep"]["reads_per_s"])
    results["cold"] = {
        "dataset_bytes": os.path.getsize(file), "build_s": built_s, "limits": limits, "cold": cold, "warm": warm,
        "row_sizes": {"small": small, "large": large}, "machine_mem_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf(
            "SC_PHYS_PAGES") / 2**30, "page_cache_dropped": bool(c["drop_caches"] and os.geteuid() == 0),
        "data": f"one chunk of synthetic uniform float32 rows (NOT real data), the same bytes viewed as rows of "
                f"{c['row_bytes']} bytes; warm: rows drawn from the first {c['warm_mib']} MiB, in the page cache"}


if __name__ == "__main__":
    print(json.dumps(probe(json.loads(sys.argv[1]))))
