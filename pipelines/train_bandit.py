"""The main job: an offline-to-online contextual bandit on an OpenML table, on Ray.

The bandit is TorchRL's ``OpenMLEnv``: the context is a row's features ``X``, the action is a class, and the
reward is 1 when the action is the row's label ``y``, else 0.

1. A Ray task prepares the dataset (TorchRL's recipe) and splits it into training and held-out rows.
2. ``rayrb.preprocess`` logs a behaviour policy on the training contexts, as Ray tasks, into the offline
   dataset: ``observation``, ``action``, ``action_log_prob`` (the behaviour policy's), ``("next", "reward")``
   and ``("next", "done")``. The default, ``narrow``, is a deterministic, mediocre rule: a softmax regression
   on two columns, fit on the training split's labels, that takes one action per context. The log never says
   what any other action would have earned in a context, and never takes some actions at all: gaps only
   online data can fill. ``segment`` is the narrow rule that tries every action where it is least sure
   (``--explored-share`` of the contexts). ``uniform``, ``skewed`` and ``partial`` (never the odd-numbered
   actions) are context-free.
3. Three learners, same seeds, same steps, each on a buffer of its own: offline only, online only (starting
   empty, with the same collectors) and offline-to-online (below).
4. The offline-to-online run: collector actors act epsilon-greedily with the learner's latest weights on fresh
   training contexts and ``extend`` the online buffer; the learner actor trains on batches whose offline
   share is annealed from ``--initial-offline-fraction`` (0.5) to ``--final-offline-fraction`` (0.25) over
   ``--anneal-steps``, and every batch's split is checked to be exact.
   The learner is fed by ``rb.feed()`` (``--input feed``), pulls ``rb.iter_batches()`` itself
   (``--input iterator``), or is an RLlib ``LearnerGroup`` updated from rayrb's batch refs (``--input rllib``).
5. ``metrics.json`` and ``train_bandit.png`` (online reward and held-out greedy accuracy against learner
   steps, beside the offline-only baseline) go to ``--out``.

The learner is a reward model ``Q(x, a)`` (an MLP, one logit per action) fitted to the observed rewards of the
actions taken; the greedy policy is ``argmax_a Q(x, a)``.

    python pipelines/train_bandit.py --data-home ../shared/data
    python pipelines/train_bandit.py --dataset openml:adult_num --data-home ../shared/data --out /tmp/bandit
    ray job submit --working-dir . -- python pipelines/train_bandit.py --data-home /mnt/data --root /mnt/rayrb \\
        --out /mnt/rayrb/out
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import ray  # noqa: E402

QUICK = {"steps": 60, "sync_every": 10, "batch_size": 64, "collectors": 1, "collect_rows": 64, "hidden": 32,
         "offline_shards": 1, "online_shards": 1, "online_capacity": 4096}


# ---------------------------------------------------------------------------- the bandit's pieces
def make_model(n_features: int, n_actions: int, hidden: int):
    import torch

    return torch.nn.Sequential(torch.nn.Linear(n_features, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, n_actions))


CONTEXT_FREE = ("partial", "uniform", "skewed")
FITTED = ("narrow", "segment")  # policies fit on the training split (fit_narrow)
BEHAVIOURS = (*FITTED, *CONTEXT_FREE)


def behaviour_probs(policy: str, n_actions: int) -> np.ndarray:
    """Action probabilities of a context-free behaviour policy.

    ``partial`` never takes the odd-numbered actions: the log says nothing of their reward, which
    only online data can fill in. ``uniform`` covers every action; ``skewed`` halves the probability with each
    class id.

    >>> behaviour_probs("partial", 4).tolist(), behaviour_probs("uniform", 2).tolist()
    ([0.5, 0.0, 0.5, 0.0], [0.5, 0.5])
    """
    if policy == "uniform":
        p = np.ones(n_actions)
    elif policy == "skewed":
        p = 0.5 ** np.arange(n_actions)
    elif policy == "partial":
        p = (np.arange(n_actions) % 2 == 0).astype(np.float64)
    else:
        raise ValueError(f"expected a context-free behaviour policy in {CONTEXT_FREE}, got {policy!r}")
    return p / p.sum()


def fit_narrow(X: np.ndarray, y: np.ndarray, n_actions: int, n_features: int = 2, seed: int = 0,
               steps: int = 200, lr: float = 0.5) -> dict[str, list]:
    """The ``narrow`` behaviour policy: a softmax regression on ``n_features`` features drawn with ``seed``.

    A deployed rule that sees only a few of the columns, fit on the training split's labels: deliberately weak,
    and deterministic (``narrow_actions`` takes its argmax), so the log holds one action per context and never
    says what any other action would have earned there. Full-batch gradient descent from zero weights: the same
    inputs give the same policy. Returns plain lists, so the policy pickles, prints and fingerprints as data.
    """
    X, y = np.asarray(X, np.float64), np.asarray(y)
    if X.ndim != 2 or y.shape != (len(X),) or not 0 < n_features:
        raise ValueError(f"expected X of shape (n, d), y of shape (n,) and n_features > 0, got {X.shape}, "
                         f"{y.shape} and {n_features}")
    features = np.sort(np.random.default_rng(seed).choice(X.shape[1], min(n_features, X.shape[1]), replace=False))
    z = X[:, features]
    mean, scale = z.mean(0), z.std(0) + 1e-6
    z = (z - mean) / scale
    w, b = np.zeros((len(features), n_actions)), np.zeros(n_actions)
    target = np.eye(n_actions)[y]
    for _ in range(steps):
        logits = z @ w + b
        p = np.exp(logits - logits.max(1, keepdims=True))
        g = (p / p.sum(1, keepdims=True) - target) / len(y)
        w -= lr * z.T @ g
        b -= lr * g.sum(0)
    return {"features": features.tolist(), "mean": mean.tolist(), "scale": scale.tolist(), "weight": w.tolist(),
            "bias": b.tolist()}


def narrow_actions(params: dict[str, list], X: np.ndarray) -> np.ndarray:
    """The ``narrow`` policy's one action per context (int64)."""
    z = (np.asarray(X, np.float64)[:, params["features"]] - params["mean"]) / params["scale"]
    return (z @ np.asarray(params["weight"]) + params["bias"]).argmax(1).astype(np.int64)


