"""`pipelines/demo.py` stays runnable (a short run, in its own process and its own local Ray); `make demo`'s job,
`pipelines/train_bandit.py`, runs in `tests/test_jobs.py`."""
import os
import subprocess
import sys

from conftest import REPO


def test_demo_job_runs_and_checks_every_split(data_home, tmp_path):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run(
        [sys.executable, str(REPO / "pipelines" / "demo.py"), "--data-home", str(data_home), "--root", str(tmp_path),
         "--steps", "20", "--batch-size", "64", "--collectors", "1", "--offline-shards", "1", "--online-shards", "1"],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trained 20 steps" in out.stdout
    assert "provenance totals" in out.stdout
