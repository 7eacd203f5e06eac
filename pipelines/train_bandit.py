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
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import ray  # noqa: E402

# The job's pieces live in pipelines/bandit/. Run as a script (plain or under `ray job submit`), this file's folder
# is sys.path[0], so the driver imports them as `bandit`; Ray's workers get their code by value, never by import
# (bandit/__init__.py says why).
from bandit.behaviour import BEHAVIOURS  # noqa: E402
from bandit.data import Collector, log_offline, prepare_splits  # noqa: E402
from bandit.learners import evaluate, make_learner, rllib_classes, stop, train_block, weights  # noqa: E402
from bandit.results import metrics_of, plot, summary  # noqa: E402

if TYPE_CHECKING:
    from bandit.learners import GroupLearner
    from ray.actor import ActorHandle

    from rayrb import OfflineToOnlineReplayBuffer

QUICK = {"steps": 60, "sync_every": 10, "batch_size": 64, "collectors": 1, "collect_rows": 64, "hidden": 32,
         "offline_shards": 1, "online_shards": 1, "online_capacity": 4096}


def parser() -> argparse.ArgumentParser:
    """The job's command line."""
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
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, with ``--quick``'s settings applied, checked."""
    p = parser()
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


# ---------------------------------------------------------------------------- one run
def expected_offline(batch_size: int, fraction: float) -> int:
    """The buffer's contract: ``n_off = floor(f * B + 1/2)``."""
    return math.floor(fraction * batch_size + 0.5)


def anneal_total(args: argparse.Namespace) -> int | None:
    """``rb.anneal``'s horizon: it decays the initial fraction to 0 over it, so the final one is at
    ``--anneal-steps``; None when the fraction stays as it is."""
    if args.final_offline_fraction >= args.initial_offline_fraction:
        return None
    return max(1, math.ceil(min(args.anneal_steps, args.steps) /
                            (1 - args.final_offline_fraction / args.initial_offline_fraction)))


def collect(learner: ActorHandle | GroupLearner, collectors: list[ActorHandle], rows: int) -> list[ray.ObjectRef]:
    """The collectors' next block with the learner's newest weights (refs to their results)."""
    if not collectors:
        return []
    w = weights(learner)  # one object, read by every collector from the object store
    for c in collectors:  # an actor runs its calls in order: the weights land before the collect
        c.set_weights.remote(w)
    return [c.collect.remote(rows) for c in collectors]


def mean_of(collected: list[dict], key: str) -> float | None:
    """The collectors' mean ``key`` over a block (None without collectors)."""
    return float(np.mean([c[key] for c in collected])) if collected else None


def run(rb: OfflineToOnlineReplayBuffer, learner: ActorHandle | GroupLearner, collectors: list[ActorHandle],
        args: argparse.Namespace, label: str, anneal: bool = True) -> dict[str, list]:
    """Train for ``args.steps`` in blocks of ``args.sync_every``; between blocks, anneal, sync weights, evaluate.

    ``learner`` is a ``Learner`` actor, or a ``GroupLearner`` (driver-side) with ``--input rllib``. Without
    ``anneal`` the buffer's offline fraction stays as it is (0 for the online-only learner).
    """
    series: dict[str, list] = {"step": [], "offline_fraction": [], "online_reward": [], "greedy_reward": [],
                               "heldout_accuracy": [], "loss": [], "online_rows_so_far": []}
    if args.input != "rllib":  # a LearnerGroup is updated from batch refs, not fed
        rb.connect_learners([learner])
    total = anneal_total(args) if collectors and anneal else None
    # the online side is never empty once training starts, so every batch has the exact split
    ray.get(collect(learner, collectors, args.collect_rows))
    batches = exact = step = 0
    online_rows, t0 = len(collectors) * args.collect_rows, time.perf_counter()
    while step < args.steps:
        n = min(args.sync_every, args.steps - step)
        if total:
            rb.anneal(min(step, args.anneal_steps, args.steps), total)
        f = rb.offline_fraction
        pending = collect(learner, collectors, args.collect_rows)  # acting while the learner trains on this block
        results = train_block(args.input, rb, learner, n, args.batch_size)
        want = expected_offline(args.batch_size, f)
        batches += len(results)
        exact += sum(n_off == want and rows == args.batch_size for _, n_off, rows in results)
        step += n
        collected = ray.get(pending)
        acc = evaluate(learner)
        online_rows += sum(c["rows"] for c in collected)
        for key, value in {"step": step, "offline_fraction": f, "online_reward": mean_of(collected, "reward"),
                           "greedy_reward": mean_of(collected, "greedy_reward"), "heldout_accuracy": acc,
                           "loss": float(np.mean([r[0] for r in results])), "online_rows_so_far": online_rows}.items():
            series[key].append(value)
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


