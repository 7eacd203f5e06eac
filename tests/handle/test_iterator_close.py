"""An iterator that stops early gives back the batches it drew ahead and never handed over.

Each test compares the ids a buffer serves with the stream of a twin buffer (same
data, same seed) that only ever calls ``sample()`` without drawing ahead.
"""
from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

pytestmark = pytest.mark.usefixtures("ray_session")

KW = {"online_capacity": 100, "num_offline_shards": 2, "num_online_shards": 1, "seed": 3, "batch_size": 10,
      "prefetch": 0}


def rows(n):
    ids = torch.arange(n, dtype=torch.int64)
    return TensorDict({"obs": ids.float()[:, None], "id": ids}, [n])


def assert_stream(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"batch {i}: {a.tolist()} != {b.tolist()}"


@pytest.mark.parametrize("sampler", ["uniform", "without_replacement"])
@pytest.mark.parametrize("how", ["close", "with", "break"])
def test_an_iterator_left_early_gives_back_what_it_did_not_hand_over(make_buffer, sampler, how, reference):
    want = reference(12, sampler=sampler)
    rb = make_buffer(rows(200), **KW, sampler=sampler)
    got = []
    if how == "close":
        it = rb.iter_batches(prefetch=8)
        got += [next(it)["id"] for _ in range(3)]
        assert it.ahead > 0  # batches were drawn ahead of the three handed over
        it.close()
        with pytest.raises(StopIteration):
            next(it)
    elif how == "with":
        with rb.iter_batches(prefetch=8) as it:
            got += [next(it)["id"] for _ in range(3)]
    else:
        for batch in rb.iter_batches(prefetch=8):  # the iterator is dropped at the break
            got.append(batch["id"])
            if len(got) == 3:
                break
    got += [rb.sample()["id"] for _ in range(9)]
    assert_stream(got, want)


def test_every_row_of_an_epoch_is_served_once_across_abandoned_iterators(make_buffer):
    rb = make_buffer(rows(200), **KW, sampler="without_replacement")
    seen = []
    for _ in range(4):  # four iterators, each left after 4 of its batches with more drawn ahead
        it = rb.iter_batches(prefetch=6)
        seen += [next(it)["id"] for _ in range(4)]
        it.close()
    seen += [rb.sample()["id"] for _ in range(4)]
    assert sorted(torch.cat(seen).tolist()) == list(range(200))


def test_a_state_dict_taken_while_iterating_leaves_out_only_what_was_drawn_ahead(make_buffer, reference):
    want = reference(10, sampler="without_replacement")
    rb = make_buffer(rows(200), **KW, sampler="without_replacement")
    it = rb.iter_batches(prefetch=8)
    got = [next(it)["id"] for _ in range(3)]
    state = rb.state_dict()  # after the three batches handed over, before the ones drawn ahead
    twin = make_buffer(rows(200), **KW, sampler="without_replacement")
    twin.load_state_dict(state)
    assert_stream(got + [twin.sample()["id"] for _ in range(7)], want)


def test_after_another_handles_draw_the_iterators_draws_stand(make_buffer, reference):
    rb = make_buffer(rows(200), **KW)
    other = rb.client()
    it = rb.iter_batches(prefetch=8)
    first = next(it)["id"]
    drawn_ahead = it.ahead
    other.sample()  # another caller draws: the iterator's batches can no longer be given back
    it.close()
    want = reference(3 + drawn_ahead)
    assert torch.equal(first, want[0])
    # the stream went on after the iterator's draws and the other handle's one
    assert torch.equal(rb.sample()["id"], want[2 + drawn_ahead])
    assert rb.stats()["coordinator"]["undo_refused"] == 1


def test_dumps_while_iterating_resumes_after_the_batches_handed_over(make_buffer, tmp_path, reference):
    want = reference(10, sampler="without_replacement")
    rb = make_buffer(rows(200), **KW, sampler="without_replacement")
    it = rb.iter_batches(prefetch=8)
    got = [next(it)["id"] for _ in range(4)]
    rb.dumps(tmp_path / "ckpt")
    twin = make_buffer(rows(200), **KW, sampler="without_replacement")
    twin.loads(tmp_path / "ckpt")
    assert_stream(got + [twin.sample()["id"] for _ in range(6)], want)


def test_a_save_from_elsewhere_serves_again_at_most_one_group_and_skips_nothing(make_buffer, reference):
    import ray

    want = reference(30, sampler="without_replacement")
    rb = make_buffer(rows(200), **KW, sampler="without_replacement")
    it = rb.iter_batches(prefetch=4)  # one plan call covers these nine batches; served reports ride on the next
    got = [next(it)["id"] for _ in range(9)]
    state = ray.get(rb.rpc.coord.state_dict.remote())  # as another process would ask: nothing reported on purpose
    twin = make_buffer(rows(200), **KW, sampler="without_replacement")
    twin.load_state_dict(state)
    first = twin.sample()["id"]
    resumed_at = next(i for i, w in enumerate(want) if torch.equal(w, first))
    assert 0 <= resumed_at <= 9, resumed_at  # at most the batches served since the last plan call, served again
    assert_stream(got, want[:9])
    assert_stream([first] + [twin.sample()["id"] for _ in range(5)], want[resumed_at:resumed_at + 6])
