"""What the multi-node scripts share: a local ray.cluster_utils.Cluster around the driver, and the marked result.

The scripts run in their own process (a Cluster cannot share the test session's Ray) and print one
``RAYRB_RESULT <json>`` line, which ``conftest.run_marked`` reads.
"""
import contextlib
import json
import logging
import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402


@contextlib.contextmanager
def local_cluster(workers: int, system_config: dict | None = None, head_cpus: int = 1,
                  worker_resources: dict | None = None):
    """A head and ``workers`` worker nodes of one CPU each, with this process connected; yields the workers."""
    head_args = {"num_cpus": head_cpus, "include_dashboard": False}
    if system_config:
        head_args["_system_config"] = system_config
    cluster = Cluster(initialize_head=True, head_node_args=head_args)
    nodes = [cluster.add_node(num_cpus=1, resources=worker_resources or {}) for _ in range(workers)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
    try:
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def report(result: dict) -> None:
    print("RAYRB_RESULT " + json.dumps(result), flush=True)  # marked: Ray may print more on shutdown
