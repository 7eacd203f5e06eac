"""Ray Data in and out: a ``ray.data.Dataset`` written as a chunk dataset, a chunk dataset read as one.

Columns are the flat row keys: nested keys keep their ``/`` names (``"next/reward"``), rows with a
shape become Ray Data tensor columns, and dtypes are kept, so rows round-trip exactly both ways.
Neither direction goes through Parquet or through the driver:

- ``to_ray_dataset`` is a lazy Ray Data source whose read tasks map chunk files and hand their
  rows to Ray Data (the chunks must be readable where the tasks run: shared storage on a cluster);
- ``write_ray_dataset`` runs ``map_batches`` tasks that write one chunk each straight under the
  new dataset's directory; the driver receives only each chunk's path, size and checksum, and writes
  the manifest last.

Examples:
    >>> ds = write_ray_dataset(ray.data.range(10), tmp_path / "ds")  # doctest: +SKIP
    >>> to_ray_dataset(ds).take(2)  # doctest: +SKIP
    [{'id': 0}, {'id': 1}]
"""
from __future__ import annotations

import functools
import json
import math
import os
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import ray
import ray.data
from ray.data.block import BlockAccessor, BlockMetadata
from ray.data.datasource import Datasource, ReadTask

import rayrb.errors as errors
from rayrb.core.schema import RowSpec
from rayrb.core.validation import optional_positive_int
from rayrb.errors import InvalidArgumentError, InvalidArgumentTypeError, RayrbError, SchemaError
from rayrb.io.chunks import ChunkDataset, ChunkInfo, new_dataset_root, write_chunk, write_manifest

SOURCE_KIND = "ray.data.Dataset"


# ---------------------------------------------------------------------------- out: chunks -> Ray Data
def _read_rows(root: str, start: int, stop: int) -> Iterable[Any]:
    # Copy-on-write views of the mapped files: Ray Data's block is the one copy made.
    return [BlockAccessor.batch_to_block(ChunkDataset.open(root).view(start, stop))]


class ChunkDatasource(Datasource):
    """A chunk dataset as a Ray Data source: one read task per chunk, or per piece of one."""

    def __init__(self, dataset: ChunkDataset | str | os.PathLike):
        super().__init__()
        ds = dataset if isinstance(dataset, ChunkDataset) else ChunkDataset.open(dataset)
        self._root = str(ds.root.resolve())
        self._chunks = [(int(a), int(a) + c.rows) for a, c in zip(ds.offsets[:-1], ds.chunks)]
        self._row_bytes = ds.spec.row_bytes

    def get_name(self) -> str:
        return "RayrbChunks"

    def estimate_inmemory_data_size(self) -> int:
        return sum(b - a for a, b in self._chunks) * self._row_bytes

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[ReadTask]:
        # Never across a chunk boundary, so each task maps one chunk without concatenating.
        pieces = max(1, math.ceil(max(1, parallelism) / len(self._chunks)))
        tasks = []
        for a, b in self._chunks:
            bounds = np.linspace(a, b, min(pieces, b - a) + 1).astype(np.int64)
            for start, stop in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
                meta = BlockMetadata(num_rows=stop - start, size_bytes=(stop - start) * self._row_bytes,
                                     input_files=None, exec_stats=None)
                tasks.append(ReadTask(functools.partial(_read_rows, self._root, start, stop), meta,
                                      per_task_row_limit=per_task_row_limit))
        return tasks


def to_ray_dataset(dataset: ChunkDataset | str | os.PathLike, *, override_num_blocks: int | None = None):
    """A chunk dataset (object or path) as a lazy ``ray.data.Dataset``, one column per row key.

    Nested keys are ``/``-joined column names; rows with a shape are tensor columns. Nothing is
    read until the dataset executes; then each read task maps its chunk's files.
    """
    return ray.data.read_datasource(ChunkDatasource(dataset), override_num_blocks=override_num_blocks)


# ---------------------------------------------------------------------------- in: Ray Data -> chunks
def block_arrays(table: Any) -> dict[str, np.ndarray]:
    """One Arrow block as flat numpy arrays: tensor columns keep their shapes, structs become ``a/b`` keys.

    Raises ``TypeError`` naming the column when it is not fixed-width (strings, ragged lists).
    """
    import pyarrow as pa

    from rayrb.io.arrow import arrow_to_arrays

    out: dict[str, np.ndarray] = {}
    plain = []
    for name, col in zip(table.column_names, table.columns):
        if isinstance(col.type, pa.ExtensionType):  # Ray's tensor columns
            arr = np.asarray(col.combine_chunks().to_numpy())
            if arr.dtype == object:
                raise InvalidArgumentTypeError(
                    f"column {name!r}: expected fixed-shape tensors, got ragged ones ({col.type})")
            out[name] = arr
        else:
            plain.append(name)
    if plain:
        out.update(arrow_to_arrays(table.select(plain)))
    return out


