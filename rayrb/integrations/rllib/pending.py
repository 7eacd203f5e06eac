"""Rows an RLlib writer (the episode buffer's ``add``, an env runner's ``EnvRunnerWriter``) has made and not yet
written: gathered until there are ``rows_per_write``, then written in one ``extend``, or an episode a write where
the buffer serves sequences (so each episode is one run of rows in one shard). A write that fails leaves itself
and the rows after it for the next ``write``, and one that timed out is retried under its ``write_id``, so it
lands once. Pure Python over the buffer's ``extend``."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from rayrb.errors import InvalidArgumentError
from rayrb.integrations.rllib.sequences import by_episode
from rayrb.integrations.rllib.transitions import SEQUENCE_HOLD_STEPS, EpisodeRows, match_dtypes


class PendingRows:
    """Rows waiting for their write (see the module).

    Args:
        rows_per_write: rows gathered before a write.
        by_episode: write an episode a write (sequences), not all gathered rows at once.
    """

    def __init__(self, rows_per_write: int = 1, by_episode: bool = False):
        self.rows_per_write, self.by_episode = int(rows_per_write), bool(by_episode)
        self._parts: list[dict[str, np.ndarray]] = []
        self._unwritten = False  # a write failed: what is left goes at the next chance, whatever its size
        self._retry_id: str | None = None  # the write_id of a write that timed out, to retry it under

    @property
    def rows(self) -> int:
        """Rows waiting."""
        return sum(len(p["t"]) for p in self._parts)

    def add(self, rows: dict[str, np.ndarray] | None) -> None:
        if rows is not None:
            self._parts.append(rows)

    def write(self, extend: Callable[..., Any], spec: Any) -> None:
        """Write what waits, if a write is due (``rows_per_write`` gathered, or rows a failed write left)."""
        if not self._parts or not (self._unwritten or self.rows >= self.rows_per_write):
            return
        gathered = {k: np.concatenate([p[k] for p in self._parts]) for k in self._parts[0]}
        self._parts = list(by_episode(gathered)) if self.by_episode else [gathered]
        self._unwritten = True  # until every part is written
        while self._parts:
            retry = {} if self._retry_id is None else {"write_id": self._retry_id}
            try:
                extend(match_dtypes(self._parts[0], spec), **retry)
            except Exception as e:  # a write that timed out may have landed: retried under its id, it lands once
                self._retry_id = getattr(e, "write_id", self._retry_id)
                raise
            self._retry_id, _ = None, self._parts.pop(0)
        self._unwritten = False


def check_write_settings(**settings: Any) -> None:
    """Refuse a writer's ``rows_per_write`` or ``sequence_hold_steps`` that is not a positive int, naming it; both
    RLlib writers call this where their settings come in (the buffer's constructor, an env runner's config).

    >>> check_write_settings(rows_per_write=1, sequence_hold_steps=0)
    Traceback (most recent call last):
    ...
    rayrb.errors.InvalidArgumentError: expected sequence_hold_steps to be a positive int, got 0
    """
    for name, value in settings.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"expected {name} to be a positive int, got {value!r}")


def sequence_length(batch_length_T: Any) -> int | None:
    """The steps of each sequence a buffer configured with RLlib's ``batch_length_T`` serves (``T >= 2``), or
    None for transitions (``0``, ``1`` or None), refusing anything else by name; both RLlib writers call this
    where their settings come in.

    >>> sequence_length(8), sequence_length(1), sequence_length(None)
    (8, None, None)
    >>> sequence_length(-1)
    Traceback (most recent call last):
    ...
    rayrb.errors.InvalidArgumentError: expected batch_length_T a non-negative int (0 or 1: transitions; T >= 2: sequences of T steps), got -1
    """
    if isinstance(batch_length_T, bool) or not isinstance(batch_length_T, (int, type(None))) or (
            batch_length_T or 0) < 0:
        raise InvalidArgumentError(f"expected batch_length_T a non-negative int (0 or 1: transitions; T >= 2: "
                                   f"sequences of T steps), got {batch_length_T!r}")
    return batch_length_T if (batch_length_T or 0) >= 2 else None


def episode_writes(n_step: int, sequences: bool, hold_steps: int = SEQUENCE_HOLD_STEPS,
                   rows_per_write: int = 1) -> tuple[EpisodeRows, PendingRows]:
    """What a writer of RLlib episodes keeps: the rows it makes (``EpisodeRows``; with sequences, each episode's
    held until it ends or ``hold_steps``, at least ``n_step``, are held) and those not written yet (``PendingRows``;
    with sequences, an episode a write)."""
    whole = max(hold_steps, int(n_step)) if sequences else None
    return EpisodeRows(n_step, whole=whole), PendingRows(rows_per_write, by_episode=sequences)
