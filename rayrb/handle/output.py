"""A handle's batches on the way out: the batch size checked against the byte cap before anything is planned,
and the rows rebuilt as a TensorDict (moved, transformed), whichever way they were sampled."""
from __future__ import annotations

from typing import Any

import torch

from rayrb.core.schema import RowSpec
from rayrb.core.validation import positive_int
from rayrb.errors import InvalidArgumentError
from rayrb.io.arrays import from_numpy_dict


class Output:
    """The batch size and the finishing of a handle's batches (see the module)."""

    def __init__(self, spec: RowSpec, batch_size: int | None, transform: Any, max_batch_bytes: int):
        self.spec, self.batch_size, self.transform, self.max_batch_bytes = spec, batch_size, transform, max_batch_bytes

    def size(self, batch_size: int | None) -> int:
        """The batch size to draw (``None``: the buffer's), refused if its rows cannot fit ``max_batch_bytes``."""
        if batch_size is None:
            batch_size = self.batch_size
        if batch_size is None:
            raise InvalidArgumentError("batch_size must be provided either in __init__ or sample(), got None in both")
        batch_size = positive_int("batch_size", batch_size)
        nbytes = batch_size * max(1, self.spec.row_bytes)
        if nbytes > self.max_batch_bytes:
            raise InvalidArgumentError(f"batch_size={batch_size} needs {nbytes:,} bytes of rows, over max_batch_bytes="
                                       f"{self.max_batch_bytes:,}; sample smaller batches or raise max_batch_bytes")
        return batch_size

    def finish(self, out: Any, return_info: bool, device: Any = None):
        """Flat numpy batch (and info) from the object store -> TensorDict (and tensors), transformed."""
        rows, info = out if return_info else (out, None)
        td = from_numpy_dict(rows)
        if device is not None:
            td = to_device(td, device)
        if self.transform is not None:
            td = self.transform(td)
        if not return_info:
            return td
        return td, {k: torch.from_numpy(v) for k, v in info.items()}

    def finish_tensors(self, out: Any, return_info: bool):
        """A ``(TensorDict, info)`` that arrived over Ray Direct Transport, transformed."""
        td, info = out
        if self.transform is not None:
            td = self.transform(td)
        return (td, info) if return_info else td


def to_device(td: Any, device: Any):
    """``td`` on ``device`` (through pinned memory for CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        return td.pin_memory().to(device, non_blocking=True)
    return td.to(device)
