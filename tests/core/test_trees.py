"""The sum and min trees under prioritized sampling: every update path (a write's run of slots, a batch's scattered
slots with repeats, a rebuild) agrees with the values it holds, and a shard's smallest ``p`` follows its writes,
priority updates and reloads."""
from __future__ import annotations

import numpy as np
import pytest

from rayrb.core.priorities import MinTree, PrioritizedSampler, SumTree
from rayrb.core.prioritized_slices import PrioritizedEpisodeSlices


def _updates(rng: np.random.Generator, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """A write's run of slots (wrapping), a batch of scattered ones with repeats, or one slot."""
    kind = rng.integers(3)
    if kind == 0:
        k = int(rng.integers(1, capacity + 1))
        idx = (int(rng.integers(capacity)) + np.arange(k)) % capacity
    elif kind == 1:
        idx = rng.integers(0, capacity, int(rng.integers(1, 300)))
    else:
        idx = rng.integers(0, capacity, 1)
    return idx, rng.random(idx.size) * 10 ** rng.uniform(-3, 3, idx.size)


@pytest.mark.parametrize("capacity", [1, 2, 3, 7, 64, 1000, 5000])
def test_every_update_path_leaves_the_trees_equal_to_their_values(capacity):
    rng = np.random.default_rng(capacity)
    total, low = SumTree(capacity), MinTree(capacity)
    values = np.zeros(capacity)
    lows = np.full(capacity, np.inf)
    for step in range(200):
        if step % 50 == 49:  # a rebuild from the values, as a restore does
            values = rng.random(capacity)
            lows = values.copy()
            total.fill(values)
            low.fill(values)
        idx, v = _updates(rng, capacity)
        total.update(idx, v)
        low.update(idx, v)
        last = {int(i): x for i, x in zip(idx, v)}  # repeated slots: the last value wins
        values[list(last)] = list(last.values())
        lows[list(last)] = list(last.values())
        assert np.isclose(total.total(), values.sum(), rtol=1e-9)
        assert low.min() == lows.min()
        a, b = sorted(rng.integers(0, capacity + 1, 2))
        assert np.isclose(total.range_sum(a, b), values[a:b].sum(), rtol=1e-9, atol=1e-12)
        assert low.range_min(a, b) == (lows[a:b].min() if b > a else np.inf)
        assert np.array_equal(total.values(np.arange(capacity)), values)


def test_a_tree_is_the_same_whichever_way_its_values_came():
    """A node is always its children's sum, added in one order: updates and a rebuild give the same tree, bit for
    bit (a restarted shard's draws follow the same sums)."""
    rng = np.random.default_rng(0)
    capacity = 777
    by_updates, rebuilt = SumTree(capacity), SumTree(capacity)
    for _ in range(100):
        by_updates.update(*_updates(rng, capacity))
    rebuilt.fill(by_updates.values(np.arange(capacity)))
    assert np.array_equal(by_updates._tree, rebuilt._tree)
    u = rng.uniform(0, by_updates.total(), 1000)
    assert np.array_equal(by_updates.find(u), rebuilt.find(u))


def test_a_shards_smallest_p_follows_writes_updates_and_reloads():
    rng = np.random.default_rng(1)
    capacity = 500
    s = PrioritizedSampler(capacity, alpha=0.7, eps=1e-6)
    p = np.zeros(capacity)
    written = 0
    for step in range(300):
        k = int(rng.integers(1, 40))
        slots = (written + np.arange(k)) % capacity
        s.on_write(slots)
        p[slots] = s.max_priority ** s.alpha
        written += k
        size = min(written, capacity)
        assert s.mass(size)[1] == p[:size].min()
        idx = rng.integers(0, size, int(rng.integers(1, 64)))
        pr = rng.random(idx.size) * 5
        s.update_priority(idx, pr)
        stored = (np.abs(pr) + s.eps) ** s.alpha
        last = {int(i): x for i, x in zip(idx, stored)}
        p[list(last)] = list(last.values())
        assert s.mass(size)[1] == p[:size].min()
        if step % 100 == 99:  # a restart: the shard's mapped priorities reloaded, and its state loaded
            mirror, top = s.tree.values(np.arange(capacity)).copy(), np.array([s.max_priority])
            fresh = PrioritizedSampler(capacity, alpha=0.7, eps=1e-6)
            fresh.attach(mirror, top, reopened=True)
            assert fresh.mass(size) == s.mass(size)
            loaded = PrioritizedSampler(capacity, alpha=0.7, eps=1e-6)
            loaded.mass(size)  # its minima made before the load: the load must move them
            loaded.load_state_dict(s.state_dict())
            assert loaded.mass(size)[1] == p[:size].min()
            s = loaded


def test_the_smallest_p_of_a_valid_slice_start_follows_writes_and_priority_updates():
    rng = np.random.default_rng(2)
    capacity, slice_len = 400, 8
    s = PrioritizedEpisodeSlices(capacity, alpha=0.6, eps=1e-6, slice_len=slice_len, slice_key="episode")
    episode = np.zeros(capacity, np.int64)
    generation = np.zeros(capacity, np.int64)
    s.bind({"episode": episode}, generation)
    written, number = 0, 0
    for _ in range(150):
        k = int(rng.integers(1, 30))
        rows = written + np.arange(k)
        slots = rows % capacity
        if rng.random() < 0.3:
            number += 1
        episode[slots], generation[slots] = number, rows // capacity + 1
        s.on_write(slots)
        written += k
        size = min(written, capacity)
        idx = rng.integers(0, size, 16)
        s.update_priority(idx, rng.random(16) * 3)
        total, low = s.mass(size)
        starts = s._slots(s._slices(size).first_steps())
        if starts.size == 0:
            assert (total, low) == (0.0, 1.0)
            continue
        assert low == s._p.tree.values(starts).min()
        assert np.isclose(total, s._p.tree.values(starts).sum(), rtol=1e-9)
