"""rayrb rows answer RLlib's episode-buffer ``sample`` as RLlib's own ``EpisodeReplayBuffer`` does. No Ray."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rayrb.core.schema import RowSpec
from rayrb.integrations.rllib import EpisodeRows, episode_rows, n_step_transitions

GAMMA = 0.9


def episode_chunks(name, steps, cuts, terminated, rng):
    """One ended episode cut into chunks at ``cuts``, as env runners return them; rewards are multiples of 1/4,
    which float32 rows hold exactly."""
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    obs = rng.normal(size=(steps + 1, 4)).astype(np.float32)
    actions, rewards = rng.integers(0, 2, steps), rng.integers(-4, 5, steps) / 4
    bounds = sorted({0, steps, *cuts})
    return [SingleAgentEpisode(id_=name, observations=list(obs[a:b + 1]), actions=list(actions[a:b]),
                               rewards=list(rewards[a:b]), terminated=b == steps and terminated,
                               truncated=b == steps and not terminated, t_started=a, len_lookback_buffer=0)
            for a, b in zip(bounds[:-1], bounds[1:])]


def chunked_episodes(seed: int, num: int = 8):
    """Episodes, half terminated and half truncated, each cut at random steps."""
    rng = np.random.default_rng(seed)
    chunks = []
    for e in range(num):
        steps = int(rng.integers(2, 14))
        chunks += episode_chunks(f"episode{e}", steps, rng.integers(1, steps, 2).tolist(), e % 2 == 0, rng)
    return chunks


def rows_by_step(chunks, n_step):
    """Our rows, keyed by (episode id, t), written chunk by chunk."""
    writer, out = EpisodeRows(n_step), {}
    for c in chunks:
        rows = writer.add([c])
        for i in range(0 if rows is None else len(rows["t"])):
            out[(c.id_, int(rows["t"][i]))] = {k: v[i:i + 1] for k, v in rows.items()}
    assert writer.held_back == 0  # every episode ended: nothing is left unwritten
    return out


@pytest.mark.parametrize("n_step", [1, 3, (1, 4)])
def test_rows_give_rllib_n_step_transitions(n_step):
    from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer

    chunks = chunked_episodes(0)
    theirs = EpisodeReplayBuffer(capacity=10_000)
    for c in chunks:
        theirs.add(c)
    theirs.rng = np.random.default_rng(1)
    stored = 3
    ours = rows_by_step(chunks, stored)
    assert len(ours) == theirs.get_num_timesteps()  # one row per stored timestep
    lengths = {e.id_: len(e) for e in theirs.episodes}
    past_end = 0
    for ep in theirs.sample(num_items=400, n_step=n_step, gamma=GAMMA, sample_episodes=True):
        n = int(ep.get_extra_model_outputs("n_step")[0])
        mine = n_step_transitions(ours[(ep.id_, ep.t_started)], n, GAMMA)
        np.testing.assert_array_equal(mine["obs"][0], ep.get_observations(0))
        np.testing.assert_array_equal(mine["new_obs"][0], ep.get_observations(-1))
        assert mine["actions"][0] == ep.get_actions(0) and mine["n_step"][0] == n and mine["t"][0] == ep.t_started
        np.testing.assert_allclose(mine["rewards"][0], ep.get_rewards(0), rtol=1e-12)
        if ep.t_started + n > lengths[ep.id_]:
            # RLlib slices past the episode's end, which drops its terminated/truncated flag (slice() keeps it only
            # when the slice stops exactly at the end): the rows keep it, so the loss does not bootstrap there.
            past_end += 1
            assert not ep.is_done
            assert bool(mine["terminateds"][0] or mine["truncateds"][0])
        else:
            assert (bool(mine["terminateds"][0]), bool(mine["truncateds"][0])) == (ep.is_terminated, ep.is_truncated)
    assert (past_end > 0) == (n_step != 1)


def test_running_episode_holds_back_the_steps_it_cannot_look_ahead_from():
    chunks = episode_chunks("e", 9, [1, 5, 6], True, np.random.default_rng(2))
    whole = episode_rows(chunks, 3)
    writer, parts = EpisodeRows(3), []
    for c in chunks:
        parts.append(writer.add([c]))
        # n_step - 1 steps wait for the next chunk; none once the episode ended
        assert writer.held_back == (0 if c.is_done else min(2, c.t_started + len(c)))
    joined = {k: np.concatenate([p[k] for p in parts if p is not None]) for k in whole}
    for k in whole:
        np.testing.assert_array_equal(joined[k], whole[k])
    np.testing.assert_array_equal(whole["t"], np.arange(len(whole["t"])))
    assert whole["rewards"].shape[1:] == (3,) and whole["new_obs"].shape[1:] == (3, 4)


def test_rows_refuse_a_chunk_out_of_order_and_a_larger_n_step():
    chunks = episode_chunks("e", 6, [2, 4], False, np.random.default_rng(3))
    writer = EpisodeRows(2)
    writer.add([chunks[0]])
    with pytest.raises(ValueError, match="expected its chunk starting at t=2, got t_started=4"):
        writer.add([chunks[2]])
    rows = episode_rows(chunked_episodes(4, num=2), 2)
    with pytest.raises(ValueError, match=r"expected n_step between 1 and 2 .*got 3"):
        n_step_transitions(rows, 3, GAMMA)
    with pytest.raises(ValueError, match=r"expected an n_step range up to 3 .*got \(1, 4\)"):
        n_step_transitions(rows, (1, 4), GAMMA)
    with pytest.raises(ValueError, match="expected n_step to be a positive int, got 0"):
        EpisodeRows(0)


class InProcessRows:
    """The part of a rayrb handle the episode buffer uses, over rows in this process: keys, writes, and
    uniform batches with rayrb's provenance (all offline)."""

    def __init__(self, rows):
        self.rows = {k: np.asarray(v) for k, v in rows.items()}
        self.spec = RowSpec.from_arrays(self.rows)
        self.rng = np.random.default_rng(0)
        self.last = None

    def __len__(self):
        return len(self.rows["t"])

    def extend(self, rows):
        self.spec.validate(rows)
        self.rows = {k: np.concatenate([self.rows[k], rows[k]]) for k in self.rows}

    def sample(self, batch_size, return_info=False):
        self.last = idx = self.rng.integers(0, len(self), batch_size)
        batch = TensorDict({k: torch.from_numpy(v[idx]) for k, v in self.rows.items()}, [batch_size])
        info = {"offline": np.ones(batch_size, bool), "shard": np.zeros(batch_size, np.int64), "index": idx,
                "generation": np.ones(batch_size, np.int64)}
        return batch, info


