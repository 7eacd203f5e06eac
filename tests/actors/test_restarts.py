"""A buffer lives as long as its job: any actor of it restarts after any number of crashes, with its state."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from restart_util import LoopingSampler, kill_and_wait, online_ids, wait_for_progress
from tensordict import TensorDict

from rayrb import OfflineToOnlineReplayBuffer


def rows(ids: np.ndarray) -> TensorDict:
    ids = torch.as_tensor(ids, dtype=torch.int64)
    return TensorDict({"obs": ids.float()[:, None], "id": ids}, [len(ids)])


def test_the_coordinator_and_an_online_shard_each_survive_ten_kills_while_writers_and_samplers_run(
        tmp_path, ray_session):
    ray = ray_session
    B, f, per_write, kills = 32, 0.5, 20, 10

    @ray.remote(num_cpus=0)
    class Writer:
        def __init__(self, rb, base):
            self.rb, self.base, self.acked, self.stop = rb, base, [], False

        def run(self):
            k = 0
            while not self.stop:
                ids = self.base + np.arange(k, k + per_write)
                self.rb.extend(rows(ids), write_id=f"{self.base}-{k}")  # a retry with the same id lands once
                self.acked.extend(ids.tolist())
                k += per_write
            return self.acked

        def progress(self):
            return len(self.acked)

        def halt(self):
            self.stop = True

    Sampler = ray.remote(num_cpus=0)(LoopingSampler)

    rb = OfflineToOnlineReplayBuffer(rows(np.arange(-500, 0)), online_capacity=100_000, num_offline_shards=1,
                                     num_online_shards=2, offline_fraction=f, seed=0, timeout=120,
                                     dataset_root=tmp_path / "ds", storage_dir=tmp_path / "state")
    try:
        ws = [Writer.options(max_concurrency=2).remote(rb.client(), 10_000_000 * (i + 1)) for i in range(2)]
        ss = [Sampler.options(max_concurrency=2).remote(rb.client(), B, f)]
        ray.get([a.__ray_ready__.remote() for a in ws + ss])
        work = [a.run.remote() for a in ws + ss]
        done = [0] * len(ws + ss)
        for actor in (rb.rpc.coord, rb.rpc.shards[-1]):
            for _ in range(kills):
                done = wait_for_progress(ray, ws + ss, [m + 1 for m in done], 60)  # each has done more
                kill_and_wait(actor)
        ray.get([a.halt.remote() for a in ws + ss])
        acked = [i for ids in ray.get(work[:2]) for i in ids]
        (batches, bad), = ray.get(work[2:])
        assert not bad and batches > 0
        stats = rb.stats()
        assert stats["coordinator"]["restarts"] == kills
        assert [s["restarts"] for s in stats["shards"]] == [0, 0, kills]
        held = online_ids(rb)
        assert held == sorted(acked) and len(set(held)) == len(held)  # every acknowledged row, once
        assert len(rb.sample(B)) == B  # and the buffer answers
    finally:
        rb.shutdown()


def test_a_coordinator_comes_back_after_the_driver_dropped_all_but_a_client(tmp_path, ray_session):
    ray = ray_session

    def build():
        rb = OfflineToOnlineReplayBuffer(rows(np.arange(100)), online_capacity=100, seed=0, batch_size=8,
                                         dataset_root=tmp_path / "ds", storage_dir=tmp_path / "state")
        rb.extend(rows(np.arange(1000, 1010)))
        return rb.client()

    client = build()  # the owner object and every ref the driver held are gone: only this handle is left
    gc.collect()
    try:
        kill_and_wait(client.rpc.coord)
        assert len(client.sample()) == 8 and client.write_count == 10
        assert client.stats()["coordinator"]["restarts"] == 1
    finally:
        for a in [*client.rpc.shards, client.rpc.coord]:
            ray.kill(a)


def test_a_start_that_keeps_crashing_backs_off(tmp_path):
    from rayrb.durability.restarts import RestartLog

    waits = [RestartLog(tmp_path).started(n, cause="init failed") for n in range(1, 10)]
    assert waits[0] == 0.0 and waits[1:4] == [0.5, 1.0, 2.0] and max(waits) == 30.0
    log = RestartLog(tmp_path)
    assert log.stats() == {"restarts": 9, "last_restart_cause": "init failed"}
    log.started(10)
    log.ready()
    assert RestartLog(tmp_path).started(11) == 0.0  # the start before got going: no wait


def test_starts_that_died_before_they_were_counted_back_off_the_next(tmp_path):
    """A process killed during its imports never reaches the restart log; Ray's count of restarts shows the gap,
    and those starts count as crashed: the next start waits, and the count is Ray's."""
    from rayrb.durability.restarts import RestartLog

    log = RestartLog(tmp_path)
    log.started(0)
    log.ready()  # a life that got going
    assert RestartLog(tmp_path).started(3) == 1.0  # restarts 1 and 2 died in their imports: two failed starts
    assert RestartLog(tmp_path).stats()["restarts"] == 3


