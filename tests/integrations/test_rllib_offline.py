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


@pytest.mark.cluster  # its own Ray, in its own process
@pytest.mark.parametrize("end", ["exit", "shutdown"])
def test_a_script_that_trained_from_a_chunk_dataset_ends_without_a_traceback(tmp_path, end):
    """RLlib leaves its learner's Ray Data iteration open; ended after Ray shut down, it printed "Ray is not
    initialized" from Ray Data's stats actor, with a traceback, at every exit."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, str(REPO / "tests" / "integrations" / "rllib_offline_exit.py"),
                          str(tmp_path), end], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0 and "RAYRB_DONE" in out.stdout, (out.stdout + out.stderr)[-3000:]
    for sign in ("Traceback", "Exception ignored", "Ray is not initialized"):
        assert sign not in out.stderr + out.stdout, out.stderr[-3000:]


def test_an_iteration_ended_after_ray_shut_down_ends_without_its_stats_report(caplog, monkeypatch):
    """Ray shut down (standing in: ``ray.is_initialized`` says so): the Ray Data iteration's end (standing in: a
    generator whose end logs, as Ray Data's does when its stats actor cannot be reached) runs inside the guard,
    whether the guarded iteration is closed at exit or collected before."""
    import logging

    from rayrb.integrations.rllib import offline

    offline.close_iterations()  # what earlier tests left
    monkeypatch.setattr(offline.ray, "is_initialized", lambda: False)
    ended = []

    def ray_data_iteration():
        try:
            yield from range(5)
        finally:
            ended.append(True)
            logging.getLogger(offline._STATS_LOG).warning("Error occurred during update_iteration_metrics: "
                                                          "Ray is not initialized")

    kept, dropped = offline._guarded(ray_data_iteration()), offline._guarded(ray_data_iteration())
    assert [next(kept), next(kept), next(dropped)] == [0, 1, 0]
    with caplog.at_level(logging.WARNING):
        del dropped  # collected, as the interpreter collects what a learner left
        assert offline.close_iterations() == 1  # the one still held
    assert ended == [True, True] and "Ray is not initialized" not in caplog.text
    assert not logging.getLogger(offline._STATS_LOG).disabled and offline.close_iterations() == 0
