"""Arrow tables to rayrb's flat arrays: the interchange format Parquet files and Ray Data blocks arrive in."""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from rayrb.errors import InvalidArgumentTypeError

COLUMNS = b"rayrb.columns"  # schema metadata: each column's key, where export_parquet wrote it (a key may hold ".")


def arrow_to_arrays(table: Any) -> dict[str, np.ndarray]:
    """Fixed-width Arrow columns to flat numpy arrays (``a/b`` for struct fields and ``a.b`` columns).

    Shapes and keys recorded by ``export_parquet`` in the schema metadata are restored. Missing values (nulls),
    lists of other lengths at any depth, and two columns naming one key are refused, naming the column: each
    would otherwise come back as other rows (a null list dropped shifts the rows after it; an integer column with
    a null comes back as float64 with NaN).
    """
    import pyarrow as pa

    meta = table.schema.metadata or {}
    spec = json.loads(meta[b"rayrb.spec"]) if b"rayrb.spec" in meta else {}
    keys = json.loads(meta[COLUMNS]) if COLUMNS in meta else {}
    table = table.flatten()
    while any(pa.types.is_struct(f.type) for f in table.schema):
        table = table.flatten()
    out: dict[str, np.ndarray] = {}
    named: dict[str, str] = {}
    for name, col in zip(table.column_names, table.columns):
        key = keys.get(name, name.replace(".", "/"))
        if key in named:
            raise InvalidArgumentTypeError(f"columns {named[key]!r} and {name!r}: expected one column per key, got "
                                           f"both as key {key!r} (a struct field and a column named with a dot)")
        named[key] = name
        arr = _column(name, col.combine_chunks())
        if key in spec:
            arr = arr.reshape(len(col), *spec[key]["shape"]).astype(spec[key]["dtype"], copy=False)
        out[key] = arr
    return out


def _column(name: str, col: Any) -> np.ndarray:
    """One column as an array of ``len(col)`` rows: lists (of lists) of one length each flattened into a row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    values, depth = col, 0
    while True:
        if values.null_count:
            where = "" if depth == 0 else f" in its lists at depth {depth}"
            raise InvalidArgumentTypeError(f"column {name!r}: expected no missing values, got {values.null_count} "
                                           f"null(s){where}: fill or drop them first")
        kind = values.type
        if not (pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind) or pa.types.is_large_list(kind)):
            break
        if not pa.types.is_fixed_size_list(kind) and len(values):
            lengths = pc.list_value_length(values)
            low, high = pc.min(lengths).as_py(), pc.max(lengths).as_py()
            if low != high:  # would reshape silently wrong
                raise InvalidArgumentTypeError(f"column {name!r}: expected lists of one length per row"
                                               f"{'' if depth == 0 else f' at depth {depth}'}, got lengths from "
                                               f"{low} to {high}")
        values, depth = values.flatten(), depth + 1
    arr = values.to_numpy(zero_copy_only=False)
    if arr.dtype == object:
        raise InvalidArgumentTypeError(f"column {name!r}: expected a fixed-width numeric column, got Arrow type "
                                       f"{col.type}")
    if depth:
        arr = arr.reshape(len(col), -1) if len(col) else arr.reshape(0, 0)
    return arr
