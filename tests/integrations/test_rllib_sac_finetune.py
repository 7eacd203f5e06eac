"""The SAC fine-tuning job (pipelines/rllib_sac_finetune.py): its quick configuration runs RLlib's SAC from a logged
Pendulum policy on RLlib's prefilled buffer, on rayrb's 50/50 mix and online only, and writes what the docs read."""
from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest
from conftest import REPO

pytest.importorskip("gymnasium")
pytest.importorskip("ray.rllib")


def load_job():
    spec = importlib.util.spec_from_file_location("rllib_sac_finetune", REPO / "pipelines" / "rllib_sac_finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_writes_every_learner_and_rayrb_batches_hold_half_logged_rows(ray_session, tmp_path):
    from rayrb.io.chunk_dataset import ChunkDataset

    metrics = load_job().main(["--quick", "--out", str(tmp_path)])
    config, behaviour = metrics["config"], metrics["behaviour"]
    assert json.loads((tmp_path / "metrics.json").read_text())["summary"].keys() == {"rllib", "rayrb", "online"}
    assert (tmp_path / "rllib_sac_finetune.png").is_file()
    assert config["offline_fraction"] == 0.5 and config["threshold"] == -300.0
    assert behaviour["steps"] == 200 * config["offline_episodes"] and math.isfinite(behaviour["eval_return"])
    # logged actions are in the module's [-1, 1] range, as RLlib's env runners store theirs
    actions = ChunkDataset.open(behaviour["dataset"]).read()["actions"]
    assert actions.shape[1:] == (1,) and np.abs(actions).max() <= 1.0 and np.abs(actions).max() > 0.9

    runs = {run["buffer"]: run for run in metrics["runs"]}
    assert [r["buffer"] for r in metrics["runs"]] == ["rllib", "rayrb", "online"] and len(metrics["runs"]) == 3
    online_steps = config["iterations"] * config["steps_per_iteration"]
    for name, run in runs.items():
        assert run["seed"] == 0 and len(run["env_steps"]) == len(run["eval_return"]) == config["iterations"]
        assert run["env_steps"][-1] == online_steps and all(math.isfinite(r) for r in run["eval_return"])
        assert "steps_to_threshold" in run and run["buffer_ms_per_iteration"] > 0 and run["iteration_ms"] > 0, name
        # one training_step per env step (rollout_fragment_length 1), one update each once learning has started
        assert run["buffer_cost"][-1]["training_steps"] == config["steps_per_iteration"], name
    assert runs["rllib"]["buffer_timesteps"] == behaviour["steps"] + online_steps  # prefilled with the log
    assert runs["online"]["buffer_timesteps"] == online_steps  # no log
    assert runs["rayrb"]["buffer_timesteps"] == behaviour["steps"] + online_steps  # n_step 1: every step a row

    # every batch SAC drew from rayrb: exactly half logged rows, floor(0.5 * 32 + 1/2) = 16
    share = runs["rayrb"]["offline_rows_per_batch"]
    updates = online_steps - config["learning_starts"] + 1  # from the step that brings the count to learning_starts
    assert share == {"expected": 16, "batches": updates, "min": 16, "max": 16, "exact": True}
    summary = metrics["summary"]["rayrb"]
    assert summary["steps_to_threshold"] == [runs["rayrb"]["steps_to_threshold"]]
    assert summary["final_returns"] == [runs["rayrb"]["final_return"]]
