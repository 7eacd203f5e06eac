"""Hostile use of drawing ahead (rayrb.handle.lookahead), of shards whose rows live in a DeviceTable, and of route planning.

The Ray tests run the same calls on a buffer that draws ahead and on one that does
not (``prefetch=0``, the same seed), in long seeded interleavings, and compare every
batch and its provenance. The device tests build shards without Ray (the CPU device
runs the GPU shards' code path) and compare them row for row with host shards. The
route tests check invariants of ``plan_routes`` over many made-up layouts.
"""
from __future__ import annotations

import collections
import itertools
import random
import time

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rayrb import write_dataset
from rayrb.actors.shards import OfflineShard, OnlineShard
from rayrb.actors.transport import Place, choose, plan_routes, receive, refuse_shared_gpus, shared_gpu
from rayrb.core.plans import BatchPlan, Epoch, ImportanceWeights, Part, assemble

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
            # state out, one batch, state back in: the stream resumes where the state was taken
            def save_load(rb):
                saved = rb.state_dict()
                flat(rb.sample())
                rb.load_state_dict(saved)
                return saved["step"]
            ops.append(save_load)
        elif r < 0.95 and tmp_path is not None:
            def dump_load(rb, key=f"ck{i}"):
                path = tmp_path / f"{rb.name}-{key}"
                rb.dumps(path)
                flat(rb.sample())
                rb.loads(path)
            ops.append(dump_load)
        elif priorities:
            def update(rb, bs=bs):
                batch, inf = rb.sample(bs, return_info=True)
                rb.update_priority(inf, (batch["id"] % 5).float() + 0.25)
                return flat((batch, inf))
            ops.append(update)
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
    assert pair[0]._stream.stats["given_back"] > 0 and pair[0]._stream.stats["groups"] < 90
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
        while h._stream._planned:
            served += h.sample()["id"].tolist()
            h.stats()
    state = rb.state_dict()
    epochs, left = state["allocator"]["epochs"]["offline"], sum(state["allocator"]["left"]["offline"])
    counts = collections.Counter(served)
    assert len(served) == epochs * n - left
    assert set(counts.values()) <= {epochs - 1, epochs} and len(counts) == n
    assert sum(c == epochs for c in counts.values()) == n - left
    assert sum(h._stream.stats["kept"] for h in handles) > 0  # the refused give-back did happen


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
    from rayrb.handle.stream import MAX_BYTES

    n = 80
    td = TensorDict({"x": torch.zeros(n, 1 << 18), "id": torch.arange(n)}, [n])  # 1 MiB rows
    pair = twins(make_buffer, td, online_capacity=4, num_online_shards=1, seed=1, local_reads=False)
    streams = []
    for rb in pair:
        got = []
        for bs in [65] * 3 + [21] * 7:
            got.append(rb.sample(bs)["id"].tolist())
            look = rb._stream
            if bs == 65:  # one batch is over the cap: nothing is read beyond it
                assert look.in_flight == 0
            else:  # the batch served and those read ahead stay within the cap
                assert (1 + look.in_flight) * bs * rb.spec.row_bytes <= MAX_BYTES
        streams.append(got)
    assert streams[0] == streams[1]
    assert pair[0]._stream.stats["reads"] < 20  # 21 MiB batches were read ahead, two at a time


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
    assert learner._stream.ahead > 0
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
    assert learner._stream.stats["stale"] >= 2


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
        outcomes.append((batches, learner._stream.stats, rb.stats()["coordinator"]["rate_limiter"]["samples"]))
    (ahead, stats, samples), (single, _, single_samples) = outcomes
    assert ahead == single and samples == single_samples == 8 * 8
    assert stats["groups"] < 8 and stats["given_back"] > 0  # it did draw ahead, and gave back after the write


# -- device tables against host memory -------------------------------------------------------------------------


