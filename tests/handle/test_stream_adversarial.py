"""Hostile use of drawing ahead (rayrb.handle.lookahead).

The Ray tests run the same calls on a buffer that draws ahead and on one that does
not (``prefetch=0``, the same seed), in long seeded interleavings, and compare every
batch and its provenance.
"""
from __future__ import annotations

import collections
import random
import time

import numpy as np
import pytest
import torch
from tensordict import TensorDict

uses_ray = pytest.mark.usefixtures("ray_session")


def rows(start, n):
    ids = torch.arange(start, start + n, dtype=torch.int64)
    return TensorDict({"obs": ids.float()[:, None].expand(n, 3).contiguous(), "id": ids}, [n])


def flat(x):
    """A batch, its info, or a flat numpy dict as nested lists, for exact comparison."""
    if isinstance(x, tuple):
        return tuple(flat(v) for v in x)
    if isinstance(x, TensorDict):
        return {k: v.tolist() for k, v in x.flatten_keys("/").items()}
    if isinstance(x, dict):
        return {k: flat(v) for k, v in x.items()}
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return x.tolist()
    return x


def outcome(fn):
    """``fn()``'s result, or the type and message of what it raised: both twins must agree on either."""
    try:
        return "ok", fn()
    except (ValueError, TimeoutError) as e:  # named by the builtin it is (rayrb's errors subclass one)
        return ("ValueError" if isinstance(e, ValueError) else "TimeoutError"), str(e)


def twins(make_buffer, data, **kwargs):
    kwargs = {"online_capacity": 400, "num_offline_shards": 2, "num_online_shards": 2, "seed": 11,
              "batch_size": 16, **kwargs}
    return make_buffer(data, prefetch=32, **kwargs), make_buffer(data, prefetch=0, **kwargs)


def coordinator_view(rb):
    c = rb.stats()["coordinator"]
    return c["step"], c["epochs"], c["rate_limiter"]["samples"], c["rate_limiter"]["inserts"]


def save_load(rb):
    """State out, one batch, state back in: the stream resumes where the state was taken."""
    saved = rb.state_dict()
    flat(rb.sample())
    rb.load_state_dict(saved)
    return saved["step"]


def dump_load(tmp_path, key):
    """A call that dumps the buffer under ``tmp_path``, draws one batch, and loads the dump back."""
    def op(rb):
        path = tmp_path / f"{rb.name}-{key}"
        rb.dumps(path)
        flat(rb.sample())
        rb.loads(path)
    return op


def sample_and_update(rb, bs):
    """One batch with its info, and new priorities for its rows."""
    batch, inf = rb.sample(bs, return_info=True)
    rb.update_priority(inf, (batch["id"] % 5).float() + 0.25)
    return flat((batch, inf))


def random_ops(rng, n, *, tmp_path=None, priorities=False):
    """A seeded list of calls on one handle: each takes the buffer and returns something comparable."""
    import ray

    written = [1000]
    ops = []

    def extend(k):
        def op(rb, start=written[0]):
            return rb.extend(rows(start, k)).tolist()
        written[0] += k
        return op

    for i in range(n):
        r = rng.random()
        bs = rng.choice([16, 16, 16, 7, 33])
        info = rng.random() < 0.5
        if r < 0.45:
            ops.append(lambda rb, bs=bs, info=info: flat(rb.sample(bs, return_info=info)))
        elif r < 0.55:
            ops.append(extend(rng.choice([1, 5, 40])))
        elif r < 0.60:
            ops.append(lambda rb, f=rng.choice([0.0, 0.25, 0.5, 1.0]): setattr(rb, "offline_fraction", f))
        elif r < 0.63:
            ops.append(lambda rb, s=rng.randrange(0, 10): rb.anneal(s, 10))
        elif r < 0.66:
            ops.append(lambda rb, s=rng.randrange(0, 50): rb.set_step(s))
        elif r < 0.70:
            ops.append(lambda rb: rb.offline_fraction)
        elif r < 0.74:
            ops.append(lambda rb, bs=bs, info=info: [flat(b) for b in rb.iter_batches(
                bs, prefetch=3, num_batches=3, return_info=info)])
        elif r < 0.77:
            ops.append(lambda rb, bs=bs, info=info: flat(ray.get(rb.sample_async(bs, return_info=info))))
        elif r < 0.80:
            ops.append(lambda rb, bs=bs: [flat(x) for x in ray.get(rb.sample_slices(2, bs, return_info=True))])
        elif r < 0.83:
            ops.append(lambda rb: coordinator_view(rb))
        elif r < 0.86:
            ops.append(lambda rb: flat(rb.offline_buffer.sample(5)))  # a stream of its own: nothing to give back
        elif r < 0.92:
            ops.append(save_load)
        elif r < 0.95 and tmp_path is not None:
            ops.append(dump_load(tmp_path, f"ck{i}"))
        elif priorities:
            ops.append(lambda rb, bs=bs: sample_and_update(rb, bs))
        else:
            ops.append(lambda rb, bs=bs: flat(rb.sample(bs)))
    return ops


