"""Rate limiting the online side: Reverb's sample-to-insert ratio, counted in online rows.

A learner that samples the online buffer much faster than collectors fill it
overfits to the few rows there; collectors that outrun the learner write rows
that are hardly sampled. Reverb's rate limiter bounds the gap between the two.
rayrb keeps Reverb's options and rules, counts rows rather than items, and
counts **only the online side**: offline rows neither unblock nor stall anyone
(a batch of ``B`` rows with ``n_on`` online rows counts ``n_on`` samples; an
extend of ``n`` rows counts ``n`` inserts). The state is two counters and,
with ``spi = samples_per_insert``, one derived number::

    diff = inserts * spi - samples

Options (Reverb's ``reverb/rate_limiters.py``):

* ``SampleToInsertRatio(spi, min_size_to_sample, error_buffer)``: a number
  ``error_buffer`` gives the window ``[min_diff, max_diff] = spi * min_size_to_sample -/+ error_buffer``
  (the offset keeps the warm-up rows out of the ratio); a pair is ``(min_diff, max_diff)`` as is.
* ``MinSize(min_size_to_sample)``: no ratio (``samples_per_insert=None``, an unbounded window).
* ``when_below_min_size``: while the online buffer holds fewer than ``min_size_to_sample`` rows,
  a batch is all offline (``"offline"``, the default; with ``MinSize(1)`` this is the design's
  "an empty online side means an all-offline batch") or waits (``"wait"``, Reverb's behaviour).

Allow rules, for a call on ``n >= 1`` rows while the online buffer holds ``size`` rows. Reverb
(``RateLimiter::CanSample`` / ``CanInsert`` in ``reverb/cc/rate_limiter.cc``) admits one row at a
time; a rayrb call is never split, so each rule says when a whole call may go:

* sample: ``size >= min_size_to_sample`` and ``diff - 1 >= min_diff``. This is Reverb's
  ``CanSample(1)``: like Reverb's ``Table::SampleFlexibleBatch``, a batch waits only for its first
  row. Reverb then returns the batch short; a rayrb batch is never short, so its other rows come
  too and ``diff`` may end up to ``n - 1`` below ``min_diff``.
* insert: ``diff + n * spi <= max_diff`` (Reverb's ``CanInsert(n)``), or no sample could go now:
  ``size < min_size_to_sample`` or ``diff - 1 < min_diff``. The second clause contains Reverb's
  "inserts are free below min size" and admits an insert too big for the window once sampling
  has stopped, so ``diff`` exceeds ``max_diff`` only by such an insert.
* zero rows: always allowed, and recording them changes nothing.

For one row, on a valid configuration, these are exactly Reverb's rules. **No deadlock**, whatever
the sizes of inserts and batches: when a sample is refused every insert is allowed, and when an
insert is refused every sample is allowed. Waiting for the whole call to fit on both sides would
deadlock: with window ``[0, 10]``, ``spi = 1`` and ``diff = 5``, an extend of 8 rows and a batch of 6
online rows would wait for each other forever.

Validation (``validate()``, run at construction) follows Reverb's ``SampleToInsertRatio``:
``min_size_to_sample >= 1``; ``spi`` positive and finite; ``error_buffer`` finite and ``>= 0``, or a
finite pair; ``max_diff - min_diff >= 2 * max(1, spi)`` (room for one inserted and one sampled row
between the bounds; these rules need no more to be deadlock-free); ``min_diff <= spi * min_size_to_sample``
(otherwise sampling would not start at ``min_size_to_sample`` rows, and the option would not mean what
it says; Reverb calls it a "deadlock as soon as min_size_to_sample items have been inserted"). Like
Reverb, it warns when
``max_diff < spi * min_size_to_sample``: once the warm-up is in, inserts wait for samples, so a
program that samples only after its writes return hangs. ``validate(online_capacity=C)`` also
refuses ``C < min_size_to_sample``: the online side could then never be sampled.

Prefill (Reverb issue #134, "fill the table, then turn limiting on"): ``record_prefill`` commits
rows written with no check. They count toward the online size (the shards hold them) but enter the
ratio only as far as they fill the warm-up: ``min(n, max(0, min_size_to_sample - size))`` of them
count as inserts, the rest only in ``prefilled``. Prefilling an empty buffer with at least
``min_size_to_sample`` rows leaves ``diff = spi * min_size_to_sample``, the middle of a numeric
window: the learner may sample ``error_buffer`` online rows (and the rest of the batch that crosses
``min_diff``) before it waits for writers, and is not held back either.

Examples (``spi = 2``, ``min_size_to_sample = 3``, ``error_buffer = 4``: window ``[2, 10]``):
    >>> rl = SampleToInsertRatio(2.0, 3, 4.0)
    >>> rl.min_diff, rl.max_diff
    (2.0, 10.0)
    >>> rl.decide(n_online_rows=2, online_size=0)  # below min size: the batch goes all offline
    <Decision.ALL_OFFLINE: 'all_offline'>
    >>> rl.can_insert(3, online_size=0); rl.record_insert(3); rl.diff  # 0 + 3 * 2 <= 10
    True
    6.0
    >>> rl.decide(4, online_size=3); rl.record_sample(4); rl.diff  # 6 - 1 >= 2
    <Decision.AS_PLANNED: 'as_planned'>
    2.0
    >>> rl.decide(1, online_size=3)  # 2 - 1 < 2
    <Decision.WAIT: 'wait'>
    >>> rl.can_insert(3, online_size=3); rl.record_insert(3); rl.diff  # 2 + 6 <= 10
    True
    8.0
    >>> rl.can_insert(2, online_size=6)  # 8 + 4 > 10, and the learner can still sample
    False
    >>> make_rate_limiter(rl.config()) == SampleToInsertRatio(2.0, 3, 4.0)
    True
"""
from __future__ import annotations

