"""A writer of dicts of arrays does not import tensordict (about 1.2 s of a collector process's CPU on top of
torch's before its first ``extend``); TensorDicts are still taken and returned where they are used."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import torch
from array_writer import ArrayWriter
from tensordict import TensorDict


def test_a_collector_writing_arrays_lands_its_rows_without_importing_tensordict(make_buffer, ray_session):
    ray = ray_session
    rb = make_buffer({"obs": np.zeros((50, 3), np.float32), "id": np.arange(50)}, online_capacity=100, seed=0)
    # env_vars: a runtime env of its own, so a process of its own (not a worker that ran another test's task)
    writer = ray.remote(num_cpus=0, runtime_env={"env_vars": {"RAYRB_TEST_ARRAY_WRITER": "1"}})(ArrayWriter).remote()
    slots, imported = ray.get(writer.write.remote(rb.client(), 1000, 10))
    assert len(slots) == 10 and rb.write_count == 10
    assert imported == ["torch"]  # extend answers torch indices, as TorchRL's does; no tensordict
    batch = rb.sample(200)
    assert isinstance(batch, TensorDict) and set(batch["id"][batch["id"] >= 1000].tolist()) <= set(range(1000, 1010))
    rb.extend(TensorDict({"obs": torch.ones(5, 3), "id": torch.arange(2000, 2005)}, [5]))  # still taken
    assert rb.write_count == 15


def test_the_client_and_its_write_path_import_no_tensordict():
    code = ("import sys, numpy as np; import rayrb.handle.client; from rayrb.io.arrays import to_numpy_dict; "
            "assert sorted(to_numpy_dict({'a': {'b': np.arange(3)}})) == ['a/b']; "
            "print('tensordict' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
