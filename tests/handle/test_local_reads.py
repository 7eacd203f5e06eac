"""Reads a handle makes itself, from the files its node's shards map (rayrb.handle.local): the same rows as the
shards' reads, or a read sent to the shard; never a row torn, stale or from files made afresh."""
from __future__ import annotations

import itertools
import multiprocessing
import os
import shutil
import time
import uuid

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rayrb.actors.lifecycle import actor_class
from rayrb.actors.online_shard import OnlineShard
from rayrb.core.layout import Copy, Shard, ShardLayout
from rayrb.core.schema import RowSpec
from rayrb.handle.local import OfflineReader, OnlineReader

WIDTH = 16
SPEC = RowSpec.from_arrays({"x": np.zeros((1, WIDTH), np.int64), "id": np.zeros(1, np.int64)})


def rows_from(first: int, n: int) -> dict[str, np.ndarray]:
    """Rows whose every value is the row's number in the shard's write stream: a torn row mixes two numbers."""
    w = np.arange(first, first + n, dtype=np.int64)
    return {"x": np.repeat(w[:, None], WIDTH, 1), "id": w}


def out_for(n: int) -> dict[str, np.ndarray]:
    return {"x": np.empty((n, WIDTH), np.int64), "id": np.empty(n, np.int64)}


def shard(directory, capacity=64) -> OnlineShard:
    return OnlineShard(SPEC.to_json(), capacity, "t/on-0", state_dir=str(directory))


def filled(tmp_path):
    """A 64-row shard holding rows 0..63, and a reader of its files: ``(directory, shard, reader)``."""
    d = tmp_path / "on-0"
    s = shard(d)
    s.extend(rows_from(0, 64), first=0)
    return d, s, OnlineReader(str(d), SPEC, 64, "uniform")


# -- no Ray: the reader against a shard in this process ----------------------------------------------------------
def test_a_local_read_gives_the_shards_rows_and_info(tmp_path):
    s = shard(tmp_path / "on-0")
    s.extend(rows_from(0, 100), first=0)  # wraps: slots hold rows 36..99
    r = OnlineReader(str(tmp_path / "on-0"), SPEC, 64, "uniform")
    out = out_for(40)
    info = r.read([25, 15], [7, 8], [None, None], 100, out)
    rows, want = s.sample_many([25, 15], [7, 8], None, 100)
    np.testing.assert_array_equal(out["id"], rows["id"])
    np.testing.assert_array_equal(info["index"], want["index"])
    np.testing.assert_array_equal(info["generation"], want["generation"])


def test_rows_being_written_or_not_yet_landed_go_to_the_shard(tmp_path):
    _, s, r = filled(tmp_path)
    assert r.read([8], [1], [None], 70, out_for(8)) is None  # planned after 6 rows that have not landed
    s._gen[:] = -np.abs(s._gen)  # every slot being written, as a shard marks them
    assert r.read([8], [1], [None], 64, out_for(8)) is None
    s._gen[:] = np.abs(s._gen)
    assert r.read([8], [1], [None], 64, out_for(8)) is not None


def test_a_row_overwritten_during_the_copy_is_not_served(tmp_path, monkeypatch):
    _, s, r = filled(tmp_path)
    real_take = np.ndarray.take
    state = {"wrote": False}

    class Rows(np.ndarray):
        def take(self, *args, **kwargs):  # the shard writes between the generations' read and the copy
            if not state["wrote"]:
                state["wrote"] = True
                s.extend(rows_from(64, 64), first=64)
            return real_take(self, *args, **kwargs)

    maps = r._current(time.monotonic())
    maps["rows"] = {k: v.view(Rows) for k, v in maps["rows"].items()}
    assert r.read([30], [3], [None], 64, out_for(30)) is None and state["wrote"]


def _writer(directory: str, ready, stop) -> None:
    s = shard(directory)
    w = int(s.written())
    ready.set()
    while not stop.is_set():
        s.extend(rows_from(w, 16), first=w)
        w += 16


