"""The behaviour policy of ``pipelines/finetune_pendulum.py`` and its log: a noisy swing-up controller on gymnasium's
``Pendulum-v1``, its episodes as TorchRL's transition keys, and its return on the evaluation seeds.

Only the job's driver calls these (before any buffer or actor exists), so nothing here goes to Ray's workers.
"""
from __future__ import annotations

import math

import numpy as np

ENV_ID = "Pendulum-v1"
# Energy pumping: thdd = 15 sin(th) + 3 u, so E = thd^2 / 2 + 15 (cos th - 1) is 0 upright at rest and dE/dt = 3 u thd.
GRAVITY_TERM = 15.0


def swing_up(obs: np.ndarray) -> float:
    """The noiseless controller: pump energy with full torque along the velocity, balance with PD near the top.

    >>> swing_up(np.array([1.0, 0.0, -0.5])), swing_up(np.array([-1.0, 0.0, 0.5]))  # balancing; pumping at the bottom
    (1.0, 2.0)
    """
    c, s, w = (float(x) for x in obs)
    if c > 0.85:  # within about 32 degrees of upright: PD on the angle
        return float(np.clip(-(10.0 * math.atan2(s, c) + 2.0 * w), -2.0, 2.0))
    energy = 0.5 * w * w + GRAVITY_TERM * (c - 1.0)
    direction = 1.0 if energy < 0 else -1.0  # below the top's energy push along the velocity, above it brake
    return 2.0 * direction * (1.0 if w >= 0 else -1.0)


def behaviour_action(obs: np.ndarray, rng: np.random.Generator, noise: float, random_p: float) -> float:
    u = swing_up(obs) + noise * rng.standard_normal()
    if rng.random() < random_p:
        u = rng.uniform(-2.0, 2.0)
    return float(np.clip(u, -2.0, 2.0))


def log_behaviour(episodes: int, seed: int, noise: float, random_p: float) -> tuple[dict[str, np.ndarray], list]:
    """``episodes`` episodes of the noisy controller on gymnasium's env: TorchRL's transition keys, and returns."""
    import gymnasium as gym

    env = gym.make(ENV_ID)
    rng = np.random.default_rng(seed)
    cols: dict[str, list] = {k: [] for k in ("observation", "action", "next_observation", "reward", "terminated",
                                             "truncated")}
    returns = []
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed * 10_000 + ep)
        total, done = 0.0, False
        while not done:
            u = behaviour_action(obs, rng, noise, random_p)
            nxt, r, term, trunc, _ = env.step(np.array([u], dtype=np.float32))
            for k, v in (("observation", obs), ("action", [u]), ("next_observation", nxt), ("reward", [r]),
                         ("terminated", [term]), ("truncated", [trunc])):
                cols[k].append(v)
            total += float(r)
            obs, done = nxt, term or trunc
        returns.append(total)
    env.close()
    f32 = {k: np.asarray(cols[k], dtype=np.float32) for k in ("observation", "action", "next_observation", "reward")}
    term, trunc = np.asarray(cols["terminated"], dtype=bool), np.asarray(cols["truncated"], dtype=bool)
    false = np.zeros_like(term)
    # The keys and dtypes TorchRL's GymEnv gives, so offline and online rows share one schema.
    arrays = {"observation": f32["observation"], "action": f32["action"], "done": false, "terminated": false,
              "truncated": false, "next/observation": f32["next_observation"], "next/reward": f32["reward"],
              "next/done": term | trunc, "next/terminated": term, "next/truncated": trunc}
    return arrays, returns


def behaviour_return(seeds: list[int], noise: float, random_p: float, rng_seed: int) -> list[float]:
    """The behaviour policy's return on the evaluation episodes' seeds."""
    import gymnasium as gym

    env, rng, out = gym.make(ENV_ID), np.random.default_rng(rng_seed), []
    for s in seeds:
        obs, _ = env.reset(seed=s)
        total, done = 0.0, False
        while not done:
            obs, r, term, trunc, _ = env.step(np.array([behaviour_action(obs, rng, noise, random_p)], np.float32))
            total, done = total + float(r), term or trunc
        out.append(total)
    env.close()
    return out
