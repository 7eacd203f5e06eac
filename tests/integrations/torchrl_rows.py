"""TorchRL's row helpers from its test/test_offline_to_online.py, shared by the ports of TorchRL's tests
(test_torchrl_compat.py, test_torchrl_promises.py)."""
from __future__ import annotations

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer


def make_offline_buffer(n: int = 1000, obs_dim: int = 4, action_dim: int = 2):
    """A plain ReplayBuffer standing in for an offline dataset (no Minari/D4RL needed)."""
    rb = ReplayBuffer(storage=LazyTensorStorage(n))
    rb.extend(
        TensorDict(
            {
                "observation": torch.randn(n, obs_dim),
                "action": torch.randn(n, action_dim),
                ("next", "reward"): torch.randn(n, 1),
            },
            batch_size=[n],
        )
    )
    return rb


def make_online_data(n: int = 50, obs_dim: int = 4, action_dim: int = 2):
    return TensorDict(
        {
            "observation": torch.randn(n, obs_dim),
            "action": torch.randn(n, action_dim),
            ("next", "reward"): torch.randn(n, 1),
        },
        batch_size=[n],
    )