import enum
import math
import warnings
from collections.abc import Mapping
from numbers import Real
from typing import Any

from rayrb.core.validation import finite_number, non_negative_int, one_of, positive_int
from rayrb.errors import InvalidArgumentError, InvalidArgumentTypeError, SavedStateError


class Decision(str, enum.Enum):
    """The rate limiter's say on a planned batch (a ``str``, so it compares equal to its value)."""

    AS_PLANNED = "as_planned"
    ALL_OFFLINE = "all_offline"  # below min_size_to_sample, when_below_min_size="offline"
    WAIT = "wait"


AS_PLANNED, ALL_OFFLINE, WAIT = Decision.AS_PLANNED, Decision.ALL_OFFLINE, Decision.WAIT
BELOW_MIN_SIZE = ("offline", "wait")
CALLS = ("insert", "sample")  # the two kinds of call a limiter may hold back (SIDES, in plans, are offline/online)
_COUNTS = ("inserts", "samples", "prefilled", "insert_blocked_calls", "sample_blocked_calls")
_SECONDS = ("insert_blocked_seconds", "sample_blocked_seconds")


def _error_buffer(value: Any) -> float | tuple[float, float]:
    if isinstance(value, Real) and not isinstance(value, bool):
        return finite_number("error_buffer", value, minimum=0.0)
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return (finite_number("error_buffer[0] (min_diff)", value[0]),
                finite_number("error_buffer[1] (max_diff)", value[1]))
    raise InvalidArgumentTypeError(f"error_buffer must be a number or a (min_diff, max_diff) pair, got {value!r}")