def _margin(params: dict[str, list], X: np.ndarray) -> np.ndarray:
    """How sure the narrow rule is of its action: its best logit minus its second best.

    Two columns give few distinct margins; ties are broken by all the context's columns (the fractional part of
    a fixed projection, a millionth of the scale), so that a share of the contexts can be cut where they tie.
    """
    X = np.asarray(X, np.float64)
    z = (X[:, params["features"]] - params["mean"]) / params["scale"]
    top2 = np.sort(z @ np.asarray(params["weight"]) + params["bias"], axis=1)[:, -2:]
    # row by row, so a context gets the same value in any chunk
    tie = np.modf((X * np.random.default_rng(0).normal(size=X.shape[1])).sum(1) * 1e3)[0]
    return top2[:, 1] - top2[:, 0] + 1e-6 * tie


def fit_segment(params: dict[str, list], X: np.ndarray, share: float) -> dict[str, list]:
    """The ``segment`` policy: the narrow one, which tries every action where it is least sure.

    Where the narrow rule's margin (``_margin``) is among the lowest ``share`` of the training contexts', the log
    takes every action uniformly; elsewhere it holds only the narrow rule's one action per context.
    """
    if not 0 < share < 1:
        raise ValueError(f"expected an explored share in (0, 1), got {share}")
    return {**params, "explore_below": [float(np.quantile(_margin(params, X), share))]}


def explored(params: dict[str, list], X: np.ndarray) -> np.ndarray:
    """Where the ``segment`` policy explores (``fit_segment``)."""
    return _margin(params, X) <= params["explore_below"][0]


