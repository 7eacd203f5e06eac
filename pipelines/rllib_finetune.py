"""RLlib's own DQN (new API stack) fine-tuning on CartPole-v1 from a logged behaviour policy, on two buffers.

1. A behaviour policy logs the offline data: the pole-angle rule (push the cart the way the pole leans, with
   its angular velocity) made mediocre by uniformly random actions (``--behaviour-random``). Its episodes are
   RLlib ``SingleAgentEpisode`` objects, written with ``rayrb.integrations.rllib.write_episodes`` (through
   ``rayrb.write_dataset``) as a chunk dataset.
2. The same DQN run, with the same seeds, on

   - ``rllib``: RLlib's ``EpisodeReplayBuffer``, prefilled with the logged episodes (``add``): batches are drawn
     uniformly over logged and collected steps together;
   - ``rayrb``: ``rayrb.integrations.rllib.OfflineToOnlineEpisodeReplayBuffer`` over the chunk dataset, through
     ``replay_buffer_config`` alone: every batch holds exactly ``floor(f * B + 1/2)`` logged rows. By default
     (``--mix size_proportional``) ``f`` is the logged share of all rows, the share RLlib's prefilled buffer
     draws on average, so the two runs differ only in the buffer; ``--mix linear`` anneals ``f`` from
     ``--offline-fraction`` to 0 over the run, ``--mix constant`` keeps it.

   Nothing else differs. After every training iteration the greedy policy plays ``--eval-episodes`` episodes
   on fixed seeds; the behaviour policy is scored on the same seeds.
3. ``metrics.json`` and ``rllib_finetune.png`` (evaluation return against env steps, both buffers, every
   seed, beside the behaviour policy's return) go to ``--out``, with each run's wall time and the buffer's
   cost per training iteration read from RLlib's own timers in the results dict.

    python pipelines/rllib_finetune.py --out outputs/rllib_finetune
    python pipelines/rllib_finetune.py --quick --buffers rayrb
    ray job submit --working-dir . -- python pipelines/rllib_finetune.py --out /mnt/rayrb/out/rllib
"""
from __future__ import annotations

import argparse
import json
import logging
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

ENV_ID = "CartPole-v1"
BUFFERS = ("rllib", "rayrb")
RAYRB_BUFFER = "rayrb.integrations.rllib.OfflineToOnlineEpisodeReplayBuffer"
# RLlib's timers around the buffer's calls in DQN's training_step (ray.rllib.utils.metrics names).
BUFFER_TIMERS = ("replay_buffer_add_data_timer", "replay_buffer_sampling_timer", "replay_buffer_update_prios_timer")
QUICK = {"iterations": 6, "steps_per_iteration": 500, "offline_episodes": 40, "eval_episodes": 5, "seeds": [0]}


# ---------------------------------------------------------------------------- the behaviour policy and its log
def pole_rule(obs: np.ndarray) -> int:
    """The noiseless rule: push towards where the pole is falling.

    >>> pole_rule(np.array([0.0, 0.0, 0.05, 0.0])), pole_rule(np.array([0.0, 0.0, 0.0, -0.2]))
    (1, 0)
    """
    return int(obs[2] + 0.5 * obs[3] > 0)


def behaviour_action(obs: np.ndarray, rng: np.random.Generator, random_p: float) -> int:
    return int(rng.integers(2)) if rng.random() < random_p else pole_rule(obs)


def log_behaviour(episodes: int, seed: int, random_p: float) -> tuple[list, list[float]]:
    """``episodes`` episodes of the noisy rule on gymnasium's env, as RLlib episodes, and their returns."""
    import gymnasium as gym
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    env, rng, out, returns = gym.make(ENV_ID), np.random.default_rng(seed), [], []
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed * 10_000 + ep)
        observations, actions, rewards = [obs], [], []
        terminated = truncated = False
        while not (terminated or truncated):
            a = behaviour_action(obs, rng, random_p)
            obs, r, terminated, truncated, _ = env.step(a)
            observations.append(obs)
            actions.append(a)
            rewards.append(float(r))
        out.append(SingleAgentEpisode(id_=f"behaviour-{seed}-{ep}", observations=observations, actions=actions,
                                      rewards=rewards, terminated=terminated, truncated=truncated,
                                      len_lookback_buffer=0))
        returns.append(float(sum(rewards)))
    env.close()
    return out, returns


