"""Drawing ahead under failures and other handles: what a hostile pass found, kept as regressions."""
from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

pytestmark = pytest.mark.usefixtures("ray_session")

KW = dict(online_capacity=400, num_offline_shards=2, num_online_shards=2, seed=5, batch_size=16)


def rows(start, n):
    ids = torch.arange(start, start + n, dtype=torch.int64)
    return TensorDict({"obs": ids.float()[:, None].expand(n, 3).contiguous(), "id": ids}, [n])


def test_a_give_back_keeps_other_handles_inserts_in_the_rate_limiter(make_buffer):
    # an undo that put back the limiter's whole state erased the collector's 50 inserts
    counts = []
    for prefetch in (8, 0):
        rb = make_buffer(rows(0, 300), prefetch=prefetch, **KW)
        rb.sample()
        rb.client().extend(rows(1000, 50))
        counts.append(rb.stats()["coordinator"]["rate_limiter"]["inserts"])
    assert counts == [50, 50]


def test_a_checkpoint_leaves_out_what_another_handle_drew_ahead_and_did_not_serve(make_buffer, tmp_path):
    # the owner's dumps saved the planner after the learner's 11 held draws: a restore skipped their rows
    kw = dict(online_capacity=10, num_offline_shards=2, num_online_shards=1, seed=5, batch_size=10,
              sampler="without_replacement", offline_fraction=1.0, prefetch=0)
    rb = make_buffer(rows(0, 120), **kw)
    learner = rb.client(prefetch=32)
    served = learner.sample()["id"].tolist()
    served += learner.sample()["id"].tolist()  # reports the first as served
    rb.dumps(tmp_path / "ck")
    restored = make_buffer(rows(0, 120), **kw)
    restored.loads(tmp_path / "ck")
    while len(served) < 120:
        served += restored.sample()["id"].tolist()
    assert sorted(served) == list(range(120))
    assert restored.state_dict()["step"] == 12


def test_a_refused_sample_is_asked_again_once_the_buffer_can_serve_it(make_buffer):
    # the failed request stayed queued and re-raised its old error on every later call
    rb = make_buffer(rows(0, 300), prefetch=0, sampler="without_replacement", offline_fraction=0.5,
                     epoch_end="raise", **KW)  # "short" (the default) would serve the 5 in a batch of 10
    learner = rb.client(prefetch=32)
    rb.extend(rows(1000, 5))
    with pytest.raises(ValueError, match="holds 5 rows"):
        learner.sample()
    rb.extend(rows(2000, 100))
    assert len(learner.sample()) == 16


def test_a_timeout_while_fetching_rows_loses_no_batch(make_buffer):
    # the group was dropped before its rows came: one batch of the epoch was never served
    rb = make_buffer(rows(0, 300), prefetch=8, sampler="without_replacement", offline_fraction=1.0,
                     local_reads=False, **dict(KW, batch_size=20))
    real, hit = rb.rpc.fetch_read, []

    def slow_once(*args, **kwargs):
        if not hit:
            hit.append(1)
            raise TimeoutError("no answer within timeout")
        return real(*args, **kwargs)

    rb.rpc.fetch_read = slow_once
    served = []
    while len(served) < 300:
        try:
            served += rb.sample()["id"].tolist()
        except TimeoutError:
            pass
    assert hit and sorted(served) == list(range(300))


@pytest.mark.parametrize("epoch_end,batches", [("drop", 4), ("raise", 4), ("short", 5)])
def test_iterating_ends_with_the_epoch_for_every_epoch_end(make_buffer, epoch_end, batches):
    # with "drop" the epoch never ran out exactly, so iteration never ended (TorchRL stops after 4)
    rb = make_buffer(rows(0, 300), sampler="without_replacement", offline_fraction=1.0, epoch_end=epoch_end,
                     **dict(KW, batch_size=64))
    sizes = [len(b) for b in rb]
    assert len(sizes) == batches and sizes[:4] == [64] * 4