class LogBehaviour:
    """Batched preprocess fn: one chunk of ``X, y, row`` in, the behaviour policy's logged rows out.

    ``params`` (``fit_narrow``'s) make the policy the deterministic ``narrow`` one, or ``segment``: uniform where
    ``explored``, narrow elsewhere; without them it is the context-free ``policy``.
    """

    def __init__(self, policy: str, n_actions: int, seed: int, params: dict[str, list] | None = None):
        if (policy in FITTED) != (params is not None):
            raise ValueError(f"expected fitted params exactly for the policies {FITTED}, got policy {policy!r} "
                             f"with {'params' if params is not None else 'none'}")
        self.policy, self.n_actions, self.seed, self.params = policy, n_actions, seed, params

    def __repr__(self) -> str:  # preprocess fingerprints fn by this: a rerun with other settings is a new job
        fitted = f", params={json.dumps(self.params)}" if self.params is not None else ""
        return f"LogBehaviour(policy={self.policy!r}, n_actions={self.n_actions}, seed={self.seed}{fitted})"

    def __call__(self, td):
        import torch
        from tensordict import TensorDict

        n = td.batch_size[0]
        # Seeded by the chunk's first row id: the same chunk logs the same actions on any worker, in any order.
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(td["row"][0]))
        if self.params is not None:  # one action per context, taken with probability 1
            action = torch.from_numpy(narrow_actions(self.params, td["X"].numpy()))
            log_prob = torch.zeros(n)
            if self.policy == "segment":
                mask = torch.from_numpy(explored(self.params, td["X"].numpy()))
                action[mask] = torch.randint(0, self.n_actions, (int(mask.sum()),), generator=g)
                log_prob[mask] = -math.log(self.n_actions)
        else:
            probs = torch.as_tensor(behaviour_probs(self.policy, self.n_actions), dtype=torch.float32)
            action = torch.multinomial(probs, n, replacement=True, generator=g)
            log_prob = probs.log()[action]
        reward = (action == td["y"]).float().unsqueeze(-1)
        return TensorDict({"observation": td["X"], "action": action, "action_log_prob": log_prob,
                           "next": {"reward": reward, "done": torch.ones(n, 1, dtype=torch.bool)}}, [n])


def expected_offline(batch_size: int, fraction: float) -> int:
    """The buffer's contract: ``n_off = floor(f * B + 1/2)``."""
    return math.floor(fraction * batch_size + 0.5)


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


@ray.remote(num_cpus=1)
class Learner:
    """The reward model and its optimizer; trains on fed slices or on batches it pulls itself."""

    def __init__(self, rb, test_root: str, n_features: int, n_actions: int, hidden: int, lr: float, seed: int):
        import torch

        from rayrb import ChunkDataset

        torch.set_num_threads(1)
        torch.manual_seed(seed)
        self.rb = rb
        self.model = make_model(n_features, n_actions, hidden)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        test = ChunkDataset.open(test_root).read()
        self.test_x, self.test_y = torch.from_numpy(test["X"]), torch.from_numpy(test["y"])

    def _step(self, td, info) -> tuple[float, int]:
        import torch

        q = self.model(td["observation"]).gather(-1, td["action"].unsqueeze(-1))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(q, td["next", "reward"])
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item(), int(info["offline"].sum())

    def update(self, plan, *parts) -> tuple[float, int, int]:
        """``rb.feed("update")`` calls this with this learner's slice, straight from the shards."""
        from rayrb.actors.transport import receive

        td, info = receive(plan, *parts)
        loss, n_off = self._step(td, info)
        return loss, n_off, td.batch_size[0]

    def train(self, steps: int, batch_size: int) -> list[tuple[float, int, int]]:
        """Pull ``steps`` batches through the buffer's prefetching iterator and train on each."""
        out = []
        for td, info in self.rb.iter_batches(batch_size, prefetch=4, return_info=True, num_batches=steps):
            loss, n_off = self._step(td, info)
            out.append((loss, n_off, td.batch_size[0]))
        return out

    def weights(self) -> dict:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def evaluate(self) -> float:
        """Held-out greedy accuracy: the mean reward of ``argmax_a Q(x, a)`` on rows never trained on."""
        import torch

        with torch.no_grad():
            return float((self.model(self.test_x).argmax(-1) == self.test_y).float().mean())


# RLlib column -> logged key: what the reward model reads.
REWARD_COLUMNS = {"obs": "observation", "actions": "action", "rewards": "next/reward"}