def play(act: Any, seeds: list[int]) -> float:
    """Mean return of ``act`` (a batch of observations -> actions), one episode per seed, all stepped together."""
    import gymnasium as gym

    envs = [gym.make(ENV_ID) for _ in seeds]
    obs = np.stack([env.reset(seed=s)[0] for env, s in zip(envs, seeds)])
    totals, done = np.zeros(len(envs)), np.zeros(len(envs), dtype=bool)
    while not done.all():
        actions = act(obs)
        for i, env in enumerate(envs):
            if not done[i]:
                obs[i], r, term, trunc, _ = env.step(int(actions[i]))
                totals[i] += r
                done[i] = term or trunc
    for env in envs:
        env.close()
    return float(totals.mean())


def behaviour_return(seeds: list[int], random_p: float, rng_seed: int) -> float:
    rng = np.random.default_rng(rng_seed)
    return play(lambda obs: [behaviour_action(o, rng, random_p) for o in obs], seeds)


def greedy_return(algo: Any, seeds: list[int]) -> float:
    """The learner's module, acting greedily (its ``forward_inference``: the Q argmax)."""
    module = algo.get_module()

    def act(obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return module.forward_inference({"obs": torch.as_tensor(obs, dtype=torch.float32)})["actions"].numpy()

    return play(act, seeds)


def eval_seeds(args: argparse.Namespace) -> list[int]:
    return [1_000_000 + i for i in range(args.eval_episodes)]  # unseen by the log (seed * 10_000 + episode)


# ---------------------------------------------------------------------------- the RLlib runs
def replay_buffer_config(kind: str, args: argparse.Namespace, dataset_root: str, log_steps: int, seed: int) -> dict:
    online = args.iterations * args.steps_per_iteration
    if kind == "rllib":  # room for the log and every collected step: nothing is evicted
        return {"type": "EpisodeReplayBuffer", "capacity": log_steps + online + args.steps_per_iteration}
    updates = online // args.rollout_fragment_length  # DQN samples the buffer once per fragment collected
    fraction = {"size_proportional": "size_proportional", "constant": args.offline_fraction,
                "linear": {"kind": "linear", "start": args.offline_fraction, "end": 0.0, "total_steps": updates}}
    return {"type": RAYRB_BUFFER, "capacity": online, "offline_dataset": dataset_root,
            "offline_fraction": fraction[args.mix], "seed": seed, "rows_per_write": args.rows_per_write}


def dqn_config(args: argparse.Namespace, buffer_config: dict, seed: int) -> Any:
    from ray.rllib.algorithms.dqn import DQNConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    online = args.iterations * args.steps_per_iteration
    return (DQNConfig()
            .environment(ENV_ID)
            .env_runners(num_env_runners=args.env_runners, rollout_fragment_length=args.rollout_fragment_length)
            .training(lr=args.lr, gamma=args.gamma, train_batch_size_per_learner=args.batch_size, n_step=args.n_step,
                      double_q=True, dueling=False, num_atoms=1, target_network_update_freq=args.target_update,
                      num_steps_sampled_before_learning_starts=0, replay_buffer_config=buffer_config,
                      epsilon=[(0, args.epsilon), (online // 2, 0.02)])
            .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[args.hidden], head_fcnet_hiddens=[]))
            .reporting(min_sample_timesteps_per_iteration=args.steps_per_iteration, min_time_s_per_iteration=0,
                       min_train_timesteps_per_iteration=0)
            .debugging(seed=seed, log_level="ERROR"))


def buffer_cost(result: dict) -> dict[str, float]:
    """Seconds per training iteration in the buffer's calls: RLlib's time per call (its timers, an exponential
    moving average over calls, coefficient 0.01, so the first calls weigh for a few hundred more) times the
    calls, which DQN makes once per training_step each (add, sample, priorities)."""
    timers, calls = result.get("timers", {}), float(result.get("num_training_step_calls_per_iteration", 0))
    per_call = {k: float(timers[k]) for k in BUFFER_TIMERS if k in timers}
    return {"per_call": per_call, "training_steps": calls, "seconds": sum(per_call.values()) * calls,
            "iteration_seconds": float(timers.get("training_iteration", float("nan")))}


def finetune(kind: str, args: argparse.Namespace, dataset_root: str, episodes: list, seed: int) -> dict[str, Any]:
    """One DQN run; the buffer is the only thing ``kind`` changes."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    log_steps = sum(len(e) for e in episodes)
    algo = dqn_config(args, replay_buffer_config(kind, args, dataset_root, log_steps, seed), seed).build_algo()
    t0 = time.perf_counter()
    try:
        if kind == "rllib":
            algo.local_replay_buffer.add(episodes)  # prefilled with the log, counted in the run's wall time
        steps, returns, costs, losses, fractions = [], [], [], [], []
        eval_s = 0.0
        for it in range(args.iterations):
            result = algo.train()
            t_eval = time.perf_counter()
            returns.append(greedy_return(algo, eval_seeds(args)))
            eval_s += time.perf_counter() - t_eval
            steps.append(int(result["env_runners"]["num_env_steps_sampled_lifetime"]))
            costs.append(buffer_cost(result))
            loss = result.get("learners", {}).get("default_policy", {}).get("qf_loss")
            losses.append(None if loss is None else float(loss))
            if kind == "rayrb":
                fractions.append(float(algo.local_replay_buffer.offline_fraction))
            print(f"  {kind} seed {seed}: iteration {it + 1}, {steps[-1]:6d} env steps, greedy return "
                  f"{returns[-1]:6.1f}, buffer {1e3 * costs[-1]['seconds']:6.1f} ms of "
                  f"{1e3 * costs[-1]['iteration_seconds']:7.1f} ms, {time.perf_counter() - t0:6.1f}s", flush=True)
        seconds = time.perf_counter() - t0
        out = {"buffer": kind, "seed": seed, "env_steps": steps, "eval_return": returns, "final_return": returns[-1],
               "last3_return": float(np.mean(returns[-3:])), "seconds": seconds, "eval_seconds": eval_s,
               # the last iteration's timers: their moving averages have forgotten the first calls the most by then
               "buffer_cost": costs, "buffer_ms_per_iteration": 1e3 * costs[-1]["seconds"],
               "iteration_ms": 1e3 * costs[-1]["iteration_seconds"], "qf_loss": losses,
               "buffer_timesteps": int(algo.local_replay_buffer.get_num_timesteps())}
        if kind == "rayrb":
            out["offline_fraction"] = fractions
            out["buffer_stats"] = algo.local_replay_buffer.rb.stats()
        print(f"{kind:6s} seed {seed}: final greedy return {out['final_return']:6.1f} after {steps[-1]} env steps, "
              f"{seconds:.1f}s ({eval_s:.1f}s evaluating), buffer {out['buffer_ms_per_iteration']:.1f} ms of the last "
              f"iteration's {out['iteration_ms']:.0f} ms (RLlib's timers)", flush=True)
        return out
    finally:
        if kind == "rayrb":
            algo.local_replay_buffer.shutdown()
        algo.stop()


# ---------------------------------------------------------------------------- report
def plot_returns(runs: list[dict], path: Path, *, colours: dict[str, str], label: Callable[[dict], str],
                 lines: list[tuple[float, str, str]], ylabel: str, title: str) -> bool:
    """Return against env steps, a line per run (colour: its buffer, dashes: its seed), with horizontal ``lines``
    ``(y, label, style)``; False where matplotlib is missing. The DQN and SAC jobs draw their figures with it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(10, 4.2))
    for run in runs:
        ax.plot(run["env_steps"], run["eval_return"], color=colours[run["buffer"]], alpha=0.85, label=label(run),
                linestyle=["-", "--", ":", "-."][run["seed"] % 4], marker="o", markersize=3)
    for y, text, style in lines:
        ax.axhline(y, color="grey" if style == "--" else "black", linestyle=style, linewidth=1, label=text)
    ax.set_xlabel("online env steps collected")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot(metrics: dict, path: Path) -> bool:
    return plot_returns(
        metrics["runs"], path, colours={"rllib": "tab:blue", "rayrb": "tab:orange"},
        label=lambda run: (f"{run['buffer']} (seed {run['seed']}, {run['seconds']:.0f} s, buffer "
                           f"{run['buffer_ms_per_iteration']:.0f} ms/iter)"),
        lines=[(metrics["behaviour"]["eval_return"], f"behaviour policy ({metrics['behaviour']['eval_return']:.0f})",
                "--")],
        ylabel=f"greedy return ({metrics['config']['eval_episodes']} episodes)",
        title="RLlib DQN on CartPole-v1 from a logged policy: RLlib's buffer vs rayrb")


def summarise(runs: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in sorted({r["buffer"] for r in runs}):
        mine = [r for r in runs if r["buffer"] == kind]
        finals, last3 = [r["final_return"] for r in mine], [r["last3_return"] for r in mine]
        out[kind] = {"final_returns": finals, "final_mean": float(np.mean(finals)), "final_std": float(np.std(finals)),
                     "last3_returns": last3, "last3_mean": float(np.mean(last3)),
                     "seconds": [r["seconds"] for r in mine],
                     "seconds_mean": float(np.mean([r["seconds"] for r in mine])),
                     "buffer_ms_per_iteration": float(np.mean([r["buffer_ms_per_iteration"] for r in mine])),
                     "iteration_ms": float(np.mean([r["iteration_ms"] for r in mine]))}
    return out


def job_parser(doc: str, out: str) -> argparse.ArgumentParser:
    """The arguments the DQN and SAC jobs share: where their outputs and log go, and the Ray cluster."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=out, help="where metrics.json and the plot go")
    p.add_argument("--root", default=None, help="where the offline chunk dataset goes (default: a folder under --out)")
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS"), help="Ray cluster (default: $RAY_ADDRESS "
                   "or a new local Ray)")
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = job_parser(__doc__, "outputs/rllib_finetune")
    p.add_argument("--buffers", default=",".join(BUFFERS), help=f"comma-separated, of {BUFFERS}")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--iterations", type=int, default=10, help="RLlib training iterations per run")
    p.add_argument("--steps-per-iteration", type=int, default=1000, help="env steps each iteration collects")
    p.add_argument("--rollout-fragment-length", type=int, default=4,
                   help="env steps per sample call; DQN trains once per fragment")
    p.add_argument("--env-runners", type=int, default=0, help="remote env runners (0: the driver's own)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--n-step", type=int, default=1)
    p.add_argument("--target-update", type=int, default=500, help="env steps between target network updates")
    p.add_argument("--epsilon", type=float, default=0.2, help="initial exploration, decayed to 0.02 by mid-run")
    p.add_argument("--mix", choices=("size_proportional", "linear", "constant"), default="size_proportional",
                   help="rayrb's offline share of each batch: the logged share of all rows (RLlib's buffer's on "
                   "average), --offline-fraction annealed linearly to 0, or --offline-fraction throughout")
    p.add_argument("--offline-fraction", type=float, default=0.5, help="for --mix linear and constant")
    p.add_argument("--rows-per-write", type=int, default=1,
                   help="rows rayrb's buffer gathers before one write (1: each add writes at once, as RLlib's)")
    p.add_argument("--offline-episodes", type=int, default=100, help="episodes the behaviour policy logs")
    p.add_argument("--behaviour-random", type=float, default=0.5, help="probability of a uniformly random action")
    p.add_argument("--eval-episodes", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch threads in the driver")
    p.add_argument("--quick", action="store_true", help=f"a short configuration for tests: {QUICK}")
    if p.parse_known_args(argv)[0].quick:  # the quick configuration's values are defaults: flags still win
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    args.buffers = [b for b in args.buffers.split(",") if b]
    if not args.buffers or set(args.buffers) - set(BUFFERS):
        p.error(f"expected --buffers among {BUFFERS}, got {args.buffers}")
    if not 0 <= args.offline_fraction <= 1:
        p.error(f"expected --offline-fraction in [0, 1], got {args.offline_fraction}")
    if min(args.iterations, args.steps_per_iteration, args.rollout_fragment_length, args.batch_size, args.hidden,
           args.n_step, args.offline_episodes, args.eval_episodes, args.rows_per_write) <= 0:
        p.error("expected positive --iterations, --steps-per-iteration, --rollout-fragment-length, --batch-size, "
                "--hidden, --n-step, --offline-episodes, --eval-episodes and --rows-per-write")
    return args


def start_ray(args: argparse.Namespace) -> bool:
    """Torch's threads as ``--threads`` says, and Ray at ``--address`` (a new local one by default) unless this
    process has one already (a test's stays up); whether this started it. The SAC job starts the same way."""
    torch.set_num_threads(args.threads)
    if ray.is_initialized():
        return False
    ray.init(address=args.address, include_dashboard=False if args.address is None else None,
             logging_level=logging.WARNING)
    return True


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    t_start, started = time.perf_counter(), start_ray(args)
    from rayrb.integrations.rllib import write_episodes

    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    root = Path(args.root).resolve() if args.root else out_dir
    t0 = time.perf_counter()
    # One log for every run and seed (its own seed, 0): the runs differ only in the buffer and the training seed.
    episodes, logged_returns = log_behaviour(args.offline_episodes, 0, args.behaviour_random)
    dataset = write_episodes(episodes, root / "cartpole-offline", n_step=args.n_step, overwrite=True,
                             source={"env": ENV_ID, "behaviour": "pole rule", "random": args.behaviour_random,
                                     "episodes": args.offline_episodes})
    behaviour_eval = behaviour_return(eval_seeds(args), args.behaviour_random, 1)
    log_s = time.perf_counter() - t0
    print(f"logged {len(dataset)} steps of the behaviour policy ({args.offline_episodes} episodes, return "
          f"{np.mean(logged_returns):.1f} +- {np.std(logged_returns):.1f}; on the evaluation seeds "
          f"{behaviour_eval:.1f}) into {dataset.root} with write_episodes ({log_s:.1f}s)", flush=True)

    runs = [finetune(kind, args, str(dataset.root), episodes, seed) for seed in args.seeds for kind in args.buffers]
    summary = summarise(runs)
    metrics = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "config": vars(args),
        "behaviour": {"logged_returns": logged_returns, "logged_return": float(np.mean(logged_returns)),
                      "eval_return": behaviour_eval, "steps": len(dataset), "dataset": str(dataset.root),
                      "log_s": log_s},
        "runs": runs,
        "summary": summary,
        "total_s": time.perf_counter() - t_start,
        "versions": {m: __import__(m).__version__ for m in ("ray", "torch", "gymnasium")},
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1, default=str))
    plotted = plot(metrics, out_dir / "rllib_finetune.png")
    for kind, s in summary.items():
        print(f"{kind}: final greedy return {s['final_mean']:.1f} +- {s['final_std']:.1f} over seeds {args.seeds} "
              f"({', '.join(f'{x:.1f}' for x in s['final_returns'])}); {s['seconds_mean']:.1f}s per run; buffer "
              f"{s['buffer_ms_per_iteration']:.1f} ms per iteration of {s['iteration_ms']:.0f} ms", flush=True)
    print(f"behaviour policy: {behaviour_eval:.1f} on the evaluation seeds; {metrics['total_s']:.1f}s in all",
          flush=True)
    print(f"wrote {out_dir / 'metrics.json'}" + (f" and {out_dir / 'rllib_finetune.png'}" if plotted else
                                                 " (matplotlib is not installed: no plot)"), flush=True)
    if started:
        ray.shutdown()
    return metrics


if __name__ == "__main__":
    main()
