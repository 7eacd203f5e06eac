"""What the restart tests share: tagged rows, the online rows the shards hold, a kill that waits for the new
process (or, for good, until calls fail), and a sampler that runs while things are killed, with a wait for its progress."""
import os
import time

import torch
from tensordict import TensorDict


def coordinator_places() -> dict:
    """Buffer options under which the coordinator admits and places each write (a rate limiter whose bounds are
    never reached): the write path of limited and replicated buffers, which shards do not place themselves."""
    from rayrb import SampleToInsertRatio

    return {"rate_limiter": SampleToInsertRatio(1.0, 1, (-10**9, 10**9))}


def rows(start: int, n: int) -> TensorDict:
    """``n`` rows whose ``id`` runs from ``start`` (and ``obs`` is the id as a float)."""
    ids = torch.arange(start, start + n, dtype=torch.int64)
    return TensorDict({"obs": ids.float()[:, None], "id": ids}, [n])


def online_ids(rb) -> list[int]:
    """Every online row's id, as many times as the shards hold it."""
    import ray

    out = []
    for state in ray.get([s.state.remote() for s in rb.rpc.by_side["online"]]):
        out += state["rows/id"][state["generation"] > 0].tolist()
    return sorted(out)


def read_group(rb, group) -> list:
    """Each shard's ``(rows, info)`` for a whole planned group, read by the shards (as a handle on another node)."""
    return [rb.rpc.fetch_read((side, i, args), rb.rpc.read(side, i, args))
            for (side, i), args in zip(group.reads, group.args)]


def kill_and_wait(actor, timeout: float = 60) -> None:
    """Kill the actor's process as a crash would, and wait until a new process answers.

    ``ray.kill`` returns before the process is gone, and a call the old process answers then dies
    replying to is re-sent; waiting for another process id keeps that case out of the tests that compare
    streams (a count of restarts would not do: each new process starts its own).
    """
    import ray

    def pid(wait: float = 10):
        return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=wait)

    before = pid(timeout)
    ray.kill(actor, no_restart=False)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if pid() != before:
                return
        except Exception:
            if time.monotonic() > deadline:
                raise
        assert time.monotonic() < deadline, f"the actor was not restarted within {timeout} s"
        time.sleep(0.05)


def kill_for_good(actor, timeout: float = 30) -> None:
    """Kill the actor for good and wait until calls to it fail: ``ray.kill`` returns before the process is gone, and
    a call sent meanwhile may still be answered by it."""
    import ray

    ray.kill(actor)
    deadline = time.monotonic() + timeout
    while True:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=timeout)
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < deadline, f"the killed actor still answers after {timeout} s"
        time.sleep(0.05)


def kill_coordinator(rb) -> None:
    """``kill_and_wait`` for the buffer's coordinator."""
    kill_and_wait(rb.rpc.coord)


class LoopingSampler:
    """Samples batches of ``batch_size`` until halted (a Ray actor with ``max_concurrency=2``), counting them and
    keeping the offline count of any batch that is not whole or not split exactly (all offline passes: that is
    the batch before the first write lands)."""

    def __init__(self, rb, batch_size: int, fraction: float):
        self.rb, self.batch_size, self.fraction, self.stop, self.batches = rb, batch_size, fraction, False, 0

    def run(self) -> tuple[int, list[int]]:
        from rayrb.core.allocation import offline_count

        B, bad = self.batch_size, []
        while not self.stop:
            _, info = self.rb.sample(B, return_info=True)
            n_off = int(info["offline"].sum())
            if n_off not in (B, offline_count(B, self.fraction)) or len(info["offline"]) != B:
                bad.append(n_off)
            self.batches += 1
        return self.batches, bad

    def progress(self) -> int:
        return self.batches

    def halt(self) -> None:
        self.stop = True


def wait_for_progress(ray, actors, want: list[int], timeout: float) -> list[int]:
    """Until each actor's ``progress()`` has reached ``want[i]``, so that a kill falls while they run; their counts."""
    deadline = time.monotonic() + timeout
    while True:
        now = ray.get([a.progress.remote() for a in actors])
        if all(n >= w for n, w in zip(now, want)):
            return now
        assert time.monotonic() < deadline, f"no progress within {timeout} s: wanted {want}, got {now}"
        time.sleep(0.02)
