"""Section ``slices``: slices/s and steps/s of a slice sampler at slice lengths 8, 32 and 80 (32 slices a batch),
rayrb's ``SliceSampler`` against TorchRL's in-process ``ReplayBuffer`` with its ``SliceSampler`` on the same
episodes, in one run. rayrb's buffer draws all its slices offline (``offline_fraction=1``, what TorchRL's buffer
holds) and, as a second figure, half of them from an online side holding episodes too; as a third, the same half
online by priority (``SliceSampler(prioritized=True)``, read by the shards; TorchRL's ``PrioritizedSliceSampler``
needs its C++ extension, which the CPU torch build here does not load, so it has no peer in this run). TorchRL's
buffer runs with 1 and with 2 torch threads, the better counting (``torchrl_slice_sampler``). Then what a write
costs a shard drawing slices (``bench.slice_writes``)."""
from __future__ import annotations

from bench.harness import measure, med_ranges, medians_text, write_offline
from bench.headline import at_threads
from bench.slice_writes import bench_slice_writes, episodes_table

SLICES_PER_BATCH = 32


def bench_slices(cfg: dict, root: str, results: dict) -> None:
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.data import SliceSampler as TorchRLSliceSampler

    from rayrb import OfflineToOnlineReplayBuffer, SliceSampler

    offline = episodes_table(cfg["n_off"], cfg["dim"], seed=0)
    online = episodes_table(cfg["n_on"], cfg["dim"], seed=1)
    online["episode"] += int(offline["episode"].max()) + 1
    ds_root = write_offline(offline, root, "slices")
    out = {}
    for length in cfg.get("slice_lens", [8, 32, 80]):
        batch = SLICES_PER_BATCH * length
        peer = ReplayBuffer(storage=LazyTensorStorage(len(offline)), batch_size=batch,
                            sampler=TorchRLSliceSampler(slice_len=length, traj_key="episode", cache_values=True))
        peer.extend(offline)
        made = []
        try:
            for fraction, prioritized in ((1.0, False), (0.5, False), (0.5, True)):
                rb = OfflineToOnlineReplayBuffer(
                    str(ds_root), online_capacity=len(online), offline_fraction=fraction, seed=0,
                    sampler=SliceSampler(slice_len=length, traj_key="episode", prioritized=prioritized))
                made.append(rb)
                rb.extend(online)
            row: dict[str, list] = {}
            for _ in range(cfg["repeats"]):
                for threads in (1, 2):  # the peer at its best (on this machine 2 threads may run it slower)
                    row.setdefault(f"torchrl_{threads}_threads", []).append(
                        at_threads(threads, lambda: measure(cfg, peer.sample, batch)["rows_per_s"]))
                row.setdefault("torchrl_slice_sampler", []).append(max(row["torchrl_1_threads"][-1],
                                                                       row["torchrl_2_threads"][-1]))
                for name, fn in (("rayrb_offline", lambda: made[0].sample(batch)),
                                 ("rayrb_half_online", lambda: made[1].sample(batch)),
                                 ("rayrb_prioritized_half_online", lambda: made[2].sample(batch))):
                    row.setdefault(name, []).append(measure(cfg, fn, batch)["rows_per_s"])
            summary = med_ranges(row)
            for name in ("rayrb_offline", "rayrb_half_online", "rayrb_prioritized_half_online"):
                summary[f"{name}_vs_torchrl"] = {"median": summary[name]["median"]
                                                 / summary["torchrl_slice_sampler"]["median"]}
            summary["slices_per_s"] = {k: summary[k]["median"] / length for k in row}
            out[str(length)] = summary
            print(f"  slice_len={length}: steps/s " + medians_text({k: summary[k] for k in row}, ",.0f"), flush=True)
        finally:
            for rb in made:
                rb.shutdown()
    results["slices"] = {"slices_per_batch": SLICES_PER_BATCH, "by_slice_len": out,
                         "data": f"synthetic episodes of 20-400 steps, {cfg['n_off']} offline and {cfg['n_on']} "
                                 f"online rows x {cfg['dim']} float32 + int64 episode id (NOT real data)"}
    bench_slice_writes(cfg, results)