def test_no_torn_or_mislabelled_row_while_another_process_overwrites_them(tmp_path):
    """A writer process laps a 64-row shard as fast as it can while this process reads it locally: every row a
    read returns is whole (one number throughout) and is the row its slot and generation say."""
    d = tmp_path / "on-0"
    s = shard(d)
    s.extend(rows_from(0, 64), first=0)
    s._lives.end()  # the writer process holds the shard from here, as a restarted shard would
    del s
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    writer = ctx.Process(target=_writer, args=(str(d), ready, stop))
    writer.start()
    try:
        assert ready.wait(120), "the writer process did not start"
        r = OnlineReader(str(d), SPEC, 64, "uniform")
        served = refused = 0
        deadline = time.time() + 3.0
        seed = 0
        while time.time() < deadline or served == 0 and time.time() < deadline + 30:
            out = out_for(32)
            info = r.read([32], [seed], [None], 64, out)
            seed += 1
            if info is None:
                refused += 1
                continue
            served += 1
            x = out["x"]
            assert (x == x[:, :1]).all(), "a torn row: two writes' values in one row"
            w = x[:, 0]
            assert (w % 64 == info["index"]).all() and (w // 64 + 1 == info["generation"]).all()
        assert served > 0 and writer.is_alive()  # rows were read locally while the writer still wrote
    finally:
        stop.set()
        writer.join(30)
    assert writer.exitcode == 0


def test_files_made_afresh_are_mapped_again_and_never_read_stale(tmp_path):
    d, s, r = filled(tmp_path)
    assert r.read([8], [1], [None], 64, out_for(8)) is not None
    (d / "layout.json").unlink()  # a directory half made: the next start makes the files afresh
    again = shard(d)
    r._checked = -1.0  # past the time a check holds
    assert r.read([8], [1], [None], 64, out_for(8)) is None  # the new shard holds no row yet
    again.extend(rows_from(1000, 64), first=0)
    out = out_for(8)
    assert r.read([8], [1], [None], 64, out) is not None and (out["id"] >= 1000).all()  # the new files


def test_a_shard_whose_process_is_gone_is_not_read_here(tmp_path):
    d, s, r = filled(tmp_path)
    assert r.read([8], [1], [None], 64, out_for(8)) is not None
    s._lives.end()  # the lease's lock goes with the process
    r._checked = -1.0
    assert r.read([8], [1], [None], 64, out_for(8)) is None


def test_online_rows_are_read_here_only_where_stores_are_seen_in_order(tmp_path, monkeypatch):
    """The generation check around a copy needs x86's store order: elsewhere the online shard reads its rows."""
    from rayrb.handle.local import LocalReads

    d, s, _ = filled(tmp_path)
    layout = one_online_shard(str(d))
    for machine, local in (("x86_64", True), ("aarch64", False)):
        monkeypatch.setattr("platform.machine", lambda: machine)
        reads = LocalReads(layout, SPEC, "node-a", lambda j: "node-a")
        assert (reads.reader("online", 0) is not None) is local, machine


def test_readers_let_go_of_the_shards_files_when_forgotten_or_closed(tmp_path):
    """A reader holds the shard's lease file open (and maps its rows): forgetting a shard closes its reader, closing
    the reads (a closed handle's) closes every one; a shard asked for again is read from a fresh reader."""
    from rayrb.durability.lease import FILE
    from rayrb.handle.local import LocalReads

    d, s, r = filled(tmp_path)
    r.close()

    def open_leases() -> int:
        return sum(os.path.realpath(f"/proc/self/fd/{fd}") == str((d / FILE).resolve())
                   for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}"))

    before = open_leases()  # the shard's own
    reads = LocalReads(one_online_shard(str(d)), SPEC, "node-a", lambda j: "node-a")
    reader = reads.reader("online", 0)
    assert reader is not None and open_leases() == before + 1
    assert reads.read_into("online", 0, ([8], [1], [None], 64), out_for(8)) is not None
    reads.forget("online", 0)
    assert open_leases() == before
    assert reads.read_into("online", 0, ([8], [1], [None], 64), out_for(8)) is not None  # asked again: a new reader
    assert reads.reader("online", 0) is not reader and open_leases() == before + 1
    reads.close()
    assert open_leases() == before
    reader.close()  # twice: nothing more to close
    assert open_leases() == before


def test_a_handle_beside_a_replica_and_not_its_shard_reads_the_replica(tmp_path):
    """With online_replicas, a node may hold a shard's replica and not the shard: its handles read the replica's
    files; a node with neither reads through the shard."""
    from rayrb.handle.local import LocalReads

    filled(tmp_path)  # the primary, on node-a
    copy = shard(tmp_path / "on-0.r1")
    copy.extend(rows_from(0, 64), first=0)
    layout = one_online_shard(str(tmp_path / "on-0"), copies=(Copy("t/on-0.r1", str(tmp_path / "on-0.r1")),))
    nodes = {0: "node-a", "t/on-0.r1": "node-b"}
    beside = LocalReads(layout, SPEC, "node-b", nodes.get).reader("online", 0)
    assert beside is not None and beside._dir == str(tmp_path / "on-0.r1")
    out = out_for(8)
    assert beside.read([8], [1], [None], 64, out) is not None
    np.testing.assert_array_equal(out["id"], copy.sample_many([8], [1], None, 64)[0]["id"])
    assert LocalReads(layout, SPEC, "node-c", nodes.get).reader("online", 0) is None


def one_online_shard(directory: str, copies: tuple = (), sampler: str = "uniform") -> ShardLayout:
    """A layout of one online shard of 64 slots whose files are in ``directory``."""
    return ShardLayout("t", "t-0", None, (Shard("online", 0, "on-0", "t/on-0", directory, sampler, capacity=64,
                                               copies=copies),))


def test_an_offline_reader_draws_what_the_shard_draws(tmp_path):
    from rayrb import write_dataset
    from rayrb.actors.shards import OfflineShard
    from rayrb.core.plans import Epoch

    n = 500
    root = str(write_dataset(TensorDict({"id": torch.arange(n)}, [n]), tmp_path / "ds", chunk_rows=70).root)
    for sampler, epochs in (("uniform", [None, None]), ("without_replacement", [Epoch(1, 9, 300, 0),
                                                                             Epoch(1, 9, 300, 40)])):
        sh = OfflineShard(root, 100, 400, "t/off", sampler)
        reader = OfflineReader(root, 100, 400, sampler)
        out = {"id": np.empty(70, np.int64)}
        info = reader.read([40, 30], [5, 6], epochs, None, out)
        rows, want = sh.sample_many([40, 30], [5, 6], epochs)
        np.testing.assert_array_equal(out["id"], rows["id"])
        np.testing.assert_array_equal(info["index"], want["index"])


@pytest.mark.parametrize("sampler", ["uniform", "without_replacement", "prioritized"])
def test_an_online_shard_and_a_reader_of_its_files_agree_on_every_read_for_every_sampler(tmp_path, sampler):
    """One read rule (rayrb.core.reads.read_size, read_indices; rayrb.durability.storage.whole): over random
    plans, every write count a plan may carry (behind, at, past the shard's; wrapped or not), the reader gives the
    shard's rows and info, or defers to the shard; a sampler whose indices need the shard's state never reads here."""
    from rayrb.core.plans import Epoch

    d = tmp_path / "on-0"
    s = OnlineShard(SPEC.to_json(), 64, "t/on-0", sampler, state_dir=str(d))
    reader = OnlineReader(str(d), SPEC, 64, sampler)
    rng = np.random.default_rng(0)
    served = deferred = 0
    for written_now in (10, 64, 100, 150):
        s.extend(rows_from(s.written(), written_now - s.written()), first=s.written())
        for _ in range(25):
            counts = [int(c) for c in rng.integers(1, 9, size=rng.integers(1, 4))]
            seeds = [int(x) for x in rng.integers(0, 2**31, size=len(counts))]
            planned = int(rng.integers(1, written_now + 20))  # at most 20 rows past what the shard holds
            size = min(planned, 64)
            epochs = [Epoch(1, 3, size, int(rng.integers(0, 3))) for _ in counts] \
                if sampler == "without_replacement" else [None] * len(counts)
            if sampler == "without_replacement" and sum(counts) > size:
                continue
            out = out_for(sum(counts))
            info = reader.read(counts, seeds, epochs, planned, out) if sampler != "prioritized" else None
            theirs = s.sample_many(counts, seeds, epochs, planned)
            if theirs is None:  # planned past the shard's rows: neither reads
                assert info is None and planned > written_now
                continue
            if info is None:
                deferred += 1
                continue
            served += 1
            rows, want = theirs
            np.testing.assert_array_equal(out["id"], rows["id"])
            np.testing.assert_array_equal(info["index"], want["index"])
            np.testing.assert_array_equal(info["generation"], want["generation"])
    if sampler == "prioritized":  # the sum tree lives in the shard: no reader of its files is ever made
        from rayrb.handle.local import LocalReads

        assert LocalReads(one_online_shard(str(d), sampler=sampler), SPEC, "n", lambda j: "n").reader("online", 0) is None
    else:
        assert served > 50 and deferred == 0


# -- through Ray ----------------------------------------------------------------------------------------------------
def ids(start, n):
    i = torch.arange(start, start + n)
    return TensorDict({"obs": i.float()[:, None], "id": i}, [n])


KW = {"online_capacity": 300, "num_offline_shards": 2, "num_online_shards": 2, "seed": 4, "batch_size": 16,
      "offline_fraction": 0.5}


@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("sampler", ["uniform", "without_replacement"])
def test_the_stream_is_the_same_with_local_reads_on_and_off(make_buffer, sampler):
    on, off = (make_buffer(ids(0, 400), **KW, sampler=sampler, local_reads=flag) for flag in (True, False))
    for rb in (on, off):
        rb.extend(ids(1000, 120))
    for step in range(40):
        (a, ia), (b, ib) = (rb.sample(return_info=True) for rb in (on, off))
        assert torch.equal(a["id"], b["id"]), step
        for key in ("offline", "shard", "index", "generation"):
            assert torch.equal(ia[key], ib[key]), (step, key)
        if step % 9 == 4:  # writes wrap the online shards (150 rows each) under the reads
            for rb in (on, off):
                rb.extend(ids(2000 + 100 * step, 100))
    its = [rb.iter_batches(prefetch=3, return_info=True) for rb in (on, off)]
    for (a, ia), (b, ib) in itertools.islice(zip(*its), 30):
        assert torch.equal(a["id"], b["id"]) and torch.equal(ia["generation"], ib["generation"])
    assert on.stats()["handle"]["local_reads"] > 0 and off.stats()["handle"].get("local_reads", 0) == 0
    assert on.stats()["handle"]["reads"] == 0  # every part was read here: no shard read at all
    # Offline rows read from the files (as if cold): the rows planned next named ahead (rayrb.io.read_ahead), same stream
    datasets = [r._ds for r in on.local_reads._readers.values() if isinstance(r, OfflineReader)]
    for ds in datasets:
        ds.reads = "read"
    for step in range(40):
        (a, ia), (b, ib) = (rb.sample(return_info=True) for rb in (on, off))
        assert torch.equal(a["id"], b["id"]) and torch.equal(ia["index"], ib["index"]), step
    assert len(datasets) == 2 and sum(ds._ahead.stats["hints"] + ds._ahead.stats["cached"] for ds in datasets) > 0


@pytest.mark.usefixtures("ray_session")
def test_a_shard_killed_restarted_or_losing_its_files_under_a_handle_gives_the_right_rows(make_buffer, tmp_path):
    from restart_util import kill_and_wait

    on, off = (make_buffer(ids(0, 400), **KW, local_reads=flag) for flag in (True, False))
    for rb in (on, off):
        rb.extend(ids(1000, 300))

    def same(n):
        for _ in range(n):
            (a, ia), (b, ib) = (rb.sample(return_info=True) for rb in (on, off))
            assert torch.equal(a["id"], b["id"]) and torch.equal(ia["generation"], ib["generation"])

    same(5)
    kill_and_wait(on.rpc.by_side["online"][0])  # its maps stay valid; while it restarts, the shard reads
    same(10)
    fell_back = on.stats()["handle"]["fell_back_reads"]
    lost = on._sampling.layout.online[1].directory  # this buffer's second online shard
    shutil.rmtree(lost)  # this node lost the shard's files: the process still maps what it held
    same(10)
    assert on.stats()["handle"]["fell_back_reads"] > fell_back  # read by the shard, not from a stale map
    assert on.stats()["handle"]["local_reads"] > 0


class PausedShard(OnlineShard):
    """An online shard that can be held busy: what is sent to it behind ``pause`` waits, as behind a slow copy."""

    def pause(self, seconds: float) -> None:
        time.sleep(seconds)


def test_after_a_restore_a_handle_beside_a_replica_never_reads_its_rows_from_before(ray_session, tmp_path):
    """A restore into a primary whose replica is busy: once the restore has returned, a reader of the replica's
    files (a handle on its node) serves the restored rows or goes to the primary, never the replica's older rows
    (their count, 128, covers the 64 rows the restored primary counts)."""
    ray = ray_session
    tag = uuid.uuid4().hex[:8]
    cls = actor_class(PausedShard)
    dirs = [tmp_path / "on-0", tmp_path / "on-0.r1"]
    replica = cls.options(name=f"{tag}/on-0.r1", num_cpus=0).remote(SPEC.to_json(), 64, f"{tag}/on-0.r1",
                                                                  state_dir=str(dirs[1]))
    primary = cls.options(name=f"{tag}/on-0", num_cpus=0).remote(SPEC.to_json(), 64, f"{tag}/on-0",
                                                                 state_dir=str(dirs[0]), replicas=[f"{tag}/on-0.r1"])
    try:
        def write(first):
            ref = ray.put(rows_from(first, 64))
            ray.get(primary.extend.remote(ref, 0, 64, first=first, forward=[ref]))

        write(0)
        saved = ray.get(primary.state.remote())
        write(64)  # laps the shard: every slot holds a row the restore takes back
        reader = OnlineReader(str(dirs[1]), SPEC, 64, "uniform")
        assert reader.read([8], [1], [None], 128, out_for(8)) is not None  # read here, from the replica
        replica.pause.remote(2.0)  # the replica busy when the restore reaches it
        ray.get(primary.load_state.remote(saved))
        for seed in range(20):
            out = out_for(32)
            info = reader.read([32], [seed], [None], 64, out)
            assert info is None or (out["id"] < 64).all(), (
                f"served ids {sorted(set(out['id'].tolist()))[:6]} (generations {sorted(set(info['generation']))}; "
                "the primary counts 64 rows): rows from before the restore")
        assert info is not None  # the replica holds the restored rows: read here again
    finally:
        [ray.kill(actor, no_restart=True) for actor in (primary, replica)]


@pytest.mark.usefixtures("ray_session")
def test_a_handle_that_cannot_open_the_chunks_reads_from_the_shards(make_buffer):
    rb = make_buffer(ids(0, 400), **KW)
    rb.extend(ids(1000, 50))
    twin = rb.client(local_reads=False)
    handle = rb.client(prefetch=0)
    [twin.sample() for _ in range(6)]  # the shards map their chunks now: a process holds its maps when the path goes
    os.rename(rb.dataset_root, rb.dataset_root + ".moved")  # the shards keep their maps; this path is gone here
    try:
        batch, info = handle.sample(return_info=True)
        assert len(batch) == 16 and torch.equal(info["offline"], batch["id"] < 1000)
        assert handle.local_reads.reader("offline", 0) is None and handle.local_reads.reader("online", 0) is not None
        assert len(twin.sample()) == 16
    finally:
        os.rename(rb.dataset_root + ".moved", rb.dataset_root)
