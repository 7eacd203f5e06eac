
import pytest

from rayrb.core.schedules import Constant, Cosine, Linear, SizeProportional, Step, make_schedule


def test_linear_matches_torchrl_anneal():
    base, total = 0.8, 100
    s = Linear(base, 0.0, total)
    for step in (0, 1, 50, 99, 100, 150):
        assert s(step, 0, 0) == pytest.approx(base * max(0.0, 1.0 - step / total))


def test_cosine_endpoints_and_midpoint():
    s = Cosine(0.9, 0.1, 10)
    assert s(0, 0, 0) == pytest.approx(0.9)
    assert s(5, 0, 0) == pytest.approx(0.5)
    assert s(10, 0, 0) == pytest.approx(0.1) and s(20, 0, 0) == pytest.approx(0.1)


def test_step_and_size_proportional():
    s = Step([10, 20], [1.0, 0.5, 0.0])
    assert [s(t, 0, 0) for t in (0, 9, 10, 19, 20)] == [1.0, 1.0, 0.5, 0.5, 0.0]
    assert SizeProportional()(0, 300, 100) == 0.75
    assert SizeProportional()(0, 0, 0) == 1.0


@pytest.mark.parametrize("s", [Constant(0.3), Linear(1, 0, 5), Cosine(0.5, 0.2, 7), Step([3], [1, 0]), SizeProportional()])
def test_config_round_trips(s):
    again = make_schedule(s.config())
    assert again == s
    assert all(again(t, 10, 5) == s(t, 10, 5) for t in range(10))


@pytest.mark.parametrize(
    "bad, err",
    [(1.5, ValueError), ({"kind": "exp"}, ValueError), ({"kind": "linear", "start": 1, "total_steps": 0}, ValueError),
     ({"kind": "step", "boundaries": [1], "values": [1]}, ValueError), (object(), TypeError)],
)
def test_bad_schedules(bad, err):
    with pytest.raises(err):
        make_schedule(bad)


def test_a_users_schedule_is_checked_where_it_answers_and_the_built_in_ones_are_trusted():
    from rayrb.core.schedules import Schedule, value_at

    class Half(Schedule):
        def __call__(self, step, n_offline, n_online):
            return 0.5 if step < 3 else float("nan")

    assert value_at(Half(), 0, 1, 1) == 0.5
    with pytest.raises(ValueError, match=r"offline_fraction must be a number in \[0, 1\], got nan"):
        value_at(Half(), 3, 1, 1)
    assert value_at(Linear(1, 0, 4), 2, 0, 0) == 0.5 and value_at(SizeProportional(), 0, 3, 1) == 0.75


def test_true_is_refused_as_a_fraction_out_of_range():
    with pytest.raises(ValueError, match=r"offline_fraction must be a number in \[0, 1\], got True"):
        make_schedule(True)


def test_configs_are_checked_where_they_are_made_and_numbers_of_any_kind_are_fractions():
    import numpy as np

    for boundaries in (["a"], [None], [float("nan")], [-1], [5, 5], [2.5]):
        with pytest.raises((ValueError, TypeError), match="step boundaries"):  # not at a later sample
            Step(boundaries, [0.1] * (len(boundaries) + 1))
    for value in (np.float32(0.5), np.float64(0.5), np.int64(1)):
        assert make_schedule(value) == Constant(float(value))
    with pytest.raises(ValueError, match="schedule kind must be one of"):
        make_schedule({"kind": ["linear"]})
    assert Linear(0.8, 0.2, 10)(10**400, 0, 0) == pytest.approx(0.2)  # a step no float holds: the end
    assert SizeProportional()(0, -5, 10) == 0.0 and SizeProportional()(0, 5, -10) == 1.0
