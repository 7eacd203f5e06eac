"""Episodes kept up to date write by write (``rayrb.core.episode_stream``, ``EpisodeSlices``) against episodes found
again over every row: on random writes, wraps, writes out of order, rows left torn and restores, the two agree, and
a shard and a reader of its files (another process, told only the write count) draw the same slices."""
import numpy as np
import pytest

from rayrb.core.episode_stream import appended, scan
from rayrb.core.samplers import make_sampler
from rayrb.errors import DrawError, InvalidArgumentError


def episodes(stream):
    return stream.episodes.starts.tolist(), stream.episodes.stops.tolist()


def column_of(rng, n, ends):
    """``n`` random steps: end flags (set one time in seven or so), or trajectory ids among 4 (a run of one id is
    an episode; an id may come back after another's)."""
    if ends:
        return rng.random(n) < 0.15
    return rng.integers(0, 4, n)


@pytest.mark.parametrize("ends", [False, True])
@pytest.mark.parametrize("capacity", [0, 7, 40])
def test_appending_writes_gives_the_episodes_a_scan_of_the_rows_held_gives(ends, capacity):
    rng = np.random.default_rng(capacity + ends)
    for _ in range(30):
        column = column_of(rng, 200, ends)
        cuts = np.sort(rng.choice(np.arange(1, 200), 25, replace=False))
        stream = scan(column[:cuts[0]][-capacity:] if capacity else column[:cuts[0]],
                      np.arange(max(0, cuts[0] - capacity) if capacity else 0, cuts[0]), ends)
        for a, b in zip(cuts, [*cuts[1:], 200]):
            if capacity and b - a >= capacity:
                with pytest.raises(InvalidArgumentError, match="fewer than the capacity"):
                    appended(stream, column[a:b], ends, capacity)
                low = b - capacity
                stream = scan(column[low:b], np.arange(low, b), ends)
                continue
            stream = appended(stream, column[a:b], ends, capacity)
            low = max(0, b - capacity) if capacity else 0
            expected = scan(column[low:b], np.arange(low, b), ends)
            assert (stream.low, stream.high, stream.size) == (low, b, b - low)
            assert episodes(stream) == episodes(expected)


def test_a_missing_row_or_a_torn_one_ends_appending_and_cuts_the_episode():
    gap = scan(np.array([1, 1, 1, 1]), np.array([3, 4, 6, 7]), ends=False)
    assert episodes(gap) == ([3, 6], [5, 8]) and not gap.contiguous
    torn = scan(np.array([1, 1]), np.array([0, 1]), ends=False, whole=False)
    for stream in (gap, torn):
        with pytest.raises(InvalidArgumentError, match="contiguous"):
            appended(stream, np.array([1]), False, 0)
    with pytest.raises(InvalidArgumentError, match="prefix"):
        gap.prefix(2)


class Ring:
    """An online shard's slots as ``OnlineShard`` writes them: row ``w`` at slot ``w mod capacity``, generation
    ``w // capacity + 1``, and its write count (the shard's sampler and a fresh one bound with it as ``count``)."""

    def __init__(self, capacity, ends, kind="slice", slice_len=3, strict=True):
        self.capacity, self.ends = capacity, ends
        self.column = np.zeros(capacity, bool if ends else np.int64)
        self.generation = np.zeros(capacity, np.int64)
        self.written = np.zeros(1, np.int64)
        opts = dict(slice_len=slice_len, slice_key="k", slice_ends=ends, slice_strict=strict)
        self.shard = make_sampler(kind, capacity, **opts)
        self.shard.bind({"k": self.column}, self.generation, count=self.written)
        self.reader = make_sampler(kind, capacity, **opts)  # another process: told only the write count
        self.reader.bind({"k": self.column}, self.generation, self.written)
        self.opts, self.kind = opts, kind

    def write(self, values, first=None, count=True):
        first = int(self.written[0]) if first is None else first
        w = first + np.arange(len(values))
        slots = w % self.capacity
        self.column[slots], self.generation[slots] = values, w // self.capacity + 1
        self.shard.on_write(slots)
        if count:
            self.written[0] = max(int(self.written[0]), first + len(values))

    def fresh(self):
        s = make_sampler(self.kind, self.capacity, **self.opts)
        s.bind({"k": self.column}, self.generation, count=self.written)
        s.on_write(np.arange(self.size()))
        return s

    def size(self):
        return min(int(self.written[0]), self.capacity)


