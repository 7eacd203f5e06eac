"""What the coordinator-restart tests share: tagged rows, the online rows the shards hold, and a kill that waits
for the new process."""
import os
import time

import torch
from tensordict import TensorDict


def rows(start: int, n: int) -> TensorDict:
    """``n`` rows whose ``id`` runs from ``start`` (and ``obs`` is the id as a float)."""
    ids = torch.arange(start, start + n, dtype=torch.int64)
    return TensorDict({"obs": ids.float()[:, None], "id": ids}, [n])


def online_ids(rb) -> list[int]:
    """Every online row's id, as many times as the shards hold it."""
    import ray

    pass

    out = []
    for state in ray.get([s.state.remote() for s in rb.rpc.by_side["online"]]):
        out += state["rows/id"][state["generation"] > 0].tolist()
    return sorted(out)


def kill_coordinator(rb) -> None:
    """Kill the coordinator's process as a crash would, and wait until a new process answers.

    ``ray.kill`` returns before the process is gone, and a call the old process answers then dies
    replying to is re-sent; waiting for another process id keeps that case out of the tests that compare
    streams (a count of restarts would not do: each new process starts its own).
    """
    import ray

    def pid():
        return ray.get(rb.rpc.coord.__ray_call__.remote(lambda self: os.getpid()), timeout=10)

    before = pid()
    ray.kill(rb.rpc.coord, no_restart=False)
    deadline = time.monotonic() + 60
    while True:
        try:
            if pid() != before:
                return
        except Exception:
            if time.monotonic() > deadline:
                raise
        assert time.monotonic() < deadline, "the coordinator was not restarted within 60 s"
        time.sleep(0.1)
