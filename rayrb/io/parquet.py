"""Parquet files: a chunk dataset exported one file per chunk (for Ray Data and pandas), and the files a Parquet
source names."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from rayrb.errors import InvalidArgumentError
from rayrb.io.arrow import COLUMNS
from rayrb.io.chunk_dataset import ChunkDataset


def parquet_files(path: Path) -> list[Path]:
    """The Parquet files at ``path``: the file itself, or a directory's ``*.parquet`` files in name order."""
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    if not files:
        raise InvalidArgumentError(f"expected Parquet files in {path}, found none")
    return files


def export_parquet(dataset: ChunkDataset | str | os.PathLike, dest: str | os.PathLike) -> list[Path]:
    """Write a chunk dataset as Parquet, one file per chunk, for Ray Data and pandas users.

    Multi-dimensional rows become (nested) fixed-size lists; nested keys become
    ``a.b`` column names; the row spec and each column's key are kept in the schema
    metadata, so ``arrow_to_arrays`` restores keys, shapes and dtypes exactly. Two
    keys that would name one column (``a.b`` and ``a/b``) are refused.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    ds = dataset if isinstance(dataset, ChunkDataset) else ChunkDataset.open(dataset)
    columns: dict[str, str] = {}  # column name -> key
    for k in ds.spec:
        name = k.replace("/", ".")
        if name in columns:
            raise InvalidArgumentError(f"keys {columns[name]!r} and {k!r}: expected keys that name one Parquet "
                                       f"column each, got both as column {name!r}")
        columns[name] = k
    metadata = {b"rayrb.spec": json.dumps(ds.spec.to_json()).encode(), COLUMNS: json.dumps(columns).encode()}
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, c in enumerate(ds.chunks):
        arrays = ds.chunk_arrays(i)
        cols = {}
        for name, k in columns.items():
            a = np.ascontiguousarray(arrays[k])
            col = pa.array(a.reshape(-1))
            for dim in reversed(ds.spec[k].shape):
                col = pa.FixedSizeListArray.from_arrays(col, dim)
            cols[name] = col
        table = pa.table(cols).replace_schema_metadata(metadata)
        path = dest / f"{c.path}.parquet"
        pq.write_table(table, path)
        paths.append(path)
    return paths