def slices_of(sampler, size):
    s = sampler._slices(size)
    return s.episodes.starts.tolist(), s.episodes.stops.tolist(), s.total


@pytest.mark.parametrize("ends", [False, True])
@pytest.mark.parametrize("strict", [True, False])
def test_a_shard_and_a_reader_of_its_files_keep_the_episodes_a_fresh_scan_finds(ends, strict):
    rng = np.random.default_rng(7 + ends + 2 * strict)
    ring = Ring(24, ends, strict=strict)
    scans = {"shard": 0, "reader": 0}
    for who in scans:  # counts how often each finds the episodes again over every slot
        sampler = getattr(ring, who)
        sampler._held._scan = (lambda scan_all, who: lambda size: scans.__setitem__(who, scans[who] + 1) or scan_all(size)
                               )(sampler._held._scan, who)
    early = 0
    for step in range(300):
        ring.write(column_of(rng, int(rng.integers(1, 9)), ends))
        n = ring.size()
        expected = slices_of(ring.fresh(), n)
        assert slices_of(ring.shard, n) == expected and slices_of(ring.reader, n) == expected, step
        if expected[2]:  # the same seed draws the same steps in both, as a fresh sampler does
            k = 3 * int(rng.integers(1, 4))
            draws = [s.sample(k, n, np.random.default_rng(step)) for s in (ring.shard, ring.reader, ring.fresh())]
            assert all(np.array_equal(draws[0], d) for d in draws[1:])
        if step % 17 == 0 and int(ring.written[0]) > 5:  # a read planned at an earlier count
            m = min(int(ring.written[0]) - 3, ring.capacity)
            assert slices_of(ring.shard, m) == slices_of(ring.fresh(), m)
            early += 1
    # found once at the start, then kept by appends (a read planned before the wrap may scan its own rows)
    assert scans["reader"] == 1 and 1 <= scans["shard"] <= 1 + early, (scans, early)


@pytest.mark.parametrize("kind", ["slice", "prioritized_slice"])
def test_writes_out_of_order_torn_rows_and_restores_are_found_again(kind):
    """A piece applied ahead of the one before it (a gap), a row left torn (a negative generation), a restore that
    rewrote the slots: each time the kept episodes equal a fresh scan's, and never span the gap."""
    rng = np.random.default_rng(3)
    ring = Ring(16, ends=False, kind=kind, slice_len=2)
    ring.write(np.repeat([1, 2], [6, 6]))
    assert slices_of(ring.shard, 12) == slices_of(ring.fresh(), 12)
    ring.write(np.full(3, 2), first=14, count=False)  # rows 14..16 ahead of rows 12..13 (held beyond the count)
    ring.write(np.full(2, 2), first=12)  # the piece before them: the count moves over both
    ring.written[0] = 17
    assert slices_of(ring.shard, 16) == slices_of(ring.fresh(), 16)
    assert slices_of(ring.reader, 16) == slices_of(ring.fresh(), 16)
    ring.generation[5] = -ring.generation[5]  # row 21 being written (slot 5), another process's view
    ring.column[5] = 9
    ring.written[0] = 22
    torn = slices_of(ring.reader, 16)
    assert torn == slices_of(ring.fresh(), 16)
    ring.generation[5] = -ring.generation[5]
    ring.shard.on_write(np.array([5]))
    ring.column[:] = rng.integers(0, 3, 16)  # a restore over the same slots at the same count
    ring.shard.load_state_dict(ring.shard.state_dict() if kind != "slice" else {})
    assert slices_of(ring.shard, 16) == slices_of(ring.fresh(), 16)


