"""Where the job's rows come from, on Ray: the prepared splits, the logged offline dataset and the collectors.

``prepare_splits`` (a task) writes the training and held-out rows as chunk datasets, ``log_offline`` logs the
behaviour policy on the training split with ``rayrb.preprocess``, and ``Collector`` actors act on fresh training
contexts and ``extend`` the online buffer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray

from .behaviour import FITTED, LogBehaviour, explored, fit_behaviour
from .learners import make_model


@ray.remote(num_cpus=1)
def prepare_splits(dataset: str, data_home: str | None, root: str | None, seed: int,
                   test_fraction: float) -> dict[str, Any]:
    """Prepare the dataset; write its training and held-out rows as chunk datasets (reused when present)."""
    from rayrb import ChunkDataset, load_dataset, write_dataset

    kw = {"data_home": data_home, "root": root} if dataset.startswith("openml:") else {}
    ds = load_dataset(dataset, **kw)
    base = Path(root or ds.root.parents[1]) / "bandit" / f"{ds.root.name}-seed{seed}-test{test_fraction:g}"
    out = {}
    if not all((base / s / "manifest.json").is_file() for s in ("train", "test")):
        rows = ds.read()
        order = np.random.default_rng(seed).permutation(len(ds))
        n_test = max(1, int(round(test_fraction * len(ds))))
        for split, idx in (("test", order[:n_test]), ("train", order[n_test:])):
            write_dataset({"X": rows["X"][idx], "y": rows["y"][idx], "row": idx.astype(np.int64)}, base / split,
                          overwrite=True, source={"split": split, "of": str(ds.root), "seed": seed})
    for split in ("train", "test"):
        out[split] = str(base / split)
    train = ChunkDataset.open(base / "train")
    y = ds.read()["y"]
    out.update(rows=len(ds), features=int(ds.spec["X"].shape[0]), classes=int(y.max()) + 1,
               train_rows=len(train), test_rows=len(ChunkDataset.open(base / "test")), prepared=str(ds.root))
    return out


@dataclass
class OfflineLog:
    """The logged offline dataset and what the job reports of it."""

    dataset: Any  # rayrb.ChunkDataset
    params: dict[str, list] | None  # the fitted policy's (fit_behaviour), None for a context-free one
    heldout_accuracy: float  # the behaviour policy's expected held-out reward
    reward: float  # its mean logged reward
    actions: list[int]  # how often it took each action
    explored: float | None  # the share of contexts where ``segment`` took every action
    seconds: float  # fitting and logging


def log_offline(splits: dict[str, Any], policy: str, n_features: int, seed: int, share: float) -> OfflineLog:
    """Fit ``policy`` on the training split (when it is fitted) and log it there with ``rayrb.preprocess``.

    The logged dataset goes beside the splits, named by the policy and seed, and is reused by later runs.
    """
    from rayrb import ChunkDataset, preprocess

    t0, K = time.perf_counter(), splits["classes"]
    test = ChunkDataset.open(splits["test"]).read()
    train = ChunkDataset.open(splits["train"]).read() if policy in FITTED else None
    params, name, accuracy = fit_behaviour(policy, train, test, K, n_features, seed, share)
    root = Path(splits["train"]).parent / f"logged-{name}-seed{seed}"
    fn = LogBehaviour(policy, K, seed, params)
    # preprocess names the job by its fn's __module__ (and reuses a log only for the same job): keep the name it had
    # when the job defined LogBehaviour in __main__, so logs earlier runs left under --root are still reused
    fn.__module__ = "__main__"
    logged = preprocess(splits["train"], fn, root, batched=True)
    seconds = time.perf_counter() - t0
    rows = logged.read()
    return OfflineLog(logged, params, accuracy, float(rows["next/reward"].mean()),
                      np.bincount(rows["action"], minlength=K).tolist(),
                      float(explored(params, rows["observation"]).mean()) if policy == "segment" else None, seconds)


@ray.remote(num_cpus=0)
class Collector:
    """An environment worker: epsilon-greedy on fresh training contexts, rows straight into the online buffer."""

    def __init__(self, rb, train_root: str, n_features: int, n_actions: int, hidden: int, epsilon: float,
                 seed: int):
        import torch

        from rayrb import ChunkDataset

        torch.set_num_threads(1)
        self.rb, self.epsilon, self.n_actions = rb, epsilon, n_actions
        self.contexts = ChunkDataset.open(train_root)
        self.model = make_model(n_features, n_actions, hidden)
        self.rng = np.random.default_rng(seed)

    def set_weights(self, weights: dict) -> None:
        self.model.load_state_dict(weights)

    def collect(self, rows: int) -> dict[str, float]:
        import torch

        batch = self.contexts.gather(self.rng.integers(0, len(self.contexts), rows))
        with torch.no_grad():
            greedy = self.model(torch.from_numpy(batch["X"])).argmax(-1).numpy()
        explore = self.rng.random(rows) < self.epsilon
        action = np.where(explore, self.rng.integers(0, self.n_actions, rows), greedy).astype(np.int64)
        prob = self.epsilon / self.n_actions + (1 - self.epsilon) * (action == greedy)
        reward = (action == batch["y"]).astype(np.float32)
        self.rb.extend({"observation": batch["X"], "action": action, "action_log_prob": np.log(prob).astype(np.float32),
                        "next/reward": reward[:, None], "next/done": np.ones((rows, 1), dtype=bool)})
        return {"rows": rows, "reward": float(reward.mean()), "greedy_reward": float((greedy == batch["y"]).mean())}
