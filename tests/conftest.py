"""One local Ray per test session; paths to the offline OpenML cache."""
from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = (REPO.parent / "shared" / "data").resolve()


@pytest.fixture(scope="session")
def data_home() -> Path:
    """The read-only scikit-learn OpenML cache beside the checkout (``../shared/data``)."""
    if not (SHARED_DATA / "openml" / "openml.org").is_dir():
        pytest.skip(f"offline OpenML cache not found at {SHARED_DATA}")
    return SHARED_DATA


# A session starts some 900 actors on each Ray instance, and every one leaves a log and an event file behind. Ray's
# log monitor globs the log directory ten times a second and its dashboard agent re-reads every event file every two
# seconds, forever: measured here, after 900 actors the two took 0.09 CPU-s per second (against 0.014 fresh), CPU
# the tests' actors wait for on 2 cores. Nothing in a test reads those logs (log_to_driver=False) or events; the
# jobs and console tests, which do, start Ray in subprocesses of their own without these settings.
QUIET_SCANS = {
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",  # glob the logs every LOG_NAME_UPDATE_INTERVAL_S, not every 0.1 s
    "LOG_NAME_UPDATE_INTERVAL_S": "5",
    "SCAN_EVENT_DIR_INTERVAL_SECONDS": "3600",  # the agent's scan of the event files: once, at start
}


@pytest.fixture(scope="session")
def ray_session():
    """The session's single local Ray instance (multi-node tests start their own in a subprocess)."""
    import ray

    # Workers unpickle test-defined actors by module name: let them import from tests/ and its folders.
    tests_dir = Path(__file__).resolve().parent
    dirs = [str(tests_dir)] + sorted(str(d) for d in tests_dir.iterdir() if d.is_dir() and d.name[0] not in "._")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (*dirs, os.environ.get("PYTHONPATH")) if p)
    if not ray.is_initialized():
        with pytest.MonkeyPatch.context() as mp:  # read by Ray's processes as they start, not by later subprocesses
            for name, value in QUIET_SCANS.items():
                mp.setenv(name, value)
            ray.init(
                address="local",  # never a `ray start` instance another test (or process) left running here
                num_cpus=2,
                object_store_memory=512 << 20,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
    yield ray
    ray.shutdown()


@pytest.fixture
def make_buffer(tmp_path):
    """Builds buffers whose files stay under this test's tmp_path; shuts every one down afterwards."""
    from rayrb import OfflineToOnlineReplayBuffer

    made, tried = [], itertools.count()

    def make(*args, **kwargs):
        # a directory per call, not per buffer made: a construction that fails may have written its dataset
        kwargs.setdefault("dataset_root", tmp_path / f"ds{next(tried)}")
        kwargs.setdefault("storage_dir", tmp_path / "state")
        rb = OfflineToOnlineReplayBuffer(*args, **kwargs)
        made.append(rb)
        return rb

    yield make
    for rb in made:
        rb.shutdown()


@pytest.fixture(scope="module")
def rayrb_home(tmp_path_factory):
    """Datasets rayrb prepares itself (OpenML ids, prefill's copies) go under a temporary RAYRB_HOME, one per module."""
    home = tmp_path_factory.mktemp("rayrb-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAYRB_HOME", str(home))
        yield home


@pytest.fixture
def local_metrics(monkeypatch):
    """Coordinator metrics kept local, so that a Coordinator built in the test imports no Ray (tests/core asks
    for it in ``pytestmark``)."""
    import rayrb.actors.coordinator
    from rayrb.actors.metrics import ActorMetrics

    monkeypatch.setattr(rayrb.actors.coordinator, "ActorMetrics", lambda *a, **kw: ActorMetrics(*a, **kw, export=False))


RAY_FIXTURES = {"ray_session", "make_buffer"}


# The longest test files (tens of seconds to over a minute each, most of it Ray starting in processes of their
# own), longest first: run before the rest, so that `make test`'s two workers (a file at a time each) end together
# instead of one running the benchmark's smoke run alone at the end.
LONGEST_FIRST = ("test_node_loss.py", "test_jobs.py", "test_benchmark.py", "test_coordinator_restart.py",
                 "test_faults.py", "test_learners.py", "test_restarts.py", "test_direct_writes.py",
                 "test_rllib_offline.py", "test_torchrl_compat.py", "test_stream_adversarial.py", "test_soak.py",
                 "test_preprocess.py", "test_slices.py", "test_finetune.py", "test_console.py")


def pytest_collection_modifyitems(config, items):
    """Mark every test that starts or uses Ray ``ray``, so that ``-m "not ray"`` (``make test-fast``) runs
    the rest in seconds; skip ``bench`` tests unless ``-m`` names them; put the longest files first (a stable sort:
    each file's tests keep their order)."""
    asked_for_bench = "bench" in (config.option.markexpr or "")
    for item in items:
        if RAY_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("cluster"):
            item.add_marker(pytest.mark.ray)
        if item.get_closest_marker("bench") and not asked_for_bench:
            item.add_marker(pytest.mark.skip(reason="benchmark smoke sections outside the default run: make test-bench"))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def run_marked(script: str, *args: str, timeout: float = 300) -> dict:
    """Run ``tests/<script>`` in a fresh process (its own Ray); return the JSON of its ``RAYRB_RESULT`` line."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, str(REPO / "tests" / script), *args], capture_output=True, text=True,
                         timeout=timeout, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    # Ray may print more (e.g. on shutdown): take the marked line
    line = next(line for line in reversed(out.stdout.splitlines()) if line.startswith("RAYRB_RESULT "))
    return json.loads(line[len("RAYRB_RESULT "):])


@pytest.fixture(scope="module")
def reference(request, tmp_path_factory, ray_session):
    """``reference(n, **kw)``: the first ``n`` batches' ids of a twin that only calls ``sample()``, built from the
    test module's ``KW`` and ``rows(200)``. One twin per setting for the module (a buffer start each), drawn further
    as tests ask for more: the stream is the same."""
    from rayrb import OfflineToOnlineReplayBuffer

    base, rows = request.module.KW, request.module.rows
    twins, streams = {}, {}

    def stream(n, **kw):
        key = tuple(sorted(kw.items()))
        if key not in twins:
            root = tmp_path_factory.mktemp("reference")
            twins[key] = OfflineToOnlineReplayBuffer(rows(200), **{**base, **kw}, dataset_root=root / "ds",
                                                     storage_dir=root / "state")
            streams[key] = []
        while len(streams[key]) < n:
            streams[key].append(twins[key].sample()["id"])
        return streams[key][:n]

    yield stream
    for rb in twins.values():
        rb.shutdown()
