"""TorchRL's ``OpenMLEnv`` over rayrb's prepared OpenML tables: a contextual bandit in one process.

Each ``reset`` draws ``batch_size`` rows: the context is ``X`` (as ``observation``,
float32) with its label ``y``; a ``step`` takes an ``action`` (a class) and rewards 1
where it equals ``y``, 0 elsewhere, and ends the episode. Rows are drawn without
replacement, as TorchRL's env draws them (``SamplerWithoutReplacement(drop_last=True)``):
an epoch visits rows in a random order, and a tail too short for a batch starts the next
epoch. ``set_seed`` fixes the order.

The rows come from ``rayrb.load_openml`` (prepared once, then mapped), so the env
needs no Ray; it needs torchrl, which rayrb does not depend on: importing this module
imports it.

Examples:
    >>> from rayrb import OpenMLEnv  # doctest: +SKIP
    >>> env = OpenMLEnv("mushroom_onehot", batch_size=[4], data_home="~/scikit_learn_data")  # doctest: +SKIP
    >>> td = env.rand_step(env.reset())  # doctest: +SKIP
    >>> td["next", "reward"].shape  # doctest: +SKIP
    torch.Size([4, 1])
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data.tensor_specs import Categorical, Composite, Unbounded
from torchrl.envs.common import EnvBase

from rayrb.errors import InvalidArgumentError, MissingKeyError, ShapeMismatchError
from rayrb.io.arrays import from_numpy_dict
from rayrb.io.datasets.openml import OPENML_DATASETS, load_openml


class EpochOrder:
    """Row indices ``n`` at a time, without replacement; a tail shorter than ``n`` starts a new epoch.

    >>> order = EpochOrder(5, seed=0)
    >>> batches = [order.take(2) for _ in range(4)]
    >>> sorted(np.concatenate(batches[:2]).tolist()) == sorted(set(np.concatenate(batches[:2]).tolist()))
    True
    >>> order.epochs  # 5 rows, batches of 2: the fifth row is dropped and a new epoch begins
    2
    """

    def __init__(self, rows: int, seed: int | None = None):
        self.rows, self.epochs = int(rows), 0
        self._rng = np.random.default_rng(seed)
        self._order, self._pos = np.empty(0, np.int64), 0

    def take(self, n: int) -> np.ndarray:
        if n > self.rows:
            raise InvalidArgumentError(f"expected at most {self.rows} rows per draw without replacement, got {n}")
        if self._pos + n > len(self._order):
            self._order, self._pos = self._rng.permutation(self.rows), 0
            self.epochs += 1
        out = self._order[self._pos:self._pos + n]
        self._pos += n
        return out


class OpenMLEnv(EnvBase):
    """An OpenML table as a contextual bandit (TorchRL's ``OpenMLEnv``, with rayrb's data).

    Args:
        dataset_name: one of ``rayrb.OPENML_DATASETS``.
        device: where the env's tensors live. Default ``"cpu"``.
        batch_size: contexts per ``reset`` (TorchRL's env batch size). Default ``[]``.

    Keyword Args:
        data_home: the scikit-learn OpenML cache (default: ``SCIKIT_LEARN_DATA``, then
            scikit-learn's own default).
        root: where prepared datasets are kept (default ``$RAYRB_HOME`` or ``~/.cache/rayrb``).
        seed: the order rows are drawn in (``set_seed`` changes it).
    """

    available_envs = list(OPENML_DATASETS)

    def __init__(self, dataset_name: str, device: Any = "cpu", batch_size: Any = None, *,
                 data_home: str | os.PathLike | None = None, root: str | os.PathLike | None = None,
                 seed: int | None = None):
        batch_size = torch.Size([] if batch_size is None else batch_size)
        self.dataset_name = dataset_name
        self._data = load_openml(dataset_name, data_home=data_home, root=root, pbar=False)
        n = batch_size.numel()
        if n > len(self._data):
            raise InvalidArgumentError(
                f"batch_size {list(batch_size)} asks for {n} rows per reset; {dataset_name!r} has "
                f"{len(self._data)}")
        self._order = EpochOrder(len(self._data), seed)
        self.max_outcome_val = int(self._data.read()["y"].max())
        super().__init__(device=device, batch_size=batch_size)
        first = self._contexts(np.arange(n))
        self.observation_spec = Composite(
            {k: Unbounded(shape=v.shape, dtype=v.dtype, device=self.device) for k, v in first.items()},
            shape=self.batch_size)
        self.action_spec = Categorical(self.max_outcome_val + 1, shape=self.batch_size, device=self.device)
        self.reward_spec = Unbounded(shape=(*self.batch_size, 1), device=self.device)

    def _contexts(self, index: np.ndarray) -> TensorDictBase:
        rows = self._data.gather(index)
        td = from_numpy_dict({"observation": rows["X"].astype(np.float32, copy=False), "y": rows["y"]})
        return td.reshape(self.batch_size).to(self.device)

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDictBase:
        return self._contexts(self._order.take(self.batch_size.numel()))

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        action, y = tensordict.get("action"), tensordict.get("y", None)
        if y is None:
            raise MissingKeyError("did not find the 'y' key in the input tensordict: call env.step() on a tensordict "
                                  "that env.reset() returned")
        if action.shape != y.shape:
            raise ShapeMismatchError(
                f"expected an action of the outcome's shape {tuple(y.shape)}, got {tuple(action.shape)}")
        reward = (action == y).float().unsqueeze(-1)
        return TensorDict({"done": torch.ones_like(reward, dtype=torch.bool), "reward": reward,
                           **tensordict.select(*self.observation_spec.keys())}, self.batch_size, device=self.device)

    def _set_seed(self, seed: int | None) -> None:
        self._order = EpochOrder(len(self._data), seed)