class RateLimiter:
    """Pure state machine: queries (``can_*``, ``decide``) change nothing; ``record_*`` commit."""

    def __init__(self, min_size_to_sample: int = 1, samples_per_insert: float | None = None,
                 error_buffer: float | tuple[float, float] | None = None, *,
                 when_below_min_size: str = "offline"):
        self.min_size_to_sample = positive_int("min_size_to_sample", min_size_to_sample)
        self.when_below_min_size = one_of("when_below_min_size", when_below_min_size, BELOW_MIN_SIZE)
        if samples_per_insert is None:
            if error_buffer is not None:
                raise InvalidArgumentError(f"error_buffer needs samples_per_insert, got error_buffer={error_buffer!r} "
                                           "with samples_per_insert=None")
            self.samples_per_insert, self.error_buffer = None, None
            self.min_diff, self.max_diff = -math.inf, math.inf
        else:
            self.samples_per_insert = finite_number("samples_per_insert", samples_per_insert, minimum=0.0, strict=True)
            if error_buffer is None:
                raise InvalidArgumentError(
                    "samples_per_insert needs an error_buffer (a number or a (min_diff, max_diff) "
                    "pair), got None")
            self.error_buffer = _error_buffer(error_buffer)
            if isinstance(self.error_buffer, tuple):
                self.min_diff, self.max_diff = self.error_buffer
            else:
                offset = self.samples_per_insert * self.min_size_to_sample
                self.min_diff, self.max_diff = offset - self.error_buffer, offset + self.error_buffer
        self.validate()
        self._state: dict[str, float] = {k: 0 for k in _COUNTS} | {k: 0.0 for k in _SECONDS}

    def validate(self, online_capacity: int | None = None) -> None:
        """Refuse a window or capacity that can block sampling for good (Reverb's checks, see the module)."""
        spi, lo, hi, m = self.samples_per_insert, self.min_diff, self.max_diff, self.min_size_to_sample
        if spi is not None:
            if not all(map(math.isfinite, (lo, hi, spi * m))):  # 1e308 * 2: a window no count can be compared to
                raise InvalidArgumentError(f"expected samples_per_insert * min_size_to_sample ({spi} * {m}) and the "
                                           f"window [min_diff, max_diff] finite, got [{lo}, {hi}]")
            if hi - lo < 2 * max(1.0, spi):
                raise InvalidArgumentError(
                    f"the error_buffer window [min_diff, max_diff] = [{lo}, {hi}] must be at least "
                    f"2 * max(1, samples_per_insert) = {2 * max(1.0, spi)} wide (Reverb's rule), "
                    f"got {hi - lo}: a narrower one leaves too little room for one inserted and one "
                    "sampled row")
            if lo > spi * m:
                raise InvalidArgumentError(
                    f"min_diff ({lo}) must be <= samples_per_insert * min_size_to_sample "
                    f"({spi} * {m} = {spi * m}): sampling could not start once min_size_to_sample "
                    "rows are in")
            if hi < spi * m:
                warnings.warn(f"max_diff ({hi}) is below samples_per_insert * min_size_to_sample ({spi * m}): once "
                              "min_size_to_sample rows are in, inserts wait for samples, so a program that "
                              "samples only after its writes return hangs", stacklevel=3)
        if online_capacity is not None and positive_int("online_capacity", online_capacity) < m:
            raise InvalidArgumentError(
                f"online_capacity ({online_capacity}) must be >= min_size_to_sample ({m}): the online "
                "side could never be sampled")

    # -- queries ------------------------------------------------------------------------------------
    @property
    def diff(self) -> float | None:
        """``inserts * samples_per_insert - samples``; ``None`` without a ratio."""
        spi = self.samples_per_insert
        return None if spi is None else self._state["inserts"] * spi - self._state["samples"]

    def _sample_allowed(self, online_size: int, diff: float | None = None) -> bool:
        """Reverb's ``CanSample(1)``: whether the first online row of a batch may go (at ``diff``, by default
        the limiter's own)."""
        if online_size < self.min_size_to_sample:
            return False
        diff = self.diff if diff is None else diff
        return diff is None or diff - 1 >= self.min_diff

    def can_sample(self, n_online_rows: int, online_size: int) -> bool:
        n, size = non_negative_int("n_online_rows", n_online_rows), non_negative_int("online_size", online_size)
        return n == 0 or self._sample_allowed(size)

    def can_insert(self, n_rows: int, online_size: int, unserved: int = 0) -> bool:
        """Whether ``n_rows`` may be inserted; ``unserved`` sampled rows were drawn ahead and not yet served,
        and count as not sampled (a write is judged against the rows served)."""
        n, size = non_negative_int("n_rows", n_rows), non_negative_int("online_size", online_size)
        diff = self.diff
        if diff is not None:
            diff += non_negative_int("unserved", unserved)
        if n == 0 or diff is None or diff + n * self.samples_per_insert <= self.max_diff:
            return True
        return not self._sample_allowed(size, diff)  # could a sample go, had only the rows served been drawn

    def decide(self, n_online_rows: int, online_size: int) -> Decision:
        """For a planned batch: ``"as_planned"``, ``"all_offline"`` (below min size) or ``"wait"``."""
        if self.can_sample(n_online_rows, online_size):
            return AS_PLANNED
        if online_size < self.min_size_to_sample and self.when_below_min_size == "offline":
            return ALL_OFFLINE
        return WAIT

    # -- commits (only after the operation succeeded) -------------------------------------------------
    def record_insert(self, n_rows: int) -> None:
        self._state["inserts"] += non_negative_int("n_rows", n_rows)

    def record_sample(self, n_online_rows: int) -> None:
        self._state["samples"] += non_negative_int("n_online_rows", n_online_rows)

    def unrecord_sample(self, n_online_rows: int) -> None:
        """Rows counted by ``record_sample`` that were never served (dropped by the handle that drew them)."""
        self._state["samples"] = max(0, self._state["samples"] - non_negative_int("n_online_rows", n_online_rows))

    def record_prefill(self, n_rows: int, online_size: int) -> None:
        """Rows written with no check; ``online_size`` is the size before them (see the module)."""
        n, size = non_negative_int("n_rows", n_rows), non_negative_int("online_size", online_size)
        self._state["inserts"] += min(n, max(0, self.min_size_to_sample - size))
        self._state["prefilled"] += n

    def record_blocked(self, call: str, seconds: float) -> None:
        """A call of kind ``call`` (``"insert"`` or ``"sample"``) that waited ``seconds`` before it went."""
        call = one_of("call", call, CALLS)
        self._state[f"{call}_blocked_seconds"] += finite_number("seconds", seconds, minimum=0.0)
        self._state[f"{call}_blocked_calls"] += 1

    # -- stats, checkpoints, config -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {**self.state_dict(), "diff": self.diff}

    def state_dict(self) -> dict[str, Any]:
        return dict(self._state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Counters from ``state_dict()``; on any error raises ValueError and changes nothing."""
        if not isinstance(state, Mapping):
            raise SavedStateError(f"expected a rate limiter state dict, got {type(state).__name__}")
        missing, unknown = sorted(set(_COUNTS + _SECONDS) - set(state)), sorted(set(state) - set(_COUNTS + _SECONDS))
        if missing or unknown:
            raise SavedStateError(f"rate limiter state has missing keys {missing} and unknown keys {unknown}")
        new = {k: non_negative_int(f"state[{k!r}]", state[k]) for k in _COUNTS}
        new |= {k: finite_number(f"state[{k!r}]", state[k], minimum=0.0) for k in _SECONDS}
        self._state = new

    def config(self) -> dict[str, Any]:
        return {"min_size_to_sample": self.min_size_to_sample, "samples_per_insert": self.samples_per_insert,
                "error_buffer": self.error_buffer, "when_below_min_size": self.when_below_min_size}

    def __repr__(self) -> str:
        return f"RateLimiter({', '.join(f'{k}={v!r}' for k, v in self.config().items())})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, RateLimiter) and self.config() == other.config()
                and self.state_dict() == other.state_dict())


def MinSize(min_size_to_sample: int, *, when_below_min_size: str = "offline") -> RateLimiter:  # noqa: N802
    """Reverb's ``MinSize``: online rows are sampled once the buffer holds ``min_size_to_sample``."""
    return RateLimiter(min_size_to_sample, when_below_min_size=when_below_min_size)


def SampleToInsertRatio(samples_per_insert: float, min_size_to_sample: int,  # noqa: N802
                        error_buffer: float | tuple[float, float], *,
                        when_below_min_size: str = "offline") -> RateLimiter:
    """Reverb's ``SampleToInsertRatio``: keep ``diff`` in the ``error_buffer`` window (see the module)."""
    return RateLimiter(min_size_to_sample, samples_per_insert, error_buffer, when_below_min_size=when_below_min_size)


def make_rate_limiter(spec: None | RateLimiter | Mapping[str, Any]) -> RateLimiter:
    """A limiter from ``None`` (``MinSize(1)``: no limit), a limiter, or a ``config()`` dict."""
    if spec is None:
        return RateLimiter()
    if isinstance(spec, RateLimiter):
        return spec
    if isinstance(spec, Mapping):
        known = ("min_size_to_sample", "samples_per_insert", "error_buffer", "when_below_min_size")
        unknown = sorted(set(spec) - set(known))
        if unknown:
            raise InvalidArgumentError(f"unknown rate limiter options {unknown}; expected some of {list(known)}")
        return RateLimiter(**spec)
    raise InvalidArgumentTypeError(f"expected None, a RateLimiter or a config dict, got {type(spec).__name__}")
