import itertools
import json
import math
import random
import warnings

import numpy as np
import pytest

from rayrb.core.rate_limiter import (
    ALL_OFFLINE,
    AS_PLANNED,
    WAIT,
    MinSize,
    RateLimiter,
    SampleToInsertRatio,
    make_rate_limiter,
)


def reverb_can_sample(inserts, deletes, samples, spi, min_size, min_diff, n):
    """reverb/cc/rate_limiter.cc, RateLimiter::CanSample, transliterated."""
    if inserts - deletes < min_size:
        return False
    return inserts * spi - samples - n >= min_diff


def reverb_can_insert(inserts, deletes, samples, spi, min_size, max_diff, n):
    """reverb/cc/rate_limiter.cc, RateLimiter::CanInsert, transliterated."""
    if inserts + n - deletes <= min_size:
        return True
    return (n + inserts) * spi - samples <= max_diff


def limiter_at(rl, inserts, samples):
    state = rl.state_dict()
    state.update(inserts=inserts, samples=samples)
    rl.load_state_dict(state)
    return rl


CONFIGS = [(1.0, 1, 2.0), (1.0, 3, 5.0), (0.5, 4, 1.0), (2.0, 2, 4.0), (4.0, 3, 8.0), (1.5, 2, (0.0, 6.0)),
           (1.0, 5, (-2.0, 3.0))]


