"""Rows held as torch tensors on one device: the storage of a shard whose rows live in GPU memory. No Ray here.

A ``DeviceTable`` is one tensor per column, ``[rows, *shape]``, on one device.
An offline shard fills it once from its memory-mapped chunks (``DeviceTable.load``),
block by block through a pinned staging buffer when the device is a GPU; an online
shard keeps its circular storage in one (``DeviceTable.empty``) next to the
durable memory maps, and writes both.

Memory: the table holds exactly its rows' bytes on the device. A gather allocates
its output, ``count * row_bytes``, plus the index (8 bytes a row); loading stages at
most ``block_bytes`` (default 32 MiB) of host memory at a time, pinned for a GPU.

Examples:
    >>> import numpy as np
    >>> t = DeviceTable.from_arrays({"x": np.arange(12, dtype=np.float32).reshape(6, 2)}, "cpu")
    >>> t.gather(np.array([4, 0]))["x"].tolist()
    [[8.0, 9.0], [0.0, 1.0]]
    >>> t.write(np.array([1]), {"x": np.array([[-1.0, -2.0]], dtype=np.float32)})
    >>> t.nbytes, t.rows
    (48, 6)
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from rayrb.errors import InvalidArgumentError, SchemaError

BLOCK_BYTES = 32 << 20

Gather = Callable[[np.ndarray], Mapping[str, np.ndarray]]


def _device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(
            f"storage device {str(device)!r} needs CUDA, but torch.cuda.is_available() is False here")
    return device


class DeviceTable:
    """Columns of equal length on one device (see the module)."""

    def __init__(self, columns: Mapping[str, torch.Tensor], dtypes: Mapping[str, np.dtype] | None = None):
        lengths = {k: v.shape[0] for k, v in columns.items()}
        if not columns or len(set(lengths.values())) != 1:
            raise InvalidArgumentError(f"expected at least one column, all of one length, got lengths {lengths}")
        devices = {str(v.device) for v in columns.values()}
        if len(devices) != 1:
            raise InvalidArgumentError(f"expected every column on one device, got {sorted(devices)}")
        self.columns = dict(columns)
        self.device = next(iter(columns.values())).device
        self.rows = next(iter(lengths.values()))
        # each column's numpy dtype; unsigned ints that torch cannot index_copy are kept as their signed bits
        self.dtypes = {k: (np.dtype(dtypes[k]) if dtypes else _numpy_dtype(v.dtype)).newbyteorder("=")
                       for k, v in self.columns.items()}

    @classmethod
    def empty(cls, shapes: Mapping[str, tuple[tuple[int, ...], np.dtype]], rows: int,
              device: str | torch.device) -> "DeviceTable":
        """Zeroed storage for ``rows`` rows of these ``{key: (shape, numpy dtype)}`` columns."""
        device = _device(device)
        return cls({k: torch.zeros((rows, *shape), dtype=_torch_dtype(_stored(dtype)), device=device)
                    for k, (shape, dtype) in shapes.items()}, {k: np.dtype(d) for k, (_, d) in shapes.items()})

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], device: str | torch.device, *,
                    block_bytes: int = BLOCK_BYTES) -> "DeviceTable":
        """A copy of these host arrays on ``device`` (memory maps are read block by block)."""
        n = next(iter(arrays.values())).shape[0]
        return cls.load(lambda idx: {k: v[idx[0]:idx[-1] + 1] for k, v in arrays.items()}, n,
                        {k: (v.shape[1:], v.dtype) for k, v in arrays.items()}, device, block_bytes=block_bytes)

    @classmethod
    def load(cls, gather: Gather, rows: int, shapes: Mapping[str, tuple[tuple[int, ...], np.dtype]],
             device: str | torch.device, *, block_bytes: int = BLOCK_BYTES) -> "DeviceTable":
        """Fill a table of ``rows`` rows from ``gather(np.arange(a, b))``, one block of rows at a time.

        For a GPU the block is copied into a pinned buffer and from there to the device,
        so host memory never holds more than one block beyond the source's pages.
        """
        table = cls.empty(shapes, rows, device)
        row_bytes = max(1, sum(int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize for s, d in shapes.values()))
        step = max(1, block_bytes // row_bytes)
        cuda = table.device.type == "cuda"
        staging = ({k: torch.empty((min(step, rows), *v.shape[1:]), dtype=v.dtype).pin_memory()
                    for k, v in table.columns.items()} if cuda and rows else None)
        for a in range(0, rows, step):
            b = min(rows, a + step)
            block = table.stage(gather(np.arange(a, b)))
            for k, dst in table.columns.items():
                src = block[k]
                if staging is not None:
                    staging[k][:b - a].copy_(src)
                    dst[a:b].copy_(staging[k][:b - a], non_blocking=True)
                else:
                    dst[a:b].copy_(src)
            if cuda:
                torch.cuda.current_stream(table.device).synchronize()  # the staging buffer is reused next block
        return table

    def _gather(self, idx: np.ndarray | torch.Tensor) -> dict[str, torch.Tensor]:
        index = torch.as_tensor(np.asarray(idx, dtype=np.int64) if not isinstance(idx, torch.Tensor) else idx,
                                dtype=torch.int64).to(self.device, non_blocking=True)
        return {k: torch.index_select(v, 0, index) for k, v in self.columns.items()}

    def gather(self, idx: np.ndarray | torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows at ``idx``, as new tensors on the table's device, in the columns' dtypes."""
        return {k: _as(v, self.dtypes[k]) for k, v in self._gather(idx).items()}

    def stage(self, rows: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """``rows`` as host tensors the columns can take (native byte order, stored dtype); raises on rows
        that do not fit, before anything is written."""
        out = {}
        for k, dst in self.columns.items():
            a = np.asarray(rows[k])
            if a.shape[1:] != tuple(dst.shape[1:]) or np.dtype(a.dtype.name) != self.dtypes[k]:
                raise SchemaError(f"column {k!r}: expected rows of shape {tuple(dst.shape[1:])} and dtype "
                                  f"{self.dtypes[k]}, got {a.shape[1:]} and {a.dtype}")
            a = np.ascontiguousarray(a, dtype=self.dtypes[k]).view(_stored(self.dtypes[k]))
            out[k] = torch.from_numpy(a)
        return out

    def write(self, pos: np.ndarray, rows: Mapping[str, np.ndarray]) -> None:
        """Put ``rows[k][j]`` at slot ``pos[j]`` of every column; rows that do not fit change nothing."""
        staged = self.stage(rows)
        index = torch.as_tensor(np.asarray(pos, dtype=np.int64)).to(self.device, non_blocking=True)
        for k, dst in self.columns.items():
            dst.index_copy_(0, index, staged[k].to(self.device, non_blocking=True))

    def numpy(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """``gather``, copied to host numpy arrays (for the object store)."""
        return {k: v.cpu().numpy().view(self.dtypes[k]) for k, v in self._gather(idx).items()}

    @property
    def nbytes(self) -> int:
        """Bytes the columns hold on the device."""
        return int(sum(v.numel() * v.element_size() for v in self.columns.values()))

    def __repr__(self) -> str:
        return f"DeviceTable(rows={self.rows}, device={str(self.device)!r}, columns={sorted(self.columns)})"


_SIGNED = {np.dtype(np.uint16): np.dtype(np.int16), np.dtype(np.uint32): np.dtype(np.int32),
           np.dtype(np.uint64): np.dtype(np.int64)}


def _stored(dtype: Any) -> np.dtype:
    """The dtype a column is kept in: its own, or the signed one of the same width where torch lacks the ops."""
    dtype = np.dtype(dtype).newbyteorder("=")
    return _SIGNED.get(dtype, dtype)


def _torch_dtype(dtype: Any) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=np.dtype(dtype))).dtype


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


def _as(t: torch.Tensor, dtype: np.dtype) -> torch.Tensor:
    """A stored column's tensor in its own dtype (a view of the same bits)."""
    want = _torch_dtype(dtype)
    return t if t.dtype == want else t.view(want)
