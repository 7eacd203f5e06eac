"""The Pendulum fine-tuning job (pipelines/finetune_pendulum.py) learns on rayrb: its quick configuration, TorchRL's
OfflineToOnlineTrainer with SAC on ``as_torchrl(rb)``, ends well above the behaviour policy that logged its offline
data."""
from __future__ import annotations

import importlib.util

import pytest
from conftest import REPO

pytest.importorskip("gymnasium")
pytest.importorskip("torchrl")

# The behaviour policy scores about -640 on the evaluation seeds and a policy that failed to learn about -1100 or
# worse; the quick configuration's SAC policy ends near -150 (docs/torchrl-trainer.md).
MARGIN = 200.0


def load_job():
    spec = importlib.util.spec_from_file_location("finetune_pendulum", REPO / "pipelines" / "finetune_pendulum.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_finetune_on_rayrb_beats_the_behaviour_policy(ray_session, tmp_path):
    metrics = load_job().main(["--quick", "--buffers", "rayrb", "--out", str(tmp_path)])
    behaviour = metrics["behaviour"]["eval_return"]
    (run,) = metrics["runs"]
    assert run["buffer"] == "rayrb" and run["online_rows"] == metrics["config"]["frames"]
    assert run["offline_fraction_at_end"] == pytest.approx(0.0)  # the trainer's anneal hook reached the buffer
    assert run["final_return"] > behaviour + MARGIN, (
        f"expected the fine-tuned policy to beat the behaviour policy's return {behaviour:.1f} by {MARGIN}, "
        f"got {run['final_return']:.1f} (evaluations {run['eval_return']} at frames {run['frames']})")
    assert (tmp_path / "metrics.json").is_file()
