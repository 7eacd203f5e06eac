"""Row specs: which keys a row has, with their trailing shapes and dtypes.

A ``RowSpec`` is the one schema shared by the offline dataset and the online
buffer. It is plain numpy (no torch), so shard actors can use it without
importing torch.

Keys are tuples of strings (nested TensorDict keys); on disk, in manifests and in
flat batches they are joined with ``/``, which is also how tensordict lays nested
keys out as directories.

Examples:
    >>> import numpy as np
    >>> spec = RowSpec.from_arrays({"X": np.zeros((4, 3), "float32"), "y": np.zeros(4, "int64")})
    >>> spec
    RowSpec(X: float32[3], y: int64[])
    >>> spec.validate({"X": np.zeros((2, 3), "float32"), "y": np.zeros(2, "int64")})
    2
    >>> spec.validate({"X": np.zeros((2, 4), "float32"), "y": np.zeros(2, "int64")})
    Traceback (most recent call last):
    ...
    rayrb.core.schema.SchemaError: key 'X': expected trailing shape (3,), got (4,) ...
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rayrb.errors import SchemaError  # noqa: F401  (re-exported)

SEP = "/"

# TorchRL adds these to sampled batches; they describe where a row was, not the row.
BOOKKEEPING_KEYS = frozenset({"index", "_weight", "priority_weight"})
# What a row's key may hold: fixed-width numbers torch maps straight from numpy (its from_numpy's own list), in
# their numpy names. Others (objects, strings, float128, a dtype spelled ">f4") could not be mapped or served.
STORED_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                 "float16", "float32", "float64", "complex64", "complex128")
MAX_ROW_VALUES = 1 << 40

def key_str(key: str | tuple[str, ...]) -> str:
    return key if isinstance(key, str) else SEP.join(key)


_UNSAFE = frozenset('/<>:"|?*\\ \0%' + "".join(map(chr, range(32))) + chr(127))
MAX_FILE_NAME = 255 - len(".memmap")  # bytes of a key part's file name (a file system's limit on a name)


def file_part(name: str) -> str:
    """The file (or directory) name a chunk gives key part ``name``: tensordict's, with each character a file
    name cannot hold (or that the encoding itself uses) as ``%XX``.

    >>> file_part("sepal length"), file_part("ratio%"), file_part("obs")
    ('sepal%20length', 'ratio%25', 'obs')
    """
    return "".join(f"%{ord(c):02X}" if c in _UNSAFE else c for c in name)


def field_spec(key: Any, shape: Any, dtype: Any) -> "FieldSpec":
    """One key's ``FieldSpec``, after checking what files and tensors are made of it: a key whose ``/``-parts
    name directories inside a chunk (none empty, ``.`` or ``..``), a shape of non-negative ints, a stored dtype.

    >>> field_spec("obs/x", [3], "float32")
    FieldSpec(shape=(3,), dtype='float32')
    >>> field_spec("../x", [3], "float32")
    Traceback (most recent call last):
    ...
    rayrb.errors.SchemaError: key '../x': expected a key of /-separated names, none empty, '.' or '..' (they name files), got '../x'
    """
    if not isinstance(key, str) or any(p in ("", ".", "..") or "\0" in p for p in key.split(SEP)):
        raise SchemaError(f"key {key!r}: expected a key of /-separated names, none empty, '.' or '..' "
                          f"(they name files), got {key!r}")
    long = [p for p in key.split(SEP) if len(file_part(p).encode()) > MAX_FILE_NAME]
    if long:
        raise SchemaError(f"key {key[:60]!r}: expected names of at most {MAX_FILE_NAME} bytes as files (they name "
                          f"files), got {len(file_part(long[0]).encode())} for {long[0][:40]!r}...")
    if not isinstance(shape, (list, tuple)) or not all(type(s) is int and s >= 0 for s in shape):
        raise SchemaError(f"key {key!r}: expected a shape of non-negative integers, got {shape!r}")
    if math.prod(shape) > MAX_ROW_VALUES:  # numpy could not make an array of even one such row
        raise SchemaError(f"key {key!r}: expected at most 2**40 values in a row, got shape {list(shape)}")
    if not isinstance(dtype, str) or dtype not in STORED_DTYPES:
        raise SchemaError(f"key {key!r}: expected a dtype rayrb stores (one of {', '.join(STORED_DTYPES)}), "
                          f"got {dtype!r}")
    return FieldSpec(tuple(shape), dtype)


@dataclass(frozen=True)
class FieldSpec:
    """Trailing shape (the shape of one row) and numpy dtype name of one key."""

    shape: tuple[int, ...]
    dtype: str

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"


class RowSpec:
    """An immutable mapping ``flat key -> FieldSpec``, sorted by key."""

    def __init__(self, fields: Mapping[str, FieldSpec]):
        if not fields:
            raise SchemaError("a row spec needs at least one key, got none")
        self._fields = dict(sorted((key_str(k), v) for k, v in fields.items()))
        for b in self._fields:
            parts = b.split(SEP)
            a = next((SEP.join(parts[:i]) for i in range(1, len(parts)) if SEP.join(parts[:i]) in self._fields), None)
            if a is not None:
                raise SchemaError(f"keys {a!r} and {b!r}: expected a key to be a value or hold keys under it, got "
                                  "both (they name one file and one directory)")

    # construction -------------------------------------------------------------
    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> "RowSpec":
        """Spec of a flat dict of arrays whose first dimension is the row."""
        fields = {}
        for k, a in arrays.items():
            a = np.asarray(a)
            if a.ndim < 1:
                raise SchemaError(f"key {key_str(k)!r}: expected an array with a row dimension, got a scalar")
            fields[k] = field_spec(key_str(k), [int(s) for s in a.shape[1:]], a.dtype.name)
        return cls(fields)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "RowSpec":
        """The spec ``to_json`` wrote (a manifest's, a checkpoint's), each key checked (``field_spec``)."""
        if not isinstance(obj, Mapping):
            raise SchemaError(f"expected a row spec as a mapping of key to {{'shape', 'dtype'}}, got "
                              f"{type(obj).__name__}")
        fields = {}
        for k, v in obj.items():
            if not isinstance(v, Mapping) or set(v) != {"shape", "dtype"}:
                got = sorted(map(str, v)) if isinstance(v, Mapping) else type(v).__name__
                raise SchemaError(f"key {k!r}: expected a mapping with 'shape' and 'dtype', got {got}")
            fields[k] = field_spec(k, v["shape"], v["dtype"])
        return cls(fields)

    def to_json(self) -> dict[str, Any]:
        return {k: {"shape": list(f.shape), "dtype": f.dtype} for k, f in self._fields.items()}

    # mapping-like access ------------------------------------------------------
    @property
    def keys(self) -> list[str]:
        return list(self._fields)

    def __getitem__(self, key: str) -> FieldSpec:
        return self._fields[key_str(key)]

    def __iter__(self):
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def items(self):
        return self._fields.items()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RowSpec) and self._fields == other._fields

    def __hash__(self) -> int:
        return hash(tuple(self._fields.items()))

    def __repr__(self) -> str:
        return "RowSpec(" + ", ".join(f"{k}: {f}" for k, f in self._fields.items()) + ")"

    @functools.cached_property
    def shapes(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """``{key: (trailing shape, numpy dtype)}``: what arrays of these rows are made with."""
        return {k: (tuple(f.shape), np.dtype(f.dtype)) for k, f in self._fields.items()}

    @functools.cached_property
    def row_bytes(self) -> int:
        """Bytes of one row (asked for every batch: computed once)."""
        return sum(int(np.prod(f.shape, dtype=np.int64)) * np.dtype(f.dtype).itemsize for f in self._fields.values())

    def empty(self, rows: int) -> dict[str, np.ndarray]:
        """Zero-filled flat arrays for ``rows`` rows."""
        return {k: np.zeros((rows, *f.shape), dtype=f.dtype) for k, f in self._fields.items()}

    # validation ---------------------------------------------------------------
    def validate(self, arrays: Mapping[str, np.ndarray], *, what: str = "data") -> int:
        """Check a flat dict of arrays against this spec; return its row count.

        Bookkeeping keys (TorchRL's ``index`` and friends) must be dropped first,
        see ``strip_bookkeeping``. Raises ``SchemaError`` naming the
        first key that differs and both specs.
        """
        got = set(arrays)
        want = set(self._fields)
        if got != want:
            missing, extra = sorted(want - got), sorted(got - want)
            raise SchemaError(
                f"{what} keys do not match the buffer's row spec: missing {missing}, unexpected {extra}; "
                f"expected {self!r}"
            )
        rows = None
        for k, f in self._fields.items():
            a = arrays[k]
            if a.ndim < 1:
                raise SchemaError(f"key {k!r}: expected a row dimension, got a scalar")
            if tuple(a.shape[1:]) != f.shape:
                raise SchemaError(
                    f"key {k!r}: expected trailing shape {f.shape}, got {tuple(a.shape[1:])} "
                    f"(expected {self!r}, got {_described(arrays)})"
                )
            if a.dtype.name != f.dtype:
                raise SchemaError(
                    f"key {k!r}: expected dtype {f.dtype}, got {a.dtype.name} "
                    f"(expected {self!r}, got {_described(arrays)})"
                )
            if rows is None:
                rows = a.shape[0]
            elif a.shape[0] != rows:
                raise SchemaError(f"key {k!r}: expected {rows} rows like the other keys, got {a.shape[0]}")
        return int(rows or 0)


def _described(arrays: Mapping[str, np.ndarray]) -> str:
    """Arrays as a spec's repr shows them, whatever their dtypes (an error message's "got")."""
    return "RowSpec(" + ", ".join(f"{key_str(k)}: {a.dtype.name}[{', '.join(map(str, a.shape[1:]))}]"
                                  for k, a in sorted(arrays.items())) + ")"


def strip_bookkeeping(arrays: Mapping[str, np.ndarray], keep: Iterable[str] = ()) -> dict[str, np.ndarray]:
    """Drop TorchRL bookkeeping keys (``index``, ``_weight``) unless listed in ``keep``."""
    keep = set(keep)
    return {k: v for k, v in arrays.items() if k in keep or k not in BOOKKEEPING_KEYS}


def native_order(a: Any) -> np.ndarray:
    """``a`` in native byte order, as files hold it (readers map them so) and torch takes it: other arrays
    are swapped, values kept (a copy)."""
    a = np.asarray(a)
    return a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))
