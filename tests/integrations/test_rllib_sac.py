"""RLlib's SAC (new API stack) trains on a rayrb buffer named in ``replay_buffer_config``: Pendulum-v1's continuous
actions, n-step returns, a logged random policy on the offline side, and every batch with exactly its offline share."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gymnasium")
pytest.importorskip("ray.rllib")

UNIFORM = "rayrb.integrations.rllib.OfflineToOnlineEpisodeReplayBuffer"
PRIORITIZED = "rayrb.integrations.rllib.PrioritizedOfflineToOnlineEpisodeReplayBuffer"
B, FRACTION, N_STEP, FRAGMENT = 32, 0.25, 3, 8
OFFLINE_PER_BATCH = 8  # floor(0.25 * 32 + 1/2)


def log_random_policy(episodes: int, seed: int) -> list:
    """Pendulum-v1 episodes (200 steps each) of a uniformly random torque, as RLlib episodes."""
    import gymnasium as gym
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    env, out = gym.make("Pendulum-v1"), []
    env.action_space.seed(seed)
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed * 1000 + ep)
        observations, actions, rewards, done = [obs], [], [], (False, False)
        while not any(done):
            a = env.action_space.sample()
            obs, r, *done, _ = env.step(a)
            observations.append(obs)
            actions.append(a)
            rewards.append(float(r))
        out.append(SingleAgentEpisode(observations=observations, actions=actions, rewards=rewards,
                                      terminated=done[0], truncated=done[1], len_lookback_buffer=0))
    env.close()
    return out


def sac_config(replay_buffer_config: dict, num_env_runners: int = 0):
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    from rayrb.integrations.rllib import SACConfig

    return (SACConfig().environment("Pendulum-v1")
            .env_runners(num_env_runners=num_env_runners, rollout_fragment_length=FRAGMENT)
            .training(train_batch_size_per_learner=B, n_step=N_STEP, num_steps_sampled_before_learning_starts=0,
                      replay_buffer_config=replay_buffer_config)
            .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[16], head_fcnet_hiddens=[16]))
            .reporting(min_sample_timesteps_per_iteration=4 * FRAGMENT, min_time_s_per_iteration=0)
            .debugging(seed=0, log_level="ERROR"))


def count_offline_rows(buffer) -> list[int]:
    """Record, for each batch SAC samples from ``buffer``, how many of its rows are logged ones."""
    counts, sample = [], buffer.sample

    def counted(*args, **kwargs):
        episodes = sample(*args, **kwargs)
        counts.append(int(np.asarray(buffer.last_info["offline"]).sum()))
        return episodes

    buffer.sample = counted
    return counts


@pytest.fixture
def offline_log(tmp_path):
    from rayrb.integrations.rllib import write_episodes

    return str(write_episodes(log_random_policy(2, 0), tmp_path / "log", n_step=N_STEP).root)


def test_sac_trains_on_rayrb_named_in_its_replay_buffer_config(ray_session, offline_log, tmp_path):
    from ray.rllib.algorithms.sac import SAC

    algo = sac_config({"type": UNIFORM, "capacity": 1000, "offline_dataset": offline_log,
                       "offline_fraction": FRACTION, "seed": 0,
                       "buffer_kwargs": {"storage_dir": str(tmp_path / "state")}}).build_algo()
    buffer = algo.local_replay_buffer
    try:
        assert type(algo) is SAC and type(buffer).__name__ == "OfflineToOnlineEpisodeReplayBuffer"
        counts = count_offline_rows(buffer)
        for _ in range(3):
            result = algo.train()
        steps = result["env_runners"]["num_env_steps_sampled_lifetime"]
        assert steps >= 3 * 4 * FRAGMENT and len(counts) >= 12  # one batch per training step
        assert counts == [OFFLINE_PER_BATCH] * len(counts)  # every batch SAC drew: exactly its offline share
        assert result["replay_buffer"]["rayrb_offline_rows_per_sample"] == OFFLINE_PER_BATCH
        assert np.isfinite(result["learners"]["default_policy"]["qf_loss"])
        # every step SAC's env runner sampled went online, but the last n_step - 1 (their 3-step future is unknown)
        assert buffer.get_num_timesteps() - 2 * 200 == steps - (N_STEP - 1)
        episodes = buffer.sample(num_items=B, n_step=N_STEP, gamma=0.99, sample_episodes=True)
        actions = np.stack([e.get_actions(0) for e in episodes])
        assert actions.shape == (B, 1) and actions.dtype == np.float32 and np.abs(actions).max() <= 2.0
        assert {int(e.get_extra_model_outputs("n_step")[0]) for e in episodes} == {N_STEP}
    finally:
        buffer.shutdown()
        algo.stop()


def test_prioritized_sac_sends_its_td_errors_back_as_priorities(ray_session, offline_log, tmp_path):
    algo = sac_config({"type": PRIORITIZED, "capacity": 1000, "offline_dataset": offline_log,
                       "offline_fraction": FRACTION, "alpha": 0.6, "beta": 0.4, "seed": 0,
                       "buffer_kwargs": {"storage_dir": str(tmp_path / "state")}}).build_algo()
    buffer = algo.local_replay_buffer
    try:
        first = buffer.sample(num_items=64, n_step=1, sample_episodes=True, beta=0.4)
        assert {float(e.get_extra_model_outputs("weights")[0]) for e in first} == {1.0}  # every row at max priority
        counts = count_offline_rows(buffer)
        result = algo.train()
        assert counts and counts == [OFFLINE_PER_BATCH] * len(counts)
        assert buffer.last_info is None  # SAC's training_step sent the last batch's TD errors back
        assert np.isfinite(result["learners"]["default_policy"]["qf_loss"])
        weights = [float(e.get_extra_model_outputs("weights")[0])
                   for e in buffer.sample(num_items=64, n_step=1, sample_episodes=True, beta=0.4)]
        assert min(weights) < 1.0 and max(weights) <= 1.0  # importance weights of the priorities SAC set
    finally:
        buffer.shutdown()
        algo.stop()


def test_env_runner_on_another_actor_writes_sac_steps(make_buffer, offline_log):
    from rayrb.integrations.rllib import EnvRunnerWriter

    rb = make_buffer(offline_log, online_capacity=1000, offline_fraction=FRACTION, seed=0)
    algo = sac_config({"type": UNIFORM, "buffer": rb.client()}, num_env_runners=1).callbacks(EnvRunnerWriter)
    algo = algo.build_algo()
    try:
        buffer = algo.local_replay_buffer
        counts = count_offline_rows(buffer)
        written = []
        for _ in range(2):
            result = algo.train()
            written.append(rb.write_count)
        steps = result["env_runners"]["num_env_steps_sampled_lifetime"]
        assert 0 < written[0] < written[1] == steps - (N_STEP - 1)  # the runner's steps, 3-step rows
        assert buffer.get_added_timesteps() == 0  # nothing came through the driver's add
        assert counts and counts == [OFFLINE_PER_BATCH] * len(counts)
    finally:
        algo.stop()


def test_sac_config_refuses_the_class_and_rllib_checks_the_rest():
    from ray.rllib.algorithms.sac import SACConfig as RLlibSACConfig

    from rayrb.errors import InvalidArgumentError
    from rayrb.integrations.rllib import OfflineToOnlineEpisodeReplayBuffer, SACConfig

    config = SACConfig().environment("Pendulum-v1").training(replay_buffer_config={"type": UNIFORM, "capacity": 8})
    config.validate()
    assert config.replay_buffer_config == {"type": UNIFORM, "capacity": 8}  # the class path, as given
    with pytest.raises(ValueError, match="must be of type `EpisodeReplayBuffer`"):
        RLlibSACConfig().environment("Pendulum-v1").training(replay_buffer_config={"type": UNIFORM}).validate()
    with pytest.raises(InvalidArgumentError, match="expected replay_buffer_config\\['type'\\] as a class path"):
        SACConfig().training(replay_buffer_config={"type": OfflineToOnlineEpisodeReplayBuffer}).validate()
    with pytest.raises(ValueError, match="must be of type `EpisodeReplayBuffer`"):  # not a buffer: RLlib's refusal
        SACConfig().training(replay_buffer_config={"type": "rayrb.integrations.rllib.EnvRunnerWriter"}).validate()
    with pytest.raises(ValueError, match="`n_step`"):  # SAC's other checks still run
        SACConfig().env_runners(rollout_fragment_length=2).training(
            n_step=(1, 3), replay_buffer_config={"type": UNIFORM}).validate()
    assert SACConfig().get_state()["class"] is SACConfig  # what Algorithm rebuilds the config from
