"""Sequences for RLlib's stateful modules (``batch_length_T > 0``): rayrb's slices of rows answer as the episode
slices RLlib's own ``EpisodeReplayBuffer`` samples from the same episodes. The first tests run without Ray, over a
stand-in that samples slices as rayrb's slice sampler does; the last ones on a real buffer."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from test_rllib_buffer import InProcessRows, episode_chunks

from rayrb.errors import InvalidArgumentError
from rayrb.integrations.rllib import episode_rows
from rayrb.integrations.rllib.transitions import EPISODE, episode_number

pytest.importorskip("ray.rllib")

T = 6
LENGTHS = [14, 3, 9, 6, 1, 11, 5, 20]  # some shorter than T: drawn whole


def episodes(seed: int, cuts: int = 3):
    """Ended episodes of LENGTHS steps (half terminated, half truncated), each cut into chunks."""
    rng = np.random.default_rng(seed)
    out = []
    for e, steps in enumerate(LENGTHS):
        cut = rng.integers(1, steps, cuts).tolist() if steps > 1 else []
        out.append(episode_chunks(f"{seed:04x}{e:04x}" + "0" * 24, steps, cut, e % 2 == 0, rng))
    return out


def interleaved(chunked):
    """Chunks as env runners hand them to ``add``: a few episodes' chunks in one call, episodes interleaved."""
    queue = [list(c) for c in chunked]
    while queue:
        yield [q.pop(0) for q in queue[:3]]
        queue = [q for q in queue[1:] + queue[:1] if q]


def valid_slices(lengths_by_id: dict[int, int], length: int) -> set[tuple[int, int, int]]:
    """``(episode, start, steps)`` of every slice rayrb draws: ``length`` steps within an episode, or a whole
    shorter one."""
    out = set()
    for e, n in lengths_by_id.items():
        out |= {(e, 0, n)} if n < length else {(e, s, length) for s in range(n - length + 1)}
    return out


