"""Argument checks shared by every public entry point, so each rule is spelled once.

Each check returns the value normalized to a plain Python type, or raises
``ValueError`` (``TypeError`` where the type is wrong in kind, as for a
callable) naming the argument, what was expected and what came. ``bool`` is
never taken for a number, and numpy scalars are taken like Python ones.

Examples:
    >>> positive_int("batch_size", 32), positive_int("batch_size", __import__("numpy").int64(8))
    (32, 8)
    >>> positive_int("chunk_rows", True)
    Traceback (most recent call last):
    rayrb.errors.InvalidArgumentError: chunk_rows must be a positive integer, got True
    >>> non_negative_int("step", 2.5)
    Traceback (most recent call last):
    rayrb.errors.InvalidArgumentError: step must be a non-negative integer, got 2.5
    >>> fraction("offline_fraction", 0.25)
    0.25
    >>> finite_number("beta", float("inf"), minimum=0.0)
    Traceback (most recent call last):
    rayrb.errors.InvalidArgumentError: beta must be a finite number >= 0.0, got inf
"""
from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

import numpy as np

from rayrb.errors import InvalidArgumentError, InvalidArgumentTypeError

# Prioritized replay's defaults (TorchRL's PrioritizedSampler takes alpha and beta; eps is its floor).
ALPHA, BETA, EPS = 0.6, 0.4, 1e-8


def _is_int(value: Any) -> bool:
    # ``type(...) is int`` first: the ABC check costs about a microsecond, and the planner checks several per batch
    return type(value) is int or (isinstance(value, Integral) and not isinstance(value, bool))


def _finite(value: Real) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int too large for a double
        return False


def positive_int(name: str, value: Any) -> int:
    """``value`` as an ``int`` > 0."""
    if not _is_int(value) or value <= 0:
        raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def non_negative_int(name: str, value: Any) -> int:
    """``value`` as an ``int`` >= 0."""
    if not _is_int(value) or value < 0:
        raise InvalidArgumentError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def optional_positive_int(name: str, value: Any) -> int | None:
    return None if value is None else positive_int(name, value)


def finite_number(name: str, value: Any, *, minimum: float | None = None, strict: bool = False) -> float:
    """``value`` as a finite ``float``, at least ``minimum`` (strictly above it with ``strict``)."""
    bound = "" if minimum is None else f" {'>' if strict else '>='} {minimum}"
    ok = isinstance(value, Real) and not isinstance(value, bool) and _finite(value)
    if ok and minimum is not None:
        ok = float(value) > minimum if strict else float(value) >= minimum
    if not ok:
        raise InvalidArgumentError(f"{name} must be a finite number{bound}, got {value!r}")
    return float(value)


def fraction(name: str, value: Any) -> float:
    """``value`` as a ``float`` in ``[0, 1]``."""
    if not isinstance(value, Real) or isinstance(value, bool) or not _finite(value) or not 0.0 <= float(value) <= 1.0:
        raise InvalidArgumentError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def timeout(value: Any) -> float | None:
    """Seconds to wait, or ``None`` for no limit."""
    return None if value is None else finite_number("timeout", value, minimum=0.0, strict=True)


def priority_options(alpha: Any = ALPHA, beta: Any = BETA, eps: Any = EPS) -> dict[str, float]:
    """Prioritized sampling's ``alpha >= 0``, ``beta >= 0`` and ``eps > 0``, all finite."""
    return {"alpha": finite_number("alpha", alpha, minimum=0.0), "beta": finite_number("beta", beta, minimum=0.0),
            "eps": finite_number("eps", eps, minimum=0.0, strict=True)}


def boolean(name: str, value: Any) -> bool:
    """``value`` as a ``bool``: ``True`` or ``False`` (numpy's too), never a truthy string or number.

    >>> boolean("prefill", np.True_)
    True
    >>> boolean("prefill", "false")
    Traceback (most recent call last):
    rayrb.errors.InvalidArgumentTypeError: prefill must be True or False, got 'false'
    """
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentTypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def optional_str(name: str, value: Any) -> str | None:
    """``value`` as a ``str``, or ``None``.

    >>> optional_str("write_id", ["w"])
    Traceback (most recent call last):
    rayrb.errors.InvalidArgumentTypeError: write_id must be a string or None, got list ['w']
    """
    if value is not None and not isinstance(value, str):
        raise InvalidArgumentTypeError(f"{name} must be a string or None, got {type(value).__name__} {value!r:.100}")
    return value


def one_of(name: str, value: Any, choices: Any) -> Any:
    if value not in tuple(choices):
        raise InvalidArgumentError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def callable_or_none(name: str, value: Any) -> Any:
    if value is not None and not callable(value):
        raise InvalidArgumentTypeError(f"{name} must be callable, got {type(value).__name__}")
    return value
