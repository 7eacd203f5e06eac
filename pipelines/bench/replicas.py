"""Sections ``replicas`` and ``rows_in_call`` (not in the default sections), each measured by a script of its own on
a simulated cluster of its own, in a subprocess: what a second copy of each online shard costs
(``pipelines/bench_replicas.py``), and what rows cost in the call against the object store
(``pipelines/bench_rows_in_call.py``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.harness import result_line

SCRIPTS = {"replicas": "bench_replicas.py", "rows_in_call": "bench_rows_in_call.py"}


def bench_on_a_cluster(section: str, smoke: bool, results: dict) -> None:
    """Run ``section``'s script (``SCRIPTS``) on its own cluster; its result line under ``results[section]``."""
    script = Path(__file__).resolve().parents[1] / SCRIPTS[section]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    p = subprocess.run([sys.executable, str(script), *(["--smoke"] if smoke else [])],
                       capture_output=True, text=True, env=env, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"{section} benchmark failed:\n{p.stderr[-2000:]}")
    results[section] = result_line(p.stdout)
    print("  " + json.dumps(results[section]), flush=True)
