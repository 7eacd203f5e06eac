"""A node lost without grace (ray.cluster_utils.Cluster, in a subprocess): with two copies of each online shard
nothing acknowledged is lost or doubled through the loss of a shard's node, of the coordinator's node and of the
node the shard moved to; with one copy the rows of the shards on the lost node are lost, as docs/durability.md
says, and nothing else; slices of episodes with two copies stay whole through a loss. The four run one after the
other in one cluster (``tests/cluster_node_loss.py``)."""
from __future__ import annotations

import pytest
from conftest import run_marked

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> dict:
    """Each scenario's result by name ("2", "1", "stream", "slices"), from one run of the script."""
    return run_marked("cluster_node_loss.py", str(tmp_path_factory.mktemp("node-loss")), timeout=900)


def result_of(scenarios: dict, name: str) -> dict:
    result = scenarios[name]
    assert "error" not in result, result["error"]
    return result


def test_two_copies_lose_nothing_acknowledged_through_three_node_losses(scenarios):
    result = result_of(scenarios, "2")
    print("\nnode loss, 2 copies:", result)
    assert [loss["what"] for loss in result["losses"]] == ["shard", "coordinator", "shard again"]
    assert result["acked"] > 0 and result["lost"] == 0, result
    assert result["lost_written_after_first_loss"] == 0, result
    assert result["doubled"] == 0 and result["unacked_held"] == 0, result
    assert result["batches"] > 0 and result["inexact"] == 0, result  # every batch split exactly
    assert result["mixed"] == 0, result  # every row sampled whole: its write's parts joined in order, in each copy
    for loss in result["losses"]:
        assert loss["dirs"] > 0  # the loss took files with it
        assert loss["recovery_s"] < 60 and loss["rebuilt_s"] < 120


def test_one_copy_loses_the_rows_of_the_shard_on_the_lost_node_and_goes_on(scenarios):
    result = result_of(scenarios, "1")
    print("\nnode loss, 1 copy:", result)
    assert not result["coordinator_lost"], result  # the shard's node only: the coordinator takes its count again
    # what that shard held, less the writes in flight at the loss (sent again, they landed), and nothing else
    assert 0 < result["on_lost_shard_before"] - result["in_flight_max"] <= result["lost"], result
    assert result["lost"] <= result["on_lost_shard_before"] and result["lost_elsewhere"] == 0, result
    assert result["lost_written_after_first_loss"] == 0, result
    assert result["doubled"] == 0 and result["inexact"] == 0, result  # the other shard's rows keep every split
    assert result["losses"][0]["recovery_s"] < 60


def test_the_seeded_stream_goes_on_through_the_loss_of_the_coordinators_node(scenarios):
    result = result_of(scenarios, "stream")
    print("\nnode loss, stream:", result)
    assert result["moved"] and result["same_before"], result
    assert result["same_after"], result  # the same batches as the twin that lost nothing
    if result["replica_node"]:  # a handle beside a replica (and not its shard) reads the replica's files itself
        assert result["replica_dirs_read"] >= 1 and result["same_beside_replica"], result
    assert result["recovery_s"] < 60


def test_slices_with_two_copies_stay_whole_and_lose_nothing_through_a_shards_node_loss(scenarios):
    result = result_of(scenarios, "slices")
    print("\nnode loss, slices with 2 copies:", result)
    assert result["dirs"] > 0 and result["acked"] > 0 and result["lost"] == 0, result
    assert result["doubled"] == 0 and result["unacked_held"] == 0, result
    # every batch sampled through the loss was whole slices of one episode, split exactly; and after it
    assert result["batches"] > result["batches_before"] > 0 and result["torn"] == 0, result
    assert result["inexact"] == 0 and result["whole_after"], result
