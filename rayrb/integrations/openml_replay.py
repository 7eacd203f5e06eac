"""TorchRL's ``OpenMLExperienceReplay`` by its name, over rayrb's sharded, memory-mapped OpenML tables.

``from torchrl.data.datasets import OpenMLExperienceReplay`` becomes ``from rayrb import
OpenMLExperienceReplay``: the same arguments, in the same order, and the same surface (``sample``,
iteration, ``len``, transforms, ``preprocess``, ``dumps`` / ``loads``, ``delete``). The table is the
one ``rayrb.load_openml`` prepares (TorchRL's recipe, written once as chunks), and a rayrb buffer
serves it: offline only (``offline_fraction=1``), its rows sharded over ``num_shards`` actors, which
start on the first call that samples. rayrb's own options come as keywords after TorchRL's.

Like TorchRL's, it is a dataset that can be composed:
``OfflineToOnlineReplayBuffer(OpenMLExperienceReplay(...), online_capacity=...)`` maps the same chunks
(or, with transforms, the transformed rows, copied once) with the dataset's sampler. It imports torchrl,
whose transforms and samplers it takes. What differs from TorchRL, and why: ``docs/migrating.md``.

Examples:
    >>> ds = OpenMLExperienceReplay("mushroom_num", batch_size=256)  # doctest: +SKIP
    >>> for batch in ds:  # one epoch without replacement, its last batch short  # doctest: +SKIP
    ...     pass
    >>> ds.shutdown()  # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, is_tensor_collection, is_tensorclass
from tensordict.utils import expand_as_right

from rayrb.core.allocation import row_ranges
from rayrb.core.plans import OFFLINE_GENERATION, checked_integers
from rayrb.core.validation import positive_int
from rayrb.errors import InvalidArgumentError, InvalidStateError
from rayrb.integrations.immutable_dataset import ImmutableDataset
from rayrb.integrations.torchrl_arguments import (
    OFFLINE_ONLY,
    check_writer,
    checked_options,
    chunk_rows_option,
    default_sampler,
    make_transform,
    one_transform,
    sampler_options,
)
from rayrb.io.arrays import as_numpy


class OpenMLExperienceReplay(ImmutableDataset):
    """An experience replay for OpenML data: TorchRL's class, its rows in rayrb's shards.

    Args:
        name: ``"adult_num"``, ``"adult_onehot"``, ``"mushroom_num"``, ``"mushroom_onehot"``,
            ``"covertype"``, ``"shuttle"`` or ``"magic"``.
        batch_size: the batch size ``sample()`` and iteration use.
        root: where the prepared table is written (``root/openml/<name>-<dtype>``; default
            ``$RAYRB_HOME`` or ``~/.cache/rayrb``).
        sampler: TorchRL's ``SamplerWithoutReplacement`` (default, an epoch without replacement whose last
            batch is short; ``drop_last=True`` drops it), ``RandomSampler`` or ``PrioritizedSampler``.
        writer: TorchRL's ``ImmutableDatasetWriter`` (default): ``add``, ``extend`` and ``empty`` raise.
        collate_fn: applied to each batch before the transform.
        pin_memory: pin each batch (where a CUDA device exists).
        prefetch: batches drawn ahead (default: the buffer's own, 32; the batches are the same either way).
        transform: a TorchRL ``Transform`` (or callable) applied to each sampled batch.

    Keyword Args:
        num_shards: offline shard actors the rows are split over (default 1).
        data_home: scikit-learn's OpenML cache (default: ``$SCIKIT_LEARN_DATA`` or ``~/scikit_learn_data``).
        dtype: ``X``'s dtype, ``"float32"`` (default) or ``"float64"`` (TorchRL's values bit for bit).
        seed: the same seed and ``num_shards`` give the same batches.
        **buffer_options: other options of ``OfflineToOnlineReplayBuffer`` (``timeout``, ``storage_dir``,
            ``actor_options``, ``name``, ``local_reads``, ``max_batch_bytes``, ...), none of the online side's.
    """

    def __init__(self, name: str, batch_size: int, root: str | os.PathLike | None = None, sampler: Any = None,
                 writer: Any = None, collate_fn: Callable | None = None, pin_memory: bool = False,
                 prefetch: int | None = None, transform: Any = None, *, num_shards: int = 1,
                 data_home: str | os.PathLike | None = None, dtype: Any = "float32", seed: int | None = None,
                 **buffer_options: Any):
        from rayrb.core.validation import boolean, callable_or_none
        from rayrb.io.datasets.openml import check_name, default_root, load_openml

        check_name(name)  # before anything is fetched or checked further
        self.dataset_id, self.batch_size = name, positive_int("batch_size", batch_size)
        own = {"num_offline_shards": num_shards, "seed": seed, "batch_size": self.batch_size,
               **({} if prefetch is None else {"prefetch": prefetch}), **sampler_options(sampler)}
        self._options = checked_options(buffer_options, own)
        self._sampler = sampler if sampler is not None else default_sampler()
        self._writer = check_writer(writer)
        self._collate_fn = callable_or_none("collate_fn", collate_fn)
        self._pin_memory = boolean("pin_memory", pin_memory)
        self._transform = make_transform(transform)
        self.root = Path(root) if root is not None else default_root()
        self._chunks = load_openml(name, root=self.root, data_home=data_home, dtype=dtype)
        if self._options["num_offline_shards"] > len(self._chunks):
            raise InvalidArgumentError(f"expected num_shards at most the table's {len(self._chunks)} rows, got "
                                       f"{self._options['num_offline_shards']}")
        self._rb, self._deleted = None, False  # the buffer, started by the first call that samples
        self._starts = shard_starts(len(self._chunks), self._options["num_offline_shards"])

    # TorchRL's properties -------------------------------------------------------------------------------------
    data_path = property(lambda self: self._chunks.root, doc="The prepared table's chunk dataset directory.")
    data_path_root = property(lambda self: self.root, doc="The root the prepared tables live under.")
    sampler = property(lambda self: self._sampler, doc="TorchRL's sampler this dataset was given (or its default).")
    writer = property(lambda self: self._writer, doc="TorchRL's ImmutableDatasetWriter.")
    storage = property(lambda self: self._chunks, doc="The read-only chunk dataset the shards map "
                       "(``rayrb.io.chunk_dataset.ChunkDataset``: ``len``, indexing, ``gather``).")
    transform = property(lambda self: self._transform, doc="TorchRL's Compose applied to each sampled batch.")

    def __len__(self) -> int:
        return len(self._chunks)

    @property
    def buffer(self) -> Any:
        """The rayrb buffer serving the rows (``OfflineToOnlineReplayBuffer``), started when first asked for."""
        if self._rb is None:
            from rayrb.handle.owner import OfflineToOnlineReplayBuffer

            if self._deleted:
                raise InvalidStateError(f"the table {self.dataset_id!r} was deleted from {self.data_path}: a new "
                                        f"OpenMLExperienceReplay({self.dataset_id!r}, ...) prepares it again")
            self._rb = OfflineToOnlineReplayBuffer(self._chunks, **OFFLINE_ONLY, **self._options)
        return self._rb

    # sampling -------------------------------------------------------------------------------------------------
    def sample(self, batch_size: int | None = None, return_info: bool = False) -> Any:
        """A batch (``batch_size`` rows, default the dataset's), collated, transformed and pinned as TorchRL's,
        holding TorchRL's bookkeeping keys: ``"index"`` (the rows' indices in the table) and, sampling by
        priority, ``"priority_weight"`` (which TorchRL's losses weigh by); with ``return_info``,
        ``(batch, info)``, ``info`` holding the same."""
        batch, info = self.buffer.sample(batch_size, return_info=True)
        info = self._info(info)
        batch = self._finish(batch, info)
        return (batch, info) if return_info else batch

    def __iter__(self):
        """Batches until the epoch without replacement ends (its last batch short unless ``drop_last``), or
        without end with replacement, as TorchRL's datasets iterate (each as ``sample`` gives it)."""
        for batch, info in self.buffer.iter_epoch(return_info=True):
            yield self._finish(batch, self._info(info))

    def _finish(self, batch: Any, info: dict[str, torch.Tensor]) -> Any:
        """As TorchRL's ``TensorDictReplayBuffer.sample``: collated, transformed, then each of ``info`` set in the
        batch (where it is a TensorDict; a collate_fn may have made it something else), then pinned."""
        if self._collate_fn is not None:
            batch = self._collate_fn(batch)
        if len(self._transform):
            with batch.unlock_() if hasattr(batch, "unlock_") else contextlib.nullcontext():
                batch = self._transform(batch)
        set_info(batch, info)
        if self._pin_memory and torch.cuda.is_available() and getattr(batch, "device", None) in (None, torch.device("cpu")):
            batch = batch.pin_memory()
        return batch

    def _info(self, info: dict) -> dict[str, torch.Tensor]:
        out = {"index": self._starts[torch.as_tensor(info["shard"])] + torch.as_tensor(info["index"])}
        if "weight" in info:
            out["priority_weight"] = torch.as_tensor(info["weight"])
        return out

    def update_priority(self, index: Any, priority: Any) -> int:
        """TorchRL's: set the priorities of the rows at ``index`` (indices in the table, as ``info["index"]``
        gives them; one priority, a number or a one-element tensor, is every row's), sampling by priority; the
        number of rows sent."""
        index = torch.from_numpy(checked_integers("index", as_numpy(index)))
        priority = as_numpy(priority).reshape(-1)
        if priority.size == 1 and len(index) != 1:  # TorchRL's "priority (Number or Tensor)"
            priority = np.repeat(priority, len(index))
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= len(self)):
            from rayrb.errors import RowIndexError

            raise RowIndexError(f"expected indices in [0, {len(self)}), got {index.min()}..{index.max()}")
        shard = torch.searchsorted(self._starts, index, right=True) - 1
        info = {"offline": torch.ones(len(index), dtype=torch.bool), "shard": shard, "index": index - self._starts[shard],
                "generation": torch.full((len(index),), OFFLINE_GENERATION, dtype=torch.int64)}
        return self.buffer.update_priority(info, priority)

    def update_tensordict_priority(self, data: Any) -> None:
        """TorchRL's: the priorities of a sampled batch's rows from its ``"td_error"`` (the largest over a row's
        own dimensions, TorchRL's ``reduction="max"``), at its ``"index"``; nothing unless sampling by priority."""
        if self._options.get("sampler") != "prioritized":
            return
        priority = data.get("td_error").detach()
        if priority.ndim > 1:
            priority = priority.reshape(priority.shape[0], -1).amax(-1)
        index = data.get("index")
        while index.ndim > 1:
            index = index[..., 0]
        self.update_priority(index, priority)

    # TorchRL's storage surface ----------------------------------------------------------------------------------
    @property
    def max_outcome_val(self) -> int:
        """The largest label in the table (TorchRL's ``OpenMLEnv`` sizes its action space by it)."""
        if not hasattr(self, "_max_outcome"):
            self._max_outcome = int(self._chunks.column("y", 0, len(self)).max())
        return self._max_outcome

    def __getitem__(self, index: Any) -> Any:
        """Rows of the table by index (an int, a slice, indices) as TorchRL's ``rb[index]``: collated (not for
        one int) and transformed; a key (``rb["X"]``) gives that column of every row."""
        if isinstance(index, str):
            return self[:][index]
        rows = self._chunks[index]
        one = isinstance(index, (int, np.integer))
        batch = TensorDict({k: torch.as_tensor(np.asarray(v)) for k, v in rows.items()},
                           batch_size=[] if one else [len(next(iter(rows.values())))])
        if not one and self._collate_fn is not None:
            batch = self._collate_fn(batch)
        return self._transform(batch) if len(self._transform) else batch

    # transforms -----------------------------------------------------------------------------------------------
    def append_transform(self, transform: Any, *, invert: bool = False) -> OpenMLExperienceReplay:
        """Append ``transform`` (a TorchRL ``Transform`` or a callable) to those run on each sampled batch;
        ``invert``: its inverse runs there instead (its forward would run on writes, which this dataset refuses)."""
        self._transform.append(one_transform(transform, invert))
        return self

    def insert_transform(self, index: int, transform: Any, *, invert: bool = False) -> OpenMLExperienceReplay:
        """Insert ``transform`` at ``index`` among the transforms run on each sampled batch (``invert`` as in
        ``append_transform``)."""
        self._transform.insert(index, one_transform(transform, invert))
        return self

    # saving ---------------------------------------------------------------------------------------------------
    def dumps(self, path: str | os.PathLike) -> None:
        """Save where the sampling stands (epoch, RNG, priorities) under ``path``; the table itself is recorded by
        its chunks' content hashes, not copied."""
        self.buffer.dumps(path)

    def loads(self, path: str | os.PathLike) -> None:
        """Restore what ``dumps`` saved, whole, or leave the dataset's sampling as it was."""
        self.buffer.loads(path)

    dump = save = dumps
    load = loads

    def state_dict(self) -> dict[str, Any]:
        """The sampling state (``load_state_dict`` resumes the same stream)."""
        return self.buffer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state)

    # the table on disk ----------------------------------------------------------------------------------------
    def preprocess(self, fn: Callable, dim: int = 0, num_workers: int | None = None, *, chunksize: int | None = None,
                   num_chunks: int | None = None, pool: Any = None, generator: Any = None,
                   max_tasks_per_child: int | None = None, worker_threads: int = 1, index_with_generator: bool = False,
                   pbar: bool = False, mp_start_method: str | None = None, num_frames: int | None = None,
                   dest: str | os.PathLike) -> Any:
        """Map every row (or the first ``num_frames``) through ``fn`` with Ray tasks into a chunk dataset at
        ``dest`` (``rayrb.preprocess``: one task per chunk of ``chunksize`` rows, or ``num_chunks`` chunks, at most
        ``num_workers`` at once); return TorchRL's ``TensorStorage`` of the new rows, for
        ``ReplayBuffer(storage=...)``. ``dest`` itself is a rayrb dataset: ``OfflineToOnlineReplayBuffer(dest, ...)``
        maps it without a copy. ``max_tasks_per_child``, ``worker_threads`` and ``mp_start_method`` concern a
        process pool and have no effect on Ray's workers; ``pool``, ``generator`` and ``index_with_generator`` are
        refused."""
        from torchrl.data.replay_buffers import TensorStorage

        from rayrb.io.preprocess import preprocess

        if dim != 0:
            raise InvalidArgumentError(f"expected dim=0 (a table's rows lie along its first dimension), got {dim}")
        odd = {k: v for k, v in (("pool", pool), ("generator", generator)) if v is not None}
        if odd or index_with_generator:
            raise InvalidArgumentError(f"expected no pool, generator or index_with_generator: Ray tasks map the "
                                       f"chunks, in order; got {sorted(odd) or ['index_with_generator']}")
        chunk_rows = chunk_rows_option(len(self) if num_frames is None else min(num_frames, len(self)),
                                       chunksize, num_chunks)
        out = preprocess(self.data_path, fn, dest, num_workers=num_workers, chunk_rows=chunk_rows,
                         num_frames=num_frames, pbar=pbar)
        return TensorStorage(out.to_tensordict())

    def delete(self) -> None:
        """Stop the buffer's actors and delete the prepared table from disk (the next dataset of this name
        prepares it again)."""
        self.shutdown()
        self._deleted = True
        self._chunks.delete()

    def shutdown(self) -> None:
        """Stop the buffer's actors (a later sample starts them again). Idempotent."""
        if self._rb is not None:
            self._rb.shutdown()
            self._rb = None

    def offline_source(self) -> Any:
        """What a buffer this dataset is composed into maps: its chunks themselves or, with transforms, its rows
        through them (copied once; TorchRL's offline side runs its dataset's transforms on each offline draw)."""
        if not len(self._transform):
            return self._chunks
        rows = self._chunks.to_tensordict()
        with rows.unlock_():
            return self._transform(rows)

    def __repr__(self) -> str:
        return (f"OpenMLExperienceReplay(name={self.dataset_id!r}, rows={len(self)}, batch_size={self.batch_size}, "
                f"sampler={type(self._sampler).__name__}, transform={self._transform}, data_path={str(self.data_path)!r})")


def set_info(batch: Any, info: dict[str, torch.Tensor]) -> None:
    """Each of ``info`` set in ``batch``, as TorchRL's ``TensorDictReplayBuffer.sample`` sets it (where the batch
    is a TensorDict: a collate_fn may have made it something else)."""
    if is_tensor_collection(batch) and not is_tensorclass(batch):
        with batch.unlock_() if batch.is_locked else contextlib.nullcontext():
            for key, value in info.items():
                batch.set(key, expand_as_right(value, batch) if value.ndim < batch.ndim else value)


def shard_starts(rows: int, shards: int) -> torch.Tensor:
    """Each shard's first row in the table, as the buffer lays out ``shards`` shards over ``rows`` rows: a shard's
    row index plus its start is the row's index in the table."""
    return torch.tensor([a for a, _ in row_ranges(rows, shards)])
