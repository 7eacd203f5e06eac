"""Arrow tables to rayrb's flat arrays: the interchange format Parquet files and Ray Data blocks arrive in."""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from rayrb.errors import InvalidArgumentTypeError


def arrow_to_arrays(table: Any) -> dict[str, np.ndarray]:
    """Fixed-width Arrow columns to flat numpy arrays (``a/b`` for struct fields).

    Shapes recorded by ``export_parquet`` in the schema metadata are restored.
    """
    import pyarrow as pa

    meta = table.schema.metadata or {}
    spec = json.loads(meta[b"rayrb.spec"]) if b"rayrb.spec" in meta else {}
    table = table.flatten()
    while any(pa.types.is_struct(f.type) for f in table.schema):
        table = table.flatten()
    out = {}
    for name, col in zip(table.column_names, table.columns):
        key = name.replace(".", "/")
        col = col.combine_chunks()
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            import pyarrow.compute as pc

            lengths = pc.list_value_length(col)
            if len(col) and pc.min(lengths).as_py() != pc.max(lengths).as_py():  # would reshape silently wrong
                raise InvalidArgumentTypeError(
                    f"column {name!r}: expected lists of one length per row, got lengths from "
                    f"{pc.min(lengths).as_py()} to {pc.max(lengths).as_py()}")
        if pa.types.is_fixed_size_list(col.type) or pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            values = col.flatten()
            while pa.types.is_fixed_size_list(values.type) or pa.types.is_list(values.type):
                values = values.flatten()
            arr = values.to_numpy(zero_copy_only=False)
            arr = arr.reshape(len(col), -1) if len(col) else arr.reshape(0, 0)
        else:
            arr = col.to_numpy(zero_copy_only=False)
        if arr.dtype == object:
            raise InvalidArgumentTypeError(
                f"column {name!r}: expected a fixed-width numeric column, got Arrow type {col.type}")
        if key in spec:
            arr = arr.reshape(len(col), *spec[key]["shape"]).astype(spec[key]["dtype"], copy=False)
        out[key] = arr
    return out