@pytest.mark.parametrize("strict", [True, False])
def test_prioritized_starts_follow_writes_and_priority_updates_as_a_fresh_build_of_them(strict):
    """The starts' tree updated near each write equals one built from nothing over the same rows and priorities:
    the same valid starts, mass and smallest p; the same draws from the same seed; built once, then updated."""
    rng = np.random.default_rng(11 + strict)
    ring = Ring(32, ends=False, kind="prioritized_slice", slice_len=3, strict=strict)
    builds = []
    set_starts = ring.shard._set_starts
    ring.shard._set_starts = lambda slots, valid: builds.append(valid is None) or set_starts(slots, valid)
    for step in range(200):
        ring.write(column_of(rng, int(rng.integers(1, 7)), False))
        n = ring.size()
        if step % 3 == 0:  # a learner's priorities for some held steps
            idx = rng.choice(n, size=min(n, 5), replace=False)
            ring.shard.update_priority(idx, rng.random(idx.size) * 10)
        fresh = ring.fresh()
        fresh.load_state_dict(ring.shard.state_dict())  # the same priorities, the tree built from them
        mass, expected = ring.shard.mass(n), fresh.mass(n)
        assert mass[0] == pytest.approx(expected[0]) and mass[1] == pytest.approx(expected[1]), step
        assert np.array_equal(ring.shard._valid, fresh._valid), step
        if expected[0] > 0:
            got = ring.shard.sample(6, n, np.random.default_rng(step))
            assert np.array_equal(got, fresh.sample(6, n, np.random.default_rng(step))), step
    assert sum(builds) == 1, sum(builds)  # the first read built it; every write after only updated it


@pytest.mark.parametrize("ends", [False, True])
def test_a_ring_written_in_order_is_read_without_sorting_as_sorting_it_reads(ends):
    rng = np.random.default_rng(5)
    ring = Ring(20, ends)
    for _ in range(60):
        ring.write(column_of(rng, int(rng.integers(1, 9)), ends))
        for n in sorted({ring.size(), max(1, ring.size() - 4)}):
            rows = (ring.generation[:n] - 1) * 20 + np.arange(n)
            order = np.argsort(rows, kind="stable")
            expected = scan(ring.column[order], rows[order], ends)
            got = ring.shard._held._scan(n)
            assert (got.low, got.high, got.contiguous) == (expected.low, expected.high, expected.contiguous)
            assert episodes(got) == episodes(expected)


def test_a_reader_whose_count_moves_past_a_piece_stored_ahead_finds_the_overwritten_rows_gone():
    """Capacity 8: rows 0-9 held at count 10; a piece of rows 14-15 stored ahead (slots 6-7: rows 6-7 overwritten),
    then rows 10-11 land (count 12). The reader, told only the count, holds what a fresh scan holds and draws the
    same slices, as the shard does."""
    ring = Ring(8, ends=False, slice_len=2)
    ring.write(np.ones(10, np.int64))
    assert slices_of(ring.reader, 8) == slices_of(ring.fresh(), 8)
    ring.write(np.full(2, 3), first=14, count=False)
    ring.write(np.full(2, 2), first=10)
    expected = slices_of(ring.fresh(), 8)
    assert slices_of(ring.reader, 8) == expected == slices_of(ring.shard, 8)
    draws = [s.sample(8, 8, np.random.default_rng(1)).tolist() for s in (ring.reader, ring.shard, ring.fresh())]
    assert draws[0] == draws[1] == draws[2]


@pytest.mark.parametrize("kind", ["slice", "prioritized_slice"])
def test_pieces_landing_in_any_order_leave_the_episodes_a_fresh_scan_finds(kind):
    """Pieces of writes land in any order, as a shard applies them (``OnlineShard._store_rows``): a slot keeps the
    newest row, so a late piece whose every slot already holds newer rows keeps none, and the count moves over the
    pieces up to the first still to come. After every landing the shard's episodes equal a fresh scan's (so its
    mass counts the rows a count passed that were stored ahead of it), and so do a reader's once the count moved."""
    rng = np.random.default_rng(21)
    ring = Ring(8, ends=False, kind=kind, slice_len=2)
    evicted = 0
    for _ in range(120):
        start = int(ring.written[0])
        bounds = start + np.concatenate([[0], np.cumsum(rng.integers(1, 7, size=rng.integers(1, 5)))])
        pieces = list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
        landed = set()
        for i in rng.permutation(len(pieces)).tolist():
            a, b = pieces[i]
            w = np.arange(a, b)
            slots, gen = w % 8, w // 8 + 1
            fresh = ring.generation[slots] < gen
            evicted += not fresh.any()
            ring.column[slots[fresh]], ring.generation[slots[fresh]] = rng.integers(0, 2), gen[fresh]
            ring.shard.on_write(slots[fresh])
            landed.add(i)
            before = int(ring.written[0])
            ring.written[0] = bounds[next((j for j in range(len(pieces)) if j not in landed), len(pieces))]
            n = ring.size()
            expected = slices_of(ring.fresh(), n)
            assert slices_of(ring.shard, n) == expected
            if int(ring.written[0]) != before and kind == "slice":
                assert slices_of(ring.reader, n) == expected
    assert evicted > 5  # late pieces that kept no slot


