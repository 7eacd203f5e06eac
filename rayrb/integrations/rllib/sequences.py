"""Sequences for RLlib's stateful modules: slices of rows back as the episode slices RLlib's buffer samples.

RLlib's ``EpisodeReplayBuffer.sample(batch_length_T=T, sample_episodes=True)`` (what DQN asks for when its module
is stateful: ``T = max_seq_len``) answers episode slices of up to ``T`` steps, and counts ``len + 1`` toward
``batch_size_B`` for each. rayrb's buffer is built with a slice sampler of ``T`` steps over the rows' episode
numbers (``SliceSampler(slice_len=T, traj_key="episode", strict_length=False)``), so each slice is ``T``
consecutive steps of one episode, or a whole episode shorter than ``T``; the buffer's exact offline/online split
counts slices. This module cuts such a batch at its ``is_init`` marks and builds each slice's
``SingleAgentEpisode``: observations ``o_t .. o_{t+len}``, actions, one-step rewards, and the episode's
terminated / truncated flag when the slice ends where the episode did.

Where it differs from RLlib's buffer: a slice starts at any step with ``T`` steps after it in its episode (RLlib
also starts within the last ``T - 1`` steps and cuts the slice short there); sequences carry no lookback step
(RLlib's learner connectors use the step before a sequence for its stored ``STATE_OUT``, which rows do not
hold, so each sequence starts from the module's initial state either way). Pure numpy and RLlib's episode class.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from rayrb.errors import InvalidArgumentError
from rayrb.integrations.rllib.transitions import EPISODE, KEYS


def length_refusals(seq: int | None, batch_length_T: Any, lookback: Any, min_batch_length_T: Any,
                    n_step: Any) -> dict[str, tuple[bool, str, Any]]:
    """``sample``'s sequence arguments for a buffer serving sequences of ``seq`` steps (``None``: transitions), as
    ``name: (refused, what was expected, what came)``."""
    if seq is None:
        return {
            "batch_length_T": (bool(batch_length_T), "0 (this buffer serves one-step transitions: build it with "
                               "batch_length_T=T for sequences)", batch_length_T),
            "lookback": (lookback not in (0, None), "0", lookback),
            "min_batch_length_T": (bool(min_batch_length_T), "0 (no burn-in over one-step rows)", min_batch_length_T),
        }
    return {
        "batch_length_T": (batch_length_T != seq, f"{seq} (this buffer serves sequences of that many steps)",
                           batch_length_T),
        "lookback": (lookback not in (0, 1, None), "0 or 1 (sequences carry no lookback step)", lookback),
        "min_batch_length_T": (not 0 <= (min_batch_length_T or 0) < seq,
                               f"an int from 0 to {seq - 1} (shorter than a sequence)", min_batch_length_T),
        "n_step": (n_step not in (None, 1), "1 (sequences are one-step)", n_step),
    }


def slices_to_ask(steps: int, length: int) -> int:
    """How many slices of ``length`` steps make ``steps`` as RLlib's buffer counts them (``len + 1`` a slice).

    >>> slices_to_ask(32, 20), slices_to_ask(42, 20), slices_to_ask(43, 20)
    (2, 2, 3)
    """
    return max(1, -(-int(steps) // (int(length) + 1)))


def by_episode(rows: Mapping[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
    """Rows cut into runs of one episode number, in order (each a write of its own: one episode, one shard).

    >>> [r["t"].tolist() for r in by_episode({"t": np.arange(5), "episode": np.array([7, 7, 3, 3, 7])})]
    [[0, 1], [2, 3], [4]]
    """
    ids = np.asarray(rows[EPISODE]).reshape(-1)
    cuts = [0, *(np.flatnonzero(ids[1:] != ids[:-1]) + 1).tolist(), len(ids)]
    for a, b in zip(cuts[:-1], cuts[1:]):
        yield {k: v[a:b] for k, v in rows.items()}


def slice_bounds(init: np.ndarray, rows: Mapping[str, np.ndarray], length: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each slice in a batch, cut at its ``is_init`` marks; each checked to be at most
    ``length`` consecutive steps of one episode.

    >>> rows = {"t": np.array([4, 5, 6, 0, 1]), "episode": np.array([9, 9, 9, 2, 2])}
    >>> slice_bounds(np.array([1, 0, 0, 1, 0], bool), rows, 3)
    [(0, 3), (3, 5)]
    """
    init = np.asarray(init, bool).reshape(-1)
    if len(init) == 0:
        return []
    if not init[0]:
        raise InvalidArgumentError("expected a batch of slices (its first step marked is_init), got one that "
                                   "starts inside a slice")
    starts = np.flatnonzero(init).tolist()
    bounds = list(zip(starts, [*starts[1:], len(init)]))
    t, ids = np.asarray(rows["t"]).reshape(-1), np.asarray(rows[EPISODE]).reshape(-1)
    for a, b in bounds:
        if b - a > length or (np.diff(t[a:b]) != 1).any() or (ids[a:b] != ids[a]).any():
            raise InvalidArgumentError(
                f"expected slices of at most {length} consecutive steps of one episode, got steps {t[a:b].tolist()} "
                f"of episodes {sorted(set(ids[a:b].tolist()))}: the buffer must sample slices of batch_length_T "
                f"steps over 'episode' (SliceSampler(slice_len={length}, traj_key='episode'))")
    return bounds


