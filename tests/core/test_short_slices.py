"""Short slices (``strict_length=False``) without Ray: every valid slice, short episodes whole among them, is drawn
uniformly over the union of shards; the offline share counts slices exactly; a shard's read keeps its planned rows
(short slices padded) and the handle drops the padding and marks each slice's edges as TorchRL's SliceSampler
does; without replacement each valid slice comes once an epoch."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats

from rayrb.core.episodes import Slices, from_ids, padded_steps, short_slices, slice_counts, whole_slices
from rayrb.core.planner import Planner
from rayrb.core.plans import OFFLINE, ONLINE
from rayrb.core.reads import read_indices
from rayrb.core.samplers import make_sampler
from rayrb.core.slice_sampling import SliceSampler

L = 4


def shard(ids, kind="slice"):
    s = make_sampler(kind, len(ids), slice_len=L, slice_key="episode", slice_strict=False)
    s.bind({"episode": np.asarray(ids)}, None)
    return s


def starts_of(idx):
    """Each read slice's first step and length, from a shard's padded read."""
    keep, first, _ = short_slices(idx, L)
    kept = idx[keep]
    cuts = np.flatnonzero(first)
    return kept[cuts], np.diff(np.append(cuts, kept.size))


def test_settings_take_strict_length_false_and_give_the_shards_its_option():
    s = SliceSampler(slice_len=L, strict_length=False)
    assert s.resolve(["episode"], None) == {"slice_len": L, "slice_key": "episode", "slice_ends": False,
                                            "slice_strict": False}
    assert "slice_strict" not in SliceSampler(slice_len=L).resolve(["episode"], None)  # strict: as always


def test_the_buffer_keyword_and_a_torchrl_buffers_slice_sampler_keep_strict_length_false():
    from rayrb.handle.settings import checked_settings

    data = {"episode": np.zeros(10, np.int64)}
    s = checked_settings(data, online_capacity=10, sampler="slice", slice_len=L, strict_length=False)
    assert s.slices == SliceSampler(slice_len=L, strict_length=False)
    rb_mod = pytest.importorskip("torchrl.data.replay_buffers")
    torchrl_rb = rb_mod.ReplayBuffer(storage=rb_mod.LazyTensorStorage(10), sampler=rb_mod.SliceSampler(
        num_slices=4, traj_key="episode", strict_length=False))
    s = checked_settings(torchrl_rb, online_capacity=10, batch_size=32)
    assert s.slices == SliceSampler(num_slices=4, traj_key="episode", strict_length=False)


def test_a_shard_reads_short_episodes_whole_padded_to_its_planned_rows_and_weighs_itself_by_every_slice():
    ids = np.repeat([0, 1, 2, 3], [6, 2, 1, 4])  # valid slices of 4: 3 + 1 (short) + 1 (short) + 1
    s = shard(ids)
    assert s.mass(len(ids)) == (6.0, 1.0)
    idx = s.sample(L * 200, len(ids), np.random.default_rng(0))
    assert idx.size == L * 200
    starts, lengths = starts_of(idx)
    assert len(starts) == 200
    assert set(zip(starts.tolist(), lengths.tolist())) == {(0, 4), (1, 4), (2, 4), (6, 2), (8, 1), (9, 4)}
    for run in idx.reshape(-1, L):  # a slice's steps in order, then copies of its last step
        real = run[:np.flatnonzero(np.append(np.diff(run) != 1, True))[0] + 1]
        assert (run[real.size:] == real[-1]).all() and len(set(ids[run].tolist())) == 1


def test_slice_starts_are_uniform_over_the_union_of_valid_slices_short_ones_included():
    """Three shards' samplers, counts ~ Multinomial over each shard's valid slices (short episodes one each), then
    each shard's own draw: uniform over every valid slice of the union (chi-square, 24 slices a batch)."""
    rng = np.random.default_rng(1)
    columns = [np.repeat(np.arange(n), rng.integers(1, 8, n)) for n in (15, 40, 25)]
    shards = [shard(c) for c in columns]
    totals = [int(s.mass(len(c))[0]) for s, c in zip(shards, columns)]
    valid = [dict(zip(Slices(from_ids(c), L, strict_length=False).locate(np.arange(t))[0].tolist(), range(t)))
             for c, t in zip(columns, totals)]
    assert totals == [len(v) for v in valid] and sum(totals) > sum(Slices(from_ids(c), L).total for c in columns)
    hits = [np.zeros(t, np.int64) for t in totals]
    draws = np.random.default_rng(2)
    for _ in range(1500):
        counts, _ = slice_counts(24, 1.0, totals, [0], draws)
        for s, c, k, v, h in zip(shards, columns, counts, valid, hits):
            for start in starts_of(s.sample(int(k) * L, len(c), draws))[0].tolist():
                h[v[start]] += 1
    assert stats.chisquare(np.concatenate(hits)).pvalue > 1e-3


