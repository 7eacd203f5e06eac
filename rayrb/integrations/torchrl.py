"""TorchRL's trainer and hooks on a rayrb buffer, without making torchrl a dependency of rayrb.

TorchRL's ``OfflineToOnlineTrainer`` checks ``isinstance(rb, torchrl...OfflineToOnlineReplayBuffer)``
and its hooks read ``rb.offline_buffer``, ``rb.online_buffer.storage``,
``rb._offline_fraction`` and ``rb._base_offline_fraction``. ``as_torchrl`` wraps
a rayrb buffer in a subclass of TorchRL's class, made when it is first asked for
(torchrl is imported only then), that answers all of these from the rayrb buffer.
The view keeps no state of its own: the fraction, the base fraction ``anneal`` decays from
and the annealing itself are the buffer's (its coordinator's sampling state, which
``state_dict`` and rayrb's checkpoints hold). The trainer's checkpoints (``save_trainer_file``,
``checkpoint=``) call the view's ``dump``/``load``: rayrb's ``dumps``/``loads``, online rows included.

Examples:
    >>> from rayrb.integrations.torchrl import as_torchrl  # doctest: +SKIP
    >>> trainer = OfflineToOnlineTrainer(collector=..., replay_buffer=as_torchrl(rb), ...)  # doctest: +SKIP
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from rayrb.errors import SavedStateError

# What views wrote beside rayrb's checkpoint before the base fraction was part of the buffer's own sampling state:
# read from a checkpoint that has it (it wins over the state, as it did), never written.
_VIEW_STATE = "torchrl_view.json"


class _ViewMethods:
    """What a ``TorchRLView`` answers from the rayrb buffer it wraps; listed first among its bases, so these
    override TorchRL's."""

    def __init__(self, rb: Any):  # TorchRL's __init__ would build buffers of its own: not called
        object.__setattr__(self, "_rayrb", rb)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_rayrb"), name)

    def __len__(self) -> int:
        return len(self._rayrb)

    def __repr__(self) -> str:
        return f"TorchRLView({self._rayrb!r})"

    @property
    def offline_buffer(self):
        return self._rayrb.offline_buffer

    @property
    def online_buffer(self):
        return self._rayrb.online_buffer

    @property
    def _offline_fraction(self) -> float:
        return float(self._rayrb.offline_fraction)

    @_offline_fraction.setter
    def _offline_fraction(self, value: float) -> None:
        self._rayrb.offline_fraction = value  # the base stays, as TorchRL's does when this is assigned

    @property
    def _base_offline_fraction(self) -> float:
        return float(self._rayrb._base_offline_fraction)

    @_base_offline_fraction.setter
    def _base_offline_fraction(self, value: float) -> None:
        self._rayrb._base_offline_fraction = value

    @property
    def offline_fraction(self) -> float:
        return float(self._rayrb.offline_fraction)

    @offline_fraction.setter
    def offline_fraction(self, value: float) -> None:
        """The fraction and, a number, the base too: what TorchRL's constructor sets (its property has no setter)."""
        self._rayrb.offline_fraction = value
        if isinstance(value, (int, float)):
            self._rayrb._base_offline_fraction = value

    def anneal(self, step: int, total_steps: int) -> None:
        """TorchRL's: linear from the base fraction to 0 over ``total_steps`` (the buffer's ``anneal``)."""
        self._rayrb.anneal(max(int(step), 0), int(total_steps))

    def extend(self, data: Any, *args: Any, **kwargs: Any):
        return self._rayrb.extend(data)

    def add(self, data: Any) -> int:
        return self._rayrb.add(data)

    def sample(self, batch_size: int | None = None, return_info: bool = False, **kwargs: Any):
        return self._rayrb.sample(batch_size, return_info=return_info)

    def state_dict(self) -> dict:
        """The buffer's sampling state, the base fraction in it."""
        return self._rayrb.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if "rayrb" in state:  # a view's state from before the base fraction was the buffer's: its base wins
            base = state.get("base_offline_fraction")
            state = {**state["rayrb"], **({} if base is None else {"base_fraction": base})}
        self._rayrb.load_state_dict(state)  # one call, checked whole: a refused state changes nothing

    def dumps(self, path: Any) -> None:
        """rayrb's checkpoint of the buffer under ``path``: the base fraction ``anneal`` decays from is in it."""
        self._rayrb.dumps(path)

    def loads(self, path: Any) -> None:
        """rayrb's ``loads``; a checkpoint an earlier view wrote keeps the base fraction in a file beside it, which
        is checked first (a damaged file changes nothing) and applied after."""
        base = _saved_base(Path(path) / _VIEW_STATE)
        self._rayrb.loads(path)
        if base is not None:
            self._rayrb._base_offline_fraction = base

    # TorchRL's Checkpoint (the trainer's save_trainer_file and checkpoint=) prefers dump/load over state_dict
    # and saves this view instead of the replay-buffer hook, whose state holds base_offline_fraction: rayrb's
    # checkpoint (rows, priorities, sampling state) holds it too.
    dump = dumps
    load = loads


@functools.lru_cache(maxsize=1)
def _adapter_class() -> type:
    from torchrl.data.replay_buffers.offline_to_online import OfflineToOnlineReplayBuffer as TorchRLO2O

    class TorchRLView(_ViewMethods, TorchRLO2O):
        """A rayrb buffer seen as TorchRL's ``OfflineToOnlineReplayBuffer``; nothing is copied."""

    return TorchRLView


def _saved_base(path: Path) -> float | None:
    """The base fraction a view's ``dumps`` wrote at ``path``, or None without the file; raises if it is damaged."""
    from rayrb.core.validation import fraction

    if not path.is_file():
        return None
    try:
        return fraction("base_offline_fraction", json.loads(path.read_text())["base_offline_fraction"])
    except (ValueError, KeyError, TypeError) as e:
        raise SavedStateError(f"expected {path} to hold a JSON object with base_offline_fraction in [0, 1], "
                              f"got {path.read_text()[:200]!r}") from e


def as_torchrl(rb: Any) -> Any:
    """``rb`` as an instance of TorchRL's ``OfflineToOnlineReplayBuffer``, for TorchRL's trainer and hooks."""
    return _adapter_class()(rb)
