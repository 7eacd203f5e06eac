"""RLlib's own DQN (new API stack) trains on a rayrb buffer named in ``replay_buffer_config``: it learns CartPole past
the policy that logged the offline data, and env runners on other actors write into the buffer themselves."""
from __future__ import annotations

import importlib.util
import time

import numpy as np
import pytest
from conftest import REPO

pytest.importorskip("gymnasium")
pytest.importorskip("ray.rllib")

RAYRB_BUFFER = "rayrb.integrations.rllib.OfflineToOnlineEpisodeReplayBuffer"


def load_job():
    spec = importlib.util.spec_from_file_location("rllib_finetune", REPO / "pipelines" / "rllib_finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_dqn_on_rayrb_beats_the_behaviour_policy(ray_session, tmp_path):
    t0 = time.perf_counter()
    metrics = load_job().main(["--quick", "--buffers", "rayrb", "--out", str(tmp_path)])
    behaviour = metrics["behaviour"]["eval_return"]
    (run,) = metrics["runs"]
    assert run["buffer"] == "rayrb" and run["env_steps"][-1] >= metrics["config"]["steps_per_iteration"]
    fractions = run["offline_fraction"]
    assert fractions[0] > fractions[-1] >= 0.0  # annealed towards 0 over the run
    # DQN's greedy return swings from one iteration to the next on CartPole: the last three, averaged
    assert run["last3_return"] > behaviour, (
        f"expected DQN's greedy return to beat the behaviour policy's {behaviour:.1f}, got {run['last3_return']:.1f} "
        f"over the last three iterations (returns {run['eval_return']} at env steps {run['env_steps']})")
    assert run["buffer_ms_per_iteration"] > 0  # RLlib timed the buffer's calls
    assert (tmp_path / "metrics.json").is_file()
    print(f"quick DQN on rayrb: {time.perf_counter() - t0:.1f}s, return {run['last3_return']:.1f} "
          f"vs behaviour {behaviour:.1f}")


def test_env_runner_on_another_actor_writes_while_the_learner_samples(make_buffer, tmp_path):
    from ray.rllib.algorithms.dqn import DQNConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    from rayrb.integrations.rllib import EnvRunnerWriter, write_episodes

    job = load_job()
    episodes, _ = job.log_behaviour(10, 0, 0.6)
    dataset = write_episodes(episodes, tmp_path / "log")
    rb = make_buffer(str(dataset.root), online_capacity=10_000, offline_fraction=0.5, seed=0)
    config = (DQNConfig().environment("CartPole-v1")
              .env_runners(num_env_runners=1, rollout_fragment_length=16)
              .callbacks(EnvRunnerWriter)
              .training(train_batch_size_per_learner=32, num_steps_sampled_before_learning_starts=0,
                        replay_buffer_config={"type": RAYRB_BUFFER, "buffer": rb.client()})
              .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[16]))
              .reporting(min_sample_timesteps_per_iteration=64, min_time_s_per_iteration=0)
              .debugging(seed=0, log_level="ERROR"))
    algo = config.build_algo()
    try:
        buffer = algo.local_replay_buffer
        written, sampled_online = [], []
        for _ in range(3):
            result = algo.train()
            written.append(rb.write_count)
            sampled_online.append(32 - result["replay_buffer"]["rayrb_offline_rows_per_sample"])
        steps = result["env_runners"]["num_env_steps_sampled_lifetime"]
        assert written[0] > 0 and written[0] < written[1] < written[2]  # the runner keeps writing
        assert written[-1] == steps  # n_step 1: each step sampled is a row at once
        assert buffer.get_added_timesteps() == 0  # nothing came through the driver's add
        assert sampled_online[-1] > 0  # the learner's batches held the runner's rows while it wrote
        _, info = rb.sample(64, return_info=True)
        assert int((~np.asarray(info["offline"])).sum()) == 32  # exact split, online rows from the runner
        episodes = buffer.sample(num_items=32, n_step=1, gamma=0.99, sample_episodes=True)
        online = ~np.asarray(buffer.last_info["offline"])
        assert online.sum() == 16 and all(len(e) == 1 for e in episodes)
        # CartPole's reward is 1 per step: the runner's rows are real transitions
        assert {float(e.get_rewards(0)) for e, o in zip(episodes, online) if o} == {1.0}
    finally:
        algo.stop()


def test_prioritized_dqn_sends_its_td_errors_back_as_priorities(ray_session, tmp_path):
    from ray.rllib.algorithms.dqn import DQNConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    from rayrb.integrations.rllib import write_episodes

    episodes, _ = load_job().log_behaviour(10, 0, 0.6)
    root = str(write_episodes(episodes, tmp_path / "log").root)
    config = (DQNConfig().environment("CartPole-v1")
              .env_runners(num_env_runners=0, rollout_fragment_length=8)
              .training(train_batch_size_per_learner=32, num_steps_sampled_before_learning_starts=0,
                        replay_buffer_config={
                            "type": "rayrb.integrations.rllib.PrioritizedOfflineToOnlineEpisodeReplayBuffer",
                            "capacity": 1000, "offline_dataset": root, "offline_fraction": 0.5, "alpha": 0.6,
                            "beta": 0.4, "seed": 0, "buffer_kwargs": {"storage_dir": str(tmp_path / "state")}})
              .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[16]))
              .reporting(min_sample_timesteps_per_iteration=64, min_time_s_per_iteration=0)
              .debugging(seed=0, log_level="ERROR"))
    algo = config.build_algo()
    buffer = algo.local_replay_buffer
    try:
        first = buffer.sample(num_items=64, n_step=1, sample_episodes=True, beta=0.4)
        assert {float(e.get_extra_model_outputs("weights")[0]) for e in first} == {1.0}  # every row at max priority
        algo.train()
        assert buffer.last_info is None  # DQN's training_step sent the last batch's TD errors back
        weights = [float(e.get_extra_model_outputs("weights")[0])
                   for e in buffer.sample(num_items=64, n_step=1, sample_episodes=True, beta=0.4)]
        assert min(weights) < 1.0 and max(weights) <= 1.0  # importance weights of the priorities DQN set
        with pytest.raises(ValueError, match="expected beta=0.4 .*got 1.0"):
            buffer.sample(num_items=8, n_step=1, sample_episodes=True, beta=1.0)
    finally:
        buffer.shutdown()
        algo.stop()
