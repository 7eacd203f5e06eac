"""Shard actors: thin shells around storage and a sampler.

* ``OfflineShard`` maps a contiguous row range of a chunk dataset read-only
  (memory maps; nothing copied into the heap or through the object store).
* ``OnlineShard`` is a circular buffer that copies rows on insert, so it never
  keeps a view into an object-store buffer (pinned plasma memory, ray#8234).

Both return rows as flat dicts of numpy arrays plus provenance (local index and
the slot's generation: how many times it has been written). They import numpy
only, not torch, so each costs little memory and starts fast.

Writes come from the coordinator, which runs one caller's tasks in order; reads
come from the handles that asked for the plans. A read carries the online write
count it was planned with: it draws over those rows, and one that arrives before
those writes have landed draws nothing and is asked again (``docs/architecture.md``).
"""
from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rayrb.actors.lifecycle import begin
from rayrb.actors.metrics import ActorMetrics
from rayrb.actors.replication import Replication, lookup
from rayrb.actors.timer import every
from rayrb.core.plans import Epoch
from rayrb.core.samplers import make_sampler, read_indices
from rayrb.core.schema import RowSpec
from rayrb.core.validation import ALPHA, EPS, positive_int
from rayrb.durability.copies import merged_count, take_newer
from rayrb.durability.storage import OnlineStorage, PriorityStore, remove_directory
from rayrb.durability.writelog import held_runs
from rayrb.errors import InvalidArgumentError, RowIndexError, RowsLostError, SavedStateError
from rayrb.io.chunks import ChunkDataset, ReadOnlyError
from rayrb.io.files import process_memory

CHECK_EVERY = 2.0  # seconds between a primary's checks of its replicas when no write comes
Rows = dict[str, np.ndarray]
Info = dict[str, np.ndarray]


