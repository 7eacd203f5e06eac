"""The GPU data plane on a machine with CUDA: shards holding rows in GPU memory, rows handed over on the GPU.

Run with ``python -m pytest -m gpu``; where CUDA is missing every test here is skipped.
The CPU side of the same code runs in ``test_device_storage.py`` and ``test_transport_routes.py``.
"""
from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("ray_session"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N, DIM = 20_000, 54


def table(n=N, start=0):
    g = torch.Generator().manual_seed(start)
    return TensorDict({"X": torch.randn(n, DIM, generator=g), "y": torch.arange(start, start + n)}, [n])


@pytest.fixture
def pair(make_buffer):
    """The same data and seed with rows in host memory maps and in GPU memory."""

    def make(transport="object_store", **kwargs):
        kwargs = {"online_capacity": 5000, "num_offline_shards": 2, "num_online_shards": 2, "seed": 3,
                  "batch_size": 1024, "offline_fraction": 0.5, **kwargs}
        cpu = make_buffer(table(), **kwargs)
        gpu = make_buffer(table(), storage_device="cuda", transport=transport, **kwargs)
        for rb in (cpu, gpu):
            rb.extend(table(3000, start=N))
        return cpu, gpu

    return make


@pytest.mark.parametrize("sampler", ["uniform", "without_replacement", "prioritized"])
def test_gpu_shards_give_the_cpu_shards_rows_for_the_same_seed(pair, sampler):
    cpu, gpu = pair(sampler=sampler)
    for _ in range(5):
        (a, ia), (b, ib) = cpu.sample(return_info=True), gpu.sample(return_info=True)
        assert torch.equal(a["y"], b["y"]) and torch.equal(a["X"], b["X"])
        assert int(ib["offline"].sum()) == 512  # the exact split
        if sampler == "prioritized":
            assert torch.equal(ia["weight"], ib["weight"])
            prio = (a["y"] % 5).float() + 0.1
            cpu.update_priority(ia, prio)
            gpu.update_priority(ib, prio)


def test_gpu_shards_hold_their_rows_bytes_and_no_more(pair):
    _, gpu = pair()
    shards = gpu.stats()["shards"]
    row_bytes = DIM * 4 + 8
    offline = sum(s["device_bytes"] for s in shards if s["kind"] == "offline")
    online = sum(s["device_bytes"] for s in shards if s["kind"] == "online")
    assert offline == N * row_bytes and online == 5000 * row_bytes


@pytest.fixture
def learners():
    """GPU learner actors (a tenth of the GPU each), killed after the test so their GPU share comes back."""
    import ray

    made = []

    def make(n):
        made.extend(_learner_class().remote() for _ in range(n))
        return made[-n:]

    yield make
    for actor in made:
        ray.kill(actor)


def _learner_class():
    import ray

    @ray.remote(num_gpus=0.1, num_cpus=0, enable_tensor_transport=True)
    class Learner:
        def update(self, plan, *parts):
            from rayrb.actors.transport import receive

            td, info = receive(plan, *parts)
            return str(td["X"].device), td["y"].cpu().tolist(), int(info["offline"].sum())

        def iterate(self, rb, batch_size, n):
            out = []
            for batch in rb.iter_batches(batch_size, prefetch=4, device="cuda", num_batches=n):
                out.append((str(batch["X"].device), batch["y"].cpu().tolist()))
            return out

    return Learner


def test_cuda_ipc_feeds_two_learners_that_share_the_gpu(pair, learners):
    cpu, gpu = pair(transport="cuda_ipc")
    assert gpu.connect_learners(learners(2)) == {"cuda_ipc": 8}
    assert cpu.connect_learners(learners(2)) == {"object_store": 8}
    for _ in range(3):
        got, want = gpu.feed("update"), cpu.feed("update")
        assert all(d.startswith("cuda") for d, _, _ in got)
        assert [y for _, y, _ in got] == [y for _, y, _ in want]
        assert sum(n for _, _, n in got) == 512


def test_an_nccl_group_of_actors_sharing_the_gpu_is_refused_before_it_exists(pair, make_buffer, learners):
    if torch.cuda.device_count() < 4:  # a GPU per shard: 4 shards need 4 GPUs
        with pytest.raises(ValueError, match="4 shards need 4 GPUs"):
            pair(transport="nccl")
    # shards told to share a GPU: the group over them and a learner on it is refused before it exists
    gpu = make_buffer(table(), online_capacity=5000, storage_device="cuda", transport="nccl", seed=3,
                      actor_options={"num_gpus": 0.01})
    with pytest.raises(ValueError, match="NCCL group cannot hold .* both run on GPU"):
        gpu.connect_learners(learners(1))


def test_iter_batches_in_a_gpu_actor_reads_the_gpu_shards_over_cuda_ipc(pair, learners):
    import ray

    cpu, gpu = pair()
    (learner,) = learners(1)
    got = ray.get(learner.iterate.remote(gpu.client(), 1024, 6))
    want = [b["y"].tolist() for b in cpu.iter_batches(1024, prefetch=4, num_batches=6)]
    assert all(d.startswith("cuda") for d, _ in got)
    assert [y for _, y in got] == want