@functools.cache
def rllib_classes() -> tuple[type, type]:
    """The reward model as an RLlib ``TorchRLModule`` and its ``TorchLearner``; only ``--input rllib`` imports RLlib."""
    try:
        import torch
        from ray.rllib.core import DEFAULT_MODULE_ID
        from ray.rllib.core.columns import Columns
        from ray.rllib.core.learner.torch.torch_learner import TorchLearner
        from ray.rllib.core.rl_module.torch import TorchRLModule
        from ray.rllib.utils.metrics import TD_ERROR_KEY
    except ImportError as e:
        raise ImportError(f"--input rllib expects RLlib to be installed (pip install 'rayrb[rllib]'), "
                          f"got {type(e).__name__}: {e}") from e

    class RewardModule(TorchRLModule):
        """``make_model``'s MLP: one reward logit per action."""

        def setup(self) -> None:
            self.q = make_model(self.observation_space.shape[0], self.action_space.n, self.model_config["hidden"])

        def _forward(self, batch: dict, **kwargs) -> dict:
            return {"q": self.q(batch[Columns.OBS])}

    class RewardLearner(TorchLearner):
        """``Learner._step``'s loss; RLlib's default optimizer is the same Adam at ``config.lr``."""

        def build(self) -> None:
            torch.set_num_threads(1)  # as the actor learner: one CPU
            super().build()
            self._test = None

        def compute_loss_for_module(self, *, module_id, config, batch, fwd_out):
            q = fwd_out["q"].gather(-1, batch[Columns.ACTIONS].long().unsqueeze(-1))
            reward = batch[Columns.REWARDS].float().unsqueeze(-1)
            # A bandit's TD error is r - Q(x, a): one per row, as rayrb.integrations.rllib.update expects.
            self.metrics.log_value((module_id, TD_ERROR_KEY), (reward - torch.sigmoid(q)).detach().squeeze(-1),
                                   reduce="item_series")
            return torch.nn.functional.binary_cross_entropy_with_logits(q, reward)

        def evaluate(self) -> float:
            """``Learner.evaluate`` on this learner's module."""
            from rayrb import ChunkDataset

            if self._test is None:
                test = ChunkDataset.open(self.config.learner_config_dict["test_root"]).read()
                self._test = torch.from_numpy(test["X"]), torch.from_numpy(test["y"])
            x, y = self._test
            with torch.no_grad():
                return float((self.module[DEFAULT_MODULE_ID].q(x).argmax(-1) == y).float().mean())

    return RewardModule, RewardLearner