class _Shard:
    kind = "shard"
    _lost = False  # restarted without its files, and no copy held its rows

    def __init__(self, shard_id: str, sampler: str, capacity: int = 0,
                 sampler_options: Mapping[str, float] | None = None, device: str | None = None,
                 state_dir: str | None = None):
        self.shard_id, self._state_dir = shard_id, state_dir
        self._lives = begin(state_dir, f"shard {shard_id}")
        self._device = device  # None: rows in host memory maps; else a DeviceTable on this torch device
        self._table = None
        opts = dict(sampler_options or {})
        self._sampler = make_sampler(sampler, capacity, opts.get("alpha", ALPHA), opts.get("eps", EPS))
        self._metrics = ActorMetrics("shard", {"shard": shard_id, "kind": self.kind})

    # storage hooks ------------------------------------------------------------
    def size(self) -> int:
        raise NotImplementedError

    def _gather(self, idx: np.ndarray) -> Rows:
        raise NotImplementedError

    def _gather_tensors(self, idx: np.ndarray) -> dict[str, Any]:
        """Rows at ``idx`` as torch tensors: on the shard's device when it holds a table, else host views."""
        import torch

        if self._table is not None:
            return self._table.gather(idx)
        return {k: torch.from_numpy(v) for k, v in self._gather(idx).items()}

    def _generation(self, idx: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _written_count(self) -> int:
        return self.size()

    def _behind(self, written: int | None) -> bool:
        """Whether a read planned at ``written`` rows came before they landed here; raises if they never will."""
        if written is None or self._written_count() >= written:
            return False
        if self._lost:
            raise RowsLostError(f"shard {self.shard_id}: expected the {written} rows this read was planned over, "
                                f"got {self._written_count()}: they were lost with this shard's node")
        return True

    # sampling -----------------------------------------------------------------
    def _info(self, idx: np.ndarray) -> Info:
        return {"index": idx, "generation": self._generation(idx), **self._sampler.info(idx)}

    def mass_stats(self) -> tuple[float, float]:
        """``(total mass, smallest p_i)`` the coordinator allocates by (``(size, 1)`` unless prioritized)."""
        return self._sampler.mass(self.size())

    def check_priority(self, idx: np.ndarray, generation: np.ndarray, priority: np.ndarray) -> int:
        """Raise if ``update_priority`` would refuse these rows; change nothing."""
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.size()):
            raise RowIndexError(f"shard {self.shard_id}: expected indices in [0, {self.size()}), "
                                f"got {int(idx.min())}..{int(idx.max())}")
        self._sampler.check_priority(idx, np.asarray(priority, dtype=np.float64))
        return int(idx.size)

    def update_priority(self, idx: np.ndarray, generation: np.ndarray, priority: np.ndarray) -> int:
        """Set priorities of rows still holding the written generation; return how many were set.

        An update for a slot overwritten since it was sampled is dropped.
        """
        self.check_priority(idx, generation, priority)
        idx = np.asarray(idx, dtype=np.int64)
        keep = self._generation(idx) == np.asarray(generation, dtype=np.int64)
        self._sampler.update_priority(idx[keep], np.asarray(priority, dtype=np.float64)[keep])
        self._metrics.count("priority_updates", int(keep.sum()))
        self._metrics.count("priority_updates_dropped", int((~keep).sum()))
        return int(keep.sum())

    def sample_many(self, counts: list[int], seeds: list[int], epochs: list[Epoch | None] | None = None,
                    written: int | None = None) -> tuple[Rows, Info] | None:
        """Several reads' rows, in order, gathered in one pass into one object.

        Read ``j`` draws ``counts[j]`` rows from ``seeds[j]``; without replacement,
        ``epochs[j]`` says which epoch it belongs to and where in it it starts.
        ``written`` is the write count the reads were planned at: they draw over the rows
        there were then (the same rows, unless overwritten since), and a read that
        arrives before those writes landed here returns None, drawing nothing.
        """
        if self._behind(written):
            return None  # planned after writes that have not landed here yet: the caller asks again
        t0 = time.perf_counter()
        idx = self._indices(counts, seeds, epochs, written)
        rows, info = self._gather(idx), self._info(idx)
        self._metrics.count("rows_sampled", len(idx))
        self._metrics.observe("sample_ms", (time.perf_counter() - t0) * 1e3)
        return rows, info

    def _indices(self, counts: list[int], seeds: list[int], epochs: list[Epoch | None] | None,
                 written: int | None = None) -> np.ndarray:
        size = self.size() if written is None else min(self.size(), self._size_at(int(written)))
        return read_indices(self._sampler, counts, seeds, epochs, size)

    def _size_at(self, written: int) -> int:
        """Rows held when ``written`` rows had been written (an offline shard's never change)."""
        return self.size()

    def sample_many_tensors(self, counts: list[int], seeds: list[int], epochs: list[Epoch | None] | None = None,
                            device: str | None = None, written: int | None = None) -> dict[str, Any]:
        """``sample_many`` as one flat dict of torch tensors (``rows/..``, ``info/..``), for Ray Direct Transport.

        A shard that holds its rows on a GPU gathers there and returns CUDA tensors (sent
        with ``.options(tensor_transport="cuda_ipc" | "nccl")``); ``device`` moves them.
        A read planned after ``written`` rows were sent here, that arrives before they
        landed, returns ``{"behind": ...}`` and draws nothing: the caller asks again.
        torch is imported only here.
        """
        import torch

        if self._behind(written):
            return {"behind": torch.zeros(1, device=self._table.device if self._table is not None else "cpu")}
        t0 = time.perf_counter()
        idx = self._indices(counts, seeds, epochs, written)  # the rows there were at the plan, as sample_many
        rows = self._gather_tensors(idx)
        target = torch.device(device) if device is not None else next(iter(rows.values())).device
        out = {f"rows/{k}": v.to(target, non_blocking=True) for k, v in rows.items()}
        out.update({f"info/{k}": torch.from_numpy(v).to(target, non_blocking=True)
                    for k, v in self._info(idx).items()})
        if target.type == "cuda":
            torch.cuda.current_stream(target).synchronize()  # the receiver reads them from another process
        self._metrics.count("rows_sampled", len(idx))
        self._metrics.observe("sample_ms", (time.perf_counter() - t0) * 1e3)
        return out

    def place(self) -> dict[str, Any]:
        """Where this shard's rows are: its node, the GPUs Ray gave it, and the device they are on."""
        import ray

        gpus = [str(g) for g in ray.get_gpu_ids()]
        return {"node": ray.get_runtime_context().get_node_id(), "gpus": gpus,
                "device": "cpu" if self._table is None else str(self._table.device)}

    def dump(self, path: str) -> tuple[str, dict[str, Any]]:
        """Write this shard's mutable state (online rows, sampler state) to ``path``; return its name and digest."""
        from rayrb.io.files import file_digest

        state = self.state()
        with open(path, "wb") as f:
            np.savez(f, **state)
            f.flush()
            os.fsync(f.fileno())
        return os.path.basename(path), file_digest(path)

    def _read(self, path: str) -> dict[str, np.ndarray]:
        try:
            with np.load(path) as f:
                return dict(f)
        except (OSError, ValueError) as e:
            raise SavedStateError(f"shard {self.shard_id}: cannot read saved state {path}: {e}") from None

    def load(self, path: str) -> None:
        """Take the state ``dump`` wrote; a file that does not fit this shard changes nothing."""
        self.load_state(self._read(path))

    def check(self, path: str) -> None:
        """Raise if ``load`` would refuse this file; change nothing (the first phase of a restore)."""
        self._checked(self._read(path))

    def state(self) -> dict[str, np.ndarray]:
        """This shard's mutable state as arrays (what ``dump`` writes)."""
        return {**self._state(), **{f"sampler/{k}": v for k, v in self._sampler.state_dict().items()}}

    def gather(self, idx: np.ndarray) -> tuple[Rows, Info]:
        """Rows at these local indices, with their provenance; no sampler state is touched."""
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.size()):
            raise RowIndexError(f"shard {self.shard_id}: expected indices in [0, {self.size()})")
        return self._gather(idx), self._info(idx)

    def check_state(self, state: dict[str, np.ndarray]) -> None:
        """Raise if ``state`` does not fit this shard; change nothing (the first phase of a restore)."""
        self._checked(state)

    def _checked(self, state: dict[str, np.ndarray]) -> Callable[[], None]:
        """Raise if ``state`` does not fit this shard; else return what applies it."""
        sampler_state = {k[len("sampler/"):]: v for k, v in state.items() if k.startswith("sampler/")}
        copy.deepcopy(self._sampler).load_state_dict(sampler_state)  # raises on bad state, on a copy
        apply_rows = self._set_state(state)

        def apply() -> None:
            apply_rows()
            self._sampler.load_state_dict(sampler_state)

        return apply

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Take ``state``'s arrays; state that does not fit this shard changes nothing."""
        self._checked(state)()

    def _state(self) -> dict[str, np.ndarray]:
        return {}

    def _set_state(self, state: dict[str, np.ndarray]) -> Callable[[], None]:
        """Check ``state``; return what applies it."""
        return lambda: None

    def stats(self) -> dict[str, Any]:
        self._metrics.gauge("size", self.size())
        self._metrics.gauge("device_bytes", 0 if self._table is None else self._table.nbytes)
        self._metrics.gauge("restarts", self._lives.restarts)
        for name, value in process_memory().items():
            self._metrics.gauge(name, value)
        return {**self._metrics.snapshot(), **self._lives.stats()}

    def ping(self) -> str:
        return self.shard_id

    def close(self) -> None:
        """Remove this shard's state files, restart record and lease: the buffer is being shut down for good."""
        self._lives.end()
        self._store.remove()
        remove_directory(self._state_dir)