def run_twins(pair, ops):
    """Every call on both buffers: results (or errors) must be equal, call by call."""
    for j, op in enumerate(ops):
        a, b = (outcome(lambda: op(rb)) for rb in pair)
        assert a == b, f"call {j}: the buffer that draws ahead gave {str(a)[:300]}, the other {str(b)[:300]}"


# -- the lookahead against its prefetch=0 twin -----------------------------------------------------------------


@uses_ray
def test_a_long_random_interleaving_gives_the_unprefetched_stream(make_buffer, tmp_path):
    # Catches any call that forgets to give back (or rewinds the stream wrongly): settings applied late,
    # a saved state taken past unserved draws, a changed batch size or return_info served from stale draws.
    pair = twins(make_buffer, rows(0, 300))
    run_twins(pair, random_ops(random.Random(1), 90, tmp_path=tmp_path))
    assert pair[0]._sampling.stream.stats["given_back"] > 0 and pair[0]._sampling.stream.stats["groups"] < 90
    assert coordinator_view(pair[0]) == coordinator_view(pair[1])


@uses_ray
def test_priority_updates_interleaved_with_everything_else(make_buffer):
    # Catches batches drawn ahead with masses older than this handle's last update_priority, and importance
    # weights computed against a stale global minimum.
    pair = twins(make_buffer, rows(0, 200), sampler="prioritized", offline_fraction=0.5)
    for rb in pair:
        rb.extend(rows(1000, 60))
    run_twins(pair, random_ops(random.Random(2), 45, priorities=True))


@uses_ray
@pytest.mark.parametrize("epoch_end", ["short", "drop", "raise"])
def test_without_replacement_epochs_on_both_sides_match_for_every_epoch_end(make_buffer, epoch_end):
    # Catches a rewind that restores the step and RNG but not the epochs (or the reverse), a short or
    # dropped final batch drawn ahead and then served after a give-back, and a refused draw ("raise")
    # that was taken anyway inside a group drawn ahead.
    pair = twins(make_buffer, rows(0, 150), sampler="without_replacement", epoch_end=epoch_end,
                 offline_fraction=0.5)
    for rb in pair:
        rb.extend(rows(1000, 70))
    run_twins(pair, random_ops(random.Random(3), 40))


