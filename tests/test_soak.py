"""Bounded soak: writers and samplers run while shards are killed; nothing acknowledged is lost or doubled."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_marked
from restart_util import LoopingSampler, wait_for_progress
from tensordict import TensorDict

from rayrb import OfflineToOnlineReplayBuffer


def rows(ids: np.ndarray) -> TensorDict:
    ids = torch.as_tensor(ids, dtype=torch.int64)
    return TensorDict({"obs": ids.float()[:, None].expand(len(ids), 2).contiguous(), "id": ids}, [len(ids)])


def kill_and_time_restart(ray, shard) -> float:
    """Kill ``shard``'s process: the seconds until the restarted process answers."""
    pid = ray.get(shard.__ray_call__.remote(lambda self: os.getpid()))
    ray.kill(shard, no_restart=False)
    t0 = time.monotonic()
    while ray.get(shard.__ray_call__.remote(lambda self: os.getpid()), timeout=60) == pid:
        time.sleep(0.01)  # the kill has not reached the process yet
    return time.monotonic() - t0  # until the restarted process answers


def held_ids(dump, shards) -> list[int]:
    """The ids of every row these shards' files in the dump ``dump`` hold."""
    held = []
    files = json.loads((dump / "buffer.json").read_text())["files"]  # [<dir>/]shard-<j>.npz
    for j in shards:
        with np.load(dump / next(n for n in files if Path(n).name == f"shard-{j}.npz")) as state:
            held.extend(state["rows/id"][:min(int(state["written"]), len(state["rows/id"]))].tolist())
    return held


@pytest.mark.usefixtures("ray_session")
def test_soak_with_killed_shards_loses_and_doubles_nothing(tmp_path, ray_session):
    ray = ray_session
    B, f, writers, per_write = 64, 0.5, 3, 50
    writes, batches = 20, 10  # each writer's writes and each sampler's batches before each kill and after the last

    @ray.remote(num_cpus=0)
    class Writer:
        def __init__(self, rb, base):
            self.rb, self.base, self.acked, self.stop = rb, base, [], False

        def run(self):
            k = 0
            while not self.stop:
                ids = self.base + np.arange(k, k + per_write)
                self.rb.extend(rows(ids))  # returns only once the shards hold the rows
                self.acked.extend(ids.tolist())
                k += per_write
            return self.acked

        def progress(self):
            return len(self.acked) // per_write

        def halt(self):
            self.stop = True

    Sampler = ray.remote(num_cpus=0)(LoopingSampler)

    def enough(since):
        """Each writer's and sampler's share more than ``since``."""
        return [m + (writes if i < writers else batches) for i, m in enumerate(since)]

    # room for every row the writers can write meanwhile: the counts below cannot tell an overwritten row from a lost one
    rb = OfflineToOnlineReplayBuffer(rows(np.arange(-1000, 0)), online_capacity=2_000_000, num_offline_shards=2,
                                     num_online_shards=2, offline_fraction=f, seed=0, timeout=60,
                                     dataset_root=tmp_path / "ds", storage_dir=tmp_path / "state")
    try:
        ws = [Writer.options(max_concurrency=2).remote(rb.client(), 10_000_000 * (i + 1)) for i in range(writers)]
        ss = [Sampler.options(max_concurrency=2).remote(rb.client(), B, f) for _ in range(2)]
        ray.get([a.__ray_ready__.remote() for a in ws + ss])
        work = [a.run.remote() for a in ws + ss]
        recovery, since = {}, [0] * len(ws + ss)
        for name, shard in (("offline shard", rb.rpc.shards[0]), ("online shard", rb.rpc.shards[-1])):
            wait_for_progress(ray, ws + ss, enough(since), 120)
            recovery[name] = kill_and_time_restart(ray, shard)
            since = ray.get([a.progress.remote() for a in ws + ss])
        wait_for_progress(ray, ws + ss, enough(since), 120)  # writes and samples go on after the last restart
        ray.get([a.halt.remote() for a in ws + ss])
        acked = [i for ids in ray.get(work[:writers]) for i in ids]
        sampled = ray.get(work[writers:])
        rb.dumps(tmp_path / "end")
        held = held_ids(tmp_path / "end", (2, 3))  # the online shards' files: every row they hold
        assert len(acked) < 2_000_000, "the writers outran the capacity: raise it"
        assert rb.write_count == len(acked) == len(held)  # nothing lost, nothing written twice
        assert sorted(held) == sorted(acked)
        assert all(not bad for _, bad in sampled), sampled
        print(f"\nsoak: {len(acked)} rows acknowledged, {sum(n for n, _ in sampled)} batches sampled, "
              f"recovery {', '.join(f'{k} {v:.2f} s' for k, v in recovery.items())}")
        assert all(v < 30 for v in recovery.values()), recovery
    finally:
        rb.shutdown()


@pytest.mark.cluster
def test_sampling_resumes_after_the_node_of_an_offline_shard_is_removed(tmp_path):
    result = run_marked("cluster_faults.py", str(tmp_path))
    if not result["placed"]:
        pytest.skip("the scheduler kept the offline shard on the head node six times: no worker node to remove")
    assert result["was_on_doomed"] and not result["moved_to_doomed"] and not result["doomed_alive"], result
    assert result["sampled"] == 64 and result["rows_ok"], result
    print(f"\nnode removal: declared dead after {result['detected_s']:.2f} s, sampling resumed after "
          f"{result['recovery_s']:.2f} s")
    assert result["recovery_s"] < 60, result
