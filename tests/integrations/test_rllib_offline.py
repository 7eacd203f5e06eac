"""RLlib's offline API (BC, new API stack) trains from a rayrb chunk dataset read through rayrb's Ray Data source."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from conftest import REPO

pytest.importorskip("gymnasium")
pytest.importorskip("ray.rllib")


def load_job():
    spec = importlib.util.spec_from_file_location("rllib_finetune", REPO / "pipelines" / "rllib_finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bc_learns_the_logged_rule_from_a_chunk_dataset(ray_session, tmp_path):
    from ray.rllib.algorithms.bc import BCConfig
    from ray.rllib.core import DEFAULT_MODULE_ID
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    from rayrb.integrations.rllib import ChunkOfflineData, write_episodes

    job = load_job()
    episodes, returns = job.log_behaviour(4, 0, 0.0)  # the noiseless pole rule: 500 a run
    root = str(write_episodes(episodes, tmp_path / "log").root)
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    config = (BCConfig().environment(observation_space=env.observation_space, action_space=env.action_space)
              .offline_data(input_=root, offline_data_class=ChunkOfflineData, dataset_num_iters_per_learner=5,
                            map_batches_kwargs={"concurrency": 1, "num_cpus": 0})
              .training(train_batch_size_per_learner=256, lr=3e-3)
              .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[32]))
              .debugging(seed=0, log_level="ERROR"))
    algo = config.build_algo()
    try:
        for _ in range(4):
            result = algo.train()
        # no env runner holds a module here: the learner's own
        (call,) = algo.learner_group.foreach_learner(lambda learner: learner.module[DEFAULT_MODULE_ID])
        module = call.get()

        def act(obs):
            with torch.no_grad():
                logits = module.forward_inference({"obs": torch.as_tensor(obs, dtype=torch.float32)})
            return logits["action_dist_inputs"].argmax(-1).numpy()

        cloned = job.play(act, list(range(1_000_000, 1_000_005)))
        random_policy = job.behaviour_return(list(range(1_000_000, 1_000_005)), 1.0, 0)
        assert np.isfinite(result["learners"]["default_policy"]["policy_loss"])
        assert cloned > 2 * random_policy, f"expected BC to clone the rule (500), got {cloned} " \
                                           f"(a random policy: {random_policy})"
    finally:
        algo.stop()