def episode_buffer(n_step=3, **kwargs):
    from rayrb.integrations.rllib import OfflineToOnlineEpisodeReplayBuffer

    rows = InProcessRows(episode_rows(chunked_episodes(5), n_step))
    return OfflineToOnlineEpisodeReplayBuffer(buffer=rows, **kwargs), rows


def test_sample_answers_one_step_episodes_as_rllib_builds_them():
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    buf, rows = episode_buffer()
    episodes = buf.sample(num_items=16, n_step=2, gamma=GAMMA, sample_episodes=True, beta=0.4)
    expected = n_step_transitions({k: v[rows.last] for k, v in rows.rows.items()}, 2, GAMMA)
    assert len(episodes) == 16 and all(isinstance(e, SingleAgentEpisode) and len(e) == 1 for e in episodes)
    for i, e in enumerate(episodes):
        np.testing.assert_array_equal(e.get_observations(0), expected["obs"][i])
        np.testing.assert_array_equal(e.get_observations(-1), expected["new_obs"][i])
        assert e.get_rewards(0) == expected["rewards"][i] and e.get_actions(0) == expected["actions"][i]
        assert (e.is_terminated, e.is_truncated) == (expected["terminateds"][i], expected["truncateds"][i])
        assert e.get_extra_model_outputs("n_step")[0] == 2 and e.get_extra_model_outputs("weights")[0] == 1.0
    assert buf.get_metrics()["num_env_steps_sampled"] == 16


def test_add_writes_rows_of_episode_chunks():
    buf, rows = episode_buffer(n_step=2)
    before = len(rows)
    chunks = chunked_episodes(6, num=3)
    buf.add(chunks)
    assert len(rows) - before == sum(len(c) for c in chunks)  # every episode ended: every step is a row
    assert buf.get_num_episodes() == 3 and buf.get_added_timesteps() == len(rows) - before


def test_add_gathers_rows_per_write():
    buf, rows = episode_buffer(n_step=1, rows_per_write=20)
    before, writes = len(rows), []
    for c in chunked_episodes(10, num=6):
        buf.add(c)
        writes.append(len(rows) - before)
    assert writes[0] == 0 and writes[-1] >= 20  # nothing written until 20 rows were gathered
    assert all(w == 0 or w >= 20 for w in writes) and len(set(writes)) > 1


