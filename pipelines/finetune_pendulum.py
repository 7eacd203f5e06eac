"""TorchRL's ``OfflineToOnlineTrainer`` fine-tuning a SAC policy on gymnasium's ``Pendulum-v1``, on two buffers.

1. A behaviour policy logs the offline data: a hand-written energy-pumping swing-up controller with a PD
   balancer on top, made mediocre by Gaussian action noise (``--behaviour-noise``) and uniformly random actions
   (``--behaviour-random``). Its episodes go through ``rayrb.write_dataset`` into a chunk dataset with the keys
   TorchRL's ``SACLoss`` reads: ``observation``, ``action`` and ``("next", ...)`` ``observation``, ``reward``,
   ``done``, ``terminated``, ``truncated``.
2. The same run, twice per seed, with the same seeds: TorchRL's ``OfflineToOnlineTrainer`` (a ``SACTrainer``:
   its ``Collector``, ``SACLoss``, ``SoftUpdate`` and its offline-to-online hooks, which extend the online buffer
   with each collected batch, sample mixed batches and anneal the offline fraction to 0) on

   - ``torchrl``: TorchRL's in-process ``torchrl.data.OfflineToOnlineReplayBuffer`` over a ``ReplayBuffer`` of
     the logged rows;
   - ``rayrb``: ``rayrb.OfflineToOnlineReplayBuffer`` over the chunk dataset (offline and online shards are Ray
     actors), handed to the trainer as ``as_torchrl(rb)``.

   Nothing else differs. Every ``--eval-every`` frames the deterministic policy plays ``--eval-episodes``
   episodes on fixed seeds; the behaviour policy is scored on the same seeds.
3. ``metrics.json`` and ``finetune_pendulum.png`` (evaluation return against frames, both buffers, every seed,
   beside the behaviour policy's return) go to ``--out``.

    python pipelines/finetune_pendulum.py --out outputs/finetune_pendulum
    python pipelines/finetune_pendulum.py --quick --buffers rayrb
    ray job submit --working-dir . -- python pipelines/finetune_pendulum.py --out /mnt/rayrb/out/pendulum
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

# The behaviour policy and its log live in pendulum_behaviour.py beside this file. Run as a script (plain or under
# `ray job submit`), this file's folder is first on the driver's path; a test loading this file by its path needs it.
HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from pendulum_behaviour import ENV_ID, behaviour_return, log_behaviour  # noqa: E402

BUFFERS = ("torchrl", "rayrb")
# The trainer's hooks that call the buffer (timed by TorchRL under these names): extend, mixed sample, anneal.
BUFFER_HOOKS = ("extend", "sample", "OfflineToOnlineAnnealHook")
QUICK = {"frames": 3000, "frames_per_batch": 200, "utd": 200, "offline_episodes": 20, "eval_every": 1000,
         "eval_episodes": 5, "seeds": [0]}


# ---------------------------------------------------------------------------- the TorchRL run
def make_env(seed: int):
    from torchrl.envs import GymEnv

    env = GymEnv(ENV_ID, device="cpu")
    env.set_seed(seed)
    return env


def make_agent(env, hidden: int):
    from tensordict.nn import NormalParamExtractor, TensorDictModule
    from torch import nn
    from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator

    obs_dim, act_dim = env.observation_spec["observation"].shape[-1], env.action_spec.shape[-1]
    actor = ProbabilisticActor(
        TensorDictModule(nn.Sequential(MLP(in_features=obs_dim, out_features=2 * act_dim, num_cells=[hidden, hidden]),
                                       NormalParamExtractor()), in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"], spec=env.action_spec, distribution_class=TanhNormal,
        distribution_kwargs={"low": env.action_spec.space.low, "high": env.action_spec.space.high},
        return_log_prob=True)
    qvalue = ValueOperator(MLP(in_features=obs_dim + act_dim, out_features=1, num_cells=[hidden, hidden]),
                           in_keys=["observation", "action"], out_keys=["state_action_value"])
    return actor, qvalue


class Evaluate:
    """A post_steps hook: every ``every`` frames, the deterministic policy's mean return over fixed-seed episodes."""

    def __init__(self, trainer: Any, actor: Any, seeds: list[int], every: int, total: int, label: str):
        self.trainer, self.actor, self.seeds, self.every, self.total = trainer, actor, seeds, every, total
        self.label, self.t0, self.seconds = label, time.perf_counter(), 0.0
        import gymnasium as gym

        # gymnasium's env directly: TorchRL's GymEnv wrapper costs more than the env itself at this size
        self.envs = [gym.make(ENV_ID) for _ in seeds]
        self.frames: list[int] = []
        self.returns: list[float] = []
        self.next_at = 0

    def evaluate(self) -> float:
        """One episode per seed, all stepped together: one policy call per step for every episode."""
        from tensordict import TensorDict
        from torchrl.envs.utils import ExplorationType, set_exploration_type

        obs = np.stack([env.reset(seed=s)[0] for env, s in zip(self.envs, self.seeds)])
        totals, done = np.zeros(len(self.envs)), np.zeros(len(self.envs), dtype=bool)
        with torch.no_grad(), set_exploration_type(ExplorationType.DETERMINISTIC):
            while not done.all():
                td = TensorDict({"observation": torch.as_tensor(obs, dtype=torch.float32)}, [len(obs)])
                actions = self.actor(td)["action"].numpy()
                for i, env in enumerate(self.envs):
                    if not done[i]:
                        obs[i], r, term, trunc, _ = env.step(actions[i])
                        totals[i] += r
                        done[i] = term or trunc
        return float(totals.mean())

    def __call__(self) -> None:
        frames = int(self.trainer.collected_frames)
        if frames >= self.next_at or frames >= self.total:
            t0 = time.perf_counter()
            self.frames.append(frames)
            self.returns.append(self.evaluate())
            self.seconds += time.perf_counter() - t0
            self.next_at = frames + self.every
            print(f"  {self.label}: {frames:6d} frames, evaluation return {self.returns[-1]:8.1f}, "
                  f"{time.perf_counter() - self.t0:6.1f}s", flush=True)