class InProcessSlices(InProcessRows):
    """``InProcessRows`` drawing slices of ``length`` steps as ``SliceSampler(slice_len=length, traj_key="episode",
    strict_length=False)`` does: uniform over the runs of one episode number, a run shorter than ``length`` drawn
    whole. Records each write."""

    def __init__(self, rows, length, seed=0):
        super().__init__(rows)
        self.length, self.rng, self.writes = length, np.random.default_rng(seed), []

    def extend(self, rows):
        super().extend(rows)
        self.writes.append({k: np.asarray(v) for k, v in rows.items()})

    def _slices(self):
        ids = self.rows[EPISODE]
        cuts = [0, *(np.flatnonzero(ids[1:] != ids[:-1]) + 1).tolist(), len(ids)]
        out = []
        for a, b in zip(cuts[:-1], cuts[1:]):
            out += [(a, b)] if b - a < self.length else [(s, s + self.length) for s in range(a, b - self.length + 1)]
        return out

    def sample(self, batch_size, return_info=False):
        assert batch_size % self.length == 0
        slices = self._slices()
        picked = [slices[i] for i in self.rng.integers(0, len(slices), batch_size // self.length)]
        idx = np.concatenate([np.arange(a, b) for a, b in picked])
        init = np.zeros(len(idx), bool)
        init[np.cumsum([0] + [b - a for a, b in picked[:-1]])] = True
        batch = TensorDict({**{k: torch.from_numpy(v[idx]) for k, v in self.rows.items()},
                            "is_init": torch.from_numpy(init)}, [len(idx)])
        info = {"offline": np.ones(len(idx), bool), "shard": np.zeros(len(idx), np.int64), "index": idx}
        return batch, info


def rllib_buffer(chunked):
    from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer

    theirs = EpisodeReplayBuffer(capacity=100_000)
    for chunk in interleaved(chunked):
        theirs.add(chunk)
    return theirs


def check_against(theirs, ours_episodes, b, length):
    """Each sequence is RLlib's slice of the same episode at the same step; the sequences count ``b`` steps by
    RLlib's rule (``len + 1`` each; without the last one, fewer)."""
    stored = {episode_number(e.id_): e for e in theirs.episodes}
    counts = [len(e) + 1 for e in ours_episodes]
    assert sum(counts) >= b > sum(counts[:-1])
    for ep in ours_episodes:
        whole = stored[int(ep.id_, 16)]
        start, n = ep.t_started, len(ep)
        assert 1 <= n <= length and start + n <= len(whole)
        np.testing.assert_array_equal(np.stack(ep.get_observations()), np.stack(whole.get_observations(
            slice(start, start + n + 1))))
        np.testing.assert_array_equal(ep.get_actions(), whole.get_actions(slice(start, start + n)))
        np.testing.assert_array_equal(np.float32(ep.get_rewards()), np.float32(whole.get_rewards(
            slice(start, start + n))))
        at_end = start + n == len(whole)
        assert (ep.is_terminated, ep.is_truncated) == (at_end and whole.is_terminated, at_end and whole.is_truncated)
        assert ep.get_extra_model_outputs("n_step").tolist() == [1] * n
        assert ep.get_extra_model_outputs("weights").tolist() == [1.0] * n


@pytest.mark.parametrize("stored", [1, 3])
def test_sequences_are_rllib_slices_of_the_same_episodes_and_every_valid_slice_comes(stored):
    """Rows that look ``stored`` steps ahead (a log written for n-step DQN) serve one-step sequences too."""
    from rayrb.integrations.rllib import OfflineToOnlineEpisodeReplayBuffer

    offline, online = episodes(0), episodes(1)
    rows = InProcessSlices(episode_rows([c for e in offline for c in e], stored), T)
    ours = OfflineToOnlineEpisodeReplayBuffer(buffer=rows, batch_length_T=T, seed=3)
    for chunk in interleaved(online):
        ours.add(chunk)
    # each episode was written once it ended, in one write of its own: one run of rows
    assert [int(w["t"][0]) for w in rows.writes] == [0] * len(LENGTHS)
    assert sorted(len(w["t"]) for w in rows.writes) == sorted(LENGTHS)
    assert all((w[EPISODE] == w[EPISODE][0]).all() for w in rows.writes)
    theirs = rllib_buffer(offline + online)
    lengths = {episode_number(e.id_): len(e) for e in theirs.episodes}
    seen = set()
    for b in (32, 7, 43, 64):
        for _ in range(150):
            got = ours.sample(num_items=b, batch_length_T=T, n_step=1, lookback=1, sample_episodes=True)
            check_against(theirs, got, b, T)
            seen |= {(int(e.id_, 16), e.t_started, len(e)) for e in got}
    assert seen == valid_slices(lengths, T)  # every valid slice came, and nothing else
    # RLlib's own full-length sequences from these episodes are among ours (it also starts near an episode's end
    # and cuts those short)
    drawn = theirs.sample(num_items=2000, batch_length_T=T, n_step=1, lookback=1, sample_episodes=True)
    full = {(episode_number(e.id_), e.t_started, len(e)) for e in drawn if len(e) == T}
    assert full and full <= valid_slices(lengths, T)


def test_burn_in_skips_sequences_no_longer_than_it_and_a_running_episode_waits_until_it_ends():
    from rayrb.integrations.rllib import OfflineToOnlineEpisodeReplayBuffer

    offline = episodes(4)
    rows = InProcessSlices(episode_rows([c for e in offline for c in e], 1), T)
    ours = OfflineToOnlineEpisodeReplayBuffer(buffer=rows, batch_length_T=T, sequence_hold_steps=8)
    for _ in range(40):
        got = ours.sample(num_items=40, batch_length_T=T, n_step=1, min_batch_length_T=3, sample_episodes=True)
        assert min(len(e) for e in got) > 3  # RLlib's rule: a sequence must be longer than the burn-in
    long = episode_chunks("f" * 32, 20, [5, 7, 12, 19], False, np.random.default_rng(5))
    written = len(rows)
    ours.add(long[0])
    ours.add(long[1])
    assert len(rows) == written  # 7 steps held: fewer than sequence_hold_steps, episode running
    ours.add(long[2])
    assert len(rows) == written + 12  # 12 held: written as one piece
    ours.add(long[3])
    ours.add(long[4])
    assert len(rows) == written + 20 and [len(w["t"]) for w in rows.writes] == [12, 8]


def test_a_failed_write_is_written_by_the_next_add_once():
    """``add`` writes an episode a write; a write that fails leaves it, and the episodes after it, to the next
    ``add``: every episode lands once, whole."""
    from rayrb.errors import WriteTimeoutError
    from rayrb.integrations.rllib import OfflineToOnlineEpisodeReplayBuffer

    rows = InProcessSlices(episode_rows([c for e in episodes(10) for c in e], 1), T)
    ours = OfflineToOnlineEpisodeReplayBuffer(buffer=rows, batch_length_T=T)
    # the second write fails before it lands; the fifth lands and then times out (its answer lost)
    extend, events, ids = rows.extend, iter([None, "fails", None, None, "times out"]), set()

    def flaky(part, write_id=None):
        event = next(events, None)
        if event == "fails":
            raise ConnectionError("the shard went away")
        if write_id in ids:
            return  # a retry of a write that landed: answered, not written again
        extend(part)
        ids.add(write_id or f"id{len(ids)}")
        if event == "times out":
            raise WriteTimeoutError("no answer in time", write_id=f"id{len(ids) - 1}")

    rows.extend = flaky
    online, failed = episodes(11, cuts=0), 0  # whole episodes, four in each add
    for i in range(0, len(online), 4):
        try:
            ours.add([e[0] for e in online[i:i + 4]])
        except (ConnectionError, WriteTimeoutError):
            failed += 1
    ours.add([])  # an add with nothing new still writes what is left
    assert failed == 2
    assert sorted(len(w["t"]) for w in rows.writes) == sorted(LENGTHS)  # each episode once, whole
    assert len({int(w[EPISODE][0]) for w in rows.writes}) == len(LENGTHS)


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_length_T": 0}, "expected batch_length_T=6 .this buffer serves sequences"),
    ({"batch_length_T": 5}, "expected batch_length_T=6 .*got 5"),
    ({"batch_length_T": 6, "lookback": 2}, "expected lookback=0 or 1 .*got 2"),
    ({"batch_length_T": 6, "min_batch_length_T": 6}, "expected min_batch_length_T=an int from 0 to 5 .*got 6"),
    ({"batch_length_T": 6, "n_step": 3}, "expected n_step=1 .*got 3"),
])
def test_a_sequence_buffer_refuses_what_it_cannot_answer(kwargs, message):
    from rayrb.integrations.rllib import OfflineToOnlineEpisodeReplayBuffer

    rows = InProcessSlices(episode_rows([c for e in episodes(6) for c in e], 1), T)
    ours = OfflineToOnlineEpisodeReplayBuffer(buffer=rows, batch_length_T=T)
    with pytest.raises(ValueError, match=message):
        ours.sample(num_items=8, sample_episodes=True, **{"n_step": 1, **kwargs})


