"""Argument validation: integers, fractions, priority options, timeouts and choices. Nothing here imports Ray."""
from __future__ import annotations

import re

import numpy as np
import pytest

from rayrb.core.samplers import (
    SAMPLERS,
    sampler_class,
)
from rayrb.core.validation import (
    callable_or_none,
    finite_number,
    fraction,
    non_negative_int,
    one_of,
    positive_int,
    priority_options,
    timeout,
)

pytestmark = pytest.mark.usefixtures("local_metrics")


# ---------------------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("check, value, message", [
    (positive_int, True, "batch_size must be a positive integer, got True"),
    (positive_int, np.True_, "batch_size must be a positive integer, got "),
    (positive_int, 0, "batch_size must be a positive integer, got 0"),
    (positive_int, 2.0, "batch_size must be a positive integer, got 2.0"),
    (positive_int, np.float64(3.0), "batch_size must be a positive integer, got "),
    (positive_int, "4", "batch_size must be a positive integer, got '4'"),
    (non_negative_int, 2.5, "batch_size must be a non-negative integer, got 2.5"),
    (non_negative_int, False, "batch_size must be a non-negative integer, got False"),
    (non_negative_int, -1, "batch_size must be a non-negative integer, got -1"),
])
def test_integers_refuse_bools_floats_and_strings_naming_the_argument(check, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check("batch_size", value)


def test_integers_take_numpy_ints_as_plain_ints():
    for value in (np.int64(8), np.int32(8), np.uint8(8)):
        out = positive_int("batch_size", value)
        assert out == 8 and type(out) is int
    assert non_negative_int("step", np.int64(0)) == 0 and type(non_negative_int("step", 0)) is int
    with pytest.raises(ValueError, match="step must be a non-negative integer, got 2.5"):
        non_negative_int("step", 2.5)


@pytest.mark.parametrize("name", ["alpha", "beta", "eps"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), np.float64("nan"), True, "1"])
def test_priority_options_refuse_non_finite_values(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a finite number .*, got {re.escape(repr(value))}$"):
        priority_options(**{name: value})


def test_priority_options_bounds():
    assert priority_options(alpha=0, beta=0, eps=1e-12) == {"alpha": 0.0, "beta": 0.0, "eps": 1e-12}
    assert priority_options(alpha=np.float32(0.5))["alpha"] == 0.5
    with pytest.raises(ValueError, match="eps must be a finite number > 0.0, got 0"):
        priority_options(eps=0)
    with pytest.raises(ValueError, match="beta must be a finite number >= 0.0, got -0.1"):
        priority_options(beta=-0.1)


def test_fraction_bounds():
    assert fraction("offline_fraction", 0) == 0.0 and fraction("offline_fraction", 1) == 1.0
    assert fraction("offline_fraction", np.float32(0.25)) == 0.25
    for bad in (-1e-12, 1 + 1e-12, float("nan"), float("inf"), True, None, "0.5"):
        with pytest.raises(ValueError, match=f"offline_fraction must be a number in \\[0, 1\\], got {bad!r}"):
            fraction("offline_fraction", bad)


def test_timeouts_and_choices():
    assert timeout(None) is None and timeout(2) == 2.0
    for bad in (0, -1, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match=f"timeout must be a finite number > 0.0, got {bad!r}"):
            timeout(bad)
    assert one_of("sampler", "uniform", SAMPLERS) == "uniform"
    with pytest.raises(ValueError, match=re.escape("sampler must be one of ('uniform', 'without_replacement', "
                                                   "'prioritized') or rayrb.SliceSampler(...) (slices of episodes), got 'fifo'")):
        sampler_class("fifo")
    assert callable_or_none("transform", None) is None
    with pytest.raises(TypeError, match="transform must be callable, got int"):
        callable_or_none("transform", 3)
    assert finite_number("x", 1, minimum=1.0) == 1.0
    with pytest.raises(ValueError, match="x must be a finite number > 1.0, got 1"):
        finite_number("x", 1, minimum=1.0, strict=True)


def test_numbers_too_large_for_a_float_are_refused_naming_the_argument():
    for check in (lambda v: priority_options(beta=v), lambda v: fraction("beta", v)):
        with pytest.raises(ValueError, match="beta must be"):
            check(10**400)