class OfflineShard(_Shard):
    """Rows ``[start, stop)`` of a chunk dataset, mapped read-only.

    Its only mutable state, priorities, is kept in ``state_dir`` (node-local files),
    so a restarted shard re-maps its chunks and reloads its priorities.
    """

    kind = "offline"

    def __init__(self, root: str, start: int, stop: int, shard_id: str, sampler: str = "uniform",
                 sampler_options: Mapping[str, float] | None = None, state_dir: str | None = None,
                 device: str | None = None):
        super().__init__(shard_id, sampler, capacity=max(1, stop - start), sampler_options=sampler_options,
                         device=device, state_dir=state_dir)
        self._ds = ChunkDataset.open(root)
        if not 0 <= start < stop <= len(self._ds):
            raise InvalidArgumentError(
                f"shard {shard_id}: expected 0 <= start < stop <= {len(self._ds)}, got [{start}, {stop})")
        self._start, self._stop = int(start), int(stop)
        if device is not None:  # the row range goes to the device once; gathers run there
            from rayrb.io.device_table import DeviceTable

            self._table = DeviceTable.load(lambda idx: self._ds.gather(idx + self._start), self.size(),
                                           self._ds.spec.shapes, device)
        self._sampler.on_write(np.arange(self.size()))
        self._store = PriorityStore(max(1, stop - start), state_dir if self._sampler.per_slot_state else None)
        self._sampler.attach(self._store.priority, self._store.max_priority, self._store.reopened)
        self._metrics.gauge("dataset_bytes", (stop - start) * self._ds.spec.row_bytes)
        self._lives.ready()

    def size(self) -> int:
        return self._stop - self._start

    def _gather(self, idx: np.ndarray) -> Rows:
        if self._table is not None:
            return self._table.numpy(idx)
        return self._ds.gather(idx + self._start)

    def _generation(self, idx: np.ndarray) -> np.ndarray:
        return np.ones(idx.shape, dtype=np.int64)  # written once, never again

    def extend(self, *args: Any, **kwargs: Any):
        raise ReadOnlyError(f"offline shard {self.shard_id} is immutable: write to the online buffer instead")


