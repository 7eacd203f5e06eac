"""What the job reports at the end: ``metrics.json`` and its final figures, the summary line and
``train_bandit.png`` (online reward and held-out greedy accuracy against learner steps).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import argparse

    from .data import OfflineLog


def rows_to_reach(series: dict, accuracy: float) -> int | None:
    """Online rows written when ``series`` first reached held-out ``accuracy`` (None if it never did).

    >>> rows_to_reach({"heldout_accuracy": [0.4, 0.7, 0.9], "online_rows_so_far": [100, 200, 300]}, 0.7)
    200
    """
    for acc, rows in zip(series["heldout_accuracy"], series["online_rows_so_far"]):
        if acc >= accuracy:
            return int(rows)
    return None


def final_figures(offline_only: dict, o2o: dict, online_only: dict | None, behaviour_acc: float) -> dict:
    """``metrics.json``'s ``final``: each run's last held-out accuracy and what the online runs took to get there."""
    tail = max(1, len(o2o["step"]) // 5)  # the last fifth of the run
    return {"o2o_heldout_accuracy": o2o["heldout_accuracy"][-1],
            "offline_only_heldout_accuracy": offline_only["heldout_accuracy"][-1],
            "online_only_heldout_accuracy": online_only["heldout_accuracy"][-1] if online_only else None,
            "o2o_minus_offline_only": o2o["heldout_accuracy"][-1] - offline_only["heldout_accuracy"][-1],
            # online rows each needed to reach the offline-only learner's final accuracy (None: never)
            "online_rows_to_offline_only_accuracy": {
                k: rows_to_reach(s, offline_only["heldout_accuracy"][-1])
                for k, s in (("o2o", o2o), ("online_only", online_only)) if s is not None},
            "behaviour_heldout_accuracy": behaviour_acc,
            "online_reward_last_fifth": float(np.mean(o2o["online_reward"][-tail:])),
            "online_rows_written": o2o["online_rows"]}


def metrics_of(args: argparse.Namespace, splits: dict, log: OfflineLog, runs: dict[str, dict], stats: dict | None,
               timing: dict[str, float]) -> dict:
    """What ``metrics.json`` holds: the configuration, the dataset and its log, each run's series (``runs``: the
    job's ``train_all``), the final figures, timings, the offline-to-online buffer's stats and versions."""
    offline_only, o2o, online_only = runs["offline_only"], runs["o2o"], runs.get("online_only")
    return {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "config": vars(args),
        "dataset": {"id": args.dataset, "rows": splits["rows"], "features": splits["features"],
                    "classes": splits["classes"], "train_rows": splits["train_rows"], "test_rows": splits["test_rows"],
                    "logged_rows": len(log.dataset), "logged_root": str(log.dataset.root),
                    "behaviour": args.behaviour, "behaviour_params": log.params, "logged_actions": log.actions,
                    "behaviour_reward": log.reward, "behaviour_heldout_accuracy": log.heldout_accuracy},
        "offline_only": offline_only,
        "online_only": online_only,
        "o2o": o2o,
        "final": final_figures(offline_only, o2o, online_only, log.heldout_accuracy),
        "timing": {**timing, "offline_only_s": offline_only["seconds"], "o2o_s": o2o["seconds"],
                   "learner_rows_per_s": args.steps * args.batch_size / o2o["seconds"]},
        "buffer_stats": stats,
        "versions": {m: __import__(m).__version__ for m in ("ray", "torch", "tensordict", "numpy")},
    }


def summary(metrics: dict) -> str:
    """The job's last figures in one line."""
    fin, o2o = metrics["final"], metrics["o2o"]
    only = fin["online_only_heldout_accuracy"]
    return (f"final held-out greedy accuracy: offline-to-online {fin['o2o_heldout_accuracy']:.3f}, offline only "
            f"{fin['offline_only_heldout_accuracy']:.3f}, online only {'-' if only is None else f'{only:.3f}'}, "
            f"behaviour policy {fin['behaviour_heldout_accuracy']:.3f}; online rows to reach the offline-only "
            f"accuracy: {fin['online_rows_to_offline_only_accuracy']}; online reward "
            f"(last fifth) {fin['online_reward_last_fifth']:.3f}; {o2o['exact_split_batches']}/{o2o['batches']} "
            f"batches with the exact split; {metrics['timing']['total_s']:.1f}s in all")


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