@uses_ray
@pytest.mark.parametrize("epoch_end", ["short", "drop", "raise"])
def test_each_row_once_per_epoch_through_give_backs(make_buffer, epoch_end):
    # Catches a give-back that returns the RNG but leaves the epoch's cursor past the unserved rows (rows
    # lost) or the reverse (rows served twice); and, for "raise", a group that ran past the epoch's end.
    n, bs = 200, 24
    pair = twins(make_buffer, rows(0, n), sampler="without_replacement", epoch_end=epoch_end,
                 offline_fraction=1.0, online_capacity=50)
    streams = []
    for rb in pair:
        served, rng = [], random.Random(4)
        while len(served) < 20:
            size = bs
            out = outcome(lambda: rb.sample(size)["id"].tolist())
            if out[0] == "ValueError":  # the epoch has fewer than bs rows left: take them in a smaller batch
                assert epoch_end == "raise"
                size = n % bs
                out = outcome(lambda: rb.sample(size)["id"].tolist())
            assert out[0] == "ok", out
            served.append(out[1])
            r = rng.random()
            if r < 0.2:
                rb.extend(rows(1000 + len(served), 3))  # online rows: the offline epoch is unaffected
            elif r < 0.3:
                rb.offline_fraction = 1.0
            elif r < 0.4:
                rb.state_dict()
        streams.append(served)
    assert streams[0] == streams[1]
    per_epoch = n // bs + (epoch_end != "drop")
    for e in range(len(streams[0]) // per_epoch):
        epoch = [i for batch in streams[0][e * per_epoch:(e + 1) * per_epoch] for i in batch]
        assert len(epoch) == len(set(epoch)), f"epoch {e} served a row twice"
        if epoch_end != "drop":
            assert sorted(epoch) == list(range(n)), f"epoch {e} lost rows"
        else:
            assert len(epoch) == n - n % bs


@uses_ray
def test_two_handles_interleaving_without_replacement_serve_each_row_once_per_epoch(make_buffer):
    # Catches batches another handle's draw made impossible to give back being dropped (rows lost), or
    # given back although another handle drew after them (rows served twice).
    n = 240
    rb = make_buffer(rows(0, n), online_capacity=100, num_offline_shards=2, num_online_shards=1, seed=3,
                     batch_size=16, sampler="without_replacement", offline_fraction=1.0)
    handles = [rb.client(prefetch=32), rb.client(prefetch=8), rb.client(prefetch=0)]
    rng, served = random.Random(5), []
    for step in range(90):
        h = rng.choice(handles)
        r = rng.random()
        if r < 0.75:
            served += h.sample()["id"].tolist()
        elif r < 0.85:
            h.stats()  # a give-back that changes nothing
        else:
            h.extend(rows(10_000 + step, 2))
    for h in handles:  # each handle drains what it holds
        h.stats()
        while h._sampling.stream._planned:
            served += h.sample()["id"].tolist()
            h.stats()
    state = rb.state_dict()
    epochs, left = state["allocator"]["epochs"]["offline"], sum(state["allocator"]["left"]["offline"])
    counts = collections.Counter(served)
    assert len(served) == epochs * n - left
    assert set(counts.values()) <= {epochs - 1, epochs} and len(counts) == n
    assert sum(c == epochs for c in counts.values()) == n - left
    assert sum(h._sampling.stream.stats["kept"] for h in handles) > 0  # the refused give-back did happen


@uses_ray
@pytest.mark.parametrize("sampler", ["uniform", "without_replacement"])
def test_killing_an_offline_shard_while_batches_are_held_ahead(make_buffer, sampler):
    # Catches reads of a group drawn ahead that are lost or drawn again when their shard restarts, and
    # a handle that stops working after the restart; every batch must still split exactly.
    import ray

    pair = twins(make_buffer, rows(0, 180), num_offline_shards=3, sampler=sampler, offline_fraction=0.75,
                 batch_size=20)
    streams = []
    for rb in pair:
        rb.extend(rows(1000, 40))
        got = [flat(rb.sample(return_info=True)) for _ in range(3)]
        ray.kill(rb.rpc.shards[1], no_restart=False)  # Ray restarts it
        deadline = time.monotonic() + 30
        while True:
            try:
                got.append(flat(rb.sample(return_info=True)))
                break
            except Exception:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        got += [flat(rb.sample(return_info=True)) for _ in range(12)]
        streams.append(got)
    assert streams[0] == streams[1]
    for _, info in streams[0]:
        assert sum(info["offline"]) == 15 and len(info["offline"]) == 20
    if sampler == "without_replacement":  # 180 rows, 15 a batch: the first 12 batches are one epoch
        epoch = [i for batch, _ in streams[0][:12] for i in batch["id"] if i < 1000]
        assert sorted(epoch) == list(range(180))


@uses_ray
def test_a_handle_with_a_tiny_timeout_keeps_every_batch_exact(make_buffer):
    # Catches a half-fetched group whose batches are served torn (rows of one plan, info of another) after
    # a TimeoutError, and a handle left unusable by one.
    rb = make_buffer(rows(0, 200), online_capacity=100, num_offline_shards=2, num_online_shards=2, seed=2,
                     batch_size=20, offline_fraction=0.5)
    rb.extend(rows(1000, 80))
    hasty = rb.client(timeout=0.002)
    ok, deadline = 0, time.monotonic() + 30
    while ok < 30 and time.monotonic() < deadline:
        try:
            batch, info = hasty.sample(return_info=True)
        except TimeoutError:
            continue
        ok += 1
        ids = batch["id"]
        assert int(info["offline"].sum()) == 10 and len(ids) == 20
        assert bool((ids[info["offline"]] < 1000).all()) and bool((ids[~info["offline"]] >= 1000).all())
        off = info["offline"]
        assert torch.equal(info["index"][off] + 100 * info["shard"][off], ids[off])  # shard i holds rows 100i..
    assert ok == 30
    assert len(rb.sample()) == 20  # the buffer itself is unharmed


@uses_ray
def test_batches_over_the_lookahead_byte_cap_are_not_drawn_ahead(make_buffer):
    # Catches a cap that ignores the batch's bytes: 65 MiB batches drawn 32 ahead would hold 2 GiB in the
    # object store. Under the cap, rows in flight must stay within 64 MiB; the stream stays the same.
    from rayrb.handle.policies import MAX_BYTES

    n = 80
    td = TensorDict({"x": torch.zeros(n, 1 << 18), "id": torch.arange(n)}, [n])  # 1 MiB rows
    pair = twins(make_buffer, td, online_capacity=4, num_online_shards=1, seed=1, local_reads=False)
    streams = []
    for rb in pair:
        got = []
        for bs in [65] * 3 + [21] * 7:
            got.append(rb.sample(bs)["id"].tolist())
            look = rb._sampling.stream
            if bs == 65:  # one batch is over the cap: nothing is read beyond it
                assert look.in_flight == 0
            else:  # the batch served and those read ahead stay within the cap
                assert (1 + look.in_flight) * bs * rb.spec.row_bytes <= MAX_BYTES
        streams.append(got)
    assert streams[0] == streams[1]
    assert pair[0]._sampling.stream.stats["reads"] < 20  # 21 MiB batches were read ahead, two at a time


@uses_ray
def test_other_handles_writes_and_settings_reach_the_second_sample(make_buffer):
    # Catches batches drawn ahead that are served however old they are: another handle's write or
    # fraction must show no later than the second sample() after it. (One batch size and one return_info
    # throughout, so that nothing but the other handles' calls can make the learner give back.)
    rb = make_buffer(rows(0, 300), online_capacity=200, num_offline_shards=2, num_online_shards=1, seed=9,
                     batch_size=16, offline_fraction=0.5)
    learner, collector, steerer = rb.client(prefetch=32), rb.client(), rb.client()

    def n_online():
        return int((~learner.sample(return_info=True)[1]["offline"]).sum())

    assert n_online() == 0  # nothing online yet: all offline, and more like it held
    assert learner._sampling.stream.ahead > 0
    collector.extend(rows(1000, 50))
    n_online()
    assert n_online() == 8
    steerer.offline_fraction = 1.0
    n_online()
    assert [n_online() for _ in range(3)] == [0, 0, 0]
    steerer.set_step(0)
    steerer.offline_fraction = {"kind": "step", "values": [0.0, 1.0], "boundaries": [2]}
    n_online()
    assert n_online() == 16  # step 0 or 1 of the new schedule: all online
    assert learner._sampling.stream.stats["stale"] >= 2


@uses_ray
def test_a_limited_buffer_draws_ahead_yet_judges_writes_by_the_rows_served(make_buffer):
    # Catches drawing ahead that counts against collectors: rows drawn and not yet served must neither let a
    # write through that single calls would hold back, nor change the stream. 100 rows in, 4 batches of 8
    # online rows served: diff = 100 - 32 = 68 and max_diff = 208, so 140 rows fit and 141 do not.
    from rayrb import SampleToInsertRatio

    outcomes = []
    for prefetch in (32, 0):
        rb = make_buffer(rows(0, 300), online_capacity=1000, batch_size=16, offline_fraction=0.5, seed=0,
                         rate_limiter=SampleToInsertRatio(samples_per_insert=1.0, min_size_to_sample=8,
                                                          error_buffer=200), prefetch=prefetch, timeout=5)
        rb.extend(rows(1000, 100))
        learner = rb.client()
        batches = [learner.sample()["id"].tolist() for _ in range(4)]
        writer = rb.client(timeout=1)
        with pytest.raises(TimeoutError):  # would go through if the unserved draws counted as sampled
            writer.extend(rows(2000, 141))
        writer.extend(rows(3000, 140))
        batches += [learner.sample()["id"].tolist() for _ in range(4)]
        outcomes.append((batches, learner._sampling.stream.stats, rb.stats()["coordinator"]["rate_limiter"]["samples"]))
    (ahead, stats, samples), (single, _, single_samples) = outcomes
    assert ahead == single and samples == single_samples == 8 * 8
    assert stats["groups"] < 8 and stats["given_back"] > 0  # it did draw ahead, and gave back after the write
