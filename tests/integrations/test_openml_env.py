"""rayrb's OpenMLEnv: TorchRL's contextual bandit over rayrb's prepared OpenML tables (no Ray)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rayrb import OpenMLEnv, load_openml
from rayrb.integrations.openml_env import EpochOrder


@pytest.fixture
def home(data_home, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("RAYRB_HOME", str(tmp_path_factory.getbasetemp() / "openml-env-home"))
    return data_home


def test_rewards_are_one_exactly_where_the_action_is_the_label(home):
    env = OpenMLEnv("shuttle", batch_size=[64], data_home=home, seed=0)
    td = env.reset()
    y = td["y"].clone()
    td["action"] = torch.where(torch.arange(64) % 2 == 0, y, (y + 1) % (env.max_outcome_val + 1))
    out = env.step(td)["next"]
    assert out["reward"].squeeze(-1).tolist() == [float(i % 2 == 0) for i in range(64)]
    assert out["done"].all() and torch.equal(out["observation"], td["observation"])
    assert td["observation"].dtype == torch.float32 and td["y"].dtype == torch.int64


def test_contexts_are_the_datasets_rows_each_once_per_epoch(home):
    ds = load_openml("mushroom_num", data_home=home, pbar=False)
    rows = ds.read()
    env = OpenMLEnv("mushroom_num", batch_size=[1000], data_home=home, seed=3)
    seen = torch.cat([env.reset()["observation"] for _ in range(len(ds) // 1000)])
    assert len(np.unique(rows["X"], axis=0)) == len(ds)  # the table's rows are distinct, so repeats would show
    assert len(seen) == 8000 and len(np.unique(seen.numpy(), axis=0)) == 8000  # no row twice in an epoch
    # each context is a real row with its own label
    td = env.reset()
    index = {r.tobytes(): int(label) for r, label in zip(rows["X"], rows["y"])}
    assert all(index[o.numpy().tobytes()] == int(label) for o, label in zip(td["observation"], td["y"]))


def test_the_same_seed_gives_the_same_contexts_and_set_seed_restarts_them(home):
    a = OpenMLEnv("magic", batch_size=[2, 3], data_home=home, seed=5)
    b = OpenMLEnv("magic", batch_size=[2, 3], data_home=home, seed=5)
    assert torch.equal(a.reset()["observation"], b.reset()["observation"])
    a.set_seed(11)
    first = a.reset()["observation"]
    a.set_seed(11)
    assert torch.equal(a.reset()["observation"], first)


def test_specs_match_torchrls_env_on_the_same_data(home, monkeypatch):
    from torchrl.envs.libs.openml import OpenMLEnv as TorchRLOpenMLEnv

    monkeypatch.setenv("SCIKIT_LEARN_DATA", str(home))
    ours, theirs = OpenMLEnv("shuttle", batch_size=[4], data_home=home), TorchRLOpenMLEnv("shuttle", batch_size=[4])
    assert ours.action_spec.space.n == theirs.action_spec.space.n
    assert set(ours.observation_spec.keys()) == set(theirs.observation_spec.keys())
    for k in theirs.observation_spec.keys():
        assert ours.observation_spec[k].shape == theirs.observation_spec[k].shape
        assert ours.observation_spec[k].dtype == theirs.observation_spec[k].dtype


def test_bad_input_is_refused_with_what_was_expected(home):
    with pytest.raises(ValueError, match="asks for 100000 rows per reset; 'mushroom_num' has 8124"):
        OpenMLEnv("mushroom_num", batch_size=[100000], data_home=home)
    with pytest.raises(RuntimeError, match="Dataset does not exist"):
        OpenMLEnv("iris", data_home=home)
    env = OpenMLEnv("magic", batch_size=[3], data_home=home)
    td = env.reset()
    td["action"] = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"expected an action of the outcome's shape \(3,\), got \(3, 2\)"):
        env.step(td)


def test_epoch_order_draws_every_row_once_before_any_twice():
    order = EpochOrder(10, seed=1)
    first = np.concatenate([order.take(3) for _ in range(3)])  # 9 of 10, then the tail of 1 is dropped
    assert len(set(first.tolist())) == 9 and order.epochs == 1
    order.take(3)
    assert order.epochs == 2
    with pytest.raises(ValueError, match="at most 10 rows per draw without replacement, got 11"):
        order.take(11)