def make_buffer(kind: str, dataset_root: str, args: argparse.Namespace, seed: int):
    if kind == "torchrl":
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, ReplayBuffer
        from torchrl.data import OfflineToOnlineReplayBuffer as TorchRLBuffer

        from rayrb import ChunkDataset

        rows = ChunkDataset.open(dataset_root).read()
        data = TensorDict({k: torch.from_numpy(np.asarray(v)) for k, v in rows.items()}, [len(rows["action"])])
        data = data.unflatten_keys("/")
        offline = ReplayBuffer(storage=LazyTensorStorage(len(data)))
        offline.extend(data)
        return TorchRLBuffer(offline_dataset=offline, online_capacity=args.frames,
                             offline_fraction=args.offline_fraction, batch_size=args.batch_size), None
    from rayrb import OfflineToOnlineReplayBuffer
    from rayrb.integrations.torchrl import as_torchrl

    rb = OfflineToOnlineReplayBuffer(dataset_root, online_capacity=args.frames, offline_fraction=args.offline_fraction,
                                     batch_size=args.batch_size, seed=seed)
    return as_torchrl(rb), rb


def finetune(kind: str, dataset_root: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One fine-tuning run with TorchRL's OfflineToOnlineTrainer; the buffer is the only thing ``kind`` changes."""
    from torchrl.collectors import Collector
    from torchrl.objectives import SACLoss, SoftUpdate
    from torchrl.trainers.algorithms.offline_to_online import OfflineToOnlineTrainer

    torch.manual_seed(seed)
    np.random.seed(seed)
    env = make_env(seed)
    actor, qvalue = make_agent(env, args.hidden)
    loss = SACLoss(actor_network=actor, qvalue_network=qvalue, num_qvalue_nets=2)
    loss.make_value_estimator(gamma=args.gamma)
    collector = Collector(env, actor, frames_per_batch=args.frames_per_batch, total_frames=args.frames,
                          init_random_frames=0)
    from torchrl._utils import timeit

    rb, owner = make_buffer(kind, dataset_root, args, seed)
    timeit.erase()  # log_timings: TorchRL's trainer times each hook, the buffer's extend, sample and anneal included
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = OfflineToOnlineTrainer(
                collector=collector, total_frames=args.frames, frame_skip=1, optim_steps_per_batch=args.utd,
                loss_module=loss, replay_buffer=rb, anneal_frames=args.anneal_frames or args.frames,
                batch_size=args.batch_size, optimizer=torch.optim.Adam(loss.parameters(), lr=args.lr),
                target_net_updater=SoftUpdate(loss, tau=0.005), progress_bar=False, enable_logging=False,
                log_timings=True, seed=seed)
            evaluate = Evaluate(trainer, actor, eval_seeds(args), args.eval_every, args.frames, f"{kind} seed {seed}")
            trainer.register_op("post_steps", evaluate)
            trainer.train()
        seconds = time.perf_counter() - t0
        hooks = {k.removeprefix("hook/"): v for k, v in timeit.todict(percall=False).items() if k.startswith("hook/")}
        in_buffer = sum(hooks.get(k, 0.0) for k in BUFFER_HOOKS)
        out = {"buffer": kind, "seed": seed, "frames": evaluate.frames, "eval_return": evaluate.returns,
               "final_return": evaluate.returns[-1],
               "last3_return": float(np.mean(evaluate.returns[-3:])), "seconds": seconds,
               "eval_seconds": evaluate.seconds, "hook_seconds": hooks, "buffer_seconds": in_buffer, "online_rows": len(rb.online_buffer),
               "offline_fraction_at_end": float(rb.offline_fraction)}
        if owner is not None:
            out["buffer_stats"] = owner.stats()
        print(f"{kind:8s} seed {seed}: final return {out['final_return']:8.1f} after {evaluate.frames[-1]} frames, "
              f"{seconds:.1f}s ({in_buffer:.1f}s of it in the buffer's hooks, {evaluate.seconds:.1f}s evaluating), online rows {out['online_rows']}", flush=True)
        return out
    finally:
        collector.shutdown()
        if owner is not None:
            owner.shutdown()


def eval_seeds(args: argparse.Namespace) -> list[int]:
    return [1_000_000 + i for i in range(args.eval_episodes)]  # unseen by the log (seed * 10_000 + episode)


# ---------------------------------------------------------------------------- report
def plot(metrics: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    colours = {"torchrl": "tab:blue", "rayrb": "tab:orange"}
    for run in metrics["runs"]:
        label = f"{run['buffer']} (seed {run['seed']}, {run['seconds']:.0f} s)"
        ax.plot(run["frames"], run["eval_return"], color=colours[run["buffer"]], alpha=0.85, label=label,
                linestyle=["-", "--", ":", "-."][run["seed"] % 4])
    ax.axhline(metrics["behaviour"]["eval_return"], color="grey", linestyle="--",
               label=f"behaviour policy ({metrics['behaviour']['eval_return']:.0f})")
    ax.set_xlabel("online frames collected")
    ax.set_ylabel(f"evaluation return ({metrics['config']['eval_episodes']} episodes)")
    ax.set_title("OfflineToOnlineTrainer (SAC) on Pendulum-v1: TorchRL's buffer vs rayrb")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def summarise(runs: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in {r["buffer"] for r in runs}:
        finals = [r["final_return"] for r in runs if r["buffer"] == kind]
        last3 = [r["last3_return"] for r in runs if r["buffer"] == kind]
        secs = [r["seconds"] for r in runs if r["buffer"] == kind]
        in_buffer = [r["buffer_seconds"] for r in runs if r["buffer"] == kind]
        out[kind] = {"final_returns": finals, "final_mean": float(np.mean(finals)),
                     "final_std": float(np.std(finals)), "last3_returns": last3,
                     "last3_mean": float(np.mean(last3)), "last3_std": float(np.std(last3)), "seconds": secs, "seconds_mean": float(np.mean(secs)),
                     "buffer_seconds": in_buffer, "buffer_seconds_mean": float(np.mean(in_buffer))}
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/finetune_pendulum", help="where metrics.json and the plot go")
    p.add_argument("--root", default=None, help="where the offline chunk dataset goes (default: a folder under --out)")
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS"), help="Ray cluster (default: $RAY_ADDRESS "
                   "or a new local Ray)")
    p.add_argument("--buffers", default=",".join(BUFFERS), help=f"comma-separated, of {BUFFERS}")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--frames", type=int, default=6000, help="online frames each run collects")
    p.add_argument("--frames-per-batch", type=int, default=200)
    p.add_argument("--utd", type=int, default=200, help="optimisation steps per collected batch")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--offline-fraction", type=float, default=0.5, help="annealed to 0 over --anneal-frames")
    p.add_argument("--anneal-frames", type=int, default=None, help="default: --frames")
    p.add_argument("--offline-episodes", type=int, default=50, help="200-step episodes the behaviour policy logs")
    p.add_argument("--behaviour-noise", type=float, default=2.0, help="std of the Gaussian added to its torque")
    p.add_argument("--behaviour-random", type=float, default=0.3, help="probability of a uniformly random torque")
    p.add_argument("--eval-every", type=int, default=400, help="frames between evaluations")
    p.add_argument("--eval-episodes", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch threads in the driver")
    p.add_argument("--quick", action="store_true", help=f"a short configuration for tests: {QUICK}")
    if p.parse_known_args(argv)[0].quick:  # the quick configuration's values are defaults: flags still win
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    args.buffers = [b for b in args.buffers.split(",") if b]
    if not args.buffers or set(args.buffers) - set(BUFFERS):
        p.error(f"expected --buffers among {BUFFERS}, got {args.buffers}")
    if not 0 < args.offline_fraction < 1:
        p.error(f"expected --offline-fraction in (0, 1) (TorchRL's range), got {args.offline_fraction}")
    if min(args.frames, args.frames_per_batch, args.utd, args.batch_size, args.eval_every, args.eval_episodes,
           args.offline_episodes) <= 0:
        p.error("expected positive --frames, --frames-per-batch, --utd, --batch-size, --eval-every, --eval-episodes "
                "and --offline-episodes")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    started = not ray.is_initialized()  # a caller's Ray (a test's) stays up
    if started:
        ray.init(address=args.address, include_dashboard=False if args.address is None else None,
                 logging_level=logging.WARNING)
    from rayrb import write_dataset

    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    root = Path(args.root).resolve() if args.root else out_dir
    t0 = time.perf_counter()
    # One log for every run and seed (its own seed, 0): the runs differ only in the buffer and the training seed.
    arrays, logged_returns = log_behaviour(args.offline_episodes, 0, args.behaviour_noise, args.behaviour_random)
    dataset = write_dataset(arrays, root / "pendulum-offline", overwrite=True,
                            source={"env": ENV_ID, "behaviour": "noisy swing-up", "noise": args.behaviour_noise,
                                    "random": args.behaviour_random, "episodes": args.offline_episodes})
    behaviour_eval = behaviour_return(eval_seeds(args), args.behaviour_noise, args.behaviour_random, 1)
    log_s = time.perf_counter() - t0
    print(f"logged {len(dataset)} transitions of the behaviour policy ({args.offline_episodes} episodes, "
          f"return {np.mean(logged_returns):.1f} +- {np.std(logged_returns):.1f}; on the evaluation seeds "
          f"{np.mean(behaviour_eval):.1f}) into {dataset.root} with rayrb.write_dataset ({log_s:.1f}s)", flush=True)

    runs = []
    for seed in args.seeds:
        for kind in args.buffers:
            runs.append(finetune(kind, str(dataset.root), args, seed))
    summary = summarise(runs)
    metrics = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "config": vars(args),
        "behaviour": {"logged_returns": logged_returns, "logged_return": float(np.mean(logged_returns)),
                      "eval_returns": behaviour_eval, "eval_return": float(np.mean(behaviour_eval)),
                      "transitions": len(dataset), "dataset": str(dataset.root), "log_s": log_s},
        "runs": runs,
        "summary": summary,
        "total_s": time.perf_counter() - t_start,
        "versions": {m: __import__(m).__version__ for m in ("ray", "torch", "tensordict", "torchrl", "gymnasium")},
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1, default=str))
    plotted = plot(metrics, out_dir / "finetune_pendulum.png")
    for kind, s in summary.items():
        print(f"{kind}: final return {s['final_mean']:.1f} +- {s['final_std']:.1f} over seeds {args.seeds} "
              f"({', '.join(f'{x:.1f}' for x in s['final_returns'])}); {s['seconds_mean']:.1f}s per run, "
              f"{s['buffer_seconds_mean']:.1f}s of it in the buffer's hooks", flush=True)
    print(f"behaviour policy: {metrics['behaviour']['eval_return']:.1f} on the evaluation seeds; "
          f"{metrics['total_s']:.1f}s in all", flush=True)
    print(f"wrote {out_dir / 'metrics.json'}" + (f" and {out_dir / 'finetune_pendulum.png'}" if plotted else
                                                 " (matplotlib is not installed: no plot)"), flush=True)
    if started:
        ray.shutdown()
    return metrics


if __name__ == "__main__":
    main()
