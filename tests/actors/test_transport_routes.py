"""Which way rows travel from each shard to each learner, and the groups that are refused before they exist.

The routing is pure (rayrb.actors.transport.plan_routes over Places), so every GPU layout is
tested here with made-up places; the last tests run the CPU side through Ray.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rayrb.actors.transport import Place, choose, plan_routes, receive, refuse_shared_gpus
from rayrb.core.plans import BatchPlan, Part

GPU_SHARD = Place("rb/off-0", "node-a", ("0",))
GPU_SHARD_B = Place("rb/on-0", "node-b", ("0",))
CPU_SHARD = Place("rb/on-1", "node-a")
LEARNER_A0 = Place("learner 0", "node-a", ("0",))
LEARNER_A1 = Place("learner 1", "node-a", ("1",))
LEARNER_CPU = Place("learner 2", "node-a")


def test_auto_picks_cuda_ipc_on_a_shared_gpu_nccl_between_gpus_and_the_object_store_without_one():
    routes, shards, learners = plan_routes("auto", [GPU_SHARD, GPU_SHARD_B, CPU_SHARD],
                                           [LEARNER_A1, LEARNER_A0, LEARNER_CPU])
    assert routes[(0, 1)] == "cuda_ipc"  # same node, same GPU
    assert routes[(0, 0)] == "nccl" and routes[(1, 0)] == "nccl"  # another GPU, another node
    # learner 0's GPU would share the group with shard 0's: that pair goes through the object store
    assert routes[(1, 1)] == "object_store"
    assert routes[(2, 0)] == "object_store" and routes[(0, 2)] == "object_store"  # an end without a GPU
    assert shards == [0, 1] and learners == [0]  # the NCCL group: only what needs it


def test_auto_falls_back_to_the_object_store_where_an_nccl_group_would_share_a_gpu():
    # each shard shares a GPU with the learner on its node (CUDA IPC); the cross pairs need NCCL, but
    # a group of shard 0 and learner 1 cannot also take shard 1, which shares learner 1's GPU
    routes, shards, learners = plan_routes("auto", [GPU_SHARD, GPU_SHARD_B],
                                           [LEARNER_A0, Place("learner 1", "node-b", ("0",))])
    assert routes[(0, 0)] == "cuda_ipc" and routes[(1, 1)] == "cuda_ipc"
    assert routes[(0, 1)] == "nccl" and routes[(1, 0)] == "object_store"
    assert shards == [0] and learners == [1]


def test_nccl_refuses_two_members_on_one_gpu_naming_them_and_the_device():
    with pytest.raises(ValueError, match=r"rb/off-0 and learner 0: both run on GPU 0 of node node-a"):
        plan_routes("nccl", [GPU_SHARD], [LEARNER_A0])
    refuse_shared_gpus([GPU_SHARD, LEARNER_A1, GPU_SHARD_B])  # distinct GPUs: accepted
    routes, shards, learners = plan_routes("nccl", [GPU_SHARD], [LEARNER_A1])
    assert set(routes.values()) == {"nccl"} and shards == [0] and learners == [0]


def test_cuda_ipc_refuses_a_pair_that_does_not_share_a_gpu():
    with pytest.raises(ValueError, match=r"rb/on-1 .*GPUs \[\].* and learner 0"):
        plan_routes("cuda_ipc", [GPU_SHARD, CPU_SHARD], [LEARNER_A0])
    with pytest.raises(ValueError, match="learner 1"):
        plan_routes("cuda_ipc", [GPU_SHARD], [LEARNER_A1])
    routes, shards, _ = plan_routes("cuda_ipc", [GPU_SHARD], [LEARNER_A0])
    assert routes == {(0, 0): "cuda_ipc"} and shards == []  # one-sided: no group


def test_cuda_ipc_needs_the_gpu_that_holds_the_senders_rows():
    # a shard given GPUs 0 and 1 keeps its rows on its first, GPU 0: a learner on GPU 1 cannot open them
    two = Place("rb/off-0", "node-a", ("0", "1"))
    assert choose(two, LEARNER_A1) == "nccl" and choose(two, LEARNER_A0) == "cuda_ipc"


def test_explicit_nccl_refuses_an_end_without_a_gpu():
    with pytest.raises(ValueError, match="Ray gave learner 2 .* none"):
        plan_routes("nccl", [GPU_SHARD], [LEARNER_CPU])


def test_gloo_and_the_object_store_route_every_pair_alike():
    routes, shards, learners = plan_routes("gloo", [CPU_SHARD, CPU_SHARD], [LEARNER_CPU])
    assert set(routes.values()) == {"gloo"} and shards == [0, 1] and learners == [0]
    routes, shards, _ = plan_routes("object_store", [GPU_SHARD], [LEARNER_A0])
    assert routes == {(0, 0): "object_store"} and shards == []
    assert choose(CPU_SHARD, LEARNER_CPU) == "object_store"


def test_receive_joins_object_store_parts_and_tensor_parts():
    plan = BatchPlan([Part("offline", 0, 2), Part("online", 0, 1)], 2, 1, fraction=0.5)
    host = ({"x": np.array([[1.0], [2.0]], np.float32)},
            {"index": np.array([4, 5]), "generation": np.array([1, 1])})
    flat = {"rows/x": torch.tensor([[3.0]]), "info/index": torch.tensor([7]), "info/generation": torch.tensor([2])}
    td, info = receive(plan, host, flat)
    assert td["x"].flatten().tolist() == [1.0, 2.0, 3.0]
    assert info["offline"].tolist() == [True, True, False] and info["index"].tolist() == [4, 5, 7]


@pytest.mark.usefixtures("ray_session")
def test_storage_device_cuda_is_refused_on_a_cluster_without_gpus(make_buffer):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    td = TensorDict({"x": torch.zeros(10, 2)}, [10])
    with pytest.raises(ValueError, match="storage_device='cuda' needs GPUs in the Ray cluster, found 0"):
        make_buffer(td, online_capacity=10, storage_device="cuda")
    with pytest.raises(ValueError, match="storage_device must be one of"):
        make_buffer(td, online_capacity=10, storage_device="tpu")


@pytest.mark.usefixtures("ray_session")
def test_cpu_learners_are_fed_through_the_object_store_under_auto_and_refused_under_cuda_ipc(make_buffer):
    import ray

    @ray.remote(num_cpus=0)
    class Learner:
        def update(self, plan, *parts):
            td, info = receive(plan, *parts)
            return td["x"].sum().item(), int(info["offline"].sum())

    td = TensorDict({"x": torch.arange(40.0)[:, None]}, [40])
    auto = make_buffer(td, online_capacity=20, transport="auto", seed=1, batch_size=8)
    plain = make_buffer(td, online_capacity=20, seed=1, batch_size=8)
    learners = [Learner.remote(), Learner.remote()]
    assert auto.connect_learners(learners) == {"object_store": 4}  # no GPUs anywhere: nothing else fits
    plain.connect_learners(learners)
    assert auto.feed("update") == plain.feed("update")  # the same stream, the same slices
    ipc = make_buffer(td, online_capacity=20, transport="cuda_ipc", seed=1, batch_size=8)
    with pytest.raises(ValueError, match="transport='cuda_ipc' carries rows only between actors"):
        ipc.connect_learners(learners)
