"""One local Ray per test session; paths to the offline OpenML cache."""
from __future__ import annotations

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


@pytest.fixture(scope="session")
def ray_session():
    """The session's single local Ray instance (multi-node tests start their own in a subprocess)."""
    import ray

    # Workers unpickle test-defined actors by module name: let them import from tests/.
    tests_dir = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p)
    if not ray.is_initialized():
        ray.init(
            num_cpus=2,
            object_store_memory=512 << 20,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    yield ray
    ray.shutdown()
