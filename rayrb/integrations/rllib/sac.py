"""RLlib's ``SACConfig``, taking an ``EpisodeReplayBuffer`` subclass by class path as ``DQNConfig`` does.

RLlib's ``SACConfig.validate()`` (new API stack) accepts only the names of RLlib's four episode buffers as
``replay_buffer_config["type"]``: a class path, or the class, of any other buffer is refused ("the replay buffer
must be of type `EpisodeReplayBuffer`"), even a subclass of theirs. ``DQNConfig.validate()`` takes any string, and
RLlib's ``Algorithm`` builds the buffer from a class path in both. This subclass changes only that check::

    from rayrb.integrations.rllib import SACConfig  # instead of ray.rllib.algorithms.sac's

    config = SACConfig().environment("Pendulum-v1").training(replay_buffer_config={
        "type": "rayrb.integrations.rllib.OfflineToOnlineEpisodeReplayBuffer", ...})

This module imports RLlib; ``rayrb.integrations.rllib`` imports it only when ``SACConfig`` is asked for.
"""
from __future__ import annotations

import importlib
from typing import Any

from ray.rllib.algorithms.sac import SACConfig as RLlibSACConfig
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer

from rayrb.errors import InvalidArgumentError

# What RLlib's SAC check reads in place of a class path that names an EpisodeReplayBuffer subclass.
STAND_IN = "EpisodeReplayBuffer"


class SACConfig(RLlibSACConfig):
    """RLlib's ``SACConfig`` whose ``validate()`` also takes an ``EpisodeReplayBuffer`` subclass by class path.

    Everything else is RLlib's: the algorithm built is RLlib's ``SAC``, the buffer is built by RLlib's
    ``Algorithm`` from ``replay_buffer_config``, and every other check of ``SACConfig.validate()`` runs.
    """

    def validate(self) -> None:
        rb_config = self.replay_buffer_config
        given = rb_config.get("type") if isinstance(rb_config, dict) else None
        new_stack = self.enable_env_runner_and_connector_v2
        if new_stack and isinstance(given, type) and issubclass(given, EpisodeReplayBuffer):
            raise InvalidArgumentError(
                f"expected replay_buffer_config['type'] as a class path ('{given.__module__}.{given.__qualname__}'): "
                "RLlib's Algorithm looks for 'EpisodeReplayBuffer' in the type's name, got the class "
                f"{given.__qualname__}")
        if not (new_stack and _names_episode_buffer(given)):
            return super().validate()
        # RLlib's check compares the type with its own buffers' names only: it reads a stand-in for the time of
        # the check, and the class path is back before anything builds the buffer.
        rb_config["type"] = STAND_IN
        try:
            super().validate()
        finally:
            rb_config["type"] = given


def _names_episode_buffer(type_: Any) -> bool:
    """Whether ``type_`` is a ``module.Class`` path to a subclass of RLlib's ``EpisodeReplayBuffer``."""
    if not isinstance(type_, str) or "." not in type_:
        return False  # RLlib's own names (and anything else) go to RLlib's check as they are
    module, name = type_.rsplit(".", 1)
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False  # RLlib's check refuses it, and says why
    return isinstance(found, type) and issubclass(found, EpisodeReplayBuffer)