# ---------------------------------------------------------------------------- the job
def train_all(args: argparse.Namespace, splits: dict, logged_root: Path) -> tuple[dict[str, dict], dict | None]:
    """Offline only, online only and offline-to-online, one after the other, each on a buffer of its own; the
    runs' series and the offline-to-online buffer's stats."""
    from rayrb import OfflineToOnlineReplayBuffer

    K, d = splits["classes"], splits["features"]
    results, stats = {}, None
    for name, fraction, online, anneal in (("offline_only", 1.0, False, False), ("online_only", 0.0, True, False),
                                           ("o2o", args.initial_offline_fraction, True, True)):
        if name == "online_only" and args.no_online_only:
            continue
        rb = OfflineToOnlineReplayBuffer(logged_root, online_capacity=args.online_capacity, offline_fraction=fraction,
                                         batch_size=args.batch_size, num_offline_shards=args.offline_shards,
                                         num_online_shards=args.online_shards, seed=args.seed)
        actors = []
        try:
            actors.append(make_learner(args.input, rb, splits["test"], d, K, args.hidden, args.lr, args.seed))
            # the same seeds for every run: the same contexts, in the same order
            actors += [Collector.remote(rb, splits["train"], d, K, args.hidden, args.epsilon, args.seed + 1 + i)
                       for i in range(args.collectors if online else 0)]
            label = name.replace("_", " ").replace("o2o", "offline-to-online")
            results[name] = run(rb, actors[0], actors[1:], args, label, anneal=anneal)
            if name == "o2o":
                stats = rb.stats()
        finally:
            rb.shutdown()
            for a in actors:
                stop(a)  # frees its CPU for the next run
    return results, stats


def main(argv: list[str] | None = None) -> dict:
    """Prepare the splits, log the behaviour policy, train the three learners, write and print the results."""
    args = parse(argv)
    if args.input == "rllib":
        rllib_classes()  # fails here, before Ray starts, when RLlib is missing
    t_start = time.perf_counter()
    ray.init(address=args.address, include_dashboard=False if args.address is None else None,
             logging_level=logging.WARNING)
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    data_home = os.path.abspath(args.data_home) if args.data_home else None
    root = os.path.abspath(args.root) if args.root else None

    t0 = time.perf_counter()
    splits = ray.get(prepare_splits.remote(args.dataset, data_home, root, args.seed, args.test_fraction))
    timing = {"prepare_s": time.perf_counter() - t0}
    print(f"prepared {args.dataset}: {splits['rows']} rows, {splits['features']} features, {splits['classes']} "
          f"actions; {splits['train_rows']} training / {splits['test_rows']} held-out rows "
          f"({timing['prepare_s']:.1f}s)", flush=True)

    log = log_offline(splits, args.behaviour, args.behaviour_features, args.seed, args.explored_share)
    timing["log_s"] = log.seconds
    about = f" (features {log.params['features']} of {splits['features']})" if log.params else ""
    if log.explored is not None:
        about += f", every action on {log.explored:.0%} of the contexts"
    print(f"logged the {args.behaviour} behaviour policy{about} on {len(log.dataset)} contexts with rayrb.preprocess "
          f"({timing['log_s']:.1f}s): mean reward {log.reward:.3f}, actions taken {log.actions}, "
          f"spec {log.dataset.spec}", flush=True)

    results, stats = train_all(args, splits, log.dataset.root)
    timing["total_s"] = time.perf_counter() - t_start
    metrics = metrics_of(args, splits, log, results, stats, timing)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1, default=str))
    plotted = plot(metrics, out_dir / "train_bandit.png")
    print(summary(metrics), flush=True)
    print(f"wrote {out_dir / 'metrics.json'}" + (f" and {out_dir / 'train_bandit.png'}" if plotted else
                                                 " (matplotlib is not installed: no plot)"), flush=True)
    ray.shutdown()
    return metrics


if __name__ == "__main__":
    main()
