"""Offline-fraction schedules: the share of each batch drawn from the offline dataset.

A schedule maps ``(step, n_offline_rows, n_online_rows)`` to a fraction in
``[0, 1]``. The coordinator counts sample calls as steps (or takes an explicit
step), so a schedule is resumable from ``state_dict()`` alone.

Examples:
    >>> Linear(1.0, 0.0, total_steps=10)(5, 0, 0)
    0.5
    >>> round(Cosine(1.0, 0.0, total_steps=10)(5, 0, 0), 6)
    0.5
    >>> Step(boundaries=[100], values=[1.0, 0.5])(100, 0, 0)
    0.5
    >>> SizeProportional()(0, 750, 250)  # Cal-QL style: the offline share of all rows
    0.75
    >>> make_schedule({"kind": "linear", "start": 0.5, "end": 0.0, "total_steps": 4})(2, 0, 0)
    0.25
"""
from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from rayrb.core.allocation import check_fraction
from rayrb.core.validation import non_negative_int, positive_int
from rayrb.errors import InvalidArgumentError, InvalidArgumentTypeError


class Schedule:
    kind = "schedule"

    def __call__(self, step: int, n_offline: int, n_online: int) -> float:
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        return {"kind": self.kind, **{k: v for k, v in vars(self).items()}}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)


class Constant(Schedule):
    kind = "constant"

    def __init__(self, value: float):
        self.value = check_fraction(value)

    def __call__(self, step: int, n_offline: int, n_online: int) -> float:
        return self.value


class _Ramp(Schedule):
    """From ``start`` to ``end`` over ``total_steps``, then held at ``end``; subclasses give the curve."""

    def __init__(self, start: float, end: float = 0.0, total_steps: int = 1):
        self.start, self.end = check_fraction(start), check_fraction(end)
        self.total_steps = positive_int("total_steps", total_steps)

    def _progress(self, step: int) -> float:
        return 1.0 if step >= self.total_steps else max(step, 0) / self.total_steps  # no float of a huge step


class Linear(_Ramp):
    """Linear ramp (TorchRL's ``anneal`` is ``Linear(base, 0, total_steps)``)."""

    kind = "linear"

    def __call__(self, step: int, n_offline: int, n_online: int) -> float:
        return self.start + (self.end - self.start) * self._progress(step)


class Cosine(_Ramp):
    """Half-cosine ramp: flat at both ends."""

    kind = "cosine"

    def __call__(self, step: int, n_offline: int, n_online: int) -> float:
        return self.end + (self.start - self.end) * 0.5 * (1.0 + math.cos(math.pi * self._progress(step)))


class Step(Schedule):
    """``values[i]`` while ``boundaries[i-1] <= step < boundaries[i]``."""

    kind = "step"

    def __init__(self, boundaries: Sequence[int], values: Sequence[float]):
        boundaries = [non_negative_int("step boundaries", b) for b in boundaries]
        values = [check_fraction(v) for v in values]
        if len(values) != len(boundaries) + 1:
            raise InvalidArgumentError(
                f"expected one more value than boundaries, got {len(values)} values for {len(boundaries)} boundaries"
            )
        if any(a >= b for a, b in zip(boundaries, boundaries[1:])):
            raise InvalidArgumentError(f"step boundaries must be strictly increasing, got {boundaries}")
        self.boundaries, self.values = boundaries, values

    def __call__(self, step: int, n_offline: int, n_online: int) -> float:
        i = sum(step >= b for b in self.boundaries)
        return self.values[i]


class SizeProportional(Schedule):
    """Offline share = ``N_off / (N_off + N_on)``: sampling the union uniformly (Cal-QL's mixing)."""

    kind = "size_proportional"

    def __call__(self, step: int, n_offline: int, n_online: int) -> float:
        n_offline, n_online = max(n_offline, 0), max(n_online, 0)
        total = n_offline + n_online
        return 1.0 if total <= 0 else n_offline / total


_KINDS = {c.kind: c for c in (Constant, Linear, Cosine, Step, SizeProportional)}


def value_at(schedule: Schedule, step: int, n_offline: int, n_online: int) -> float:
    """The fraction ``schedule`` gives: a kind of this module answers within ``[0, 1]`` by construction (its
    numbers were checked when it was made), any other (a user's subclass) is checked here, where it answers."""
    value = schedule(step, n_offline, n_online)
    return float(value) if type(schedule) in _TRUSTED else check_fraction(value)


_TRUSTED = frozenset(_KINDS.values())


def make_schedule(spec: float | str | Mapping[str, Any] | Schedule) -> Schedule:
    """A schedule from a number (constant), a kind name, a config dict, or a schedule."""
    if isinstance(spec, Schedule):
        return spec
    if isinstance(spec, numbers.Real):  # numpy's too; True as well: Constant refuses it, as it refuses 2
        return Constant(spec)
    if isinstance(spec, str):
        spec = {"kind": spec}
    if isinstance(spec, Mapping):
        cfg = dict(spec)
        kind = cfg.pop("kind", None)
        if not isinstance(kind, str) or kind not in _KINDS:
            raise InvalidArgumentError(f"schedule kind must be one of {sorted(_KINDS)}, got {kind!r}")
        params = list(inspect.signature(_KINDS[kind]).parameters)
        unknown = sorted(set(cfg) - set(params))
        if unknown:
            raise InvalidArgumentError(
                f"the {kind!r} schedule takes no {', '.join(map(repr, unknown))}: expected some of "
                f"{params}, got {sorted(cfg)}")
        try:
            return _KINDS[kind](**cfg)
        except TypeError as e:  # a required parameter missing
            raise InvalidArgumentError(f"the {kind!r} schedule expects {params}, got {sorted(cfg)}: {e}") from None
    raise InvalidArgumentTypeError(
        f"expected a fraction, a schedule kind, a config dict or a Schedule, got {type(spec).__name__}")
