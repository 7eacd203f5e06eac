"""Dataset ids need a batch size as TorchRL's do; OpenMLEnv's batch dims pass TorchRL's checks."""
from __future__ import annotations

import numpy as np
import pytest

from rayrb.io.chunks import write_dataset


# dataset ids ---------------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("ray_session")
def test_a_dataset_id_needs_batch_size_and_a_path_does_not(tmp_path, make_buffer):
    from rayrb import OfflineToOnlineReplayBuffer

    with pytest.raises(ValueError, match="batch_size must be provided when offline_dataset is a string"):
        OfflineToOnlineReplayBuffer("openml:no-such-table", online_capacity=10)
    write_dataset({"obs": np.zeros((8, 1), np.float32), "id": np.arange(8)}, tmp_path / "prepared")
    rb = make_buffer(str(tmp_path / "prepared"), online_capacity=10, seed=0)  # a path: batch_size may come later
    assert len(rb.sample(4)["id"]) == 4


# OpenMLEnv -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch_size", [None, [2, 3]])
def test_openml_env_with_no_or_two_batch_dims_passes_torchrls_checks(data_home, tmp_path, monkeypatch, batch_size):
    from torchrl.envs.utils import check_env_specs

    from rayrb import OpenMLEnv

    monkeypatch.setenv("RAYRB_HOME", str(tmp_path / "home"))
    env = OpenMLEnv("shuttle", batch_size=batch_size, data_home=data_home, seed=0)
    check_env_specs(env)
    td = env.reset()
    assert td["observation"].shape[:-1] == env.batch_size and td["y"].shape == env.batch_size
    td["action"] = td["y"].clone()
    out = env.step(td)["next"]
    assert out["reward"].shape == (*env.batch_size, 1) and bool((out["reward"] == 1).all())
