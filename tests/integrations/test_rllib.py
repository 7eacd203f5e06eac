"""A real DQN LearnerGroup (RLlib new API stack) trains on rayrb batches."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rayrb import OfflineToOnlineReplayBuffer

pytestmark = pytest.mark.usefixtures("ray_session")


def cartpole_shaped(n, seed):
    """Random transitions with CartPole's spaces (obs: 4 floats, action: 0/1), in TorchRL's TED layout."""
    g = torch.Generator().manual_seed(seed)
    return TensorDict({
        "observation": torch.randn(n, 4, generator=g),
        "action": torch.randint(0, 2, (n,), generator=g),
        "next": {"observation": torch.randn(n, 4, generator=g), "reward": torch.ones(n, 1),
                 "terminated": torch.rand(n, 1, generator=g) < 0.05, "truncated": torch.zeros(n, 1, dtype=torch.bool)},
    }, [n])


def test_dqn_learner_group_trains_on_rayrb_batches(tmp_path):
    import gymnasium as gym
    from ray.rllib.algorithms.dqn import DQNConfig
    from ray.rllib.core import DEFAULT_MODULE_ID

    from rayrb.integrations.rllib import update

    obs_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
    act_space = gym.spaces.Discrete(2)
    config = (DQNConfig().environment(observation_space=obs_space, action_space=act_space)
              .learners(num_learners=0).training(double_q=True, dueling=False, num_atoms=1, n_step=1, lr=1e-3))
    learner_group = config.build_learner_group(spaces={"__env__": (obs_space, act_space),
                                                       DEFAULT_MODULE_ID: (obs_space, act_space)})
    rb = OfflineToOnlineReplayBuffer(cartpole_shaped(2000, 0), online_capacity=1000, num_offline_shards=2,
                                     offline_fraction=0.75, batch_size=128, seed=0, dataset_root=tmp_path / "ds")
    try:
        rb.extend(cartpole_shaped(300, 1))
        losses = []
        for step in range(5):
            out = update(learner_group, rb, timesteps={"num_env_steps_sampled_lifetime": 128 * (step + 1)})
            losses.append(out.results[0][DEFAULT_MODULE_ID]["qf_loss"].peek())
            assert out.td_errors.shape == (128,) and np.isfinite(out.td_errors).all()
            assert int(out.info["offline"].sum()) == 96  # floor(0.75 * 128 + 1/2)
            assert out.info["index"].shape == (128,) and out.info["generation"].min() >= 1
        assert np.isfinite(losses).all()
    finally:
        rb.shutdown()
        learner_group.shutdown()


def test_multi_agent_batch_columns_and_importance_weights():
    from ray.rllib.core import DEFAULT_MODULE_ID

    from rayrb.integrations.rllib import to_multi_agent_batch
    from rayrb.io.arrays import to_numpy_dict

    rows = to_numpy_dict(cartpole_shaped(8, 2))
    mab = to_multi_agent_batch(rows, {"weight": np.linspace(0.5, 1.0, 8, dtype=np.float32)})
    sb = mab.policy_batches[DEFAULT_MODULE_ID]
    assert sb["rewards"].shape == (8,) and sb["terminateds"].dtype == bool  # [B, 1] squeezed
    np.testing.assert_allclose(sb["weights"], np.linspace(0.5, 1.0, 8))
    assert sb["n_step"].tolist() == [1] * 8
    assert np.all(to_multi_agent_batch(rows).policy_batches[DEFAULT_MODULE_ID]["weights"] == 1.0)
    with pytest.raises(KeyError, match="do not have"):
        to_multi_agent_batch({"observation": rows["observation"]})