def draw_batches(seed, fraction, batches=30, num_slices=7):
    """Batches planned and read as the coordinator and shards run them; per batch, the offline and online slices,
    the steps served and the rows read."""
    rng = np.random.default_rng(3)
    columns = {OFFLINE: [np.repeat(np.arange(n), rng.integers(1, 7, n)) for n in (12, 20)],
               ONLINE: [np.repeat(np.arange(n), rng.integers(1, 5, n)) for n in (9,)]}
    shards = {side: [shard(c) for c in cs] for side, cs in columns.items()}
    p = Planner({OFFLINE: 2, ONLINE: 1}, offline_fraction=fraction, sampler="slice", slice_len=L, seed=seed)
    sizes = {side: np.array([len(c) for c in cs]) for side, cs in columns.items()}
    for side in (OFFLINE, ONLINE):
        p.alloc.set_masses(side, [s.mass(len(c)) for s, c in zip(shards[side], columns[side])], sizes[side])
    out = []
    for _ in range(batches):
        ((plan, reads),) = p.draw(num_slices * L, sizes=sizes)
        parts = [read_indices(shards[part.side][part.shard], [part.count], [seed_], [None], sizes[part.side][part.shard])
                 for part, (seed_, _) in zip(plan.parts, reads)]
        index, side = np.concatenate(parts), np.repeat([part.side for part in plan.parts], [len(x) for x in parts])
        keep, first, _ = short_slices(index, L)
        out.append((int(first[side[keep] == OFFLINE].sum()), int(first[side[keep] == ONLINE].sum()), int(keep.sum()),
                    index.tolist()))
    return out


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.5, 1.0])
def test_the_offline_share_counts_slices_exactly_in_every_batch_of_short_slices(fraction):
    batches = draw_batches(0, fraction)
    for n_off, n_on, _, _ in batches:
        assert n_off == int(np.floor(fraction * 7 + 0.5)) and n_off + n_on == 7
    assert sum(served for _, _, served, _ in batches) < 30 * 7 * L  # short slices among them


def test_the_same_seed_gives_the_same_stream_of_short_slices():
    assert draw_batches(5, 0.5) == draw_batches(5, 0.5) != draw_batches(6, 0.5)


def test_padding_is_found_by_place_and_overlapping_slices_are_kept_whole():
    keep, first, last = short_slices(np.array([5, 6, 7, 7, 7, 8, 9, 10, 3, 3, 3, 3]), L)
    assert keep.tolist() == [1, 1, 1, 0] + [1] * 4 + [1, 0, 0, 0]  # [5 6 7]+pad, [7 8 9 10] kept whole, [3]+pad
    assert np.flatnonzero(first).tolist() == [0, 3, 7] and np.flatnonzero(last).tolist() == [2, 6, 7]
    assert whole_slices(np.array([5, 6, 7, 7]), np.array([1, 1, 1, 1]), L, ends=False, padded=True)
    assert not whole_slices(np.array([5, 6, 7, 7]), np.array([1, 1, 1, 1]), L, ends=False)  # strict: no padding
    assert not whole_slices(np.array([5, 6, 6, 7]), np.array([1, 1, 1, 1]), L, ends=False, padded=True)
    assert not whole_slices(np.array([5, 6, 7, 7]), np.array([0, 1, 0, 0]), L, ends=True, padded=True)


