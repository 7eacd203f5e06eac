"""Shard actors: thin shells around storage and a sampler.

* ``OfflineShard`` maps a contiguous row range of a chunk dataset read-only
  (memory maps; nothing copied into the heap or through the object store).
* ``OnlineShard`` (``rayrb.actors.online_shard``) is a circular buffer that copies
  rows on insert, so it never keeps a view into an object-store buffer (pinned
  plasma memory, ray#8234).

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
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from rayrb.actors.lifecycle import begin
from rayrb.actors.metrics import ActorMetrics
from rayrb.core.plans import OFFLINE_GENERATION, Epoch
from rayrb.core.reads import read_indices, read_size
from rayrb.core.samplers import make_sampler
from rayrb.core.validation import ALPHA, EPS
from rayrb.durability.storage import PriorityStore, remove_directory, whole
from rayrb.errors import BufferUnavailableError, InvalidArgumentError, RowIndexError, RowsLostError, SavedStateError
from rayrb.io.chunks import ChunkDataset, ReadOnlyError
from rayrb.io.files import process_memory

Rows = dict[str, np.ndarray]
Info = dict[str, np.ndarray]


class Shard:
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
        self._sampler = make_sampler(sampler, capacity, opts.get("alpha", ALPHA), opts.get("eps", EPS),
                                     **{k: v for k, v in opts.items() if k.startswith("slice_")})
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

    def _unchanged(self, idx: np.ndarray, generation: np.ndarray) -> bool:  # after a copy (OnlineShard's)
        return True

    def _generation(self, idx: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def written(self) -> int:
        """Rows ever written (the write count): an offline shard's rows, all there from the start."""
        return self.size()

    def _behind(self, written: int | None) -> bool:
        """Whether a read planned at ``written`` rows came before they landed here; raises if they never will."""
        if read_size(self.written(), self._capacity_for_reads, written) is not None:
            return False
        if self._lost:
            raise RowsLostError(f"shard {self.shard_id}: expected the {written} rows this read was planned over, "
                                f"got {self.written()}: they were lost with this shard's node")
        return True

    # sampling -----------------------------------------------------------------
    def _info(self, idx: np.ndarray, generation: np.ndarray | None = None) -> Info:
        gen = self._generation(idx) if generation is None else generation
        return {"index": idx, "generation": gen, **self._sampler.info(idx, gen)}

    def _whole(self, idx: np.ndarray) -> np.ndarray | None:
        """The generations of the slots at ``idx``, or None if one holds a row a crash left half written
        (``rayrb.durability.storage.whole``, every reader's rule): never served until its write lands again."""
        gen = self._generation(idx)
        if whole(gen):
            return gen
        self._metrics.count("reads_of_torn_rows")
        return None

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
        gen = self._whole(idx)
        if gen is None:
            return None  # a row left torn by a crash: the caller asks again, as for writes still to land
        rows = self._gather(idx)
        if not self._unchanged(idx, gen):
            return None  # a writer on this node appended over a row during the copy: the caller asks again
        info = self._info(idx, gen)
        self._metrics.count("rows_sampled", len(idx))
        self._metrics.observe("sample_ms", (time.perf_counter() - t0) * 1e3)
        return rows, info

    def _indices(self, counts: list[int], seeds: list[int], epochs: list[Epoch | None] | None,
                 written: int | None = None) -> np.ndarray:
        size = read_size(self.written(), self._capacity_for_reads, written)  # not None: _behind said so first
        return read_indices(self._sampler, counts, seeds, epochs, self.size() if size is None else size)

    @property
    def _capacity_for_reads(self) -> int:
        """Slots a read draws within: an online shard's capacity, an offline shard's rows."""
        return self.size()

    def sample_many_tensors(self, counts: list[int], seeds: list[int], epochs: list[Epoch | None] | None = None,
                            device: str | None = None, written: int | None = None) -> dict[str, Any]:
        """``sample_many`` as one flat dict of torch tensors (``rows/..``, ``info/..``), for Ray Direct Transport.

        A shard that holds its rows on a GPU gathers there and returns CUDA tensors (sent with
        ``.options(tensor_transport="cuda_ipc" | "nccl")``); ``device`` moves them. A read that must be asked again
        (as ``sample_many``'s None) returns ``{"behind": ...}``. torch is imported only here."""
        import torch

        def behind() -> dict:  # made only when a read must be asked again, not on every read
            return {"behind": torch.zeros(1, device=self._table.device if self._table is not None else "cpu")}

        if self._behind(written):
            return behind()
        t0 = time.perf_counter()
        idx = self._indices(counts, seeds, epochs, written)  # the rows there were at the plan, as sample_many
        gen = self._whole(idx)
        if gen is None:
            return behind()  # a row left torn by a crash: asked again, as sample_many
        rows = self._gather_tensors(idx)
        if self._table is None and not self._unchanged(idx, gen):  # host rows, copied: checked as sample_many's
            return behind()
        target = torch.device(device) if device is not None else next(iter(rows.values())).device
        out = {f"rows/{k}": v.to(target, non_blocking=True) for k, v in rows.items()}
        out.update({f"info/{k}": torch.from_numpy(v).to(target, non_blocking=True)
                    for k, v in self._info(idx, gen).items()})
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
        gen = self._whole(idx)
        if gen is None:
            torn = idx[self._generation(idx) <= 0]
            raise BufferUnavailableError(f"shard {self.shard_id}: expected whole rows, got slots {torn[:8].tolist()} "
                                         "left half written by a crash, whose write is being sent again: ask again")
        return self._gather(idx), self._info(idx, gen)

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


class OfflineShard(Shard):
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
        key = getattr(self._sampler, "key", None)
        if key is not None:  # a slice sampler finds this shard's episodes in one of its columns
            self._sampler.bind({key: self._ds.column(key, self._start, self._stop)}, None)
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
        return np.full(idx.shape, OFFLINE_GENERATION, dtype=np.int64)

    def extend(self, *args: Any, **kwargs: Any):
        raise ReadOnlyError(f"offline shard {self.shard_id} is immutable: write to the online buffer instead")