class GroupLearner:
    """``Learner`` run as RLlib's ``LearnerGroup`` (new API stack, one remote learner with one CPU).

    Batches are sampled by rayrb and reach the learner as ``MultiAgentBatch`` refs through
    ``rayrb.integrations.rllib.update``, straight from the shards.
    """

    def __init__(self, rb, test_root: str, n_features: int, n_actions: int, hidden: int, lr: float, seed: int):
        import gymnasium as gym
        from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
        from ray.rllib.core import DEFAULT_MODULE_ID
        from ray.rllib.core.rl_module.rl_module import RLModuleSpec

        module_cls, learner_cls = rllib_classes()
        config = (AlgorithmConfig()
                  .learners(num_learners=1, num_cpus_per_learner=1, learner_class=learner_cls,
                            learner_config_dict={"test_root": test_root})
                  .training(lr=lr)
                  .debugging(seed=seed))
        spec = RLModuleSpec(module_class=module_cls,
                            observation_space=gym.spaces.Box(-np.inf, np.inf, (n_features,), np.float32),
                            action_space=gym.spaces.Discrete(n_actions), model_config={"hidden": hidden})
        self.rb, self.module_id, self.rows, self.stopped = rb, DEFAULT_MODULE_ID, 0, False
        self.group = config.build_learner_group(rl_module_spec=spec)

    def train(self, steps: int, batch_size: int) -> list[tuple[float, int, int]]:
        """``steps`` updates, each on one batch sampled by rayrb; ``(loss, offline rows, rows)`` for each."""
        from ray.rllib.core.learner.learner import Learner as RLlibLearner
        from ray.rllib.utils.metrics import NUM_ENV_STEPS_SAMPLED_LIFETIME

        from rayrb.integrations.rllib import update

        out = []
        for _ in range(steps):
            self.rows += batch_size
            res = update(self.group, self.rb, batch_size, columns=REWARD_COLUMNS,
                         timesteps={NUM_ENV_STEPS_SAMPLED_LIFETIME: self.rows})
            loss = res.results[0][self.module_id][RLlibLearner.TOTAL_LOSS_KEY]
            out.append((float(loss.peek() if hasattr(loss, "peek") else loss), int(res.info["offline"].sum()),
                        int(res.info["index"].shape[0])))
        return out

    def weights(self):
        """The module's weights as ``make_model``'s state dict, in the object store for the collectors."""
        import torch

        state = self.group.get_weights([self.module_id])[self.module_id]
        return ray.put({k.split(".", 1)[1]: torch.tensor(v) for k, v in state.items()})  # drop the "q." prefix

    def evaluate(self) -> float:
        """Held-out greedy accuracy, computed on the remote learner."""
        return next(r.get() for r in self.group.foreach_learner(lambda learner: learner.evaluate()))

    def shutdown(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.group.shutdown()


# ---------------------------------------------------------------------------- the runs
def run(rb, learner, collectors: list, args: argparse.Namespace, label: str, anneal: bool = True
        ) -> dict[str, list]:
    """Train for ``args.steps`` in blocks of ``args.sync_every``; between blocks, anneal, sync weights, evaluate.

    ``learner`` is a ``Learner`` actor, or a ``GroupLearner`` (driver-side) with ``--input rllib``. Without
    ``anneal`` the buffer's offline fraction stays as it is (0 for the online-only learner).
    """
    series: dict[str, list] = {"step": [], "offline_fraction": [], "online_reward": [], "greedy_reward": [],
                               "heldout_accuracy": [], "loss": [], "online_rows_so_far": []}
    rllib = args.input == "rllib"
    if not rllib:  # a LearnerGroup is updated from batch refs, not fed
        rb.connect_learners([learner])
    online = bool(collectors)
    anneal_total, anneal_steps = None, min(args.anneal_steps, args.steps)
    if online and anneal and args.final_offline_fraction < args.initial_offline_fraction:
        # rb.anneal decays the initial fraction to 0 over anneal_total steps: the final one at anneal_steps
        anneal_total = max(1, math.ceil(anneal_steps / (1 - args.final_offline_fraction /
                                                        args.initial_offline_fraction)))
    if online:  # the online side is never empty once training starts, so every batch has the exact split
        weights = learner.weights() if rllib else learner.weights.remote()
        ray.get([c.set_weights.remote(weights) for c in collectors])
        ray.get([c.collect.remote(args.collect_rows) for c in collectors])
    batches = exact = 0
    online_rows = len(collectors) * args.collect_rows if online else 0
    step, t0 = 0, time.perf_counter()
    while step < args.steps:
        n = min(args.sync_every, args.steps - step)
        if anneal_total:
            rb.anneal(min(step, anneal_steps), anneal_total)
        f = rb.offline_fraction
        pending = []
        if online:  # collectors act with the newest weights while the learner trains on this block
            # one object, read by every collector from the object store
            weights = learner.weights() if rllib else learner.weights.remote()
            for c in collectors:  # an actor runs its calls in order: the weights land before the collect
                c.set_weights.remote(weights)
            pending = [c.collect.remote(args.collect_rows) for c in collectors]
        if args.input == "feed":
            results = [rb.feed("update")[0] for _ in range(n)]
        elif rllib:
            results = learner.train(n, args.batch_size)
        else:
            results = ray.get(learner.train.remote(n, args.batch_size))
        want = expected_offline(args.batch_size, f)
        for loss, n_off, rows in results:
            batches += 1
            exact += int(n_off == want and rows == args.batch_size)
        step += n
        collected = ray.get(pending)
        acc = learner.evaluate() if rllib else ray.get(learner.evaluate.remote())
        series["step"].append(step)
        series["offline_fraction"].append(f)
        series["online_reward"].append(float(np.mean([c["reward"] for c in collected])) if collected else None)
        series["greedy_reward"].append(float(np.mean([c["greedy_reward"] for c in collected])) if collected else None)
        series["heldout_accuracy"].append(acc)
        series["loss"].append(float(np.mean([r[0] for r in results])))
        online_rows += sum(c["rows"] for c in collected)
        series["online_rows_so_far"].append(online_rows)
        if step == n or step == args.steps or len(series["step"]) % max(1, args.print_every // args.sync_every) == 0:
            reward = f"  online reward {series['online_reward'][-1]:.3f}" if collected else ""
            print(f"[{label}] step {step:5d}/{args.steps}  offline fraction {f:.3f}  loss {series['loss'][-1]:.4f}"
                  f"{reward}  held-out greedy accuracy {acc:.3f}  ({time.perf_counter() - t0:.1f}s)", flush=True)
    if exact != batches:
        raise AssertionError(f"[{label}] {batches - exact} of {batches} batches did not have the exact "
                             f"offline/online split")
    series["batches"], series["exact_split_batches"], series["online_rows"] = batches, exact, online_rows
    series["seconds"] = time.perf_counter() - t0
    return series


def rows_to_reach(series: dict, accuracy: float) -> int | None:
    """Online rows written when ``series`` first reached held-out ``accuracy`` (None if it never did).

    >>> rows_to_reach({"heldout_accuracy": [0.4, 0.7, 0.9], "online_rows_so_far": [100, 200, 300]}, 0.7)
    200
    """
    for acc, rows in zip(series["heldout_accuracy"], series["online_rows_so_far"]):
        if acc >= accuracy:
            return int(rows)
    return None


def stop(actor) -> None:
    """Kill an actor, or shut a ``GroupLearner``'s learners down (again is harmless)."""
    if isinstance(actor, GroupLearner):
        actor.shutdown()
    else:
        ray.kill(actor)


def plot(metrics: dict, path: Path) -> bool:
    """Online reward and held-out greedy accuracy against learner steps; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    o2o, base, ds = metrics["o2o"], metrics["offline_only"], metrics["dataset"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.plot(o2o["step"], o2o["online_reward"], label=f"collectors (epsilon={metrics['config']['epsilon']:g})")
    a.plot(o2o["step"], o2o["greedy_reward"], label="greedy policy on the same contexts", alpha=0.7)
    a.axhline(ds["behaviour_reward"], color="gray", ls=":", label=f"behaviour policy ({ds['behaviour']})")
    a.set(xlabel="learner step", ylabel="mean reward", title="online reward", ylim=(0, 1.02))
    twin = a.twinx()
    twin.plot(o2o["step"], o2o["offline_fraction"], color="black", ls="--", lw=0.8, label="offline fraction")
    twin.set(ylabel="offline fraction", ylim=(0, 1.02))
    handles = [h for ax in (a, twin) for h in ax.get_legend_handles_labels()[0]]
    a.legend(handles=handles, loc="lower right", fontsize=8)
    b.plot(o2o["step"], o2o["heldout_accuracy"], label="offline-to-online")
    b.plot(base["step"], base["heldout_accuracy"], label="offline only")
    if metrics.get("online_only"):
        b.plot(metrics["online_only"]["step"], metrics["online_only"]["heldout_accuracy"], label="online only")
    b.axhline(ds["behaviour_heldout_accuracy"], color="gray", ls=":", label="behaviour policy")
    b.set(xlabel="learner step", ylabel="accuracy", title="held-out greedy accuracy", ylim=(0, 1.02))
    b.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{ds['id']}: {ds['train_rows']} training / {ds['test_rows']} held-out rows, "
                 f"{ds['classes']} actions")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="openml:shuttle")
    p.add_argument("--data-home", default=os.environ.get("SCIKIT_LEARN_DATA"),
                   help="scikit-learn data home holding the OpenML cache (default $SCIKIT_LEARN_DATA)")
    p.add_argument("--root", default=None, help="prepared and logged datasets (default $RAYRB_HOME or ~/.cache/rayrb)")
    p.add_argument("--out", default="outputs/train_bandit", help="where metrics.json and train_bandit.png go")
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS"), help="Ray cluster (default: $RAY_ADDRESS "
                   "or a new local Ray)")
    p.add_argument("--input", choices=["feed", "iterator", "rllib"], default="feed",
                   help="feed: rb.feed() hands the learner actor its slices; iterator: it pulls rb.iter_batches(); "
                        "rllib: an RLlib LearnerGroup is updated from rayrb's MultiAgentBatch refs")
    p.add_argument("--no-online-only", action="store_true", help="skip the online-only learner")
    p.add_argument("--behaviour", choices=list(BEHAVIOURS), default="narrow",
                   help="the logging policy: narrow (a softmax regression on --behaviour-features columns, fit on "
                        "the training split and acted on greedily: one action per context), segment (narrow, but every "
                        "action uniformly on the --explored-share of contexts where narrow is least sure), partial (never the "
                        "odd-numbered actions), uniform random, or skewed (p(a) halving with each class id)")
    p.add_argument("--explored-share", type=float, default=0.25,
                   help="the segment policy's share of training contexts where it takes every action uniformly")
    p.add_argument("--behaviour-features", type=int, default=2,
                   help="columns the narrow policy sees, drawn with --seed")
    p.add_argument("--steps", type=int, default=600, help="learner steps, for each run")
    p.add_argument("--sync-every", type=int, default=20, help="steps between weight syncs, annealing and evaluation")
    p.add_argument("--print-every", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--initial-offline-fraction", type=float, default=0.5,
                   help="the offline-to-online learner's offline share at step 0 (0.5: RLPD's symmetric sampling)")
    p.add_argument("--final-offline-fraction", type=float, default=0.25)
    p.add_argument("--anneal-steps", type=int, default=200,
                   help="steps over which the offline share goes linearly from initial to final, then stays")
    p.add_argument("--epsilon", type=float, default=0.1, help="collectors' exploration rate")
    p.add_argument("--collectors", type=int, default=2)
    p.add_argument("--collect-rows", type=int, default=128, help="rows each collector adds per block")
    p.add_argument("--online-capacity", type=int, default=20_000)
    p.add_argument("--offline-shards", type=int, default=2)
    p.add_argument("--online-shards", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--test-fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help=f"a short configuration for tests: {QUICK}")
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if not 0 <= args.final_offline_fraction <= args.initial_offline_fraction <= 1 or not 0 <= args.epsilon <= 1:
        p.error(f"expected 0 <= --final-offline-fraction <= --initial-offline-fraction <= 1 and --epsilon in [0, 1], "
                f"got {args.final_offline_fraction}, {args.initial_offline_fraction} and {args.epsilon}")
    if min(args.steps, args.sync_every, args.collectors, args.anneal_steps, args.behaviour_features) <= 0:
        p.error(f"expected positive --steps, --sync-every, --collectors, --anneal-steps and --behaviour-features, "
                f"got {args.steps}, {args.sync_every}, {args.collectors}, {args.anneal_steps} and "
                f"{args.behaviour_features}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.input == "rllib":
        rllib_classes()  # fails here, before Ray starts, when RLlib is missing
    t_start = time.perf_counter()
    ray.init(address=args.address, include_dashboard=False if args.address is None else None,
             logging_level=logging.WARNING)
    from rayrb import ChunkDataset, OfflineToOnlineReplayBuffer, preprocess

    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    data_home = os.path.abspath(args.data_home) if args.data_home else None
    root = os.path.abspath(args.root) if args.root else None
    timing: dict[str, float] = {}

    t0 = time.perf_counter()
    splits = ray.get(prepare_splits.remote(args.dataset, data_home, root, args.seed, args.test_fraction))
    timing["prepare_s"] = time.perf_counter() - t0
    K, d = splits["classes"], splits["features"]
    print(f"prepared {args.dataset}: {splits['rows']} rows, {d} features, {K} actions; "
          f"{splits['train_rows']} training / {splits['test_rows']} held-out rows ({timing['prepare_s']:.1f}s)",
          flush=True)

    t0 = time.perf_counter()
    test = ChunkDataset.open(splits["test"]).read()
    params, name = None, args.behaviour
    if args.behaviour in FITTED:  # fit on the training split only; the held-out rows just score it
        train = ChunkDataset.open(splits["train"]).read()
        params = fit_narrow(train["X"], train["y"], K, args.behaviour_features, args.seed)
        name = f"{args.behaviour}{len(params['features'])}"
        hit = (narrow_actions(params, test["X"]) == test["y"]).astype(np.float64)
        if args.behaviour == "segment":
            params = fit_segment(params, train["X"], args.explored_share)
            name += f"-explored{args.explored_share:g}"
            hit[explored(params, test["X"])] = 1 / K  # a uniform action earns 1/K in expectation
        behaviour_acc = float(hit.mean())
    else:
        behaviour_acc = float(behaviour_probs(args.behaviour, K)[test["y"]].mean())  # its expected held-out reward
    logged_root = Path(splits["train"]).parent / f"logged-{name}-seed{args.seed}"
    logged = preprocess(splits["train"], LogBehaviour(args.behaviour, K, args.seed, params), logged_root,
                        batched=True)
    timing["log_s"] = time.perf_counter() - t0
    logged_rows = logged.read()
    behaviour_reward = float(logged_rows["next/reward"].mean())
    logged_actions = np.bincount(logged_rows["action"], minlength=K).tolist()
    about = f" (features {params['features']} of {d})" if params else ""
    if args.behaviour == "segment":
        about += f", every action on {explored(params, logged_rows['observation']).mean():.0%} of the contexts"
    print(f"logged the {args.behaviour} behaviour policy{about} on {len(logged)} contexts with rayrb.preprocess "
          f"({timing['log_s']:.1f}s): mean reward {behaviour_reward:.3f}, actions taken {logged_actions}, "
          f"spec {logged.spec}", flush=True)

    def buffer(fraction: float):
        return OfflineToOnlineReplayBuffer(logged.root, online_capacity=args.online_capacity,
                                           offline_fraction=fraction, batch_size=args.batch_size,
                                           num_offline_shards=args.offline_shards,
                                           num_online_shards=args.online_shards, seed=args.seed)

    def learner(rb):
        make = GroupLearner if args.input == "rllib" else Learner.remote
        return make(rb, splits["test"], d, K, args.hidden, args.lr, args.seed)

    def collectors(rb):  # the same seeds for every run: the same contexts, in the same order
        return [Collector.remote(rb, splits["train"], d, K, args.hidden, args.epsilon, args.seed + 1 + i)
                for i in range(args.collectors)]

    results, stats = {}, None
    for name, fraction, online, anneal in (("offline_only", 1.0, False, False), ("online_only", 0.0, True, False),
                                           ("o2o", args.initial_offline_fraction, True, True)):
        if name == "online_only" and args.no_online_only:
            continue
        rb, actors = buffer(fraction), []
        try:
            actors = [learner(rb)] + (collectors(rb) if online else [])
            label = name.replace("_", " ").replace("o2o", "offline-to-online")
            results[name] = run(rb, actors[0], actors[1:], args, label, anneal=anneal)
            if name == "o2o":
                stats = rb.stats()
        finally:
            rb.shutdown()
            for a in actors:
                stop(a)  # frees its CPU for the next run
    offline_only, o2o, online_only = results["offline_only"], results["o2o"], results.get("online_only")
    timing["total_s"] = time.perf_counter() - t_start
    tail = max(1, len(o2o["step"]) // 5)  # the last fifth of the run
    metrics = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "config": vars(args),
        "dataset": {"id": args.dataset, "rows": splits["rows"], "features": d, "classes": K,
                    "train_rows": splits["train_rows"], "test_rows": splits["test_rows"], "logged_rows": len(logged),
                    "logged_root": str(logged.root), "behaviour": args.behaviour,
                    "behaviour_params": params, "logged_actions": logged_actions,
                    "behaviour_reward": behaviour_reward, "behaviour_heldout_accuracy": behaviour_acc},
        "offline_only": offline_only,
        "online_only": online_only,
        "o2o": o2o,
        "final": {"o2o_heldout_accuracy": o2o["heldout_accuracy"][-1],
                  "offline_only_heldout_accuracy": offline_only["heldout_accuracy"][-1],
                  "online_only_heldout_accuracy": online_only["heldout_accuracy"][-1] if online_only else None,
                  "o2o_minus_offline_only": o2o["heldout_accuracy"][-1] - offline_only["heldout_accuracy"][-1],
                  # online rows each needed to reach the offline-only learner's final accuracy (None: never)
                  "online_rows_to_offline_only_accuracy": {
                      k: rows_to_reach(s, offline_only["heldout_accuracy"][-1])
                      for k, s in (("o2o", o2o), ("online_only", online_only)) if s is not None},
                  "behaviour_heldout_accuracy": behaviour_acc,
                  "online_reward_last_fifth": float(np.mean(o2o["online_reward"][-tail:])),
                  "online_rows_written": o2o["online_rows"]},
        "timing": {**timing, "offline_only_s": offline_only["seconds"], "o2o_s": o2o["seconds"],
                   "learner_rows_per_s": args.steps * args.batch_size / o2o["seconds"]},
        "buffer_stats": stats,
        "versions": {m: __import__(m).__version__ for m in ("ray", "torch", "tensordict", "numpy")},
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1, default=str))
    plotted = plot(metrics, out_dir / "train_bandit.png")
    fin = metrics["final"]
    only = fin["online_only_heldout_accuracy"]
    print(f"final held-out greedy accuracy: offline-to-online {fin['o2o_heldout_accuracy']:.3f}, offline only "
          f"{fin['offline_only_heldout_accuracy']:.3f}, online only {'-' if only is None else f'{only:.3f}'}, "
          f"behaviour policy {behaviour_acc:.3f}; online rows to reach the offline-only accuracy: "
          f"{fin['online_rows_to_offline_only_accuracy']}; online reward "
          f"(last fifth) {fin['online_reward_last_fifth']:.3f}; {o2o['exact_split_batches']}/{o2o['batches']} "
          f"batches with the exact split; {timing['total_s']:.1f}s in all", flush=True)
    print(f"wrote {out_dir / 'metrics.json'}" + (f" and {out_dir / 'train_bandit.png'}" if plotted else
                                                 " (matplotlib is not installed: no plot)"), flush=True)
    ray.shutdown()
    return metrics


if __name__ == "__main__":
    main()