def test_the_handle_drops_the_padding_and_marks_each_slices_edges_as_torchrls_slice_sampler():
    """TorchRL as the peer on one fixed set of episodes: for the slices its SliceSampler drew, a shard's padded
    read of the same slices, trimmed and marked by the handle, gives its rows, length and marks."""
    torch = pytest.importorskip("torch")
    tensordict = pytest.importorskip("tensordict")
    rb_mod = pytest.importorskip("torchrl.data.replay_buffers")
    from rayrb.handle.output import Output
    from rayrb.io.arrays import from_numpy_dict

    ids = np.repeat(np.arange(6), [7, 2, 5, 1, 3, 6])
    n = ids.size
    done = np.zeros((n, 1), bool)
    done[np.cumsum([7, 2, 5, 1, 3, 6]) - 1] = True  # each episode's end, stored as a collector writes it
    rb = rb_mod.ReplayBuffer(storage=rb_mod.LazyTensorStorage(n), batch_size=8 * L,
                             sampler=rb_mod.SliceSampler(slice_len=L, traj_key="episode", strict_length=False))
    rb.extend(tensordict.TensorDict({"episode": torch.as_tensor(ids), "step": torch.arange(n),
                                     "is_init": torch.zeros(n, 1, dtype=torch.bool),
                                     "next": {"done": torch.as_tensor(done)}}, [n]))
    out = Output(SimpleNamespace(row_bytes=8), 8 * L, None, 1 << 30,
                 SimpleNamespace(slice_len=L, strict_length=False))
    torch.manual_seed(0)
    for _ in range(50):
        theirs, info = rb.sample(return_info=True)
        cuts = np.flatnonzero(info[("next", "truncated")].reshape(-1).numpy()) + 1
        bounds = np.concatenate([[0], cuts])
        starts, lengths = theirs["step"].numpy()[bounds[:-1]], np.diff(bounds)
        index = padded_steps(starts, lengths, L)  # the shard's read of the same slices
        assert index.size == 8 * L
        rows = {"step": index, "episode": ids[index], "is_init": np.zeros((index.size, 1), bool),
                "next/done": done[index]}
        td, _ = out.finish((rows, {"index": index}), True)
        assert td.shape == theirs.shape and td["step"].tolist() == theirs["step"].tolist()
        direct = out.finish_tensors((from_numpy_dict(rows), {"index": torch.from_numpy(index)}), False)  # tensors
        for key in (("next", "truncated"), ("next", "done"), "is_init"):  # TorchRL's marks, in its info
            assert td[key].reshape(-1).tolist() == info[key].reshape(-1).tolist(), key
            assert direct[key].reshape(-1).tolist() == info[key].reshape(-1).tolist(), key


@pytest.mark.parametrize("epoch_end", ["short", "drop"])
def test_without_replacement_each_valid_slice_short_ones_included_comes_once_an_epoch(epoch_end):
    rng = np.random.default_rng(5)
    columns = [np.repeat(np.arange(n), rng.integers(1, 9, n)) for n in (20, 30)]
    shards = [shard(c, kind="slice_without_replacement") for c in columns]
    sizes = np.array([len(c) for c in columns])
    p = Planner({OFFLINE: 2, ONLINE: 1}, offline_fraction=1.0, sampler={OFFLINE: "slice_without_replacement",
                ONLINE: "slice"}, slice_len=L, epoch_end=epoch_end, seed=0)
    p.alloc.set_masses(OFFLINE, [s.mass(n) for s, n in zip(shards, sizes)], sizes)
    p.alloc.set_masses(ONLINE, [(0.0, 1.0)], np.array([0]))
    seen = [[] for _ in shards]
    while True:
        ((plan, reads),) = p.draw(5 * L, sizes={OFFLINE: sizes, ONLINE: np.array([0])})
        if p.stats()["epochs"][OFFLINE] == 2:
            break
        for part, (seed, kwargs) in zip(plan.parts, reads):
            idx = read_indices(shards[part.shard], [part.count], [seed], [kwargs["epoch"]], sizes[part.shard])
            seen[part.shard] += list(zip(*(x.tolist() for x in starts_of(idx))))
    assert any(length < L for got in seen for _, length in got)
    for c, got in zip(columns, seen):
        every = Slices(from_ids(c), L, strict_length=False)
        expected = set(zip(*(x.tolist() for x in every.locate(np.arange(every.total)))))
        assert any(length < L for _, length in expected)
        assert len(got) == len(set(got)) and (set(got) == expected if epoch_end == "short" else set(got) <= expected)


def test_reads_that_cannot_drop_the_padding_are_refused_before_anything_is_planned():
    from rayrb.errors import InvalidArgumentError
    from rayrb.handle.learners import Learners

    learners = Learners(None, SimpleNamespace(short=True), "rb", "object_store", "cpu")  # no rpc: nothing planned
    for kwargs in ({"return_info": False}, {"return_info": True, "postprocess": print}):
        with pytest.raises(InvalidArgumentError, match="return_info=True and no postprocess"):
            learners._slices(8, 1, **kwargs)
    learners.learners = [object()]
    with pytest.raises(InvalidArgumentError, match="strict_length=True"):
        learners.feed("update", 8)