@pytest.mark.parametrize("kwargs, message", [
    ({"sample_episodes": False}, "expected sample_episodes=True .*got False"),
    ({"batch_length_T": 20}, "expected batch_length_T=0 .*got 20"),
    ({"include_infos": True}, "expected include_infos=False .*got True"),
    ({"include_extra_model_outputs": True}, "expected include_extra_model_outputs=False .*got True"),
    ({"min_batch_length_T": 4}, "expected min_batch_length_T=0 .*got 4"),
    ({"n_step": 4}, r"expected n_step between 1 and 3 .*got 4"),
    ({"n_step": (2, 6)}, r"expected an n_step range up to 4 .*got \(2, 6\)"),
    ({"replay_mode": "x"}, r"expected only RLlib's EpisodeReplayBuffer.sample arguments, got \['replay_mode'\]"),
])
def test_sample_refuses_what_it_cannot_answer(kwargs, message):
    buf, rows = episode_buffer()
    base = {"num_items": 8, "n_step": 1, "gamma": GAMMA, "sample_episodes": True}
    with pytest.raises(ValueError, match=message):
        buf.sample(**{**base, **kwargs})
    assert rows.last is None  # refused before anything was drawn


def test_construction_refuses_bad_settings():
    from rayrb.integrations.rllib import (
        OfflineToOnlineEpisodeReplayBuffer,
        PrioritizedOfflineToOnlineEpisodeReplayBuffer,
    )

    rows = InProcessRows(episode_rows(chunked_episodes(7), 2))
    with pytest.raises(ValueError, match="expected either buffer .* or offline_dataset, got neither"):
        OfflineToOnlineEpisodeReplayBuffer()
    with pytest.raises(ValueError, match="got both"):
        OfflineToOnlineEpisodeReplayBuffer(buffer=rows, offline_dataset="/nowhere")
    with pytest.raises(ValueError, match=r"expected only this buffer's settings, got \['alpha'\]"):
        OfflineToOnlineEpisodeReplayBuffer(buffer=rows, alpha=0.6)
    with pytest.raises(ValueError, match="expected n_step=2 .*got 3"):
        OfflineToOnlineEpisodeReplayBuffer(buffer=rows, n_step=3)
    with pytest.raises(ValueError, match="expected rows_per_write to be a positive int, got 0"):
        OfflineToOnlineEpisodeReplayBuffer(buffer=rows, rows_per_write=0)
    with pytest.raises(ValueError, match="expected batch_length_T a non-negative int .*got -1"):
        OfflineToOnlineEpisodeReplayBuffer(buffer=rows, batch_length_T=-1)
    with pytest.raises(ValueError, match="expected sequence_hold_steps to be a positive int, got 0"):
        OfflineToOnlineEpisodeReplayBuffer(buffer=rows, batch_length_T=8, sequence_hold_steps=0)
    old_rows = InProcessRows({k: v for k, v in episode_rows(chunked_episodes(7), 2).items() if k != "episode"})
    with pytest.raises(ValueError, match="expected rows with episode numbers .'episode'. for sequences"):
        OfflineToOnlineEpisodeReplayBuffer(buffer=old_rows, batch_length_T=8)
    with pytest.raises(ValueError, match="expected batch_length_T 0 or 1 with prioritized sampling .*got 8"):
        PrioritizedOfflineToOnlineEpisodeReplayBuffer(buffer=rows, batch_length_T=8)
    with pytest.raises(ValueError, match=r"expected rows with the keys .*missing \[.actions.*.horizon."):
        OfflineToOnlineEpisodeReplayBuffer(buffer=InProcessRows({"obs": np.zeros((4, 2)), "t": np.zeros(4)}))
    with pytest.raises(ValueError, match="expected no .*'alpha'.* with a given buffer"):
        PrioritizedOfflineToOnlineEpisodeReplayBuffer(buffer=rows, alpha=0.6)
    prioritized = PrioritizedOfflineToOnlineEpisodeReplayBuffer(buffer=rows)
    with pytest.raises(ValueError, match="expected a rayrb buffer that samples by priority"):
        prioritized.sample(num_items=4, n_step=1, sample_episodes=True)
    with pytest.raises(ValueError, match="expected a sample.. before update_priorities"):
        prioritized.update_priorities(np.ones(4))