class OnlineShard(_Shard):
    """A circular buffer of ``capacity`` rows; the oldest rows are overwritten first.

    Rows, generations, the write count and priorities live in
    ``OnlineStorage``, memory-mapped under ``state_dir`` when
    given: a restarted shard reopens them with every acknowledged write.
    """

    kind = "online"

    def __init__(self, spec_json: Mapping[str, Any], capacity: int, shard_id: str, sampler: str = "uniform",
                 sampler_options: Mapping[str, float] | None = None, state_dir: str | None = None,
                 device: str | None = None, replicas: Sequence[str] = (), coordinator: str | None = None):
        capacity = positive_int(f"shard {shard_id}: capacity", capacity)
        super().__init__(shard_id, sampler, capacity=capacity, sampler_options=sampler_options, device=device,
                         state_dir=state_dir)
        self._spec = RowSpec.from_json(spec_json)
        self._capacity = int(capacity)
        self._store = OnlineStorage(self._spec, self._capacity, state_dir)
        self._data, self._gen = self._store.rows, self._store.generation
        # writes applied beyond the write count (behind a piece still to come): first row -> end; a
        # restarted shard finds them again from the generations
        self._held: dict[int, int] = dict(held_runs(self._gen, self._store.written))
        self._mirror()
        if self._store.reopened:
            self._sampler.on_write(np.arange(self.size()))
        self._sampler.attach(self._store.priority, self._store.max_priority, self._store.reopened)
        self._replication = Replication(replicas, self.state) if replicas else None
        # Restarted without its files (its node was lost): its rows come from its replicas, or are lost
        self._lost = bool(self._lives.restarts) and not self._store.reopened
        if self._replication is not None:
            if self._lost:  # restarted without its files: the replicas' rows are taken before any call
                self._lost = not self._replication.take_all(self.merge, self.shard_id)
            every(CHECK_EVERY, "check_replicas")
        if self._lost and coordinator is not None:  # its count went back: the coordinator takes it again
            lookup(coordinator).resync.remote()
        self._lives.ready()

    @property
    def _written(self) -> int:
        return self._store.written

    def size(self) -> int:
        return self._store.size

    def written(self) -> int:
        """Rows ever written (the write count); ``size()`` is this capped at the capacity."""
        return self._store.written

    def _size_at(self, written: int) -> int:
        return min(written, self._capacity)

    def write_state(self) -> tuple[int, list[tuple[int, int]]]:
        """The write count, and the runs of rows held beyond it (written behind a piece that has not landed)."""
        return self._store.written, held_runs(self._gen, self._store.written)

    def _written_count(self) -> int:
        return self._store.written

    def extend(self, rows: Mapping[str, np.ndarray], start: int = 0, stop: int | None = None,
               first: int | None = None, forward: list | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Copy ``rows[start:stop]`` in as this shard's ``first``-th rows on; return their slots and generations.

        ``first`` is the write count the coordinator planned with, and it names the
        write: the ``w``-th row ever written goes to slot ``w mod capacity`` with
        generation ``w // capacity + 1``. So a write lands in the same place whenever
        it runs: a retry (after a restart, in whatever order Ray re-sends tasks) never
        lands twice, and never over a newer row. The write count advances over
        contiguous writes only, so a restart still finds every write that completed.
        ``forward`` holds the rows' ref, unresolved, for a shard to pass on to its replicas
        (``rayrb.actors.replication``), each of which fetches the rows itself.
        """
        t0 = time.perf_counter()
        first = self._store.written if first is None else int(first)
        if self._lost and first > self._store.written:
            # placed over rows this shard lost with its node (sent before the coordinator took its count again):
            # refused whole, so that the write's retry places it anew at the count there is
            raise RowsLostError(f"shard {self.shard_id}: expected a piece at its count {self._store.written} or "
                                f"below, got one at {first}: the rows before it were lost with this shard's node")
        sent: list = []
        if forward and self._replication is not None:  # sent first: the replicas copy while this copy does
            sent = self._replication.send(forward[0], start, stop, first)
        rows = {k: v[start:stop] for k, v in rows.items()}
        n = self._spec.validate(rows, what=f"rows for shard {self.shard_id}")
        w = first + np.arange(n, dtype=np.int64)
        pos, gen = w % self._capacity, w // self._capacity + 1
        fresh = (w >= first + n - self._capacity) & (self._gen[pos] < gen)  # a write larger than the shard keeps its tail
        slots = pos[fresh]
        if self._table is not None:  # the device copy serves reads: written first, as it may refuse the rows
            self._table.write(slots, {k: rows[k][fresh] for k in self._data})
        # Readers in other processes on this node copy rows straight out of the memory maps
        # (rayrb.handle.local): a slot's generation is negative while its row is being written, and they
        # compare it before and after their copy, so a row half written is never served.
        before = self._gen[slots].copy()
        self._gen[slots] = -gen[fresh]
        try:
            for k, dst in self._data.items():
                dst[slots] = rows[k][fresh]  # copies out of the object store; the memory maps keep what is acknowledged
        except BaseException:
            self._gen[slots] = before  # the rows there were not all replaced: as they were, but readers retry
            if self._table is not None:  # back to what the memory maps hold
                self._table.write(slots, {k: v[slots] for k, v in self._data.items()})
            raise
        self._gen[slots] = gen[fresh]
        self._sampler.on_write(slots)
        self._advance(first, first + n)  # last: this is what makes the rows visible after a restart
        if self._replication is not None:  # acknowledged once every live replica holds the rows too
            self._replication.settle(sent, self._store.written)
        self._metrics.count("rows_written", int(fresh.sum()))
        self._metrics.observe("extend_ms", (time.perf_counter() - t0) * 1e3)
        return pos, gen

    # replicas -----------------------------------------------------------------------
    def replicate(self, rows: Mapping[str, np.ndarray], start: int, stop: int, first: int) -> int:
        """A piece its primary was given; this copy's write count after."""
        self.extend(rows, start, stop, first=first)
        return self._store.written

    def merge(self, state: Mapping[str, np.ndarray]) -> int:
        """Take, slot by slot, the newer rows of another copy of this shard (``state()`` of its primary or of a
        replica; ``rayrb.durability.copies``); return the write count after. Taking a copy twice changes nothing."""
        take = take_newer(self._data, self._gen, state, f"shard {self.shard_id}")
        if take.size:
            self._sampler.on_write(take)
            if "sampler/priority" in state:  # the copy's priorities for the rows taken from it
                mine = self._sampler.state_dict()
                mine["priority"][take] = np.asarray(state["sampler/priority"])[take]
                mine["max_priority"] = max(float(mine["max_priority"]), float(state["sampler/max_priority"]))
                self._sampler.load_state_dict(mine)
            self._mirror()
        count = merged_count(self._gen, self._store.written, int(state["written"]))
        self._lost = False  # it holds what the copy held
        self._held.clear()
        self._held.update(held_runs(self._gen, count))
        self._store.written = count
        self._metrics.count("rows_merged", int(take.size))
        return count

    def replace(self, state: Mapping[str, np.ndarray]) -> int:
        """Take another copy's state whole (a replica rebuilt from its primary); the write count after."""
        self.load_state(state)
        self._lost = False
        return self._store.written

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        super().load_state(state)
        if self._replication is not None:  # replaced (a restore): the replicas take it too
            self._replication.rebuild_all()

    def check_replicas(self) -> None:
        """Between writes: replicas that restarted empty or fell behind are rebuilt (a timer sends this)."""
        if self._replication is not None:
            self._replication.check(self._store.written)

    def _advance(self, first: int, end: int) -> None:
        written = self._store.written
        if first > written:  # an earlier write is still to come (a retry out of order)
            self._held[first] = end
            return
        written = max(written, end)
        # Every run the count reaches, also one that starts inside the rows it passed: a write wider than the
        # shard keeps only its tail, and a restarted shard (or the log, after a resync) knows just that.
        for a in sorted(self._held):
            if a > written:
                break
            written = max(written, self._held.pop(a))
        self._store.written = written

    def _mirror(self) -> None:
        """The device copy of the storage (what a restart reopened, or zeros), when rows live on a device."""
        if self._device is not None:
            from rayrb.io.device_table import DeviceTable

            self._table = DeviceTable.from_arrays(self._data, self._device)

    def _gather(self, idx: np.ndarray) -> Rows:
        if self._table is not None:
            return self._table.numpy(idx)
        return {k: v[idx] for k, v in self._data.items()}

    def _state(self) -> dict[str, np.ndarray]:
        return {**{f"rows/{k}": v for k, v in self._data.items()}, "generation": self._gen,
                "written": np.int64(self._written)}

    def _set_state(self, state: dict[str, np.ndarray]) -> Callable[[], None]:
        rows = {k[len("rows/"):]: v for k, v in state.items() if k.startswith("rows/")}
        gen = state.get("generation")
        if set(rows) != set(self._data) or gen is None or gen.shape != self._gen.shape or "written" not in state:
            raise SavedStateError(f"shard {self.shard_id}: saved state has keys {sorted(rows)} and capacity "
                                  f"{None if gen is None else gen.shape[0]}, expected {sorted(self._data)} and "
                                  f"{self._capacity}")
        self._spec.validate(rows, what="saved rows")
        if any(v.shape[0] != self._capacity for v in rows.values()):
            raise SavedStateError(f"shard {self.shard_id}: saved rows are not {self._capacity} slots")

        def apply() -> None:
            self._gen[...] = -1  # every row is being replaced: readers on this node leave it to the shard
            for k in self._data:
                self._data[k][...] = rows[k]
            self._gen[...] = gen
            self._store.written = int(state["written"])
            self._held.clear()  # rows the saved shard held behind a hole: counted once it is filled
            self._held.update(held_runs(self._gen, self._store.written))
            self._mirror()

        return apply

    def _generation(self, idx: np.ndarray) -> np.ndarray:
        return self._gen[idx]

    def update_priority(self, idx: np.ndarray, generation: np.ndarray, priority: np.ndarray) -> int:
        done = super().update_priority(idx, generation, priority)
        if self._replication is not None:
            self._replication.priorities(idx, generation, priority)
        return done

    def stats(self) -> dict[str, Any]:
        self._metrics.gauge("write_count", self._written)
        self._metrics.gauge("capacity", self._capacity)
        out = super().stats()
        if self._replication is not None:
            report = self._replication.report(self._written)
            self._metrics.gauge("replicas_live", self._replication.live())
            self._metrics.gauge("replica_rows_behind", max((r["behind"] or 0 for r in report), default=0))
            out = {**out, **self._metrics.snapshot(), "node": self.place()["node"], "replicas": report}
        return out

    def close(self) -> None:
        """Remove this shard's files, and its replicas' (the buffer is being shut down for good)."""
        if self._replication is not None:
            import ray

            calls = [lookup(r.name, 1.0).close.remote() for r in self._replication.replicas]
            ray.wait(calls, num_returns=len(calls), timeout=5)
        super().close()