def test_a_given_buffer_that_samples_rows_not_slices_is_refused_when_sampled():
    from rayrb.integrations.rllib import OfflineToOnlineEpisodeReplayBuffer

    rows = InProcessRows(episode_rows([c for e in episodes(7) for c in e], 1))
    ours = OfflineToOnlineEpisodeReplayBuffer(buffer=rows, batch_length_T=T)
    with pytest.raises(ValueError, match="expected a buffer that samples slices of 6 steps over 'episode'"):
        ours.sample(num_items=8, batch_length_T=T, n_step=1, sample_episodes=True)


def test_a_built_buffer_serves_sequences_with_an_exact_offline_share_from_its_shards(ray_session, tmp_path):
    """On a real buffer (offline episodes logged with ``write_episodes``, online ones added as env runners hand
    them over, two shards a side): each draw holds exactly ``floor(f * slices + 1/2)`` offline sequences, and
    every sequence is RLlib's slice of the same episode."""
    from rayrb.integrations.rllib import OfflineToOnlineEpisodeReplayBuffer, write_episodes

    offline, online = episodes(8), episodes(9)
    write_episodes([c for e in offline for c in e], tmp_path / "log", n_step=2)
    ours = OfflineToOnlineEpisodeReplayBuffer(
        capacity=256, offline_dataset=str(tmp_path / "log"), offline_fraction=0.5, batch_length_T=T, seed=11,
        buffer_kwargs={"num_offline_shards": 2, "num_online_shards": 2, "storage_dir": str(tmp_path / "state")})
    try:
        for chunk in interleaved(online):
            ours.add(chunk)
        assert len(ours.rb) == 2 * sum(LENGTHS)
        draws, sample = [], ours.rb.sample

        def recorded(*args, **kwargs):
            draws.append(sample(*args, **kwargs))
            return draws[-1]

        ours.rb.sample = recorded
        theirs = rllib_buffer(offline + online)
        shards = {True: set(), False: set()}
        for b in (15, 43):
            for _ in range(10):
                draws.clear()
                check_against(theirs, ours.sample(num_items=b, batch_length_T=T, n_step=1, lookback=1,
                                                  sample_episodes=True), b, T)
                for batch, info in draws:
                    init = batch["is_init"].numpy().reshape(-1)
                    side = np.asarray(info["offline"]).reshape(-1)
                    k, off = int(init.sum()), int(side[init].sum())
                    assert off == int(np.floor(0.5 * k + 0.5)), (k, off)
                    for o, shard in zip(side[init], np.asarray(info["shard"]).reshape(-1)[init]):
                        shards[bool(o)].add(int(shard))
        assert len(shards[True]) == 2 and len(shards[False]) == 2  # both shards of each side served sequences
    finally:
        ours.shutdown()