def odd_table(n, start=0):
    """Columns of every awkward kind: bool, int8, float16, float64, scalars, multi-dim, nested keys."""
    ids = np.arange(start, start + n)
    return {
        "id": ids.astype(np.int64),
        "flag": (ids % 3 == 0),
        "small": (ids % 100 - 50).astype(np.int8)[:, None].repeat(2, 1),
        "half": (ids / 7).astype(np.float16)[:, None, None].repeat(2, 1).repeat(3, 2),
        "wide": (ids * 1.5).astype(np.float64),
        "img": (ids % 256).astype(np.uint8)[:, None, None, None].repeat(2, 1).repeat(2, 2).repeat(1, 3),
        "next/reward": (ids % 2).astype(np.float32),
        "next/done/now": (ids % 5 == 0)[:, None],
    }


@pytest.fixture
def odd_dataset(tmp_path):
    return str(write_dataset(odd_table(500), tmp_path / "ds", chunk_rows=70).root)


def same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def same_reads(host, dev, counts, seeds, epochs=None):
    (rh, ih), (rd, idev) = (s.sample_many(counts, seeds, epochs) for s in (host, dev))
    same(rh, rd)
    same(ih, idev)
    t = dev.sample_many_tensors(counts, seeds, epochs)
    for k in rh:
        np.testing.assert_array_equal(t[f"rows/{k}"].numpy(), rh[k], err_msg=k)
    return rh


@pytest.mark.parametrize("sampler", ["uniform", "without_replacement", "prioritized"])
def test_offline_device_shard_matches_host_through_restarts_priorities_and_epochs(odd_dataset, tmp_path, sampler):
    # Catches a device table that drops a dtype, a scalar or nested column, or a shape; loses its priorities
    # when the process restarts or a state is loaded; or starts a restarted shard at the wrong epoch place.
    def shard(kind, state=True):
        return OfflineShard(odd_dataset, 130, 470, f"t/off-{kind}", sampler, device=None if kind == "host" else "cpu",
                            state_dir=str(tmp_path / kind) if state else None)

    host, dev = shard("host"), shard("dev")
    rng = np.random.default_rng(0)
    if sampler == "prioritized":
        idx, prio = rng.integers(0, 340, 120), rng.uniform(0, 9, 120).round(1)  # repeated rows, zeros
        for s in (host, dev):
            s.update_priority(idx, np.ones(120, np.int64), prio)
    epochs = [Epoch(1, 5, 340, 0), Epoch(1, 5, 340, 100), Epoch(1, 5, 340, 101)] \
        if sampler == "without_replacement" else None
    first = same_reads(host, dev, [100, 1, 0], [1, 2, 3], epochs)
    dev = shard("dev")  # the device shard's process died: a new one over the same state directory
    epochs2 = [Epoch(1, 5, 340, 101), Epoch(2, 6, 340, 0)] if sampler == "without_replacement" else None
    second = same_reads(host, dev, [239, 7], [4, 5], epochs2)
    if sampler == "without_replacement":  # one epoch: every row once
        assert sorted(np.concatenate([first["id"], second["id"][:239]]).tolist()) == list(range(130, 470))
    fresh = shard("dev2", state=False)
    fresh.load_state(host.state())
    same_reads(host, fresh, [50], [9], [Epoch(2, 6, 340, 7)] if sampler == "without_replacement" else None)
    idx = np.array([0, 339, 339, 5])
    same(host.gather(idx)[0], dev.gather(idx)[0])


