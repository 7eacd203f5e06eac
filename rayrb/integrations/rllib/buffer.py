"""A rayrb buffer as RLlib's replay buffer (new API stack): DQN and SAC sample it as their own episode buffer.

RLlib's off-policy algorithms take an ``EpisodeReplayBuffer`` subclass by its class path::

    config.training(replay_buffer_config={
        "type": "rayrb.integrations.rllib.OfflineToOnlineEpisodeReplayBuffer",
        "capacity": 50_000, "offline_dataset": "/data/cartpole_log", "offline_fraction": 0.5})

(a class path, not the class: RLlib's ``Algorithm`` tests the type's name for "EpisodeReplayBuffer"). SAC takes
it from ``rayrb.integrations.rllib.SACConfig`` (``sac``): RLlib's own ``SACConfig`` accepts only its buffers' names.
``add`` turns episode chunks into rows (``transitions``) and writes them to the online side; ``sample``
draws a batch with the exact offline/online split and answers with the 1-step episodes RLlib's
``EpisodeReplayBuffer._sample_episodes`` builds: the same n-step return, next observation, flags,
``n_step`` and ``weights``. Built with ``batch_length_T=T`` (``replay_buffer_config``), it serves a stateful
module's sequences instead: RLlib's episode slices of up to ``T`` steps, each from one episode (``sequences``).
Settings it cannot honour are refused, not ignored.

This module imports RLlib; ``rayrb.integrations.rllib`` imports it only when one of its classes is asked for.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from ray.rllib.core import DEFAULT_AGENT_ID, DEFAULT_MODULE_ID
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer
from ray.rllib.utils import force_list
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer

from rayrb.errors import InvalidArgumentError, SchemaError
from rayrb.integrations.rllib.pending import check_write_settings, episode_writes, sequence_length
from rayrb.integrations.rllib.sequences import length_refusals, sample_sequences
from rayrb.integrations.rllib.transitions import (
    EPISODE,
    KEYS,
    SEQUENCE_HOLD_STEPS,
    check_n_step,
    n_step_transitions,
    row_n_step,
)
from rayrb.io.arrays import as_numpy

OFFLINE_ROWS_PER_SAMPLE = "rayrb_offline_rows_per_sample"


class OfflineToOnlineEpisodeReplayBuffer(EpisodeReplayBuffer):
    """RLlib's episode replay buffer over a rayrb ``OfflineToOnlineReplayBuffer``.

    Either attach to a buffer (``buffer``: its owner or a ``client()``, which env runners can write into
    with ``EnvRunnerWriter``), or let this class build one over ``offline_dataset`` (it then owns it:
    ``shutdown()`` stops it).

    Args:
        capacity: online rows (timesteps) the built buffer holds; RLlib's name.
        buffer: a rayrb buffer (owner or client) to use as it is.
        offline_dataset: the logged rows to build a buffer over: a chunk-dataset directory written by
            ``write_episodes`` (or anything ``OfflineToOnlineReplayBuffer`` takes with these rows).
        offline_fraction: the built buffer's offline share of each batch: a number or a schedule
            (``rayrb.core.schedules``; its step counts ``sample`` calls).
        n_step: the most steps each row looks ahead; default: the rows' (``write_episodes(n_step=)``).
        seed: the built buffer's seed, and the seed of n-steps drawn from a range.
        buffer_kwargs: more ``OfflineToOnlineReplayBuffer`` options for the built buffer (shards, ...).
        rows_per_write: rows ``add`` gathers before it writes them in one ``extend`` (default 1: each ``add``
            writes at once, in the driver's own process where the shard and coordinator run on its node:
            rayrb.handle.direct). Gathered rows are not sampled until written.
        batch_length_T: 0 or 1: ``sample`` serves one-step transitions (what DQN and SAC ask for); ``T >= 2``:
            it serves sequences of ``T`` steps (what DQN asks for with a stateful module: its ``max_seq_len``),
            and only those. The built buffer then samples slices of ``T`` steps of one episode (a given buffer
            must: ``SliceSampler(slice_len=T, traj_key="episode", strict_length=False)``), and ``add`` writes
            each episode's rows once it ends (or each ``sequence_hold_steps`` steps), one write per episode, so
            an episode is one run of rows in one shard.
        sequence_hold_steps: with sequences, the most steps of a running episode ``add`` holds before it writes
            them (a longer episode is written in pieces of that many steps; a sequence does not cross from one
            piece to the next unless they landed next to each other in one shard).
        batch_size_B, metrics_num_episodes_for_smoothing: RLlib's.
    """

    _sampler = None  # what the built buffer samples with (None: rayrb's default)

    def __init__(self, capacity: int = 10000, *, buffer: Any = None, offline_dataset: Any = None,
                 offline_fraction: Any = 0.5, n_step: int | None = None, seed: int | None = None,
                 buffer_kwargs: dict | None = None, rows_per_write: int = 1, batch_size_B: int = 16,
                 batch_length_T: int = 1, sequence_hold_steps: int = SEQUENCE_HOLD_STEPS,
                 metrics_num_episodes_for_smoothing: int = 100, **kwargs: Any):
        self._check_settings(kwargs)
        check_write_settings(rows_per_write=rows_per_write, sequence_hold_steps=sequence_hold_steps)
        self._seq_len = sequence_length(batch_length_T)
        self._check_sequences(buffer)
        EpisodeReplayBuffer.__init__(self, capacity=capacity, batch_size_B=batch_size_B, batch_length_T=1,
                                     metrics_num_episodes_for_smoothing=metrics_num_episodes_for_smoothing)
        if (buffer is None) == (offline_dataset is None):
            raise InvalidArgumentError("expected either buffer (a rayrb buffer or its client) or offline_dataset, got "
                                       + ("both" if buffer is not None else "neither"))
        self._owned = buffer is None
        if buffer is None:
            from rayrb.handle.owner import OfflineToOnlineReplayBuffer

            options = dict(buffer_kwargs or {})
            if self._sampler is not None:
                options.setdefault("sampler", self._sampler)
            if self._seq_len is not None:
                from rayrb.core.slice_sampling import SliceSampler

                options.setdefault("sampler", SliceSampler(slice_len=self._seq_len, traj_key=EPISODE,
                                                           strict_length=False))
            options.update(self._priority_settings())
            buffer = OfflineToOnlineReplayBuffer(offline_dataset, online_capacity=capacity,
                                                 offline_fraction=offline_fraction, seed=seed, **options)
        elif buffer_kwargs:
            raise InvalidArgumentError(f"expected no buffer_kwargs with a given buffer (its settings are its own), "
                                       f"got {sorted(buffer_kwargs)}")
        self.rb = buffer
        try:
            self.n_step = row_n_step(buffer.spec)
            if n_step is not None and n_step != self.n_step:
                raise InvalidArgumentError(
                    f"expected n_step={self.n_step} (how far the buffer's rows look ahead), got {n_step}")
            if self._seq_len is not None and EPISODE not in buffer.spec.keys:
                raise SchemaError(f"expected rows with episode numbers ('{EPISODE}') for sequences, got keys "
                                  f"{buffer.spec.keys}: write the offline episodes again with write_episodes")
        except BaseException:
            self.shutdown()  # a buffer built here and refused here is not left running
            raise
        self.rng = np.random.default_rng(seed)
        self._rows, self._pending = episode_writes(self.n_step, self._seq_len is not None, sequence_hold_steps,
                                                   rows_per_write)
        self._episodes_started = 0
        self._last_info: dict | None = None

    # RLlib's interface ------------------------------------------------------------------------------------
    def add(self, episodes: Any) -> None:
        """Write the episode chunks' rows to the online side (steps whose n-step future is unknown wait; with
        sequences, steps of running episodes wait). Rows a failed write left are written first, by this call or
        the next one."""
        episodes = force_list(episodes)
        rows = self._rows.add(episodes)  # checks each is one agent's episode chunk first
        new = sum(1 for e in episodes if e.t_started == 0)  # an episode's first chunk starts at its reset
        steps = sum(len(e) for e in episodes)
        self._episodes_started += new
        self._num_timesteps_added += steps
        self._update_add_metrics(
            num_episodes_added=new, num_env_steps_added=steps, num_episodes_evicted=0, num_env_steps_evicted=0,
            agent_to_num_episodes_added={DEFAULT_AGENT_ID: new}, agent_to_num_steps_added={DEFAULT_AGENT_ID: steps},
            agent_to_num_episodes_evicted={DEFAULT_AGENT_ID: 0}, agent_to_num_steps_evicted={DEFAULT_AGENT_ID: 0},
            module_to_num_episodes_added={DEFAULT_MODULE_ID: new}, module_to_num_steps_added={DEFAULT_MODULE_ID: steps},
            module_to_num_episodes_evicted={DEFAULT_MODULE_ID: 0}, module_to_num_steps_evicted={DEFAULT_MODULE_ID: 0})
        self._pending.add(rows)
        self._pending.write(self.rb.extend, self.rb.spec)

    def sample(self, num_items: int | None = None, *, batch_size_B: int | None = None,
               batch_length_T: int | None = None, n_step: Any = None, beta: float | None = 0.0,
               gamma: float = 0.99, include_infos: bool = False, include_extra_model_outputs: bool = False,
               sample_episodes: bool | None = False, to_numpy: bool = False, lookback: int = 0,
               min_batch_length_T: int = 0, **kwargs: Any) -> list[SingleAgentEpisode]:
        """One batch as RLlib's one-step episodes (``sample_episodes=True``, as DQN and SAC ask), or with
        ``batch_length_T`` its sequences (``rayrb.integrations.rllib.sequences``).

        The rows hold exactly ``floor(f * B + 1/2)`` offline transitions (slices, for sequences); each episode
        carries RLlib's n-step return, ``n_step`` and ``weights`` (importance weights when prioritized, else 1).
        """
        seq = self._seq_len
        refused = {
            "sample_episodes": (not sample_episodes, "True (batches of [B, T] rows are not served)", sample_episodes),
            "include_infos": (include_infos, "False (infos are not stored)", include_infos),
            "include_extra_model_outputs": (include_extra_model_outputs, "False (extra model outputs are not "
                                            "stored)", include_extra_model_outputs),
        }
        refused.update(length_refusals(seq, batch_length_T, lookback, min_batch_length_T, n_step))
        for name, (bad, expected, got) in refused.items():
            if bad:
                raise InvalidArgumentError(f"expected {name}={expected}, got {got!r}")
        if kwargs:
            raise InvalidArgumentError(
                f"expected only RLlib's EpisodeReplayBuffer.sample arguments, got {sorted(kwargs)}")
        if num_items is not None and batch_size_B is not None:
            raise InvalidArgumentError(f"expected num_items or batch_size_B, got both ({num_items}, {batch_size_B})")
        self._check_beta(beta)
        check_n_step(n_step, self.n_step)  # before drawing: a refused call leaves the stream as it was
        b = int(num_items or batch_size_B or self.batch_size_B)
        if seq is not None:
            episodes, infos = sample_sequences(self.rb, b, seq, int(min_batch_length_T or 0))
            self._last_info, starts = infos[-1], {(e.id_, e.t_started) for e in episodes}
            self._log_sample(b, np.concatenate([i["offline"] for i in infos]), starts, len({i for i, _ in starts}), 1.)
            return episodes
        batch, info = self.rb.sample(b, return_info=True)
        rows = {k: batch[k].numpy() for k in KEYS}
        tr = n_step_transitions(rows, n_step, gamma, self.rng)
        weights = self._weights(info, len(tr["t"]))
        self._last_info = info
        episodes = [_one_step_episode(tr, weights, i) for i in range(len(tr["t"]))]
        ids = set(zip(np.asarray(info["offline"]).tolist(), np.asarray(info["shard"]).tolist(),
                      np.asarray(info["index"]).tolist()))
        self._log_sample(len(tr["t"]), np.asarray(info["offline"]), ids, len(tr["t"]), float(tr["n_step"].mean()))
        return episodes

    def get_num_timesteps(self, module_id: Any = None) -> int:
        """Rows the buffer holds, offline and online."""
        return len(self.rb)

    def get_num_episodes(self, module_id: Any = None) -> int:
        """Episodes this buffer's ``add`` has seen begin (offline rows and other writers' are not episodes here)."""
        return self._episodes_started

    def get_state(self) -> dict[str, Any]:
        """The sampling state (rayrb's ``state_dict``) and counters; the rows stay in the shards (``rb.dumps``
        saves them)."""
        return {"rayrb": self.rb.state_dict(), "sampled_timesteps": self.sampled_timesteps,
                "_num_timesteps_added": self._num_timesteps_added, "_episodes_started": self._episodes_started,
                "rng": self.rng.bit_generator.state}

    def set_state(self, state: dict[str, Any]) -> None:
        self.rb.load_state_dict(state["rayrb"])
        self.sampled_timesteps = state["sampled_timesteps"]
        self._num_timesteps_added = state["_num_timesteps_added"]
        self._episodes_started = state.get("_episodes_started", 0)  # a state saved before it was kept: none
        self.rng.bit_generator.state = state["rng"]

    # rayrb's side -------------------------------------------------------------------------------------------
    @property
    def offline_fraction(self) -> float:
        return self.rb.offline_fraction

    @property
    def last_info(self) -> dict | None:
        """Where the last batch's rows came from (rayrb's ``info``: offline, shard, index, generation)."""
        return self._last_info

    def client(self) -> Any:
        """A picklable handle to the rayrb buffer, for writers on other actors."""
        return self.rb.client() if hasattr(self.rb, "client") else self.rb

    def shutdown(self) -> None:
        """Stop the rayrb buffer if this object built it; a given buffer is its owner's to stop."""
        if self._owned:
            self.rb.shutdown()

    # internals ---------------------------------------------------------------------------------------------
    def _check_settings(self, kwargs: dict) -> None:
        if kwargs:
            raise InvalidArgumentError(
                f"expected only this buffer's settings, got {sorted(kwargs)}: prioritized sampling "
                "(alpha, beta) is PrioritizedOfflineToOnlineEpisodeReplayBuffer's")

    def _priority_settings(self) -> dict:
        return {}

    def _check_beta(self, beta: Any) -> None:
        return None  # uniform sampling: RLlib's own buffer ignores beta too

    def _check_sequences(self, buffer: Any) -> None:
        return None  # uniform sequences: built here, or a given buffer's batches checked as they come

    def _weights(self, info: dict, b: int) -> np.ndarray:
        return np.ones(b, dtype=np.float32)

    def _log_sample(self, b: int, offline: np.ndarray, ids: set, episodes: int, n: float) -> None:
        """RLlib's sample metrics: ``b`` steps sampled (its count), ``ids`` the distinct steps (or sequence
        starts) drawn, ``episodes`` the episodes they came from, ``n`` the mean n-step."""
        self.sampled_timesteps += b
        self._update_sample_metrics(
            num_env_steps_sampled=b, num_episodes_per_sample=episodes, num_env_steps_per_sample=len(ids),
            sampled_n_step=n, num_resamples=0,
            agent_to_num_steps_sampled={DEFAULT_AGENT_ID: b},
            agent_to_num_episodes_per_sample={DEFAULT_AGENT_ID: episodes},
            agent_to_num_steps_per_sample={DEFAULT_AGENT_ID: len(ids)}, agent_to_sampled_n_step={DEFAULT_AGENT_ID: n},
            agent_to_num_resamples={DEFAULT_AGENT_ID: 0}, module_to_num_steps_sampled={DEFAULT_MODULE_ID: b},
            module_to_num_episodes_per_sample={DEFAULT_MODULE_ID: episodes},
            module_to_num_steps_per_sample={DEFAULT_MODULE_ID: len(ids)},
            module_to_sampled_n_step={DEFAULT_MODULE_ID: n}, module_to_num_resamples={DEFAULT_MODULE_ID: 0})
        self.metrics.log_value(OFFLINE_ROWS_PER_SAMPLE, int(offline.sum()), reduce="mean",
                               window=self._metrics_num_episodes_for_smoothing)