@pytest.mark.parametrize("value", [-2, 1.5, "many", None])
def test_max_restarts_is_checked(tmp_path, value):
    with pytest.raises((ValueError, TypeError), match="max_restarts"):
        OfflineToOnlineReplayBuffer(rows(np.arange(10)), online_capacity=10, max_restarts=value,
                                    dataset_root=tmp_path / "ds")


def test_a_restart_is_a_restart_when_rays_actor_table_does_not_answer(tmp_path, monkeypatch):
    """Its record in the buffer's own directory says so: a coordinator that took itself for a first start would
    clear its saved stream and journal, and plan writes over acknowledged rows."""
    from rayrb.actors import lifecycle

    monkeypatch.setattr(lifecycle, "whoami", lambda: ("ab" * 16, "c" * 56, 0, None))
    lifecycle.begin(str(tmp_path), "the coordinator").ready()  # the first start
    monkeypatch.setattr(lifecycle, "whoami", lambda: ("ab" * 16, "c" * 56, None, None))  # the table fails
    again = lifecycle.begin(str(tmp_path), "the coordinator")
    assert again.restarts == 1 and again.stats()["restarts"] == 1
    monkeypatch.setattr(lifecycle, "whoami", lambda: ("ab" * 16, "c" * 56, None, None))
    fresh = lifecycle.begin(str(tmp_path / "new"), "a shard")  # no record: a first start
    assert fresh.restarts == 0 and fresh.unsure


def test_a_coordinator_moved_to_another_node_while_rays_actor_table_does_not_answer_keeps_its_gcs_copy(
        tmp_path, monkeypatch):
    """Its restart record stays on the lost node's disk, and the actor table does not answer: the GCS copy of its
    state is then what shows an earlier start. It restarts from that copy, and never clears it."""
    import shutil

    from rayrb.actors import coordinator, lifecycle
    from rayrb.durability.mirror import DictMirror

    gcs, d = DictMirror(), tmp_path / "coordinator"
    monkeypatch.setattr(coordinator, "GcsMirror", lambda: gcs)
    monkeypatch.setattr(lifecycle, "whoami", lambda: ("ab" * 16, "c" * 56, 0, None))
    first = coordinator.Coordinator([object()], [100], [], [], seed=0, state_dir=str(d), replicated=True)
    answers = [first.plan(16, 1, call=f"learner/{i}") for i in range(3)]
    kept = first.state_dict()
    first._lives.end()
    shutil.rmtree(d)  # the node and its disk are gone
    monkeypatch.setattr(lifecycle, "whoami", lambda: ("ab" * 16, "c" * 56, None, None))  # the table fails
    moved = coordinator.Coordinator([object()], [100], [], [], seed=0, state_dir=str(d), replicated=True)
    assert moved.state_dict() == kept and gcs.keys(f"{d}/state.")
    assert moved.plan(16, 1, call="learner/2").args == answers[2].args  # its answer kept, not planned anew
    moved.close()
