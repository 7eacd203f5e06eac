"""Batches to learners: async refs, bounded prefetch, per-learner slices, device placement."""
from __future__ import annotations

import pytest
import torch
from restart_util import kill_for_good
from tensordict import TensorDict

from rayrb import OfflineToOnlineReplayBuffer
from rayrb.core.allocation import offline_count

pytestmark = pytest.mark.usefixtures("ray_session")


def rows(n, start=0, online=False):
    ids = torch.arange(start, start + n, dtype=torch.int64) + (1_000_000 if online else 0)
    return TensorDict({"obs": ids.float()[:, None].expand(n, 2).contiguous(), "id": ids}, [n])


def build(dataset_root, seed=0, **kw):
    kw = {"online_capacity": 500, "num_offline_shards": 2, "num_online_shards": 2, "seed": seed,
          "dataset_root": dataset_root, **kw}
    rb = OfflineToOnlineReplayBuffer(rows(400), **kw)
    rb.extend(rows(300, online=True))
    return rb


@pytest.fixture
def buffers(tmp_path):
    made = []

    def make(seed=0, **kw):
        made.append(build(tmp_path / f"ds{len(made)}", seed, **kw))
        return made[-1]

    yield make
    for rb in made:
        rb.shutdown()


@pytest.fixture(scope="module")
def shared_buffer(tmp_path_factory, ray_session):
    """One buffer (five actors to start) for the tests that neither write nor depend on what was drawn before."""
    rb = build(tmp_path_factory.mktemp("shared") / "ds")
    yield rb
    rb.shutdown()


def test_sample_async_and_iterator_match_sample(buffers, ray_session):
    ray = ray_session
    a, b, c = buffers(seed=3), buffers(seed=3), buffers(seed=3)
    want = [a.sample(64, return_info=True) for _ in range(6)]
    refs = [b.sample_async(64, return_info=True) for _ in range(6)]
    assert all(isinstance(r, ray.ObjectRef) for r in refs)
    got_async = [b.to_tensordict(ray.get(r), return_info=True) for r in refs]
    got_iter = list(c.iter_batches(64, prefetch=3, return_info=True, num_batches=6))
    for (wt, wi), (at, ai), (it, ii) in zip(want, got_async, got_iter):
        assert torch.equal(wt["id"], at["id"]) and torch.equal(wt["id"], it["id"])
        assert torch.equal(wi["offline"], ai["offline"]) and torch.equal(wi["generation"], ii["generation"])


def test_prefetch_depth_is_respected(shared_buffer):
    rb = shared_buffer.client(local_reads=False)  # the shards read: prefetch bounds the rows on their way
    it = rb.iter_batches(32, prefetch=4)
    assert it.in_flight == 0  # nothing is requested before the first batch is asked for
    seen = set()
    for _ in range(12):
        next(it)
        assert 2 <= it.in_flight <= 4  # the next group goes out as soon as it fits
        seen.add(it.in_flight)
    assert it.max_in_flight == 4 and 4 in seen
    it1 = rb.iter_batches(32, prefetch=1, num_batches=4)
    assert len(list(it1)) == 4 and it1.max_in_flight == 1 and it1.in_flight == 0
    with pytest.raises(ValueError, match="prefetch must be a positive integer, got 0"):
        rb.iter_batches(32, prefetch=0)


def test_iterator_moves_batches_to_the_device(shared_buffer):
    rb = shared_buffer
    batch = next(iter(rb.iter_batches(8, device="cpu")))
    assert batch.device == torch.device("cpu") and batch["obs"].device.type == "cpu"


@pytest.fixture(scope="module")
def two_learners(ray_session):
    """Two learner actors for the module's direct-feed cases (a process start each): each case attaches its buffer."""
    ray = ray_session

    @ray.remote(num_cpus=0)
    class Learner:
        def attach(self, rb):
            self.rb = rb

        def update(self, flat):  # the ref was resolved by Ray: the rows came straight to this actor
            td, info = self.rb.to_tensordict(flat, return_info=True)
            return td["id"].tolist(), info["offline"].tolist()

    learners = [Learner.remote() for _ in range(2)]
    yield learners
    for l in learners:
        ray.kill(l)


@pytest.mark.parametrize("f", [0.5, 0.3])
def test_direct_feed_to_two_learners(buffers, two_learners, ray_session, f):
    ray = ray_session
    rb = buffers(sampler="without_replacement", drop_last=True, offline_fraction=f)
    learners = two_learners
    ray.get([l.attach.remote(rb) for l in learners])
    B = 101
    for _ in range(3):
        refs = rb.sample_slices(2, B, return_info=True, learners=learners)
        assert len(refs) == 2
        out = ray.get([l.update.remote(r) for l, r in zip(learners, refs)])
        ids = [set(o[0]) for o in out]
        assert len(out[0][0]) + len(out[1][0]) == B and abs(len(out[0][0]) - len(out[1][0])) <= 1
        assert not ids[0] & ids[1]  # disjoint slices
        n_off = [sum(o[1]) for o in out]
        assert sum(n_off) == offline_count(B, f)  # exact for the global batch
        assert abs(n_off[0] - n_off[1]) <= 1  # as even as integers allow
        for o in out:  # provenance agrees with the rows
            assert all((i < 1_000_000) == off for i, off in zip(o[0], o[1]))


