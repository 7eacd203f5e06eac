"""The coordinator's checkpoint and restore calls (``Restoring``, mixed into ``rayrb.actors.coordinator.Coordinator``):
the shards' states and the sampling state taken at one cut, each checked whole before any part is given, and the
shards' own counts taken again after a restore or a failed write. ``saved`` marks the calls after which the
coordinator saves its own state."""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from rayrb.core.plans import OFFLINE, ONLINE, SIDES
from rayrb.errors import SavedStateError


def saved(method):
    """Mark a call after which the coordinator saves its state: one that changes the stream, the settings, the
    version or the write log (getters and ``served`` do not). Like every call that reads the state, it first takes
    the counts appends published since the last call (``Coordinator._poll``): a write is counted before any call
    that came after it, as if it had passed through here."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        self._poll()
        out = method(self, *args, **kwargs)
        self._save()
        return out

    return wrapper


class Restoring:
    """The coordinator's calls that save and restore shards and the sampling state; they use its parts
    (``_shards``, ``_drawing``, ``_writing``) and its ``_poll``, ``_changed``, ``_sizes`` and ``sizes``."""

    @saved
    def resync(self) -> dict[str, list[int]]:
        """Take the online shards' own write counts (after a failed write or a restore)."""
        self._changed()
        self._writing.resync()
        for side in SIDES:
            self._drawing.requery_masses(side, range(len(self._shards[side])))
        return self.sizes()

    def shard_states(self, side: str) -> list[Any]:
        """Refs to each shard's state arrays, behind every write sent so far."""
        self._poll()
        return [s.state.remote() for s in self._shards[side]]

    @saved
    def load_shard_states(self, side: str, states: Sequence[dict]) -> list[Any]:
        """Give each shard of ``side`` its state once every shard checked its own (a refused call changes nothing);
        the acks, then ``resync``, complete it."""
        import ray

        if len(states) != len(self._shards[side]):
            raise SavedStateError(f"expected {len(self._shards[side])} {side} shard states, got {len(states)}")
        ray.get([s.check_state.remote(st) for s, st in zip(self._shards[side], states)])
        self._changed()
        return [s.load_state.remote(st) for s, st in zip(self._shards[side], states)]

    def state_dict(self) -> dict[str, Any]:
        """The sampling state, draws ahead given back, with the draws the buffer owes (``Drawing.state_dict``)."""
        self._poll()
        return self._drawing.state_dict()

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """Raise, naming what is wrong, unless ``load_state_dict`` would take ``state``; change nothing."""
        self._poll()
        self._drawing.check_state_dict(state, self._sizes())

    @saved
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the sampling state and the draws it owes (``Drawing.load_state_dict``), or change nothing."""
        self._drawing.load_state_dict(state)
        self._changed()

    def checkpoint(self, path: str | None) -> dict[str, Any]:
        """Every shard's dump into ``path`` (its state as an object where None) and this state, at one cut."""
        self._poll()
        acks = [s.dump.remote(f"{path}/shard-{j}.npz") if path is not None else s.state.remote()
                for j, s in enumerate(self._shards[OFFLINE] + self._shards[ONLINE])]
        return {"acks": acks, "state": self.state_dict(), "sizes": self.sizes()}
