"""The behaviour policies that log the offline dataset: ``narrow``, ``segment`` and three context-free ones.

Pure numpy and torch, no Ray: ``LogBehaviour`` is the fn ``rayrb.preprocess`` maps over the training split's
chunks, and ``fit_behaviour`` fits a policy on the training split and scores it on the held-out rows.
"""
from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tensordict import TensorDict

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


def fit_behaviour(policy: str, train: dict[str, np.ndarray] | None, test: dict[str, np.ndarray], n_actions: int,
                  n_features: int, seed: int, share: float) -> tuple[dict[str, list] | None, str, float]:
    """``policy``'s fitted params (None for a context-free one), its name in the logged dataset's folder, and its
    expected held-out reward.

    A fitted policy sees only the training split (``train``: ``X`` and ``y``, unused by a context-free one); the
    held-out rows (``test``) just score it.
    """
    if policy not in FITTED:
        return None, policy, float(behaviour_probs(policy, n_actions)[test["y"]].mean())
    params = fit_narrow(train["X"], train["y"], n_actions, n_features, seed)
    name = f"{policy}{len(params['features'])}"
    hit = (narrow_actions(params, test["X"]) == test["y"]).astype(np.float64)
    if policy == "segment":
        params = fit_segment(params, train["X"], share)
        name += f"-explored{share:g}"
        hit[explored(params, test["X"])] = 1 / n_actions  # a uniform action earns 1/K in expectation
    return params, name, float(hit.mean())


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

    def __call__(self, td: TensorDict) -> TensorDict:
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