def test_online_device_shard_matches_host_through_wraps_out_of_order_writes_and_restarts(odd_dataset, tmp_path):
    # Catches a device copy that misses a write (out of order, larger than the shard, wrapping), that keeps
    # stale rows after a restart or load_state, or that reads back a dtype or shape differently.
    from rayrb.io.chunks import ChunkDataset

    spec = ChunkDataset.open(odd_dataset).spec.to_json()
    cap = 37

    def shard(kind, sampler="prioritized", state=True):
        return OnlineShard(spec, cap, f"t/on-{kind}", sampler, state_dir=str(tmp_path / kind) if state else None,
                           device=None if kind.startswith("host") else "cpu")

    host, dev = shard("host"), shard("dev")
    data = odd_table(400, start=1000)
    rng = np.random.default_rng(1)
    bounds = np.unique(np.concatenate([[0, 400], rng.integers(1, 400, 14)]))
    writes = list(itertools.pairwise(bounds))
    order = list(range(len(writes)))
    for j in range(0, len(order) - 1, 3):  # every third pair of writes lands out of order
        order[j], order[j + 1] = order[j + 1], order[j]
    for step, j in enumerate(order):
        a, b = writes[j]
        for s in (host, dev):
            s.extend(data, int(a), int(b), first=int(a))
        assert host.written() == dev.written()
        same(host.gather(np.arange(host.size()))[0], dev.gather(np.arange(dev.size()))[0])
        if step % 4 == 3:
            n = min(10, host.size())
            _, info = host.gather(np.arange(n))
            prio = rng.uniform(0.1, 4, n)
            gen = info["generation"].copy()
            gen[::2] -= 1  # stale generations: those updates are dropped on both
            assert host.update_priority(np.arange(n), gen, prio) == dev.update_priority(np.arange(n), gen, prio)
            same_reads(host, dev, [25, 3], [step, step + 1])
    big = odd_table(2 * cap + 3, start=5000)  # one write larger than the shard keeps its tail
    for s in (host, dev):
        s.extend(big, 0, len(big["id"]), first=400)
    same_reads(host, dev, [60], [7])
    dev = shard("dev")  # restart
    assert dev.written() == host.written() == 400 + 2 * cap + 3
    same_reads(host, dev, [60], [8])
    for kind in ("host-fresh", "dev-fresh"):  # a loaded state replaces whatever the shard held
        fresh = shard(kind, state=False)
        fresh.extend(odd_table(5, start=-5), 0, 5, first=0)
        fresh.load_state(host.state())
        same_reads(host, fresh, [40], [9])
    wor_host, wor_dev = shard("host-w", "without_replacement"), shard("dev-w", "without_replacement")
    for s in (wor_host, wor_dev):
        s.extend(data, 0, 30, first=0)
    ep = [Epoch(3, 4, 30, 0), Epoch(3, 4, 30, 17)]
    got = same_reads(wor_host, wor_dev, [17, 13], [0, 0], ep)
    assert sorted(got["id"].tolist()) == list(range(1000, 1030))


def test_device_shards_refuse_bad_writes_and_states_without_changing_anything(odd_dataset, tmp_path):
    # Catches a device shard that half-applies a refused write or state: every refusal is checked
    # before the memory maps or the device copy change.
    from rayrb.io.chunks import ChunkDataset

    spec = ChunkDataset.open(odd_dataset).spec.to_json()
    dev = OnlineShard(spec, 20, "t/on-dev", "uniform", state_dir=str(tmp_path / "d"), device="cpu")
    dev.extend(odd_table(20), 0, 20, first=0)
    before = dev.gather(np.arange(20))[0]
    wrong = odd_table(5, start=100)
    wrong["half"] = wrong["half"].astype(np.float32)  # the spec says float16
    with pytest.raises(ValueError, match="half"):
        dev.extend(wrong, 0, 5, first=20)
    short = odd_table(5, start=100)
    short["small"] = short["small"][:, :1]
    with pytest.raises(ValueError, match="small"):
        dev.extend(short, 0, 5, first=20)
    bad_state = dev.state()
    bad_state["rows/img"] = bad_state["rows/img"][:10]
    with pytest.raises(ValueError):
        dev.load_state(bad_state)
    assert dev.written() == 20
    same(dev.gather(np.arange(20))[0], before)
    same(OnlineShard(spec, 20, "t/on-dev", "uniform", state_dir=str(tmp_path / "d"),
                     device="cpu").gather(np.arange(20))[0], before)


# -- routes ------------------------------------------------------------------------------------------------------


