"""The main job's behaviour policies, without Ray: the narrow policy takes one action per context, not a random one."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
from conftest import REPO


@pytest.fixture(scope="module")
def job():
    """The main job's behaviour policies, ``pipelines/bandit/behaviour.py``, imported as the job imports them (it
    imports ray, but starts nothing)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(REPO / "pipelines"))  # what running pipelines/train_bandit.py puts first
        return importlib.import_module("bandit.behaviour")


def table(n: int = 900, d: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A small table, four classes: the quartile of the columns' sum; every context three times."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n // 3, d)).astype(np.float32)
    s = x.sum(1)
    y = np.digitize(s, np.quantile(s, [0.25, 0.5, 0.75])).astype(np.int64)
    return np.repeat(x, 3, axis=0), np.repeat(y, 3)


def log(job, policy: str, x: np.ndarray, y: np.ndarray, k: int, params=None) -> dict[str, np.ndarray]:
    """The job's ``LogBehaviour`` on ``x, y`` in chunks of 128 rows, as numpy."""
    import torch
    from tensordict import TensorDict

    fn = job.LogBehaviour(policy, k, seed=0, params=params)
    out = []
    for start in range(0, len(y), 128):
        sl = slice(start, start + 128)
        td = TensorDict({"X": torch.from_numpy(x[sl]), "y": torch.from_numpy(y[sl]),
                         "row": torch.arange(start, min(start + 128, len(y)))}, [len(y[sl])])
        out.append(fn(td))
    return {"action": np.concatenate([o["action"].numpy() for o in out]),
            "log_prob": np.concatenate([o["action_log_prob"].numpy() for o in out]),
            "reward": np.concatenate([o["next", "reward"].numpy()[:, 0] for o in out])}


def actions_per_context(x: np.ndarray, action: np.ndarray) -> int:
    """The most distinct actions logged for any one context."""
    _, ctx = np.unique(x, axis=0, return_inverse=True)
    return max(len(np.unique(action[ctx.ravel() == c])) for c in np.unique(ctx))


def test_narrow_policy_takes_one_action_per_context(job):
    x, y = table()
    params = job.fit_narrow(x, y, 4, n_features=2, seed=0)
    assert params == job.fit_narrow(x, y, 4, n_features=2, seed=0)  # deterministic fit
    action = job.narrow_actions(params, x)
    assert action.dtype == np.int64 and actions_per_context(x, action) == 1  # no other action is ever seen there
    # it reads only its two columns: the others shuffled, the same actions
    other = np.setdiff1d(np.arange(x.shape[1]), params["features"])
    assert len(params["features"]) == 2 and len(other) == 2
    shuffled = x.copy()
    shuffled[:, other] = np.random.default_rng(1).permutation(shuffled[:, other])
    assert (job.narrow_actions(params, shuffled) == action).all()


def test_narrow_policy_is_not_uniform(job):
    x, y = table()
    action = job.narrow_actions(job.fit_narrow(x, y, 4, n_features=2, seed=0), x)
    uniform = np.random.default_rng(0).integers(0, 4, len(y))
    # a random log shows several actions for a context seen three times; the narrow one never does
    assert actions_per_context(x, uniform) > 1 and actions_per_context(x, action) == 1
    # mediocre, not random: two of the four columns put it well above the uniform policy's 1/4, well below 1
    assert 0.35 < (action == y).mean() < 0.8, (action == y).mean()
    assert abs((uniform == y).mean() - 0.25) < 0.06


def test_log_behaviour_logs_the_narrow_actions(job):
    x, y = table()
    params = job.fit_narrow(x, y, 4, n_features=2, seed=0)
    logged = log(job, "narrow", x, y, 4, params)
    assert (logged["action"] == job.narrow_actions(params, x)).all()
    assert (logged["log_prob"] == 0).all()  # taken with probability 1
    np.testing.assert_array_equal(logged["reward"], logged["action"] == y)
    assert actions_per_context(x, log(job, "uniform", x, y, 4)["action"]) > 1


def test_log_behaviour_refuses_params_for_a_context_free_policy(job):
    with pytest.raises(ValueError, match="expected fitted params exactly for the policies"):
        job.LogBehaviour("uniform", 4, seed=0, params={"features": [0]})
    with pytest.raises(ValueError, match="expected fitted params"):
        job.LogBehaviour("narrow", 4, seed=0)


def test_segment_policy_tries_every_action_where_the_narrow_rule_is_least_sure_and_only_there(job):
    x, y = table()
    narrow = job.fit_narrow(x, y, 4, n_features=2, seed=0)
    params = job.fit_segment(narrow, x, 0.25)
    where = job.explored(params, x)
    assert 0.2 <= where.mean() <= 0.3  # the share asked for, up to ties in the margin
    logged = log(job, "segment", x, y, 4, params)
    # elsewhere: the narrow rule's one action, taken with probability 1
    assert (logged["action"][~where] == job.narrow_actions(narrow, x[~where])).all()
    assert (logged["log_prob"][~where] == 0).all()
    # where it explores: every action, each with probability 1/4
    assert set(logged["action"][where].tolist()) == {0, 1, 2, 3}
    np.testing.assert_allclose(logged["log_prob"][where], np.log(0.25), rtol=1e-6)
    assert actions_per_context(x[where], logged["action"][where]) > 1
    np.testing.assert_array_equal(logged["reward"], logged["action"] == y)
    # the explored contexts are those the narrow rule is least sure of
    assert job._margin(narrow, x)[where].max() <= job._margin(narrow, x)[~where].min()
    with pytest.raises(ValueError, match=r"expected an explored share in \(0, 1\), got 1.5"):
        job.fit_segment(narrow, x, 1.5)
    with pytest.raises(ValueError, match="expected fitted params"):
        job.LogBehaviour("segment", 4, seed=0)
