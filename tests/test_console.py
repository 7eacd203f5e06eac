"""What a user's console shows of a job: rayrb's own lines, once. ``tests/quiet_job.py`` runs a buffer on every
kind of actor through restarts, a checkpoint and a preprocess map, with Ray relaying every actor's output."""
import os
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.cluster  # its own Ray, in its own process
def test_a_job_prints_no_warning_and_each_progress_bar_once(tmp_path):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    env.pop("PYTHONWARNINGS", None)
    out = subprocess.run([sys.executable, str(REPO / "tests" / "quiet_job.py"), str(tmp_path)], capture_output=True,
                         text=True, timeout=300, env=env, cwd=tmp_path)
    printed = out.stdout + out.stderr
    assert out.returncode == 0 and "RAYRB_JOB_DONE" in out.stdout, printed[-3000:]
    warnings = [line for line in printed.splitlines() if "Warning" in line]
    assert warnings == [], "warnings in the job's output (driver and actors):\n" + "\n".join(warnings)
    assert "\r" not in printed, "a progress bar redrew itself on one line: " + repr(printed[printed.find("\r") - 80:][:300])
    bars = [line for line in printed.splitlines() if line.startswith("preprocess -> doubled")]
    assert len(bars) == 1 and "400/400 rows (100%)" in bars[0], bars