@pytest.mark.parametrize("spi, min_size, error_buffer", CONFIGS)
def test_one_row_rules_are_reverbs(spi, min_size, error_buffer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (-2, 3) is below spi * min_size: Reverb's warning, tested below
        rl = SampleToInsertRatio(spi, min_size, error_buffer)
    for inserts, samples in itertools.product(range(16), range(40)):
        limiter_at(rl, inserts, samples)
        for deletes in range(inserts + 1):
            size = inserts - deletes
            assert rl.can_sample(1, size) == reverb_can_sample(inserts, deletes, samples, spi, min_size, rl.min_diff, 1)
            assert rl.can_insert(1, size) == reverb_can_insert(inserts, deletes, samples, spi, min_size, rl.max_diff, 1)
            for n in (2, 3, 7):  # a call on n rows goes whenever Reverb would let all n go
                if reverb_can_sample(inserts, deletes, samples, spi, min_size, rl.min_diff, n):
                    assert rl.can_sample(n, size)
                if reverb_can_insert(inserts, deletes, samples, spi, min_size, rl.max_diff, n):
                    assert rl.can_insert(n, size)


def test_windows_match_reverbs_offsets():
    rl = SampleToInsertRatio(4.0, 100, 50.0)
    assert (rl.min_diff, rl.max_diff) == (350.0, 450.0)
    rl = SampleToInsertRatio(4.0, 100, (-10, 400))
    assert (rl.min_diff, rl.max_diff) == (-10.0, 400.0)
    assert (MinSize(7).min_diff, MinSize(7).max_diff) == (-math.inf, math.inf)


def test_hand_worked_cases():
    # spi 0.5, min size 2, window [1 - 1, 1 + 1] = [0, 2].
    rl = SampleToInsertRatio(0.5, 2, 1.0, when_below_min_size="wait")
    assert rl.decide(1, 1) == WAIT
    assert rl.can_insert(4, 0)  # 0 + 4 * 0.5 = 2 <= 2
    rl.record_insert(4)
    assert rl.diff == 2.0
    assert not rl.can_insert(1, 4)  # 2.5 > 2, and a sample can go (2 - 1 >= 0)
    assert rl.decide(3, 4) == AS_PLANNED  # 2 - 1 >= 0: the whole batch goes, to diff -1
    rl.record_sample(3)
    assert rl.diff == -1.0
    assert rl.decide(1, 4) == WAIT  # -1 - 1 < 0
    assert rl.can_insert(100, 4)  # 49 > 2, but no sample can go
    assert rl.can_insert(2, 4)  # -1 + 1 <= 2
    rl.record_insert(2)
    assert rl.diff == 0.0 and rl.decide(1, 6) == WAIT  # 0 - 1 < 0
    rl.record_insert(2)
    assert rl.decide(1, 8) == AS_PLANNED  # 1 - 1 >= 0


def test_strict_batches_on_both_sides_would_deadlock_and_these_rules_do_not():
    rl = SampleToInsertRatio(1.0, 1, (0.0, 10.0))
    limiter_at(rl, 5, 0)  # diff 5: neither 5 + 8 <= 10 nor 5 - 6 >= 0
    assert 5 + 8 > rl.max_diff and 5 - 6 < rl.min_diff
    assert not rl.can_insert(8, 5)
    assert rl.can_sample(6, 5)
    rl.record_sample(6)
    assert rl.can_insert(8, 5)


def run_loop(rl, seed, steps, max_insert, batch_size, capacity):
    """Writer and learner take turns at random; returns the (diff, size) after each committed call."""
    rng = random.Random(seed)
    size, trace = 0, []
    for _ in range(steps):
        n_ins = rng.randint(1, max_insert)
        n_on = batch_size - math.floor(rng.random() * batch_size + 0.5)  # n_on of a random offline fraction
        can_ins, decision = rl.can_insert(n_ins, size), rl.decide(n_on, size)
        assert can_ins or decision != WAIT, f"both sides blocked at diff={rl.diff}, size={size}"
        before, size_before = rl.diff, size
        if can_ins and (decision == WAIT or rng.random() < 0.5):
            rl.record_insert(n_ins)
            size = min(capacity, size + n_ins)
            if rl.diff > rl.max_diff:  # only while no sample could go
                assert before - 1 < rl.min_diff or size_before < rl.min_size_to_sample
        else:
            rl.record_sample(n_on if decision == AS_PLANNED else 0)
            if n_on and decision == AS_PLANNED:
                assert before - 1 >= rl.min_diff and rl.diff >= rl.min_diff + 1 - n_on
        trace.append((rl.diff, size))
    return trace


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("spi, min_size, error_buffer, max_insert, batch_size, capacity",
                         [(1.0, 50, 40.0, 20, 16, 10**6), (4.0, 100, 200.0, 30, 64, 500), (0.25, 20, 10.0, 8, 32, 64)])
@pytest.mark.parametrize("mode", ["offline", "wait"])
def test_simulated_loop_keeps_the_ratio_in_its_window(seed, spi, min_size, error_buffer, max_insert, batch_size,
                                                      capacity, mode):
    rl = SampleToInsertRatio(spi, min_size, error_buffer, when_below_min_size=mode)
    trace = run_loop(rl, seed, 3000, max_insert, batch_size, capacity)
    warm = [d for d, size in trace if size >= min_size]
    assert len(warm) > 2500
    # inserts * spi - samples stays in [min_diff - (B - 1), max_diff]: the ratio, within error_buffer plus one batch.
    assert min(warm) >= rl.min_diff - (batch_size - 1)
    assert max(warm) <= rl.max_diff
    s = rl.stats()
    assert s["samples"] > 0 and s["inserts"] * spi - s["samples"] == s["diff"]
    assert abs(s["samples"] / s["inserts"] - spi) <= (spi * min_size + error_buffer + batch_size) / s["inserts"]


def test_min_size_has_no_ratio():
    rl = MinSize(10)
    assert rl.can_insert(10**9, 0) and rl.diff is None
    assert rl.decide(5, 9) == ALL_OFFLINE and rl.decide(5, 10) == AS_PLANNED
    rl.record_sample(10**6)
    assert rl.decide(5, 10) == AS_PLANNED and rl.can_insert(1, 10)
    assert make_rate_limiter(None) == MinSize(1) and make_rate_limiter(None).decide(3, 0) == ALL_OFFLINE


def test_offline_rows_never_count():
    rl = SampleToInsertRatio(1.0, 5, 3.0, when_below_min_size="wait")
    limiter_at(rl, 5, 7)  # diff -2: online sampling waits
    before = rl.state_dict()
    assert rl.decide(0, 0) == AS_PLANNED and rl.decide(0, 5) == AS_PLANNED  # an all-offline batch never waits
    assert rl.can_sample(0, 0) and rl.can_insert(0, 5)
    rl.record_sample(0)
    rl.record_insert(0)
    assert rl.state_dict() == before and rl.decide(1, 5) == WAIT


def test_queries_change_nothing():
    rl = SampleToInsertRatio(2.0, 3, 4.0)
    limiter_at(rl, 4, 3)
    before = rl.state_dict()
    for n, size in itertools.product(range(6), range(6)):
        rl.can_insert(n, size), rl.can_sample(n, size), rl.decide(n, size)
    assert rl.state_dict() == before


@pytest.mark.parametrize("mode, below", [("offline", ALL_OFFLINE), ("wait", WAIT)])
def test_below_min_size(mode, below):
    rl = SampleToInsertRatio(1.0, 10, 5.0, when_below_min_size=mode)
    for size in range(10):
        assert rl.decide(4, size) == below and not rl.can_sample(4, size)
        assert rl.can_insert(50, size)  # nothing can sample, so writers must not wait
    rl.record_insert(10)
    assert rl.decide(4, 10) == AS_PLANNED
    assert MinSize(3, when_below_min_size=mode).decide(1, 2) == below


def test_huge_insert_waits_only_until_sampling_stops():
    rl = SampleToInsertRatio(1.0, 10, 5.0)  # window [5, 15]
    rl.record_insert(10)
    size, huge = 10, 1000
    steps = 0
    while not rl.can_insert(huge, size):
        assert rl.decide(4, size) == AS_PLANNED  # refused only while the learner can go
        rl.record_sample(4)
        steps += 1
    assert steps == 2 and rl.decide(1, size) == WAIT  # diff 2: the learner is stuck, the writer goes
    rl.record_insert(huge)
    assert rl.diff == 1002 and not rl.can_insert(1, size + huge)
    while rl.decide(4, size + huge) == AS_PLANNED:  # the learner drains it; the writer waits meanwhile
        rl.record_sample(4)
    assert rl.can_insert(1, size + huge) and rl.diff - 1 < rl.min_diff


def test_huge_batch_goes_on_its_first_row():
    rl = SampleToInsertRatio(1.0, 10, 5.0)  # window [5, 15]
    rl.record_insert(10)
    assert rl.decide(500, 10) == AS_PLANNED  # diff 10 - 1 >= 5
    rl.record_sample(500)
    assert rl.diff == -490 and rl.decide(1, 10) == WAIT
    size = 10
    while rl.decide(500, size) == WAIT:
        assert rl.can_insert(7, size)  # the learner is stuck, so writers always go
        rl.record_insert(7)
        size += 7
    assert rl.diff - 1 >= rl.min_diff


def test_prefill_seeds_the_online_side_balanced():
    rl = SampleToInsertRatio(8.0, 1000, 2000.0)  # window [6000, 10000]
    rl.record_prefill(50_000, online_size=0)
    assert rl.diff == 8000.0  # the middle: as if exactly the warm-up had been inserted
    assert rl.stats()["prefilled"] == 50_000 and rl.stats()["inserts"] == 1000
    assert not rl.can_insert(500, 50_000)  # 8000 + 500 * 8 > 10000: a limited insert waits ...
    rl.record_prefill(500, online_size=50_000)  # ... a prefill takes no check and, after the warm-up, no credit
    assert rl.diff == 8000.0
    assert rl.decide(256, 50_000) == AS_PLANNED  # the learner is not held back ...
    for _ in range(8):
        rl.record_sample(256)
    assert rl.decide(256, 50_000) == WAIT  # ... nor let 50 000 * 8 samples ahead
    # Below the warm-up, prefilled rows count only as far as they fill it.
    rl2 = SampleToInsertRatio(8.0, 1000, 2000.0)
    rl2.record_insert(300)
    rl2.record_prefill(5000, online_size=300)
    assert rl2.stats()["inserts"] == 1000 and rl2.diff == 8000.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(samples_per_insert=4.0, min_size_to_sample=10, error_buffer=3.0), "8.0"),  # 6 wide < 2 * 4
    (dict(samples_per_insert=1.0, min_size_to_sample=10, error_buffer=(0.0, 1.5)), "1.5"),  # < 2 * 1
    (dict(samples_per_insert=0.5, min_size_to_sample=10, error_buffer=0.9), "1.8"),  # < 2 * max(1, 0.5)
    (dict(samples_per_insert=1.0, min_size_to_sample=5, error_buffer=(6.0, 20.0)), "min_diff (6.0)"),
    (dict(samples_per_insert=1.0, min_size_to_sample=0, error_buffer=5.0), "got 0"),
    (dict(samples_per_insert=float("nan"), min_size_to_sample=1, error_buffer=5.0), "got nan"),
    (dict(samples_per_insert=float("inf"), min_size_to_sample=1, error_buffer=5.0), "got inf"),
    (dict(samples_per_insert=-1.0, min_size_to_sample=1, error_buffer=5.0), "got -1.0"),
    (dict(samples_per_insert=0, min_size_to_sample=1, error_buffer=5.0), "got 0"),
    (dict(samples_per_insert=True, min_size_to_sample=1, error_buffer=5.0), "got True"),
    (dict(samples_per_insert=1.0, min_size_to_sample=1, error_buffer=float("nan")), "got nan"),
    (dict(samples_per_insert=1.0, min_size_to_sample=1, error_buffer=-3.0), "got -3.0"),
    (dict(samples_per_insert=1.0, min_size_to_sample=1, error_buffer=(0.0, float("inf"))), "got inf"),
    (dict(samples_per_insert=1.0, min_size_to_sample=1, error_buffer=None), "got None"),
    (dict(samples_per_insert=None, min_size_to_sample=1, error_buffer=5.0), "error_buffer=5.0"),
    (dict(min_size_to_sample=2.5), "got 2.5"),
    (dict(when_below_min_size="block"), "got 'block'"),
])
def test_bad_configs_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RateLimiter(**kwargs)


