"""Section ``replicas`` (not in the default sections): what a second copy of each online shard costs, measured by
``pipelines/bench_replicas.py`` on a simulated cluster of its own, in a subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.harness import result_line

SCRIPT = Path(__file__).resolve().parents[1] / "bench_replicas.py"


def bench_replicas(smoke: bool, results: dict) -> None:
    """What a second copy of each online shard costs (``pipelines/bench_replicas.py``, on its own cluster)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    p = subprocess.run([sys.executable, str(SCRIPT), *(["--smoke"] if smoke else [])],
                       capture_output=True, text=True, env=env, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"replicas benchmark failed:\n{p.stderr[-2000:]}")
    results["replicas"] = result_line(p.stdout)
    print("  " + json.dumps(results["replicas"]), flush=True)