def sequence_episode(rows: Mapping[str, np.ndarray], a: int, b: int) -> object:
    """Rows ``a:b`` (one slice) as the episode slice RLlib's buffer returns, with ``n_step`` 1 and ``weights`` 1."""
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode
    from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer

    n, last = b - a, b - 1
    ends = int(np.asarray(rows["horizon"]).reshape(-1)[last]) == 1  # the slice's last step is its episode's last
    terminated = ends and bool(np.asarray(rows["terminateds"]).reshape(-1)[last])
    truncated = ends and not terminated and bool(np.asarray(rows["truncateds"]).reshape(-1)[last])
    eps = SingleAgentEpisode(
        id_=f"{int(np.asarray(rows[EPISODE]).reshape(-1)[a]):015x}",
        observations=[*rows["obs"][a:b], rows["new_obs"][last, 0]],
        actions=list(rows["actions"][a:b]),
        rewards=[float(r) for r in np.asarray(rows["rewards"])[a:b, 0]],
        infos=[{} for _ in range(n + 1)],
        terminated=terminated,
        truncated=truncated,
        extra_model_outputs={},
        t_started=int(np.asarray(rows["t"]).reshape(-1)[a]),
        len_lookback_buffer=0,
    )
    eps.extra_model_outputs["n_step"] = InfiniteLookbackBuffer(np.ones(n, np.int64), lookback=0)
    eps.extra_model_outputs["weights"] = InfiniteLookbackBuffer(np.ones(n, np.float32), lookback=0)
    return eps


def sample_sequences(rb: object, steps: int, length: int, min_length: int = 0,
                     tries: int = 100) -> tuple[list, list[dict]]:
    """RLlib's sequence batch: slices drawn from ``rb`` until they count ``steps`` (``len + 1`` each, RLlib's count),
    skipping slices of at most ``min_length`` steps (RLlib's ``min_batch_length_T`` rule). Returns the episodes
    and each draw's ``info`` (every draw holds the buffer's exact split of its slices)."""
    episodes, infos, need = [], [], int(steps)
    for _ in range(tries):
        batch, info = rb.sample(slices_to_ask(need, length) * length, return_info=True)
        if "is_init" not in batch.keys():
            raise InvalidArgumentError(f"expected a buffer that samples slices of {length} steps over 'episode' "
                                       f"(SliceSampler(slice_len={length}, traj_key='episode')), got batches of rows")
        rows = {k: batch[k].numpy() for k in (*KEYS, EPISODE)}
        infos.append(info)
        for a, b in slice_bounds(batch["is_init"].numpy(), rows, length):
            if b - a > min_length:
                episodes.append(sequence_episode(rows, a, b))
                need -= b - a + 1
        if need <= 0:
            return episodes, infos
    raise InvalidArgumentError(f"expected sequences longer than min_batch_length_T={min_length} steps, got "
                               f"{tries} draws without enough of them: the buffer's episodes are shorter")