def random_places(rng, kind, n):
    out = []
    for i in range(n):
        node = f"node-{rng.randrange(3)}"
        gpus = tuple(sorted(rng.sample(["0", "1", "2", "3"], rng.choice([0, 0, 1, 1, 1, 2, 3]))))
        out.append(Place(f"{kind} {i}", node, gpus))
    return out


def shares(a, b):
    """Whether learner ``b`` was given the GPU that holds shard ``a``'s rows (its first) on the same node."""
    return a.node == b.node and bool(a.gpus) and a.gpus[0] in b.gpus


def test_auto_routes_keep_their_invariants_over_many_layouts():
    # Catches an NCCL group whose members share a GPU, CUDA IPC between actors that share none, a GPU-less
    # end outside the object store, members listed that carry no NCCL pair, and needless fallbacks.
    rng = random.Random(0)
    for _ in range(400):
        shards = random_places(rng, "shard", rng.randrange(0, 6))
        learners = random_places(rng, "learner", rng.randrange(0, 5))
        routes, s_ids, l_ids = plan_routes("auto", shards, learners)
        assert set(routes) == {(i, j) for i in range(len(shards)) for j in range(len(learners))}
        members = [shards[i] for i in s_ids] + [learners[j] for j in l_ids]
        assert shared_gpu(members) is None
        assert s_ids == sorted({i for (i, _), t in routes.items() if t == "nccl"})
        assert l_ids == sorted({j for (_, j), t in routes.items() if t == "nccl"})
        for (i, j), t in routes.items():
            s, d = shards[i], learners[j]
            if not s.gpus or not d.gpus:
                assert t == "object_store"
            elif shares(s, d):
                assert t == "cuda_ipc"
            elif t == "object_store":  # NCCL refused: only because the group could not take both ends
                assert shared_gpu(list({*members, s, d})) is not None
            else:
                assert t == "nccl"
        assert plan_routes("auto", shards, learners) == (routes, s_ids, l_ids)  # deterministic


def test_explicit_transports_refuse_exactly_the_layouts_that_cannot_work():
    # Catches an NCCL refusal that misses a shared GPU (or invents one across nodes) and a CUDA IPC
    # check that passes a pair without a common GPU.
    rng = random.Random(1)
    for _ in range(300):
        shards = random_places(rng, "shard", rng.randrange(0, 5))
        learners = random_places(rng, "learner", rng.randrange(0, 4))
        everyone = [*shards, *learners]
        hit = shared_gpu(everyone)
        gpuless = next((p for p in everyone if not p.gpus), None) if shards and learners else None
        if gpuless is not None and hit is None:
            with pytest.raises(ValueError, match=f"Ray gave {gpuless.name} .* none"):
                plan_routes("nccl", shards, learners)
        elif gpuless is not None:
            with pytest.raises(ValueError):
                plan_routes("nccl", shards, learners)
        elif hit is None:
            routes, s_ids, l_ids = plan_routes("nccl", shards, learners)
            assert set(routes.values()) <= {"nccl"}
            assert (s_ids, l_ids) == ((list(range(len(shards))), list(range(len(learners))))
                                      if shards and learners else ([], []))
            refuse_shared_gpus(everyone)
        else:
            a, b, g = hit
            assert a.node == b.node and g in a.gpus and g in b.gpus and a is not b
            with pytest.raises(ValueError, match=f"{a.name} and {b.name}: both run on GPU {g}"):
                plan_routes("nccl", shards, learners)
        ok = all(shares(s, d) for s in shards for d in learners)
        if ok:
            routes, s_ids, l_ids = plan_routes("cuda_ipc", shards, learners)
            assert set(routes.values()) <= {"cuda_ipc"} and s_ids == l_ids == []
        else:
            with pytest.raises(ValueError, match="transport='cuda_ipc' carries rows only"):
                plan_routes("cuda_ipc", shards, learners)
        for t in ("object_store", "gloo"):
            routes, s_ids, l_ids = plan_routes(t, shards, learners)
            assert set(routes.values()) <= {t} and len(routes) == len(shards) * len(learners)
            if t == "object_store" or not routes:
                assert s_ids == l_ids == []
    with pytest.raises(ValueError, match="transport must be one of"):
        plan_routes("rdma", [], [])