def test_rllib_dqn_with_an_lstm_trains_on_rayrb_sequences(ray_session, tmp_path):
    """RLlib's DQN with a stateful (LSTM) module asks the buffer for sequences of ``max_seq_len`` steps: it trains
    on rayrb's through ``replay_buffer_config``, and each batch it sampled was made of them."""
    pytest.importorskip("gymnasium")
    from ray.rllib.algorithms.dqn import DQNConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    from rayrb.integrations.rllib import write_episodes

    seq = 8
    log = _cartpole_log(tmp_path / "log", write_episodes)
    config = (DQNConfig().environment("CartPole-v1")
              .env_runners(num_env_runners=0, rollout_fragment_length=50)
              .rl_module(model_config=DefaultModelConfig(use_lstm=True, max_seq_len=seq, lstm_cell_size=16,
                                                         fcnet_hiddens=[16]))
              .training(train_batch_size=32, num_steps_sampled_before_learning_starts=0, n_step=1,
                        replay_buffer_config={
                            "type": "rayrb.integrations.rllib.OfflineToOnlineEpisodeReplayBuffer", "capacity": 2000,
                            "offline_dataset": str(log), "offline_fraction": 0.5, "batch_length_T": seq,
                            "buffer_kwargs": {"storage_dir": str(tmp_path / "state")}}))
    algo = config.build_algo()
    try:
        buffer = algo.local_replay_buffer
        for _ in range(2):
            result = algo.train()
        assert buffer._seq_len == seq and buffer.sampled_timesteps >= 2 * 32
        info = buffer.last_info
        assert info is not None and np.asarray(info["offline"]).any()
        learner = result["learners"]["default_policy"]
        assert np.isfinite(learner["qf_loss"])
    finally:
        algo.stop()
        buffer.shutdown()


def _cartpole_log(root, write_episodes):
    """Random-policy CartPole episodes, logged as rows with episode numbers."""
    import gymnasium as gym
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    env, rng, logged = gym.make("CartPole-v1"), np.random.default_rng(0), []
    for e in range(20):
        obs, _ = env.reset(seed=e)
        ep = SingleAgentEpisode(observations=[obs], len_lookback_buffer=0)
        done = False
        while not done:
            action = int(rng.integers(2))
            obs, reward, terminated, truncated, _ = env.step(action)
            ep.add_env_step(obs, action, reward, terminated=terminated, truncated=truncated)
            done = terminated or truncated
        logged.append(ep)
    write_episodes(logged, root)
    return root


def test_an_env_runner_writes_each_episode_whole_where_the_config_asks_for_sequences():
    """``EnvRunnerWriter`` with ``batch_length_T`` in the config: each episode's rows wait until it ends and go in a
    write of their own (as the buffer's ``add`` writes them); without it, chunks go as they come."""
    from types import SimpleNamespace

    from rayrb.integrations.rllib import EnvRunnerWriter

    for config, whole in (({"batch_length_T": T}, True), ({}, False)):
        rows = InProcessSlices(episode_rows([c for e in episodes(12) for c in e], 1), T)
        runner = SimpleNamespace(config=SimpleNamespace(in_evaluation=False,
                                                        replay_buffer_config={"buffer": rows, **config}))
        writer = EnvRunnerWriter()
        for chunk in interleaved(episodes(13)):
            samples = list(chunk)
            writer.on_sample_end(env_runner=runner, samples=samples)
            assert samples == []  # taken: the driver writes nothing twice
        if whole:
            assert sorted(len(w["t"]) for w in rows.writes) == sorted(LENGTHS)
            assert all((w[EPISODE] == w[EPISODE][0]).all() and w["t"][0] == 0 for w in rows.writes)
        else:
            assert len(rows.writes) == len(list(interleaved(episodes(13))))  # a write a sample, episodes mixed
        assert sum(len(w["t"]) for w in rows.writes) == sum(LENGTHS)


def test_an_env_runner_refuses_sequence_settings_that_are_not_ints_and_takes_no_rows():
    from types import SimpleNamespace

    from rayrb.integrations.rllib import EnvRunnerWriter

    cases = [("sequence_hold_steps", bad, "to be a positive int") for bad in (0, -5, 2.5, "100", True)]
    cases += [("batch_length_T", bad, "a non-negative int") for bad in (-1, 8.0, "8", True)]
    for key, bad, expected in cases:
        rows = InProcessSlices(episode_rows([c for e in episodes(12) for c in e], 1), T)
        runner = SimpleNamespace(config=SimpleNamespace(in_evaluation=False, replay_buffer_config={
            "buffer": rows, "batch_length_T": T, key: bad}))
        samples = list(next(iter(interleaved(episodes(13)))))
        with pytest.raises(InvalidArgumentError, match=f"expected {key} {re.escape(expected)}.*got "
                                                       f"{re.escape(repr(bad))}"):
            EnvRunnerWriter().on_sample_end(env_runner=runner, samples=samples)
        assert samples and rows.writes == []  # refused before anything was taken from the runner