@pytest.mark.parametrize("error_buffer", ["5", (1.0,), (1.0, 2.0, 3.0)])
def test_error_buffer_of_the_wrong_kind(error_buffer):
    with pytest.raises(TypeError, match="error_buffer must be a number or a"):
        SampleToInsertRatio(1.0, 1, error_buffer)


def test_reverbs_warning_and_capacity_check():
    with pytest.warns(UserWarning, match=r"max_diff \(3.0\) is below .* \(5.0\)"):
        SampleToInsertRatio(1.0, 5, (-2.0, 3.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rl = SampleToInsertRatio(1.0, 5, 4.0)
    rl.validate(online_capacity=5)
    with pytest.raises(ValueError, match=r"online_capacity \(4\) must be >= min_size_to_sample \(5\)"):
        rl.validate(online_capacity=4)
    with pytest.raises(ValueError, match=r"online_capacity \(4\)"):
        MinSize(5).validate(online_capacity=4)


def test_blocked_time_accounting():
    rl = MinSize(1)
    rl.record_blocked("sample", 0.25)
    rl.record_blocked("sample", 0.5)
    rl.record_blocked("insert", 1)
    s = rl.stats()
    assert (s["sample_blocked_calls"], s["sample_blocked_seconds"]) == (2, 0.75)
    assert (s["insert_blocked_calls"], s["insert_blocked_seconds"]) == (1, 1.0)
    before = rl.state_dict()
    for side, seconds in [("learner", 1.0), ("sample", -1.0), ("insert", float("nan"))]:
        with pytest.raises(ValueError):
            rl.record_blocked(side, seconds)
    assert rl.state_dict() == before


@pytest.mark.parametrize("call", ["record_insert", "record_sample"])
@pytest.mark.parametrize("n", [-1, 1.5, True, "3"])
def test_bad_counts_refused(call, n):
    rl = MinSize(1)
    with pytest.raises(ValueError):
        getattr(rl, call)(n)
    with pytest.raises(ValueError):
        rl.can_insert(n, 0)
    assert rl.state_dict() == MinSize(1).state_dict()


def test_state_dict_round_trip():
    rl = SampleToInsertRatio(2.0, 3, 4.0)
    rl.record_insert(np.int64(9))
    rl.record_sample(5)
    rl.record_prefill(2, online_size=9)
    rl.record_blocked("insert", 0.125)
    state = json.loads(json.dumps(rl.state_dict()))
    again = SampleToInsertRatio(2.0, 3, 4.0)
    again.load_state_dict(state)
    assert again == rl and again.stats() == rl.stats() and again.diff == 13.0


@pytest.mark.parametrize("mutate, message", [
    (lambda s: s.pop("samples"), "missing keys \\['samples'\\]"),
    (lambda s: s.update(extra=1), "unknown keys \\['extra'\\]"),
    (lambda s: s.update(inserts=-1), "inserts"),
    (lambda s: s.update(samples=2.5), "samples"),
    (lambda s: s.update(insert_blocked_seconds=float("nan")), "insert_blocked_seconds"),
    (lambda s: s.update(sample_blocked_calls=True), "sample_blocked_calls"),
])
def test_bad_state_refused_and_nothing_changed(mutate, message):
    rl = SampleToInsertRatio(2.0, 3, 4.0)
    rl.record_insert(4)
    rl.record_sample(1)
    state, before = rl.state_dict(), rl.state_dict()
    state["inserts"] = 99  # valid, so a load that applied keys one by one would show it
    mutate(state)
    with pytest.raises(ValueError, match=message):
        rl.load_state_dict(state)
    assert rl.state_dict() == before
    with pytest.raises(ValueError, match="expected a rate limiter state dict"):
        rl.load_state_dict([1, 2])


@pytest.mark.parametrize("rl", [MinSize(1), MinSize(64, when_below_min_size="wait"), SampleToInsertRatio(4.0, 100, 50),
                                SampleToInsertRatio(0.5, 7, (-3, 9), when_below_min_size="wait")])
def test_config_round_trips(rl):
    again = make_rate_limiter(json.loads(json.dumps(rl.config())))
    assert again == rl and again.config() == rl.config()
    assert (again.min_diff, again.max_diff) == (rl.min_diff, rl.max_diff)
    assert make_rate_limiter(rl) is rl
    assert repr(rl).startswith("RateLimiter(min_size_to_sample=")


@pytest.mark.parametrize("spec, err, message", [
    ({"min_size": 3}, ValueError, "unknown rate limiter options \\['min_size'\\]"),
    ({"samples_per_insert": 1.0, "error_buffer": 0.5}, ValueError, "at least"),
    (3, TypeError, "got int"),
    ("min_size", TypeError, "got str"),
])
def test_bad_specs(spec, err, message):
    with pytest.raises(err, match=message):
        make_rate_limiter(spec)


def test_a_window_no_count_can_be_compared_to_is_refused():
    for args in ((1e308, 2, 1.0), (1.0, 1, (-math.inf, 5.0))):
        with pytest.raises(ValueError, match="finite"):
            SampleToInsertRatio(*args)


def test_a_saved_state_without_its_limiters_config_is_refused_not_taken_as_no_limit():
    from rayrb.core.sampling_state import checked_state
    from rayrb.errors import SavedStateError

    limiter = SampleToInsertRatio(2.0, 3, 4.0)
    for saved in ({"config": None, "state": limiter.state_dict()}, None, {"state": limiter.state_dict()}):
        state = {"step": 0, "schedule": 0.5, "rng": np.random.default_rng(0).bit_generator.state,
                 "rate_limiter": saved}
        with pytest.raises(SavedStateError, match="rate_limiter"):
            checked_state(state, sampler="uniform", num_shards={"offline": 1, "online": 1}, alloc_options={},
                          online_capacity=10, limiter=limiter)
