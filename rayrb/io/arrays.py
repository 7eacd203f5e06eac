"""How rows are held between processes: flat dicts of numpy arrays, rebuilt as TensorDicts at the ends.

numpy arrays are serialized out of band and mapped straight from Ray's object
store, while torch tensors and TensorDicts are pickled into the message and
copied twice (2.7 ms against 8-12 ms for a 2 MB batch, measured: see
``docs/architecture.md``). So every batch is shipped as ``{"a/b": ndarray}`` and
rebuilt with ``torch.from_numpy`` on the consumer.

Batches rebuilt from a single stored object share its memory: treat them as
read-only and ``.clone()`` before writing in place.

Examples:
    >>> import numpy as np
    >>> td = from_numpy_dict({"obs/x": np.zeros((3, 2), "float32"), "y": np.arange(3)})
    >>> sorted(to_numpy_dict(td)), td.batch_size
    (['obs/x', 'y'], torch.Size([3]))
"""
from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rayrb.core.plans import nest
from rayrb.core.schema import SEP, STORED_DTYPES, native_order
from rayrb.errors import InvalidArgumentTypeError, SchemaError

if TYPE_CHECKING:
    from tensordict import TensorDict


def is_tensordict(value: Any) -> bool:
    """Whether ``value`` is a TensorDict, without importing tensordict: a process that never imported it (a
    collector writing dicts of arrays) holds none. Importing it costs a writer process about 1.2 s of CPU on top
    of torch's before its first ``extend`` (it imports ``torch._dynamo``; ``docs/architecture.md``)."""
    td = sys.modules.get("tensordict")
    return td is not None and isinstance(value, td.TensorDictBase)


_TORCH_TO_NUMPY = {
    torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
    torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
    torch.uint8: np.uint8, torch.bool: np.bool_, torch.complex64: np.complex64, torch.complex128: np.complex128,
}


def numpy_dtype(dtype: torch.dtype | str | np.dtype) -> np.dtype:
    """numpy dtype for a torch dtype (or anything numpy understands)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_TO_NUMPY:
            raise InvalidArgumentTypeError(f"expected a torch dtype with a numpy equivalent, got {dtype}")
        return np.dtype(_TORCH_TO_NUMPY[dtype])
    if isinstance(dtype, str) and dtype.startswith("torch."):
        return numpy_dtype(getattr(torch, dtype[len("torch."):]))
    return np.dtype(dtype)


def as_numpy(x: Any) -> np.ndarray:
    """One array as numpy: a tensor detached and on the CPU first (a learner's priorities may need grad or sit on
    a GPU), anything else through ``np.asarray``."""
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def to_numpy_dict(data: Any) -> dict[str, np.ndarray]:
    """Flatten a TensorDict, a (nested) dict of tensors/arrays into ``{"a/b": ndarray}``.

    Tensors are moved to CPU; CPU tensors become views, not copies.
    """
    if not (isinstance(data, Mapping) or is_tensordict(data)):  # a bare array would become a key named ''
        raise InvalidArgumentTypeError(f"expected rows as a TensorDict or a dict of tensors or arrays, got "
                                       f"{type(data).__name__}")
    out: dict[str, np.ndarray] = {}

    def visit(prefix: str, value: Any) -> None:
        if prefix in out:  # "a/b" and {"a": {"b": ...}}: one of them would be dropped
            raise SchemaError(f"key {prefix!r}: expected it once, got it twice (as a flat key and nested)")
        if isinstance(value, Mapping) or is_tensordict(value):
            for k in value.keys():
                visit(f"{prefix}{SEP}{k}" if prefix else str(k), value[k])
        elif isinstance(value, torch.Tensor):
            t = value.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            try:
                out[prefix] = t.numpy()
            except TypeError:  # bfloat16 and the like: numpy has no such dtype, so no file or batch can hold it
                raise SchemaError(
                    f"key {prefix!r}: expected a dtype rayrb stores (one of {', '.join(STORED_DTYPES)}), got "
                    f"{t.dtype}: cast it first (bfloat16 to float32 keeps every value)") from None
        else:
            out[prefix] = np.asarray(value)

    visit("", data)
    return out


def rows_digest(arrays: Mapping[str, np.ndarray]) -> str:
    """A digest of a flat dict of arrays: keys, dtypes, shapes and values (xxh3-128, hex). The same values in
    another byte order digest the same (the row spec takes either, and a shard stores values).

    >>> a = {"x": np.arange(4, dtype=np.int64)}
    >>> rows_digest(a) == rows_digest({"x": np.arange(4).astype(">i8")}), rows_digest(a) == rows_digest({"x": np.arange(1, 5)})
    (True, False)
    """
    import xxhash

    h = xxhash.xxh3_128()
    for key in sorted(arrays):
        v = np.asarray(arrays[key])
        if not v.dtype.isnative:
            v = v.astype(v.dtype.newbyteorder("="))
        v = np.ascontiguousarray(v)
        h.update(f"{key}\0{v.dtype.name}\0{v.shape}\0".encode())
        h.update(v.data)  # the buffer itself, no copy
    return h.hexdigest()


def _tensor(a: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        return a
    a = native_order(a)
    if not a.flags.writeable:
        # A view into the object store: torch warns about it; the module docstring documents it.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(a)
    return torch.from_numpy(a)


def from_numpy_dict(arrays: Mapping[str, np.ndarray], batch_size: int | None = None) -> TensorDict:
    """Rebuild a TensorDict from ``{"a/b": ndarray}`` without copying."""
    if batch_size is None:
        batch_size = next(iter(arrays.values())).shape[0] if arrays else 0
    tensors = {k: _tensor(a) for k, a in arrays.items()}
    cls, unchecked = _TENSORDICT or _import_tensordict()
    if unchecked is not None and all(t.shape[:1] == (batch_size,) for t in tensors.values()):
        # every batch is rebuilt here: TensorDict's own checks of what this line just made cost more than it
        return unchecked(nest(tensors), batch_size=torch.Size([batch_size]))
    return cls(nest(tensors), batch_size=[batch_size])


_TENSORDICT: tuple[Any, Any] | None = None  # (TensorDict, its constructor without its checks), once imported


def _import_tensordict() -> tuple[Any, Any]:
    """TensorDict, imported by the first batch rebuilt here (not by a process that only writes)."""
    global _TENSORDICT
    from tensordict import TensorDict

    _TENSORDICT = (TensorDict, getattr(TensorDict, "_new_unsafe", None))
    return _TENSORDICT