def _write_block(table: Any, root: str) -> Any:
    """map_batches UDF: write one batch as a chunk under ``root``; return a one-row table describing it.

    A block rayrb cannot store comes back as an error row, so that the caller gets rayrb's own
    TypeError or ValueError rather than Ray Data's wrapped traceback.
    """
    import pyarrow as pa

    if table.num_rows == 0:
        return pa.table({"info": pa.array([], pa.string())})
    try:
        arrays = block_arrays(table)
        spec = RowSpec.from_arrays(arrays)
    except (TypeError, ValueError) as e:  # named by its rayrb class, else by the builtin it is
        builtin = "TypeError" if isinstance(e, TypeError) else "ValueError"
        kind = type(e).__name__ if isinstance(e, RayrbError) else builtin
        return pa.table({"info": [json.dumps({"error": [kind, str(e)]})]})
    info = write_chunk(arrays, Path(root) / f"chunk-{uuid.uuid4().hex[:12]}", spec)
    info.node = ray.get_runtime_context().get_node_id()
    info.extra = {"spec": spec.to_json()}
    return pa.table({"info": [json.dumps(info.__dict__)]})


def _error_class(kind: str) -> type[RayrbError]:
    """The error ``_write_block`` named ``kind``: a rayrb error class, or one standing for a TypeError or ValueError."""
    found = getattr(errors, kind, None)
    if isinstance(found, type) and issubclass(found, RayrbError) and issubclass(found, (TypeError, ValueError)):
        return found
    return InvalidArgumentTypeError if kind == "TypeError" else InvalidArgumentError


def write_ray_dataset(
    dataset: Any,
    root: str | os.PathLike,
    *,
    chunk_rows: int | None = None,
    source: Any = None,
    overwrite: bool = False,
) -> ChunkDataset:
    """Write a ``ray.data.Dataset`` as a chunk dataset under ``root``, in the dataset's row order.

    At most ``chunk_rows`` rows per chunk (Ray Data batches within each task's input; default:
    one chunk per Ray Data block). Every column must be
    fixed-width (numbers, bools, fixed-shape tensors or lists, structs of those); every chunk must
    have the same spec. ``root`` must be absent or empty unless ``overwrite=True``; on failure it is
    removed, so an interrupted call leaves no dataset.
    """
    if not isinstance(dataset, ray.data.Dataset):
        raise InvalidArgumentTypeError(f"expected a ray.data.Dataset, got {type(dataset).__name__}")
    chunk_rows = optional_positive_int("chunk_rows", chunk_rows)
    claim = new_dataset_root(Path(root).resolve(), overwrite)
    root = claim.root
    written = dataset.map_batches(_write_block, batch_format="pyarrow", batch_size=chunk_rows,
                                  fn_kwargs={"root": str(root)}, zero_copy_batch=True)
    options = written.context.execution_options  # shared with `dataset`: set only while this runs
    preserve = options.preserve_order
    try:
        options.preserve_order = True  # the manifest lists chunks in the dataset's row order
        infos = [json.loads(r["info"]) for r in written.take_all()]
        for info in infos:
            if "error" in info:
                kind, message = info["error"]
                raise _error_class(kind)(message)
        if not infos:
            raise InvalidArgumentError(
                "expected at least one row to write a chunk dataset, got an empty ray.data.Dataset")
        specs = [RowSpec.from_json(i["extra"]["spec"]) for i in infos]
        for info, spec in zip(infos, specs):
            if spec != specs[0]:
                raise SchemaError(f"Ray Data blocks disagree: {info['path']} has {spec!r}, "
                                  f"{infos[0]['path']} has {specs[0]!r}; every block must have the same columns, "
                                  "shapes and dtypes")
        write_manifest(root, specs[0], [ChunkInfo(**i) for i in infos], source=source or {"kind": SOURCE_KIND})
    except BaseException:
        claim.release(undo=True)
        raise
    finally:
        options.preserve_order = preserve
    claim.release()
    return ChunkDataset.open(root)
