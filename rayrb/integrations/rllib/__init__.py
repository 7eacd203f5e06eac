"""RLlib (new API stack) on rayrb. Extra: ``pip install rayrb[rllib]``.

- ``OfflineToOnlineEpisodeReplayBuffer`` / ``PrioritizedOfflineToOnlineEpisodeReplayBuffer``: a rayrb buffer as
  the replay buffer of RLlib's DQN and SAC (``buffer``), with ``EnvRunnerWriter`` so that env runners write into
  it themselves (``writer``);
- ``SACConfig``: RLlib's ``SACConfig`` taking such a buffer by class path, as ``DQNConfig`` does (``sac``);
- ``write_episodes``, ``episode_rows``, ``n_step_transitions``, ``one_step_columns``: episodes to rows and back
  (``transitions``, numpy only); slices of rows back as a stateful module's sequences (``sequences``);
- ``ChunkOfflineData``: RLlib's offline API (BC) reading those rows through rayrb's Ray Data source (``offline``);
- ``update``, ``batch_refs``, ``to_multi_agent_batch``, ``td_errors``: feeding a ``LearnerGroup`` from rayrb
  slices without the driver (``learner``).

RLlib is imported only when a class that subclasses one of its own is asked for.
"""
from __future__ import annotations

import importlib
from typing import Any

from rayrb.integrations.rllib.learner import (  # noqa: F401
    DQN_COLUMNS,
    UpdateResult,
    batch_refs,
    td_errors,
    to_multi_agent_batch,
    update,
)
from rayrb.integrations.rllib.transitions import (  # noqa: F401
    KEYS,
    EpisodeRows,
    episode_rows,
    n_step_transitions,
    one_step_columns,
    write_episodes,
)

_LAZY = {
    "OfflineToOnlineEpisodeReplayBuffer": "rayrb.integrations.rllib.buffer",
    "PrioritizedOfflineToOnlineEpisodeReplayBuffer": "rayrb.integrations.rllib.buffer",
    "EnvRunnerWriter": "rayrb.integrations.rllib.writer",
    "ChunkOfflineData": "rayrb.integrations.rllib.offline",
    "SACConfig": "rayrb.integrations.rllib.sac",
}

__all__ = sorted(["DQN_COLUMNS", "UpdateResult", "batch_refs", "td_errors", "to_multi_agent_batch", "update", "KEYS",
                  "EpisodeRows", "episode_rows", "n_step_transitions", "one_step_columns", "write_episodes",
                  *_LAZY])


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rayrb.integrations.rllib' has no attribute {name!r}")
