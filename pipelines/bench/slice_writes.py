"""Part of section ``slices``: what a write costs a shard that draws slices while its episodes grow. One online
shard's own work, in one process and without Ray (what the shard actor does per call): write 16 steps, then draw
8 slices of 32 steps and copy them out, over a full circular shard of ``N`` steps in episodes of 20 to 400 steps,
against TorchRL's in-process ``ReplayBuffer(LazyTensorStorage(N), SliceSampler(slice_len=32))`` doing the same
``extend`` and ``sample`` (its sampler finds the trajectories again at each ``sample``; ``cache_values`` is for
storages that do not change). ``rayrb_rescan`` is rayrb's shard with its episodes found again over every step at
each write, as before they were kept write by write. ``--buffer``: the same through a buffer on a local Ray
(``buffer_writes``)."""
from __future__ import annotations

import time

import numpy as np
import torch
from tensordict import TensorDict

from bench.harness import measure, med_ranges, medians_text
from bench.headline import at_threads

WRITE, SLICE_LEN, SLICES = 16, 32, 8


class Shard:
    """An online shard's slots as ``OnlineShard`` writes them (row ``w`` at slot ``w mod N``, generation
    ``w // N + 1``), with its slice sampler told each write."""

    def __init__(self, n: int, dim: int, kind: str, rescan: bool):
        from rayrb.core.samplers import make_sampler

        self.n, self.w, self.rescan = n, 0, rescan
        self.x = np.zeros((n, dim), np.float32)
        self.episode = np.zeros(n, np.int64)
        self.generation = np.zeros(n, np.int64)
        self.sampler = make_sampler(kind, n, slice_len=SLICE_LEN, slice_key="episode")
        self.sampler.bind({"episode": self.episode}, self.generation)
        self.rng = np.random.default_rng(0)

    def write(self, x: np.ndarray, episode: np.ndarray) -> None:
        rows = self.w + np.arange(len(episode))
        slots = rows % self.n
        self.x[slots], self.episode[slots], self.generation[slots] = x, episode, rows // self.n + 1
        self.sampler.on_write(slots)
        if self.rescan:
            self.sampler.load_state_dict(self.sampler.state_dict())  # found again over every step
        self.w += len(episode)

    def step(self, x: np.ndarray, episode: np.ndarray) -> np.ndarray:
        self.write(x, episode)
        size = min(self.w, self.n)
        self.sampler.mass(size)  # what the shard reports to the coordinator after a write
        return self.x.take(self.sampler.sample(SLICES * SLICE_LEN, size, self.rng), axis=0)