def test_slice_arguments_are_checked(shared_buffer):
    rb = shared_buffer
    with pytest.raises(ValueError, match="num_slices must be a positive integer"):
        rb.sample_slices(0, 10)
    with pytest.raises(ValueError, match="num_slices must be in \\[1, batch_size=4\\]"):
        rb.sample_slices(5, 4)
    with pytest.raises(ValueError, match="expected 2 learners"):
        rb.sample_slices(2, 10, learners=[object()])


def make_rdt_learner(ray):
    @ray.remote(num_cpus=0, enable_tensor_transport=True)
    class RDTLearner:
        def update(self, meta, *parts):
            from rayrb.actors.transport import receive

            td, info = receive(meta, *parts)
            return td["id"].tolist(), info["offline"].tolist(), [type(p).__name__ for p in parts]

    return RDTLearner


def test_feed_over_object_store_and_gloo_rdt_give_the_same_rows(tmp_path, ray_session):
    ray = ray_session
    Learner = make_rdt_learner(ray)
    results = {}
    learners = [Learner.remote() for _ in range(2)]  # stateless: the same two for both buffers (no group before gloo's)
    try:
        for transport in ("object_store", "gloo"):
            rb = OfflineToOnlineReplayBuffer(rows(300), online_capacity=100, num_offline_shards=2, seed=11,
                                             offline_fraction=0.6, transport=transport, batch_size=50,
                                             dataset_root=tmp_path / transport)
            try:
                rb.extend(rows(40, online=True))
                rb.connect_learners(learners)
                results[transport] = [rb.feed("update") for _ in range(3)]
            finally:
                rb.shutdown()
    finally:
        for l in learners:
            ray.kill(l)
    for a, b in zip(results["object_store"], results["gloo"]):
        assert [x[:2] for x in a] == [x[:2] for x in b]  # same rows, same provenance
        assert sum(sum(x[1]) for x in a) == offline_count(50, 0.6)
        assert all(t == "tuple" for x in a for t in x[2])  # numpy (rows, info) pairs
        assert all(t == "dict" for x in b for t in x[2])  # tensors through the gloo group


def test_rdt_learner_without_tensor_transport_is_refused_not_hung(tmp_path, ray_session):
    ray = ray_session

    @ray.remote(num_cpus=0)
    class Plain:
        def update(self, meta, *parts):
            return 0

    rb = OfflineToOnlineReplayBuffer(rows(50), online_capacity=10, transport="gloo", seed=0,
                                     dataset_root=tmp_path / "ds")
    learner = Plain.remote()
    try:
        with pytest.raises(ValueError, match="enable_tensor_transport=True"):
            rb.connect_learners([learner])
    finally:
        rb.shutdown()
        ray.kill(learner)


def test_unknown_transport_and_nccl_without_gpu(tmp_path):
    with pytest.raises(ValueError, match="transport must be one of"):
        OfflineToOnlineReplayBuffer(rows(10), online_capacity=4, transport="tcp", dataset_root=tmp_path / "a")
    with pytest.raises(ValueError, match="transport='nccl' needs GPUs"):
        OfflineToOnlineReplayBuffer(rows(10), online_capacity=4, transport="nccl", dataset_root=tmp_path / "b")


def test_dead_learner_gives_an_error_within_the_timeout(tmp_path, ray_session):
    import time

    from rayrb import BufferUnavailableError

    ray = ray_session
    Learner = make_rdt_learner(ray)
    rb = OfflineToOnlineReplayBuffer(rows(50), online_capacity=10, seed=0, timeout=20, batch_size=8,
                                     dataset_root=tmp_path / "ds")
    learner = Learner.remote()
    try:
        rb.connect_learners([learner])
        assert len(rb.feed("update")[0][0]) == 8
        kill_for_good(learner)
        t0 = time.monotonic()
        with pytest.raises(BufferUnavailableError, match="dead"):
            rb.feed("update")
        assert time.monotonic() - t0 < 20
    finally:
        rb.shutdown()


def test_a_refused_reconnection_keeps_the_group_that_feeds_the_learners(tmp_path, ray_session):
    # the old group was destroyed before the new learners were checked: the refused call broke the feed
    ray = ray_session
    Learner = make_rdt_learner(ray)

    @ray.remote(num_cpus=0)
    class Plain:
        def update(self, meta, *parts):
            return 0

    rb = OfflineToOnlineReplayBuffer(rows(100), online_capacity=10, transport="gloo", seed=0, batch_size=10,
                                     dataset_root=tmp_path / "ds", timeout=30)
    learner, plain = Learner.remote(), Plain.remote()
    try:
        rb.connect_learners([learner])
        before = rb.feed("update")
        with pytest.raises(ValueError, match="enable_tensor_transport=True"):
            rb.connect_learners([plain])
        after = rb.feed("update")
        assert len(after[0][0]) == len(before[0][0]) == 10 and after[0][2] == ["dict"]
    finally:
        rb.shutdown()
        for a in (learner, plain):
            ray.kill(a)
