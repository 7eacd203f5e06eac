"""RLlib's own SAC (new API stack) fine-tuning from a logged behaviour policy: RLlib's buffer, rayrb's 50/50 mix, or
no log at all.

1. A behaviour policy logs the offline data on a gymnasium continuous-control task (``--env``): on ``Pendulum-v1``
   the swing-up controller of ``pendulum_behaviour.py``, on ``MountainCarContinuous-v0`` full force along the
   car's velocity (sparse reward: +100 at the goal, a small cost per unit of force; SAC from scratch rarely finds
   the goal), each made mediocre by Gaussian noise (``--behaviour-noise``) and uniformly random actions
   (``--behaviour-random``). Its episodes are RLlib ``SingleAgentEpisode`` objects with actions in the module's
   [-1, 1] range (RLlib's env runners store the module's actions, the env gets their unsquashed copies), written
   with ``rayrb.integrations.rllib.write_episodes`` as a chunk dataset.
2. The same SAC run, with the same seeds and hyperparameters, three times per seed:

   - ``rllib``: RLlib's ``EpisodeReplayBuffer`` prefilled with the logged episodes (``add``): batches are drawn
     uniformly over logged and collected steps, so the logged share shrinks as the run collects;
   - ``rayrb``: ``rayrb.integrations.rllib.OfflineToOnlineEpisodeReplayBuffer`` over the chunk dataset (through
     ``rayrb.integrations.rllib.SACConfig``): every batch holds exactly ``floor(f * B + 1/2)`` logged rows,
     ``f = --offline-fraction`` (0.5: RLPD's symmetric sampling);
   - ``online``: RLlib's ``EpisodeReplayBuffer`` without the log.

   After every training iteration the deterministic policy (``tanh`` of the squashed Gaussian's mean) plays
   ``--eval-episodes`` episodes on fixed seeds; the behaviour policy is scored on the same seeds.
3. ``metrics.json`` and ``rllib_sac_finetune.png`` (return against env steps, every learner and seed, the behaviour
   policy's return and the threshold) go to ``--out``, with the env steps each run took to first reach
   ``--threshold`` and the buffer's cost per training iteration from RLlib's own timers.

    python pipelines/rllib_sac_finetune.py --out outputs/rllib_sac_finetune
    python pipelines/rllib_sac_finetune.py --env MountainCarContinuous-v0 --iterations 8 --steps-per-iteration 256 \
        --n-step 3 --initial-alpha 0.1 --updates-per-step 4 --out outputs/rllib_sac_mountaincar
    python pipelines/rllib_sac_finetune.py --quick
    ray job submit --working-dir . -- python pipelines/rllib_sac_finetune.py --out /mnt/rayrb/out/rllib_sac
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

# The DQN job's helpers and the Pendulum controller live beside this file. Run as a script (plain or under
# `ray job submit`), this file's folder is first on the driver's path; a test loading this file by its path needs it.
HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import pendulum_behaviour  # noqa: E402
from rllib_finetune import RAYRB_BUFFER, eval_seeds, job_parser, plot_returns, start_ray, summarise  # noqa: E402

LEARNERS = ("rllib", "rayrb", "online")
QUICK = {"iterations": 3, "steps_per_iteration": 64, "learning_starts": 32, "batch_size": 32, "hidden": 16,
         "offline_episodes": 2, "eval_episodes": 2, "seeds": [0]}


def mountain_car_action(obs: np.ndarray, rng: np.random.Generator, noise: float, random_p: float) -> float:
    """Full force along the velocity, plus noise; uniformly random with probability ``random_p``.

    >>> mountain_car_action(np.array([-0.5, -0.01]), np.random.default_rng(0), 0.0, 0.0)
    -1.0
    """
    u = (1.0 if obs[1] >= 0 else -1.0) + noise * rng.standard_normal()
    if rng.random() < random_p:
        u = rng.uniform(-1.0, 1.0)
    return float(np.clip(u, -1.0, 1.0))


# env id -> the behaviour policy (obs, rng, noise, random_p -> the env's action) and the default threshold
TASKS: dict[str, tuple[Callable[..., float], float]] = {
    "Pendulum-v1": (pendulum_behaviour.behaviour_action, -300.0),
    "MountainCarContinuous-v0": (mountain_car_action, 50.0),
}


# ---------------------------------------------------------------------------- the behaviour policy and its log
def log_behaviour(args: argparse.Namespace, seed: int) -> tuple[list, list[float]]:
    """``--offline-episodes`` episodes of the noisy controller as RLlib episodes (module actions in [-1, 1])."""
    import gymnasium as gym
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    env, rng, out, returns = gym.make(args.env), np.random.default_rng(seed), [], []
    low, high = env.action_space.low, env.action_space.high
    policy = TASKS[args.env][0]
    for ep in range(args.offline_episodes):
        obs, _ = env.reset(seed=seed * 10_000 + ep)
        observations, actions, rewards, done = [obs], [], [], (False, False)
        while not any(done):
            u = np.array([policy(obs, rng, args.behaviour_noise, args.behaviour_random)], dtype=np.float32)
            obs, r, *done, _ = env.step(u)
            observations.append(obs)
            actions.append(((u - low) / (high - low) * 2.0 - 1.0).astype(np.float32))  # RLlib's squashed range
            rewards.append(float(r))
        out.append(SingleAgentEpisode(id_=f"behaviour-{seed}-{ep}", observations=observations, actions=actions,
                                      rewards=rewards, terminated=done[0], truncated=done[1], len_lookback_buffer=0))
        returns.append(float(sum(rewards)))
    env.close()
    return out, returns


def play(env_id: str, act: Callable[[np.ndarray], np.ndarray], seeds: list[int]) -> float:
    """Mean return of ``act`` (observations -> the env's actions), one episode per seed, stepped together."""
    import gymnasium as gym

    envs = [gym.make(env_id) for _ in seeds]
    obs = np.stack([env.reset(seed=s)[0] for env, s in zip(envs, seeds)])
    totals, done = np.zeros(len(envs)), np.zeros(len(envs), dtype=bool)
    while not done.all():
        actions = np.asarray(act(obs), dtype=np.float32).reshape(len(envs), -1)
        for i, env in enumerate(envs):
            if not done[i]:
                obs[i], r, term, trunc, _ = env.step(actions[i])
                totals[i] += r
                done[i] = term or trunc
    for env in envs:
        env.close()
    return float(totals.mean())


def behaviour_return(args: argparse.Namespace, rng_seed: int) -> float:
    rng, policy = np.random.default_rng(rng_seed), TASKS[args.env][0]
    return play(args.env, lambda obs: [[policy(o, rng, args.behaviour_noise, args.behaviour_random)] for o in obs],
                eval_seeds(args))


def greedy_return(algo: Any, args: argparse.Namespace) -> float:
    """The module's deterministic action: ``tanh`` of the Gaussian's mean, unsquashed to the env's bounds (RLlib's
    own ``to_deterministic`` gives the mean before ``tanh``, which the env runner then clips)."""
    import gymnasium as gym

    module, space = algo.get_module(), gym.make(args.env).action_space
    low, high = space.low, space.high

    def act(obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            logits = module.forward_inference({"obs": torch.as_tensor(obs, dtype=torch.float32)})["action_dist_inputs"]
        squashed = np.tanh(logits[:, : logits.shape[1] // 2].numpy())
        return low + (squashed + 1.0) / 2.0 * (high - low)

    return play(args.env, act, eval_seeds(args))


# ---------------------------------------------------------------------------- the RLlib runs
def replay_buffer_config(learner: str, args: argparse.Namespace, dataset_root: str, log_steps: int,
                         seed: int) -> dict:
    online = args.iterations * args.steps_per_iteration + args.steps_per_iteration  # room: nothing is evicted
    if learner == "rayrb":
        return {"type": RAYRB_BUFFER, "capacity": online, "offline_dataset": dataset_root,
                "offline_fraction": args.offline_fraction, "seed": seed}
    return {"type": "EpisodeReplayBuffer", "capacity": online + (log_steps if learner == "rllib" else 0)}


def sac_config(args: argparse.Namespace, buffer_config: dict, seed: int) -> Any:
    """One SAC configuration for every learner: only ``replay_buffer_config`` differs."""
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    from rayrb.integrations.rllib import SACConfig

    return (SACConfig()
            .environment(args.env)
            .env_runners(num_env_runners=0, rollout_fragment_length=args.rollout_fragment_length)
            .training(actor_lr=args.lr, critic_lr=args.lr, alpha_lr=args.lr, gamma=args.gamma, tau=args.tau,
                      initial_alpha=args.initial_alpha, train_batch_size_per_learner=args.batch_size,
                      n_step=args.n_step, training_intensity=args.updates_per_step * args.batch_size,
                      num_steps_sampled_before_learning_starts=args.learning_starts,
                      replay_buffer_config=buffer_config)
            .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[args.hidden], head_fcnet_hiddens=[args.hidden]))
            .reporting(min_sample_timesteps_per_iteration=args.steps_per_iteration, min_time_s_per_iteration=0,
                       min_train_timesteps_per_iteration=0)
            .debugging(seed=seed, log_level="ERROR"))


def buffer_cost(result: dict, config: Any) -> dict[str, Any]:
    """Seconds per training iteration in the buffer's calls: RLlib's time per call (its timers, moving averages)
    times the calls. Each training_step adds ``store`` times and samples (and updates priorities) ``train`` times,
    RLlib's round-robin weights for ``training_intensity`` (``ray.rllib.algorithms.dqn.calculate_rr_weights``);
    DQN's job (``rllib_finetune.buffer_cost``) has both at 1."""
    from ray.rllib.algorithms.dqn.dqn import calculate_rr_weights

    store, train = calculate_rr_weights(config)
    timers, steps = result.get("timers", {}), float(result.get("num_training_step_calls_per_iteration", 0))
    calls = {"replay_buffer_add_data_timer": store, "replay_buffer_sampling_timer": train,
             "replay_buffer_update_prios_timer": train}
    per_call = {k: float(timers[k]) for k in calls if k in timers}
    return {"per_call": per_call, "training_steps": steps, "adds_per_step": store, "samples_per_step": train,
            "seconds": steps * sum(per_call[k] * calls[k] for k in per_call),
            "training_iteration_timer": float(timers.get("training_iteration", float("nan")))}


def count_offline_rows(buffer: Any) -> list[int]:
    """Record, for each batch SAC draws from rayrb's ``buffer``, how many of its rows are logged ones."""
    counts, sample = [], buffer.sample

    def counted(*a: Any, **kw: Any) -> Any:
        episodes = sample(*a, **kw)
        counts.append(int(np.asarray(buffer.last_info["offline"]).sum()))
        return episodes

    buffer.sample = counted
    return counts


def first_reach(steps: list[int], returns: list[float], threshold: float) -> int | None:
    """The env steps at the first evaluation at or above ``threshold`` (None: never).

    >>> first_reach([100, 200, 300], [-900.0, -250.0, -400.0], -300.0), first_reach([100], [-900.0], -300.0)
    (200, None)
    """
    return next((s for s, r in zip(steps, returns) if r >= threshold), None)


def finetune(learner: str, args: argparse.Namespace, dataset_root: str, episodes: list, seed: int) -> dict:
    """One SAC run; the buffer (and whether it holds the log) is the only thing ``learner`` changes."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    config = sac_config(args, replay_buffer_config(learner, args, dataset_root, sum(map(len, episodes)), seed), seed)
    algo = config.build_algo()
    t0, eval_s = time.perf_counter(), 0.0
    steps, returns, costs, offline_rows, walls = [], [], [], [], []
    try:
        if learner == "rllib":
            algo.local_replay_buffer.add(episodes)  # prefilled with the log, counted in the run's wall time
        if learner == "rayrb":
            offline_rows = count_offline_rows(algo.local_replay_buffer)
        for it in range(args.iterations):
            t_it = time.perf_counter()
            result = algo.train()
            t_eval = time.perf_counter()
            walls.append(t_eval - t_it)  # RLlib's training_iteration timer averages over iterations (EMA, 0.01)
            returns.append(greedy_return(algo, args))
            eval_s += time.perf_counter() - t_eval
            steps.append(int(result["env_runners"]["num_env_steps_sampled_lifetime"]))
            costs.append(buffer_cost(result, config))
            print(f"  {learner} seed {seed}: iteration {it + 1}, {steps[-1]:6d} env steps, greedy return "
                  f"{returns[-1]:7.1f}, buffer {1e3 * costs[-1]['seconds']:6.1f} ms of "
                  f"{1e3 * walls[-1]:7.1f} ms, {time.perf_counter() - t0:6.1f}s", flush=True)
        seconds = time.perf_counter() - t0
        out = {"buffer": learner, "seed": seed, "env_steps": steps, "eval_return": returns,
               "final_return": returns[-1], "last3_return": float(np.mean(returns[-3:])),
               "steps_to_threshold": first_reach(steps, returns, args.threshold), "seconds": seconds,
               "eval_seconds": eval_s, "buffer_cost": costs, "buffer_ms_per_iteration": 1e3 * costs[-1]["seconds"],
               "iteration_ms": 1e3 * walls[-1], "iteration_seconds": walls,
               "qf_loss": result.get("learners", {}).get("default_policy", {}).get("qf_loss"),
               "buffer_timesteps": int(algo.local_replay_buffer.get_num_timesteps())}
        if learner == "rayrb":
            expected = int(np.floor(args.offline_fraction * args.batch_size + 0.5))
            rows = offline_rows or [None]  # every batch SAC drew, as logged rows in it
            out["offline_rows_per_batch"] = {"expected": expected, "batches": len(offline_rows), "min": min(rows),
                                             "max": max(rows), "exact": set(offline_rows) == {expected}}
        print(f"{learner:6s} seed {seed}: final greedy return {returns[-1]:7.1f} after {steps[-1]} env steps, threshold "
              f"{args.threshold} reached at {out['steps_to_threshold']}, {seconds:.1f}s ({eval_s:.1f}s evaluating), "
              f"buffer {out['buffer_ms_per_iteration']:.1f} ms of the last iteration's {out['iteration_ms']:.0f} ms",
              flush=True)
        return out
    finally:
        if learner == "rayrb":
            algo.local_replay_buffer.shutdown()
        algo.stop()


# ---------------------------------------------------------------------------- report
def plot(metrics: dict, path: Path) -> bool:
    config, behaviour = metrics["config"], metrics["behaviour"]["eval_return"]
    names = {"rllib": "RLlib's buffer + log", "rayrb": f"rayrb {config['offline_fraction']:g} mix", "online": "online"}
    return plot_returns(
        metrics["runs"], path, colours={"rllib": "tab:blue", "rayrb": "tab:orange", "online": "tab:green"},
        label=lambda run: f"{names[run['buffer']]} (seed {run['seed']})",
        lines=[(behaviour, f"behaviour policy ({behaviour:.0f})", "--"),
               (config["threshold"], f"threshold ({config['threshold']:g})", ":")],
        ylabel=f"deterministic return ({config['eval_episodes']} episodes)",
        title=f"RLlib SAC on {config['env']} from a logged policy: prefilled, rayrb's mix, online only")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = job_parser(__doc__, "outputs/rllib_sac_finetune")
    p.add_argument("--env", choices=sorted(TASKS), default="Pendulum-v1")
    p.add_argument("--learners", default=",".join(LEARNERS), help=f"comma-separated, of {LEARNERS}")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--iterations", type=int, default=8, help="RLlib training iterations per run")
    p.add_argument("--steps-per-iteration", type=int, default=500, help="env steps each iteration collects")
    p.add_argument("--rollout-fragment-length", type=int, default=None,
                   help="env steps per sample call (default: --n-step, the least SAC takes)")
    p.add_argument("--updates-per-step", type=float, default=1.0, help="SAC updates per env step (RLlib's "
                   "training_intensity is this times --batch-size)")
    p.add_argument("--learning-starts", type=int, default=256, help="env steps before the first update")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--hidden", type=int, default=64, help="units of the encoder's and the heads' hidden layer")
    p.add_argument("--lr", type=float, default=1e-3, help="actor, critic and alpha learning rate")
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--tau", type=float, default=0.005)
    p.add_argument("--initial-alpha", type=float, default=1.0)
    p.add_argument("--n-step", type=int, default=1)
    p.add_argument("--offline-fraction", type=float, default=0.5, help="rayrb's logged share of every batch")
    p.add_argument("--offline-episodes", type=int, default=20, help="episodes the behaviour policy logs")
    p.add_argument("--behaviour-noise", type=float, default=2.0, help="std of the Gaussian added to its action")
    p.add_argument("--behaviour-random", type=float, default=0.3, help="probability of a uniformly random action")
    p.add_argument("--threshold", type=float, default=None, help="the return a run must reach (default: the task's, "
                   f"{ {k: v[1] for k, v in TASKS.items()} })")
    p.add_argument("--eval-episodes", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch threads in the driver")
    p.add_argument("--quick", action="store_true", help=f"a short configuration for tests: {QUICK}")
    if p.parse_known_args(argv)[0].quick:  # the quick configuration's values are defaults: flags still win
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    args.rollout_fragment_length = args.rollout_fragment_length or args.n_step
    args.learners = [b for b in args.learners.split(",") if b]
    if not args.learners or set(args.learners) - set(LEARNERS):
        p.error(f"expected --learners among {LEARNERS}, got {args.learners}")
    if not 0 <= args.offline_fraction <= 1:
        p.error(f"expected --offline-fraction in [0, 1], got {args.offline_fraction}")
    if min(args.iterations, args.steps_per_iteration, args.rollout_fragment_length, args.batch_size, args.hidden,
           args.n_step, args.offline_episodes, args.eval_episodes, args.updates_per_step) <= 0 or args.learning_starts < 0:
        p.error("expected positive --iterations, --steps-per-iteration, --rollout-fragment-length, --batch-size, "
                "--hidden, --n-step, --offline-episodes, --eval-episodes and --updates-per-step, and "
                "--learning-starts >= 0")
    args.threshold = TASKS[args.env][1] if args.threshold is None else args.threshold
    return args


def write_log(args: argparse.Namespace, root: Path) -> tuple[list, Any, dict]:
    """The behaviour policy's log (its own seed, 0: one log for every run), its dataset, and its returns."""
    from rayrb.integrations.rllib import write_episodes

    t0 = time.perf_counter()
    episodes, logged = log_behaviour(args, 0)
    dataset = write_episodes(episodes, root / f"{args.env.split('-')[0].lower()}-offline", n_step=args.n_step,
                             overwrite=True, source={"env": args.env, "behaviour": TASKS[args.env][0].__name__,
                                                     "noise": args.behaviour_noise, "random": args.behaviour_random,
                                                     "episodes": args.offline_episodes})
    behaviour = {"logged_returns": logged, "logged_return": float(np.mean(logged)),
                 "eval_return": behaviour_return(args, 1), "steps": len(dataset), "dataset": str(dataset.root),
                 "log_s": time.perf_counter() - t0}
    print(f"logged {len(dataset)} steps of the behaviour policy ({args.offline_episodes} episodes, return "
          f"{np.mean(logged):.1f} +- {np.std(logged):.1f}; on the evaluation seeds {behaviour['eval_return']:.1f}) "
          f"into {dataset.root} ({behaviour['log_s']:.1f}s)", flush=True)
    return episodes, dataset, behaviour


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    t_start, started = time.perf_counter(), start_ray(args)
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    episodes, dataset, behaviour = write_log(args, Path(args.root).resolve() if args.root else out_dir)
    runs = [finetune(learner, args, str(dataset.root), episodes, seed)
            for seed in args.seeds for learner in args.learners]
    summary = summarise(runs)
    for learner, s in summary.items():
        s["steps_to_threshold"] = [r["steps_to_threshold"] for r in runs if r["buffer"] == learner]
    metrics = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "config": vars(args),
               "behaviour": behaviour, "runs": runs, "summary": summary, "total_s": time.perf_counter() - t_start,
               "versions": {m: __import__(m).__version__ for m in ("ray", "torch", "gymnasium")}}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1, default=str))
    plotted = plot(metrics, out_dir / "rllib_sac_finetune.png")
    for learner, s in summary.items():
        print(f"{learner:6s}: final return {s['final_mean']:.1f} +- {s['final_std']:.1f} over seeds {args.seeds} "
              f"({', '.join(f'{x:.1f}' for x in s['final_returns'])}); threshold {args.threshold} reached at "
              f"{s['steps_to_threshold']} env steps; {s['seconds_mean']:.1f}s per run; buffer "
              f"{s['buffer_ms_per_iteration']:.1f} ms per iteration of {s['iteration_ms']:.0f} ms", flush=True)
    print(f"behaviour policy: {behaviour['eval_return']:.1f} on the evaluation seeds; {metrics['total_s']:.1f}s in "
          f"all; wrote {out_dir / 'metrics.json'}" + (" and the plot" if plotted else " (no matplotlib: no plot)"),
          flush=True)
    if started:
        ray.shutdown()
    return metrics


if __name__ == "__main__":
    main()