@pytest.mark.parametrize("kind", ["slice", "prioritized_slice"])
def test_a_read_planned_before_the_shard_filled_whose_slices_were_all_overwritten_draws_over_what_it_holds(kind):
    """Capacity 8, slices of 3: a read planned at count 4 (rows 0-3, one episode: 2 slices) reaches the shard at
    count 10, when rows 8-9 (two episodes of one step) overwrote slots 0-1: the 4 slots it was planned over hold
    no whole slice. It draws its slices over every slot held instead (rows 4-7, one episode), as the shard and a
    reader of its files both do, and each step's ``episode_start`` is that of the rows the read found."""
    ring = Ring(8, ends=False, kind=kind, slice_len=3)
    ring.write(np.ones(4, np.int64))
    readers = [ring.shard, ring.reader] if kind == "slice" else [ring.shard]
    for sampler in readers:
        assert sampler.mass(4)[0] > 0
    ring.write(np.array([2, 2, 2, 2, 3, 4]))
    assert slices_of(ring.fresh(), 4)[2] == 0 and slices_of(ring.fresh(), 8)[2] == 2
    draws = []
    for sampler in readers:
        slots = sampler.sample(3 * 5, 4, np.random.default_rng(0))
        rows = (ring.generation[slots] - 1) * 8 + slots
        assert set(rows.tolist()) <= {4, 5, 6, 7} and (np.diff(rows.reshape(-1, 3), axis=1) == 1).all()
        assert sampler.info(slots, ring.generation[slots])["episode_start"].tolist() == [4] * 15
        draws.append(slots.tolist())
    assert all(d == draws[0] for d in draws)
    ring.write(np.array([5, 6, 7, 8, 9, 10, 11, 12]))  # every slot a one-step episode: nothing to draw anywhere
    with pytest.raises(DrawError, match="no episode here holds that many"):
        ring.shard.sample(3, 4, np.random.default_rng(0))


def test_a_read_over_more_slots_than_bound_is_refused():
    ring = Ring(4, ends=False, slice_len=2)
    ring.write(np.ones(4, np.int64))
    with pytest.raises(InvalidArgumentError, match="at most the 4 slots bound, got a read over 5"):
        ring.shard.mass(5)


@pytest.mark.parametrize("kind", ["slice", "prioritized_slice"])
def test_no_slice_reads_a_row_at_or_past_the_write_count(kind):
    """Contract 11: a piece stored ahead of one still to come (rows 12-13 while 10-11 are on their way: the count
    stays 10) is not acknowledged; the shard, a reader of its files and a fresh build draw none of its rows, and
    the rows it overwrote (rows 4-5) are gone: no slice spans them."""
    ring = Ring(8, ends=False, kind=kind, slice_len=2)
    ring.write(np.ones(10, np.int64))
    ring.write(np.full(2, 2), first=12, count=False)
    readers = [ring.reader] if kind == "slice" else []  # slices by priority are read by their shard only
    for sampler in (ring.shard, *readers, ring.fresh()):
        slots = sampler.sample(2 * 300, 8, np.random.default_rng(0))
        rows = ((ring.generation[slots] - 1) * 8 + slots).reshape(-1, 2)
        assert (rows < 10).all() and set(rows[:, 0].tolist()) == {2, 6, 7, 8}  # rows 2-3 and 6-9 held, whole
        assert (np.diff(rows, axis=1) == 1).all()