def test_multi_gpu_nodes_and_actors_holding_several_gpus():
    # Catches GPU ids compared across nodes, and a shared id missed when an actor holds several GPUs.
    a = Place("shard a", "n1", ("0", "1"))  # its rows are on its first GPU, "0"
    assert choose(a, Place("learner", "n1", ("1", "0"))) == "cuda_ipc"
    assert choose(a, Place("learner", "n1", ("1", "2"))) == "nccl"  # shares GPU 1, not the rows' GPU
    assert choose(a, Place("learner", "n1", ("2", "3"))) == "nccl"
    assert choose(a, Place("learner", "n2", ("0", "1"))) == "nccl"  # the same ids on another node
    assert shared_gpu([a, Place("b", "n2", ("0",)), Place("c", "n1", ("2",))]) is None
    assert shared_gpu([a, Place("b", "n1", ("3", "1"))])[2] == "1"
    many = [Place(f"s{i}", f"n{i // 4}", (str(i % 4),)) for i in range(16)]  # 4 nodes of 4 GPUs, one each
    learners = [Place(f"l{j}", f"n{j}", ("0", "1")) for j in range(4)]
    routes, s_ids, l_ids = plan_routes("auto", many, learners)
    for (i, j), t in routes.items():  # learner j shares GPUs 0 and 1 of node j with two shards
        assert (t == "cuda_ipc") == (i // 4 == j and i % 4 < 2) and t in ("cuda_ipc", "nccl", "object_store")
    assert shared_gpu([*(many[i] for i in s_ids), *(learners[j] for j in l_ids)]) is None
    assert plan_routes("auto", [], learners) == ({}, [], [])
    assert plan_routes("nccl", many, []) == ({}, [], [])


def test_receive_rebuilds_what_assemble_gives_from_any_mix_of_parts():
    # Catches parts joined out of order, provenance or importance weights misaligned with rows, dtypes
    # changed on the way (bool, int8, float16), and a wrong number of parts accepted.
    rng = np.random.default_rng(0)
    for trial in range(40):
        parts = [Part("offline", i, int(rng.integers(1, 5))) for i in range(int(rng.integers(0, 3)))]
        parts += [Part("online", i, int(rng.integers(1, 5))) for i in range(int(rng.integers(1, 3)))]
        n_off = sum(p.count for p in parts if p.side == "offline")
        weights = ImportanceWeights(0.4, {"offline": 0.5, "online": 0.25}) if trial % 2 else None
        plan = BatchPlan(parts, n_off, sum(p.count for p in parts) - n_off, fraction=0.5, step=trial,
                         weights=weights)
        results = []
        for p in parts:
            table = odd_table(p.count, start=int(rng.integers(0, 1000)))
            info = {"index": rng.integers(0, 100, p.count), "generation": rng.integers(1, 4, p.count)}
            if weights is not None:
                info["priority"] = rng.uniform(0.5, 2.0, p.count)
            results.append((table, info))
        want_rows, want_info = assemble(plan, results, return_info=True)
        as_sent = [r if rng.random() < 0.5 else
                   {**{f"rows/{k}": torch.from_numpy(v) for k, v in r[0].items()},
                    **{f"info/{k}": torch.from_numpy(v) for k, v in r[1].items()}} for r in results]
        td, info = receive(plan, *as_sent)
        got = {k: v.numpy() for k, v in td.flatten_keys("/").items()}
        same(got, want_rows)
        assert info.keys() == want_info.keys()
        for k, v in want_info.items():
            assert info[k].numpy().dtype == v.dtype, k
            np.testing.assert_array_equal(info[k].numpy(), v, err_msg=k)
        with pytest.raises(ValueError, match="shard parts"):
            receive(plan, *as_sent[:-1])
