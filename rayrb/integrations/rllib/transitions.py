"""RLlib episodes as rayrb rows, and rows back as the n-step transitions RLlib's episode buffer samples.

A row is one timestep ``t`` of an episode with what follows it, up to ``horizon`` steps (at most the rows'
``n_step``, the trailing size of ``rewards``): ``obs`` o_t, ``actions`` a_t, ``rewards`` r_t..r_{t+n-1}
(zero past the horizon), ``new_obs`` o_{t+1}..o_{t+n} (the last one repeated past the horizon), and whether
the episode terminates or is truncated right after the horizon. So any ``n <= n_step`` and any ``gamma``
can be applied when sampling, as RLlib's buffer does, without reading a neighbouring row: rows are drawn
one by one, across shards.

A row is written once the ``n_step`` steps after it are known, or its episode has ended: the last
``n_step - 1`` steps of an episode still running are held back until its next chunk comes (RLlib's buffer
samples them with a shorter n-step); with ``whole=N``, until the episode ends (or ``N`` steps are held),
so each episode is one run of rows for sequences (``rayrb.integrations.rllib.sequences``). Each row also holds
``episode``, a number for its episode (``episode_number``), which sequences cut by; rows without it (datasets
written before it) still serve transitions. Pure numpy; episodes are read through their public accessors.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rayrb.errors import InvalidArgumentError, InvalidArgumentTypeError, SchemaError

KEYS = ("obs", "actions", "rewards", "new_obs", "horizon", "terminateds", "truncateds", "t")
EPISODE = "episode"  # each row's episode number: optional for transitions, needed for sequences
SEQUENCE_HOLD_STEPS = 1000  # with sequences, the most steps of a running episode held before they are written


def episode_number(id_: Any) -> int:
    """A non-negative int64 for an RLlib episode id (a string), the same in every process: the id's first 60 bits
    where it is hex (RLlib's ids are uuid4 hex), else 60 bits of its BLAKE2b hash.

    >>> episode_number("0123456789abcdef0123456789abcdef")
    5124095576030430
    >>> episode_number("episode 7") == episode_number("episode 7") != episode_number("episode 8")
    True
    """
    text = str(id_)
    try:
        return int(text[:15], 16) if len(text) >= 15 else _hashed(text)
    except ValueError:
        return _hashed(text)


def _hashed(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 4


def row_n_step(spec: Any) -> int:
    """The largest n-step rows of this spec (a ``RowSpec``) can serve: the trailing size of ``rewards``."""
    missing = [k for k in KEYS if k not in spec.keys]
    if missing:
        raise SchemaError(f"expected rows with the keys {list(KEYS)} (written by rayrb.integrations.rllib."
                          f"episode_rows or write_episodes), got keys {spec.keys}: missing {missing}")
    shape = tuple(spec["rewards"].shape)
    if len(shape) != 1 or shape[0] < 1:
        raise SchemaError(f"expected 'rewards' rows of shape [n_step], got {list(shape)}")
    return int(shape[0])


@dataclass
class _Open:
    """What is held back of an episode that is still running: its steps from the first unwritten one."""
    t0: int
    obs: list = field(default_factory=list)
    actions: list = field(default_factory=list)
    rewards: list = field(default_factory=list)


class EpisodeRows:
    """Turns RLlib episode chunks into rows, holding back the steps whose n-step future is not known yet.

    One per writer (an env runner, the learner's buffer): the chunks of an episode come to the writer
    that runs it, in order.

    Args:
        n_step: the most steps each row looks ahead (the largest n-step the rows will serve).
        whole: hold a running episode's rows until it ends, or until this many are held (then they are written
            and the episode goes on in a new run); ``None``: write each row as soon as its n steps are known.
    """

    def __init__(self, n_step: int = 1, whole: int | None = None):
        if isinstance(n_step, bool) or not isinstance(n_step, (int, np.integer)) or n_step < 1:
            raise InvalidArgumentError(f"expected n_step to be a positive int, got {n_step!r}")
        if whole is not None and (isinstance(whole, bool) or not isinstance(whole, (int, np.integer))
                                  or whole < n_step):
            raise InvalidArgumentError(f"expected whole to be None or an int of at least n_step={n_step}, "
                                       f"got {whole!r}")
        self.n_step, self.whole = int(n_step), None if whole is None else int(whole)
        self._open: dict[str, _Open] = {}

    @property
    def held_back(self) -> int:
        """Steps held back, over all running episodes."""
        return sum(len(o.actions) for o in self._open.values())

    def add(self, episodes: Iterable[Any]) -> dict[str, np.ndarray] | None:
        """Rows for every step of ``episodes`` that can be written now, or None when there are none."""
        episodes = list(episodes)
        for eps in episodes:  # all checked before any is taken in
            _check_episode(eps)
        parts = [p for p in (self._add_one(e) for e in episodes) if p is not None]
        if not parts:
            return None
        return {k: np.concatenate([p[k] for p in parts]) for k in (*KEYS, EPISODE)}

    def _add_one(self, eps: Any) -> dict[str, np.ndarray] | None:
        steps = len(eps)
        if steps == 0:
            return None
        obs = list(eps.get_observations())
        if len(obs) != steps + 1:
            raise InvalidArgumentError(f"expected an episode chunk with one more observation than steps ({steps + 1}), "
                                       f"got {len(obs)}")
        held = self._open.pop(eps.id_, None)
        if held is None:
            held = _Open(int(eps.t_started), obs[:1])
        elif held.t0 + len(held.actions) != eps.t_started:
            raise InvalidArgumentError(
                f"episode {eps.id_}: expected its chunk starting at t={held.t0 + len(held.actions)}, "
                f"got t_started={eps.t_started}")
        held.obs.extend(obs[1:])
        held.actions.extend(eps.get_actions())
        held.rewards.extend(eps.get_rewards())
        done = bool(eps.is_terminated or eps.is_truncated)
        n, total = self.n_step, len(held.actions)
        ready = total if done else max(0, total - n + 1)  # rows whose n steps ahead are all known
        if not done and self.whole is not None and total < self.whole:
            ready = 0  # whole episodes: held until it ends or ``whole`` steps are held
        if not done:
            self._open[eps.id_] = held
        if ready == 0:
            return None
        rows = _rows(held, ready, n, terminated=bool(eps.is_terminated) and done,
                     truncated=bool(eps.is_truncated) and not eps.is_terminated and done)
        rows[EPISODE] = np.full(ready, episode_number(eps.id_), np.int64)
        if not done:  # keep the steps not written yet, and the observation before the first of them
            held.obs, held.actions, held.rewards = held.obs[ready:], held.actions[ready:], held.rewards[ready:]
            held.t0 += ready
        return rows


def _check_episode(eps: Any) -> None:
    """One agent's episode chunk, whose observations are one array each (what rows hold)."""
    if not hasattr(eps, "t_started") or not hasattr(eps, "get_observations"):
        raise InvalidArgumentTypeError(f"expected RLlib's SingleAgentEpisode (chunks of one agent's episode), got "
                                       f"{type(eps).__name__}: multi-agent episodes are not supported")
    first = eps.get_observations(0) if len(eps.get_observations()) else None
    if isinstance(first, (dict, tuple, list)):
        raise InvalidArgumentTypeError(
            f"expected observations of one array each (a Box or Discrete space), got a {type(first).__name__}: "
            "flatten Dict and Tuple observations first (RLlib's FlattenObservations connector)")


def _rows(held: _Open, ready: int, n: int, *, terminated: bool, truncated: bool) -> dict[str, np.ndarray]:
    total = len(held.actions)
    obs = np.stack([np.asarray(o) for o in held.obs])  # [total + 1, ...]
    rewards = np.asarray(held.rewards, dtype=np.float32)
    t = np.arange(ready)
    horizon = np.minimum(n, total - t)
    ahead = np.arange(n)[None, :]
    steps = t[:, None] + np.minimum(ahead, horizon[:, None] - 1)  # past the horizon: its last step again
    ends = t + horizon == total  # the horizon reaches the episode's last known step
    return {
        "obs": obs[t],
        "actions": np.stack([np.asarray(a) for a in held.actions[:ready]]),
        "rewards": np.where(ahead < horizon[:, None], rewards[steps], np.float32(0)).astype(np.float32),
        "new_obs": obs[steps + 1],
        "horizon": horizon.astype(np.int64),
        "terminateds": ends & terminated,
        "truncateds": ends & truncated,
        "t": (held.t0 + t).astype(np.int64),
    }


def match_dtypes(rows: dict[str, np.ndarray], spec: Any) -> dict[str, np.ndarray]:
    """Cast columns to the buffer's dtypes within a kind (RLlib's env runners give int32 actions where a log made
    in Python holds int64, say); a column of another kind is left for the buffer's schema check to refuse, and
    episode numbers are dropped for a buffer whose rows hold none."""
    out = {}
    for k, v in rows.items():
        if k == EPISODE and k not in spec.keys:
            continue  # a buffer whose rows have no episode numbers (written before them) serves transitions
        want = np.dtype(spec[k].dtype) if k in spec.keys else v.dtype
        out[k] = v.astype(want) if v.dtype != want and np.can_cast(v.dtype, want, "same_kind") else v
    return out


def episode_rows(episodes: Iterable[Any], n_step: int = 1) -> dict[str, np.ndarray]:
    """Rows of whole episodes (each ended, or taken as it is: a running one's held-back steps are dropped)."""
    rows = EpisodeRows(n_step).add(episodes)
    if rows is None:
        raise InvalidArgumentError("expected episodes with at least one step each to write, got none")
    return rows


def check_n_step(n_step: Any, stored: int) -> int | tuple[int, int]:
    """``n_step`` as an int or a ``(low, high)`` range, if rows that look ``stored`` steps ahead can serve it."""
    if isinstance(n_step, (tuple, list)):
        if len(n_step) != 2 or not 1 <= int(n_step[0]) < int(n_step[1]):
            raise InvalidArgumentError(f"expected an n_step range (low, high) with 1 <= low < high, got {n_step!r}")
        if int(n_step[1]) - 1 > stored:
            raise InvalidArgumentError(f"expected an n_step range up to {stored + 1} (high excluded: the rows look "
                                       f"{stored} steps ahead), got {tuple(n_step)}")
        return int(n_step[0]), int(n_step[1])
    n_step = 1 if n_step is None else n_step
    if isinstance(n_step, bool) or int(n_step) != n_step or not 1 <= int(n_step) <= stored:
        raise InvalidArgumentError(f"expected n_step between 1 and {stored} (the rows look {stored} steps ahead; write "
                                   f"them with a larger n_step for more), got {n_step!r}")
    return int(n_step)


def n_step_transitions(rows: Mapping[str, np.ndarray], n_step: Any, gamma: float,
                       rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
    """Apply ``n_step`` (an int, or RLlib's ``(low, high)`` range drawn per row, high excluded) and ``gamma``.

    Returns RLlib's transition of each row: ``obs``, ``actions``, the discounted sum of the rewards up to
    ``min(n, horizon)`` steps, the observation there, ``terminateds`` / ``truncateds`` when that is where the
    episode ended, and ``n_step``: the n asked for, as RLlib's buffer records it (also where the episode's end
    cut the row shorter; the loss bootstraps with ``gamma ** n_step`` only when not terminated).
    """
    stored = int(rows["rewards"].shape[1])
    b = int(rows["rewards"].shape[0])
    n_step = check_n_step(n_step, stored)
    if isinstance(n_step, tuple):
        rng = rng if rng is not None else np.random.default_rng()
        n = rng.integers(n_step[0], n_step[1], size=b)
    else:
        n = np.full(b, n_step)
    horizon = np.asarray(rows["horizon"]).reshape(b)
    k = np.minimum(n, horizon)
    ahead = np.arange(stored)[None, :]
    discounts = np.where(ahead < k[:, None], float(gamma) ** ahead, 0.0)
    ends = k == horizon
    return {
        "obs": np.asarray(rows["obs"]),
        "actions": np.asarray(rows["actions"]),
        "rewards": (np.asarray(rows["rewards"], dtype=np.float64) * discounts).sum(axis=1),
        "new_obs": np.asarray(rows["new_obs"])[np.arange(b), k - 1],
        "terminateds": np.asarray(rows["terminateds"]).reshape(b) & ends,
        "truncateds": np.asarray(rows["truncateds"]).reshape(b) & ends,
        "n_step": n.astype(np.int64),
        "t": np.asarray(rows["t"]).reshape(b),
    }


def one_step_columns(rows: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rows as RLlib's one-step transition columns (``obs``, ``actions``, ``rewards``, ``new_obs``, ``terminateds``,
    ``truncateds``), as its offline API reads them. Each row stands alone: no episode ids, so methods that
    need whole episodes (MARWIL's returns) do not apply."""
    last = np.asarray(rows["horizon"]).reshape(-1) == 1  # the episode's last step, when it ended there
    return {"obs": rows["obs"], "actions": rows["actions"], "rewards": np.asarray(rows["rewards"])[:, 0],
            "new_obs": np.asarray(rows["new_obs"])[:, 0], "terminateds": np.asarray(rows["terminateds"]) & last,
            "truncateds": np.asarray(rows["truncateds"]) & last}


def write_episodes(episodes: Iterable[Any], root: Any, *, n_step: int = 1, **kwargs: Any) -> Any:
    """Write logged RLlib episodes as a rayrb chunk dataset of rows (an offline dataset for the buffer).

    Args:
        episodes: ``SingleAgentEpisode`` objects, or their chunks in order.
        root: the dataset's directory (``rayrb.write_dataset``'s).
        n_step: the most steps each row looks ahead: the buffer serves any n-step up to it.
        **kwargs: forwarded to ``rayrb.write_dataset`` (``overwrite``, ``chunk_rows``, ...).

    Returns:
        The ``ChunkDataset``.
    """
    from rayrb.io.chunks import write_dataset

    kwargs.setdefault("source", "rllib episodes")
    kwargs.setdefault("recipe", {"n_step": int(n_step)})
    return write_dataset(episode_rows(episodes, n_step), root, **kwargs)
