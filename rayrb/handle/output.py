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

    def __init__(self, spec: RowSpec, batch_size: int | None, transform: Any, max_batch_bytes: int,
                 slice_len: int | None = None):
        self.spec, self.batch_size, self.transform, self.max_batch_bytes = spec, batch_size, transform, max_batch_bytes
        self.slice_len = slice_len  # batches of slices of episodes: their edges are marked (``mark_slices``)

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
        if self.slice_len is not None:
            mark_slices(td, self.slice_len)
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
        if self.slice_len is not None:
            mark_slices(td, self.slice_len)
        if self.transform is not None:
            td = self.transform(td)
        return (td, info) if return_info else td


def mark_slices(td: Any, slice_len: int) -> None:
    """TorchRL's ``SliceSampler`` marks on a flat batch of slices: ``is_init`` on each slice's first step (a
    recurrent module starts its state there), ``("next", "truncated")`` on its last, and ``("next", "done")`` there
    too where the rows hold it; each OR-ed with the flag the rows hold, in its shape and dtype (``[B, 1]`` bool when
    they hold none)."""
    at = torch.arange(td.shape[0], device=td.device) % slice_len
    last = at == slice_len - 1
    for key, flag, always in (("is_init", at == 0, True), (("next", "truncated"), last, True),
                              (("next", "done"), last, False)):
        held = td.get(key, None)
        if held is not None:
            td.set(key, (held.bool() | flag.reshape(held.shape)).to(held.dtype))
        elif always:
            td.set(key, flag.unsqueeze(-1))


def to_device(td: Any, device: Any):
    """``td`` on ``device`` (through pinned memory for CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        return td.pin_memory().to(device, non_blocking=True)
    return td.to(device)
