"""Jobs run as users submit them: the main job through `ray job submit --working-dir` to a head of our own."""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.cluster


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port_range(n: int, avoid: set[int], low: int = 20000, high: int = 32000) -> int:
    """First port of `n` consecutive free ports below the ephemeral range, so that none is one of `avoid`."""
    rng = random.Random()
    for _ in range(200):
        start = rng.randrange(low, high - n)
        block = range(start, start + n)
        if avoid.isdisjoint(block) and all(_bindable(p) for p in block):
            return start
    raise RuntimeError(f"no {n} consecutive free ports in [{low}, {high})")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A local head (`ray start --head --block`) with its own temp dir and ports; stopped by SIGTERM to its PID.
    One for the module: each test submits its own job, with its own files, and a job's actors end with it."""
    tmp_path = tmp_path_factory.mktemp("head")
    ports = free_ports(9)
    gcs, dashboard, client, agent, agent_grpc, metrics, runtime_env, node_manager, object_manager = ports
    worker = free_port_range(41, set(ports))  # worker ports must not overlap the components' ports
    venv_bin = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",  # the job's `python`
           "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    temp_dir = Path("/tmp") / f"rayrb-head-{os.getpid()}-{gcs}"  # Ray's socket paths must stay short
    log = open(tmp_path / "head.log", "w")
    proc = subprocess.Popen(
        [os.path.join(venv_bin, "ray"), "start", "--head", "--block", f"--temp-dir={temp_dir}", f"--port={gcs}",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
         f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
         f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
         f"--runtime-env-agent-port={runtime_env}", f"--node-manager-port={node_manager}",
         f"--object-manager-port={object_manager}", f"--min-worker-port={worker}", f"--max-worker-port={worker + 40}",
         "--num-cpus=2", "--object-store-memory=400000000", "--disable-usage-stats"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + 60
        while True:  # the job API answers once the dashboard is up
            try:
                with urllib.request.urlopen(f"{url}/api/version", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"head did not start: {(tmp_path / 'head.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield url, env
    finally:
        proc.send_signal(signal.SIGTERM)  # never `ray stop`: it kills every Ray on the machine
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        import shutil

        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def bandit_root(tmp_path_factory):
    """One data root for the module's jobs: the second reuses the splits and the behaviour log the first wrote."""
    return tmp_path_factory.mktemp("bandit-root")


def submit_train_bandit(head, data_home, tmp_path, root, *args: str) -> tuple[str, dict]:
    """``ray job submit`` the main job's quick configuration; its streamed log and metrics.json."""
    url, env = head
    out = tmp_path / "out"
    submit = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "ray"), "job", "submit", "--address", url,
         "--working-dir", str(REPO), "--",
         "python", "pipelines/train_bandit.py", "--quick", "--data-home", str(data_home),
         "--root", str(root), "--out", str(out), *args],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    log = submit.stdout + submit.stderr
    assert submit.returncode == 0, log[-4000:]
    assert "succeeded" in log
    return log, json.loads((out / "metrics.json").read_text())


def test_train_bandit_runs_as_a_submitted_job(head, data_home, tmp_path, bandit_root):
    log, metrics = submit_train_bandit(head, data_home, tmp_path, bandit_root, "--dataset", "openml:mushroom_onehot",
                                       "--behaviour", "uniform", "--no-online-only")
    # what the job printed, streamed back by `ray job submit`
    assert "prepared openml:mushroom_onehot: 8124 rows, 117 features, 2 actions" in log
    assert "[offline-to-online] step    60/60" in log and "60/60 batches with the exact split" in log
    final = metrics["final"]
    assert final["behaviour_heldout_accuracy"] == pytest.approx(0.5)
    assert final["o2o_heldout_accuracy"] > 0.85 and final["offline_only_heldout_accuracy"] > 0.85, final
    # annealed from the initial fraction (RLPD's 0.5) towards the final one (0.25)
    assert metrics["o2o"]["offline_fraction"][0] == 0.5 and metrics["o2o"]["offline_fraction"][-1] < 0.5
    assert metrics["o2o"]["online_rows"] > 0


def test_train_bandit_trains_an_rllib_learner_group(head, data_home, tmp_path, bandit_root):
    log, metrics = submit_train_bandit(head, data_home, tmp_path, bandit_root, "--dataset", "openml:mushroom_onehot",
                                       "--input", "rllib", "--behaviour", "uniform", "--no-online-only")
    assert metrics["config"]["input"] == "rllib"
    assert "[offline-to-online] step    60/60" in log and "60/60 batches with the exact split" in log
    for run in ("offline_only", "o2o"):
        assert metrics[run]["exact_split_batches"] == metrics[run]["batches"] == 60, metrics[run]
    final = metrics["final"]
    assert final["behaviour_heldout_accuracy"] == pytest.approx(0.5)
    assert final["o2o_heldout_accuracy"] > 0.85 and final["offline_only_heldout_accuracy"] > 0.85, final
    assert metrics["o2o"]["offline_fraction"][-1] < 0.5 and metrics["o2o"]["online_rows"] > 0
