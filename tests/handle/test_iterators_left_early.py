"""Iterators left early, dropped, or closed after a shutdown give back what they drew."""
from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

# iterators left early ------------------------------------------------------------------------------------------
KW = {"online_capacity": 100, "num_offline_shards": 2, "num_online_shards": 1, "seed": 3, "batch_size": 10,
      "prefetch": 0}


def rows(n, start=0):
    ids = torch.arange(start, start + n, dtype=torch.int64)
    return TensorDict({"obs": ids.float()[:, None], "id": ids}, [n])


def assert_stream(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"batch {i}: {a.tolist()} != {b.tolist()}"


def index_in(want, batch):
    return next(i for i, w in enumerate(want) if torch.equal(w, batch))


@pytest.mark.usefixtures("ray_session")
def test_a_state_dict_after_an_iterator_ran_out_and_was_dropped_resumes_after_its_last_batch(make_buffer, reference):
    want = reference(12, sampler="without_replacement")
    rb = make_buffer(rows(200), **KW, sampler="without_replacement")
    got = [b["id"] for b in rb.iter_batches(prefetch=8, num_batches=5)]  # runs out, then is dropped
    state = rb.state_dict()
    twin = make_buffer(rows(200), **KW, sampler="without_replacement")
    twin.load_state_dict(state)
    assert_stream(got + [twin.sample()["id"] for _ in range(7)], want)


@pytest.mark.usefixtures("ray_session")
def test_a_state_dict_from_a_second_handle_here_while_iterating(make_buffer, reference):
    want = reference(12, sampler="without_replacement")
    rb = make_buffer(rows(200), **KW, sampler="without_replacement")
    other = rb.client()
    it = rb.iter_batches(prefetch=6)
    got = [next(it)["id"] for _ in range(3)]
    state = other.state_dict()
    got.append(next(it)["id"])  # the save does not disturb the iterator
    twin = make_buffer(rows(200), **KW, sampler="without_replacement")
    twin.load_state_dict(state)
    assert_stream(got[:3] + [twin.sample()["id"] for _ in range(9)], want)
    assert torch.equal(got[3], want[3])
    it.close()


@pytest.mark.usefixtures("ray_session")
def test_a_prefetch_deeper_than_the_coordinators_log_skips_no_row_of_the_epoch(make_buffer):
    kw = {**KW, "batch_size": 1, "sampler": "without_replacement"}
    rb = make_buffer(rows(700), **kw)
    it = rb.iter_batches(prefetch=300)
    from rayrb.core.ahead import MAX_AHEAD

    seen, deepest = [], 0
    while len(seen) < 100:  # plans grow call by call
        seen.append(next(it)["id"])
        deepest = max(deepest, it.ahead)
        assert it.ahead <= MAX_AHEAD  # no deeper than the coordinator can give back
    assert deepest >= 100
    it.close()
    seen += [rb.sample(200)["id"] for _ in range(3)]  # the 600 rows left in the epoch
    assert sorted(torch.cat(seen).tolist()) == list(range(700))


@pytest.mark.usefixtures("ray_session")
def test_the_later_of_two_iterators_on_one_handle_gives_back_its_draws(make_buffer, reference):
    want = reference(260, sampler="without_replacement")  # past both iterators' plans
    rb = make_buffer(rows(200), **KW, sampler="without_replacement")
    a = rb.iter_batches(prefetch=4)
    first = next(a)["id"]
    held_by_a = a.ahead
    b = rb.iter_batches(prefetch=4)
    from_b = [next(b)["id"] for _ in range(2)]
    b.close()
    after_b = rb.sample()["id"]
    assert torch.equal(after_b, want[index_in(want, from_b[-1]) + 1])
    a.close()  # another caller drew since: its draws stand; without replacement the next caller serves them
    a.close()
    assert torch.equal(first, want[0])
    adopted = [rb.sample()["id"] for _ in range(held_by_a)]
    assert_stream(adopted, want[1:1 + held_by_a])  # a's batches, in the order a drew them: no row lost
    nxt = rb.sample()["id"]
    assert torch.equal(nxt, want[index_in(want, after_b) + 1])  # then the stream goes on after the loop's draw
    coordinator = rb.stats()["coordinator"]
    assert coordinator["undo_refused"] == 1 and coordinator["batches_adopted"] == held_by_a


@pytest.mark.usefixtures("ray_session")
def test_an_exception_inside_with_still_gives_back(make_buffer, reference):
    want = reference(8)
    rb = make_buffer(rows(200), **KW)
    got = []
    with pytest.raises(KeyError):
        with rb.iter_batches(prefetch=8) as it:
            got += [next(it)["id"] for _ in range(2)]
            raise KeyError("learner failed")
    with pytest.raises(StopIteration):
        next(it)
    got += [rb.sample()["id"] for _ in range(6)]
    assert_stream(got, want)


@pytest.mark.usefixtures("ray_session")
def test_closing_after_shutdown_or_a_dead_coordinator_is_quiet(make_buffer, ray_session):
    rb = make_buffer(rows(200), **KW)
    it = rb.iter_batches(prefetch=4)
    next(it)
    rb.shutdown()
    it.close()
    it.close()
    with pytest.raises(StopIteration):
        next(it)

    rb2 = make_buffer(rows(200), **KW)
    it2 = rb2.iter_batches(prefetch=4)
    next(it2)
    ray_session.kill(rb2.rpc.coord, no_restart=True)
    it2.close()  # nothing to give back to: no error


@pytest.mark.usefixtures("ray_session")
def test_an_iterator_over_a_rate_limited_buffer_gives_back_its_samples_on_close(make_buffer):
    from rayrb.core.rate_limiter import SampleToInsertRatio
    from rayrb.errors import HeldBackTimeout

    def make():
        # the timeout bounds the limiter's wait; a loaded machine must not turn a slow answer into a hold-back
        rb = make_buffer(rows(200), **{**KW, "online_capacity": 1000},
                         rate_limiter=SampleToInsertRatio(1.0, 10, 40.0), timeout=2.0)
        rb.extend(rows(60, start=10_000))
        return rb

    twin = make()
    want = [twin.sample()["id"] for _ in range(3)]
    rb = make()
    it = rb.iter_batches(prefetch=6)
    got = [next(it)["id"] for _ in range(3)]
    assert it.ahead > 0
    it.close()
    assert_stream(got, want)
    limits = rb.stats()["coordinator"]["rate_limiter"]
    assert limits["samples"] == twin.stats()["coordinator"]["rate_limiter"]["samples"]
    # the limiter's window is where the twin's is: the same number of batches go through before it holds back
    counts = []
    for buf in (rb, twin):
        n = 0
        while n < 50:
            try:
                buf.sample()
            except HeldBackTimeout:
                break
            n += 1
        counts.append(n)
    assert counts[0] == counts[1] and counts[0] < 50, counts


@pytest.mark.usefixtures("ray_session")
def test_a_prioritized_iterator_closed_after_a_priority_update(make_buffer):
    def run(iterate):
        rb = make_buffer(rows(200), **KW, sampler="prioritized")
        if iterate:
            it = rb.iter_batches(prefetch=6, return_info=True)
            got = [next(it) for _ in range(3)]
        else:
            got = [rb.sample(return_info=True) for _ in range(3)]
        _, info = got[0]
        rb.update_priority(info, torch.full((10,), 50.0))
        if iterate:
            it.close()
        return [b["id"] for b, _ in got] + [rb.sample()["id"] for _ in range(6)]

    assert_stream(run(True), run(False))
