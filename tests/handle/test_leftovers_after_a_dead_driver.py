"""A driver killed without shutdown() leaves its coordinator's version map; the next buffer on the node removes it."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from tensordict import TensorDict

DRIVER = textwrap.dedent("""
    import os, sys, ray, torch
    from tensordict import TensorDict
    ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
    from rayrb import OfflineToOnlineReplayBuffer
    rb = OfflineToOnlineReplayBuffer(TensorDict({"x": torch.zeros(10, 1)}, [10]), online_capacity=10,
                                     dataset_root=sys.argv[2], storage_dir=None)
    node, path = ray.get(rb.rpc.coord.version_file.remote())
    print(rb.rpc.coord._actor_id.hex(), path, flush=True)
    os._exit(0)  # no shutdown(): the coordinator dies with its owner, its file stays
""")


@pytest.mark.usefixtures("ray_session")
def test_the_next_buffer_removes_the_version_map_a_dead_driver_left(tmp_path, make_buffer, ray_session):
    address = ray_session.get_runtime_context().gcs_address
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    out = subprocess.run([sys.executable, "-c", DRIVER, address, str(tmp_path / "ds")], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    actor, path = out.stdout.strip().splitlines()[-1].split()
    assert os.path.exists(path) and actor in path  # named by its cluster and actor: Ray is asked, not the pid
    from ray._private import state

    deadline = time.monotonic() + 60
    while state.actors(actor).get("State") != "DEAD":  # Ray kills the actors of a driver that died
        assert time.monotonic() < deadline
        time.sleep(0.2)
    make_buffer(TensorDict({"x": torch.zeros(10, 1)}, [10]), online_capacity=10)
    assert not os.path.exists(path)