class PrioritizedOfflineToOnlineEpisodeReplayBuffer(OfflineToOnlineEpisodeReplayBuffer, PrioritizedEpisodeReplayBuffer):
    """The same, sampling both sides by priority; DQN routes its TD errors back through ``update_priorities``.

    rayrb's prioritized sampler: ``p_i = (|td| + eps) ** alpha`` in per-shard sum trees, new rows at the side's
    largest priority, importance weights ``(p_i / min p) ** -beta`` over each side (RLlib's formula, per side).
    ``beta`` is fixed when the buffer is built: a ``sample(beta=...)`` that differs is refused.

    Args:
        alpha, beta, eps: the built buffer's exponents and floor (RLlib's ``alpha`` and ``beta``; rayrb's ``eps``).
        **kwargs: as ``OfflineToOnlineEpisodeReplayBuffer``; a given ``buffer`` must sample by priority.
    """

    _sampler = "prioritized"

    def __init__(self, capacity: int = 10000, *, alpha: float | None = None, beta: float | None = None,
                 eps: float | None = None, **kwargs: Any):
        given = {k: v for k, v in {"alpha": alpha, "beta": beta, "eps": eps}.items() if v is not None}
        if kwargs.get("buffer") is not None and given:
            raise InvalidArgumentError(
                f"expected no {sorted(given)} with a given buffer (its settings are its own), got {given}")
        # RLlib's prioritized buffer's alpha, DQN's beta; a given buffer's beta is not checked against.
        self._alpha, self._eps = float(given.get("alpha", 1.0)), float(given.get("eps", 1e-6))
        self._beta = None if kwargs.get("buffer") is not None else float(given.get("beta", 0.4))
        OfflineToOnlineEpisodeReplayBuffer.__init__(self, capacity, **kwargs)

    def _check_settings(self, kwargs: dict) -> None:
        if kwargs:
            raise InvalidArgumentError(f"expected only this buffer's settings, got {sorted(kwargs)}")

    def _priority_settings(self) -> dict:
        return {"alpha": self._alpha, "beta": self._beta, "eps": self._eps}

    def _check_sequences(self, buffer: Any) -> None:
        if self._seq_len is not None:
            raise InvalidArgumentError(f"expected batch_length_T 0 or 1 with prioritized sampling (sequences by "
                                       f"priority are not built), got {self._seq_len}")

    def _check_beta(self, beta: Any) -> None:
        if beta is not None and self._beta is not None and float(beta) != self._beta:
            raise InvalidArgumentError(f"expected beta={self._beta} (fixed when the buffer was built), got {beta}")

    def _weights(self, info: dict, b: int) -> np.ndarray:
        if "weight" not in info:
            raise InvalidArgumentError(
                "expected a rayrb buffer that samples by priority (sampler='prioritized'), got one "
                "whose batches carry no importance weights")
        return np.asarray(info["weight"], dtype=np.float32).reshape(b)

    def update_priorities(self, priorities: Any, module_id: Any = None) -> None:
        """Set the last batch's rows' priorities (``|td_error|``), on the shards that own them."""
        if self._last_info is None:
            raise InvalidArgumentError("expected a sample() before update_priorities, got none since the last update")
        p = np.abs(as_numpy(priorities).astype(np.float64)).reshape(-1)  # a learner's tensor may need grad
        if p.shape[0] != len(self._last_info["index"]):
            raise InvalidArgumentError(f"expected one priority per sampled row ({len(self._last_info['index'])}), "
                                       f"got {p.shape[0]}")
        self.rb.update_priority(self._last_info, p)
        self._last_info = None


def _one_step_episode(tr: dict[str, np.ndarray], weights: np.ndarray, i: int) -> SingleAgentEpisode:
    """Row ``i`` as the one-step episode RLlib's ``_sample_episodes`` returns."""
    eps = SingleAgentEpisode(
        observations=[tr["obs"][i], tr["new_obs"][i]],
        actions=[tr["actions"][i]],
        rewards=[tr["rewards"][i]],
        infos=[{}, {}],
        terminated=bool(tr["terminateds"][i]),
        truncated=bool(tr["truncateds"][i]),
        extra_model_outputs={},
        t_started=int(tr["t"][i]),
        len_lookback_buffer=0,
    )
    eps.extra_model_outputs["n_step"] = InfiniteLookbackBuffer(np.full((1,), tr["n_step"][i]), lookback=0)
    eps.extra_model_outputs["weights"] = InfiniteLookbackBuffer(np.full((1,), weights[i]), lookback=0)
    return eps