def stream(n: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` steps in episodes of 20 to 400 steps: ``(X, episode id)``. NOT real data."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 400, size=n // 20 + 1)
    return rng.standard_normal((n, dim), dtype=np.float32), np.repeat(np.arange(lengths.size), lengths)[:n]


def episodes_table(n: int, dim: int, seed: int, first: int = 0) -> TensorDict:
    """``stream`` as rows (``X``, and ``episode`` numbered from ``first``). NOT real data."""
    x, episode = stream(n, dim, seed)
    return TensorDict({"X": torch.from_numpy(x), "episode": torch.from_numpy(episode.astype(np.int64) + first)}, [n])


def bench_slice_writes(cfg: dict, results: dict) -> dict:
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.data import SliceSampler as TorchRLSliceSampler

    out = {}
    for n in cfg.get("slice_write_steps", [100_000, 1_000_000]):
        x, episode = stream(n + n // 2, cfg["dim"], seed=2)
        extra, extra_ep = stream(WRITE * 4096, cfg["dim"], seed=3)
        extra_ep = extra_ep + int(episode.max()) + 1
        shards = {"rayrb": Shard(n, cfg["dim"], "slice", rescan=False),
                  "rayrb_rescan": Shard(n, cfg["dim"], "slice", rescan=False),
                  "rayrb_prioritized": Shard(n, cfg["dim"], "prioritized_slice", rescan=False)}
        for s in shards.values():  # a full shard, wrapped once
            for a in range(0, len(episode), n // 4):
                s.write(x[a:a + n // 4], episode[a:a + n // 4])
        shards["rayrb_rescan"].rescan = True
        peer = ReplayBuffer(storage=LazyTensorStorage(n), batch_size=SLICES * SLICE_LEN,
                            sampler=TorchRLSliceSampler(slice_len=SLICE_LEN, traj_key="episode"))
        for a in range(0, len(episode), n // 4):
            peer.extend(TensorDict({"X": torch.from_numpy(x[a:a + n // 4]),
                                    "episode": torch.from_numpy(episode[a:a + n // 4])}, [len(episode[a:a + n // 4])]))
        pieces = [TensorDict({"X": torch.from_numpy(extra[i:i + WRITE]), "episode": torch.from_numpy(extra_ep[i:i + WRITE])},
                             [WRITE]) for i in range(0, len(extra_ep), WRITE)]
        at = {"i": 0}

        def nxt() -> int:
            at["i"] = (at["i"] + 1) % len(pieces)
            return at["i"]

        def torchrl_step() -> None:
            peer.extend(pieces[nxt()])
            peer.sample()

        row: dict[str, list] = {}
        for _ in range(cfg["repeats"]):
            for threads in (1, 2):  # the peer at its best
                row.setdefault(f"torchrl_{threads}_threads", []).append(
                    at_threads(threads, lambda: measure(cfg, torchrl_step, 1)["rows_per_s"]))
            row.setdefault("torchrl", []).append(max(row["torchrl_1_threads"][-1], row["torchrl_2_threads"][-1]))
            for name, s in shards.items():
                def step(s=s) -> None:
                    i = nxt() * WRITE
                    s.step(extra[i:i + WRITE], extra_ep[i:i + WRITE])
                row.setdefault(name, []).append(measure(cfg, step, 1)["rows_per_s"])
        summary = {f"{k}_ms": {"median": 1e3 / v["median"]} for k, v in med_ranges(row).items()}
        for name in shards:
            summary[f"{name}_vs_torchrl"] = {"median": summary["torchrl_ms"]["median"] / summary[f"{name}_ms"]["median"]}
        out[str(n)] = summary
        print(f"  {n} steps, ms per write and draw: " + medians_text(
            {k: v for k, v in summary.items() if k.endswith("_ms")}, ",.3f"), flush=True)
    results.setdefault("slices", {})["while_written"] = {
        "write": WRITE, "slice_len": SLICE_LEN, "slices": SLICES, "by_steps": out,
        "what": "one shard's work per call in one process (no Ray): write 16 steps, then draw 8 slices of 32 and "
                "copy them out; TorchRL's in-process extend + sample (ms per write and draw; ratio: TorchRL's ms "
                "over rayrb's). Synthetic episodes of 20-400 steps, NOT real data"}
    return out


def buffer_writes(n: int, prioritized: bool, iters: int = 300) -> dict[str, float]:
    """The same through a buffer on a local Ray (``--buffer``): an online side of one shard of ``n`` steps, filled
    1.5 times; then, ``iters`` times, two writes of one 16-step episode each, the shard's mass asked (what the
    coordinator asks after writes) and a ``sample(256)`` of slices of 32, half offline. Milliseconds, p50 and p99."""
    import ray

    from rayrb import OfflineToOnlineReplayBuffer, SliceSampler

    rb = OfflineToOnlineReplayBuffer(episodes_table(20_000, 8, 0), online_capacity=n, num_online_shards=1, seed=0,
                                     offline_fraction=0.5, batch_size=256,
                                     sampler=SliceSampler(slice_len=SLICE_LEN, traj_key="episode",
                                                          prioritized=prioritized))
    try:
        fill = episodes_table(n + n // 2, 8, 1, first=10**6)
        for a in range(0, len(fill), 100_000):
            rb.extend(fill[a:a + 100_000])
        rb.sample(256)
        shard, times = rb.rpc.shards[-1], {"extend": [], "mass": [], "sample": []}
        for i in range(iters):
            for j in range(2):
                t = time.perf_counter()
                rb.extend(episodes_table(WRITE, 8, 2 + 2 * i + j, first=10**8 + 2 * i + j))
                times["extend"].append(time.perf_counter() - t)
            t = time.perf_counter()
            ray.get(shard.mass_stats.remote())
            times["mass"].append(time.perf_counter() - t)
            t = time.perf_counter()
            rb.sample(256)
            times["sample"].append(time.perf_counter() - t)
    finally:
        rb.shutdown()
    return {f"{k}_p{q}_ms": float(np.percentile(v, q) * 1e3) for k, v in times.items() for q in (50, 99)}


def tree_updates(sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000), loops: int = 300) -> dict:
    """Microseconds per call, in a loop of ``loops``: a sum tree's update of 16 slots in a run (a write) and of
    256 scattered ones (a batch's priorities); a shard of prioritized rows told a 16-row write, then its mass."""
    from rayrb.core.priorities import PrioritizedSampler, SumTree

    rng, out = np.random.default_rng(0), {}
    for n in sizes:
        tree = SumTree(n)
        tree.fill(rng.random(n))
        run, scattered = np.arange(500, 516) % n, rng.integers(0, n, 256)
        shard = PrioritizedSampler(n)
        shard.on_write(np.arange(n))
        shard.mass(n)
        calls = {"update_run_16_us": lambda: tree.update(run, rng.random(16)),
                 "update_scattered_256_us": lambda: tree.update(scattered, rng.random(256)),
                 "write_16_and_mass_us": lambda: (shard.on_write(rng.integers(0, n - 16) + np.arange(16)),
                                                  shard.mass(n))}
        for name, call in calls.items():
            t0 = time.perf_counter()
            for _ in range(loops):
                call()
            out.setdefault(str(n), {})[name] = (time.perf_counter() - t0) / loops * 1e6
    return out


if __name__ == "__main__":  # this part alone: PYTHONPATH=pipelines python -m bench.slice_writes [steps,...] [repeats]
    # (or --trees, or --buffer [steps] [uniform|prioritized])
    import json
    import sys

    if sys.argv[1:2] == ["--trees"]:
        print(json.dumps(tree_updates()))
        sys.exit(0)
    if sys.argv[1:2] == ["--buffer"]:  # ... --buffer [steps] [uniform|prioritized]
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        steps = int(sys.argv[2]) if len(sys.argv) > 2 else 1_000_000
        prioritized = len(sys.argv) > 3 and sys.argv[3] == "prioritized"
        import rayrb

        print(json.dumps({"steps": steps, "prioritized": prioritized, "rayrb": rayrb.__file__,
                          **buffer_writes(steps, prioritized)}))
        sys.exit(0)
    cfg = {"dim": 54, "repeats": int(sys.argv[2]) if len(sys.argv) > 2 else 1, "min_time": 1.0, "min_iters": 5,
           "slice_write_steps": [int(n) for n in (sys.argv[1] if len(sys.argv) > 1 else "100000,1000000").split(",")]}
    results: dict = {}
    bench_slice_writes(cfg, results)
    print(json.dumps(results["slices"]["while_written"]["by_steps"]))
