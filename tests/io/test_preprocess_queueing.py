"""Preprocess queues a task per worker ahead, and never lets more than num_workers run at once."""
from __future__ import annotations

import pytest


def ray_slots(cluster_cpus, task_cpus):
    """How many tasks Ray runs at once: it counts resources in fixed point, 1/10000 of a unit."""
    return int(round(cluster_cpus * 10000)) // int(round(task_cpus * 10000))


@pytest.mark.parametrize("num_workers,cluster_cpus,task_cpus", [
    (1, 2.0, 1), (2, 2.0, 1), (3, 2.0, 1), (2, 3.0, 1), (4, 16.0, 4), (19, 2.0, 0.1), (4, 1.0, 0.2),
    (2, 0.6, 0.2), (29, 3.0, 0.1), (5, 2.0, 0.5), (7, 7.0, 1.0), (1, 0.0, 1),
])
def test_tasks_queued_ahead_never_let_more_than_num_workers_run(num_workers, cluster_cpus, task_cpus):
    from rayrb.io.preprocess import in_flight_limit

    limit = in_flight_limit(num_workers, cluster_cpus, task_cpus)
    assert num_workers <= limit <= 2 * num_workers
    running_at_once = min(limit, ray_slots(cluster_cpus, task_cpus))
    assert running_at_once <= num_workers, (limit, ray_slots(cluster_cpus, task_cpus))