def test_one_step_columns_are_the_rows_one_step_transitions():
    from rayrb.integrations.rllib import one_step_columns

    rows = episode_rows(chunked_episodes(8), 3)
    columns, expected = one_step_columns(rows), n_step_transitions(rows, 1, GAMMA)
    assert sorted(columns) == ["actions", "new_obs", "obs", "rewards", "terminateds", "truncateds"]
    for k in columns:
        np.testing.assert_array_equal(columns[k], expected[k])
    assert columns["terminateds"].sum() == 4 and columns["truncateds"].sum() == 4  # one last step per episode


def test_rllib_builds_the_buffer_from_its_class_path():
    """As ``Algorithm._create_local_replay_buffer_if_necessary`` does: the type's name must say EpisodeReplayBuffer,
    and RLlib's ``from_config`` imports the class from its path."""
    from ray.rllib.utils.from_config import from_config
    from ray.rllib.utils.replay_buffers.replay_buffer import ReplayBuffer

    from rayrb.integrations.rllib import OfflineToOnlineEpisodeReplayBuffer

    path = "rayrb.integrations.rllib.OfflineToOnlineEpisodeReplayBuffer"
    assert "EpisodeReplayBuffer" in path
    rows = InProcessRows(episode_rows(chunked_episodes(9), 1))
    buf = from_config(ReplayBuffer, {"type": path, "buffer": rows, "metrics_num_episodes_for_smoothing": 10})
    assert isinstance(buf, OfflineToOnlineEpisodeReplayBuffer) and buf.n_step == 1
    assert len(buf) == len(rows)


def test_what_rllibs_buffer_takes_and_rows_cannot_hold_is_refused_naming_it_and_a_state_keeps_its_episodes():
    """A multi-agent episode, or Dict / Tuple observations (flattened first in RLlib's connectors), are refused
    by name before any episode of the call is taken in; priorities may be a learner's tensor that needs grad; a
    saved state keeps the count of episodes ``add`` saw begin."""
    from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    from rayrb.errors import InvalidArgumentTypeError
    from rayrb.integrations.rllib import (
        OfflineToOnlineEpisodeReplayBuffer,
        PrioritizedOfflineToOnlineEpisodeReplayBuffer,
    )

    buf = OfflineToOnlineEpisodeReplayBuffer(buffer=InProcessRows(episode_rows(chunked_episodes(5), 1)))
    held = len(buf.rb)
    agents = MultiAgentEpisode(observations=[{"a": np.zeros(4, np.float32)}, {"a": np.ones(4, np.float32)}],
                               actions=[{"a": 1}], rewards=[{"a": 1.0}], terminateds={"a": True, "__all__": True},
                               len_lookback_buffer=0)
    tuples = SingleAgentEpisode(observations=[(np.zeros(4, np.float32), 1), (np.ones(4, np.float32), 2)],
                                actions=[0], rewards=[1.0], terminated=True, len_lookback_buffer=0)
    for bad, message in ((agents, "multi-agent episodes are not supported"), (tuples, "got a tuple: flatten")):
        with pytest.raises(InvalidArgumentTypeError, match=message):
            buf.add([*chunked_episodes(6, num=2), bad])
        assert len(buf.rb) == held and buf.get_num_episodes() == 0 and not buf._rows._open
    buf.add(chunked_episodes(6, num=3))
    again = OfflineToOnlineEpisodeReplayBuffer(buffer=InProcessRows(episode_rows(chunked_episodes(5), 1)))
    for b in (buf, again):  # the rows' own state is rayrb's (checked in tests/handle); here the counters
        b.rb.state_dict, b.rb.load_state_dict = (lambda: {}), (lambda s: None)
    again.set_state(buf.get_state())
    assert (again.get_added_timesteps(), again.get_num_episodes()) == (buf.get_added_timesteps(),
                                                                        buf.get_num_episodes()) and buf.get_num_episodes()

    class Prioritized(InProcessRows):
        def sample(self, b, return_info=False):
            batch, info = super().sample(b, True)
            return batch, {**info, "weight": np.ones(b, np.float32)}

        def update_priority(self, info, p):
            self.updated = np.asarray(p)
            return len(p)

    rows = Prioritized(episode_rows(chunked_episodes(5), 1))
    prioritized = PrioritizedOfflineToOnlineEpisodeReplayBuffer(buffer=rows)
    prioritized.sample(num_items=8, n_step=1, sample_episodes=True, beta=None)
    prioritized.update_priorities(-torch.rand(8, requires_grad=True))  # RLlib's buffer takes it as it comes
    assert rows.updated.shape == (8,) and (rows.updated >= 0).all()
