"""A handle's batches on the way out: the batch size checked against the byte cap before anything is planned,
and the rows rebuilt as a TensorDict (moved, transformed), whichever way they were sampled.

Batches of slices are marked at each slice's edges (``mark_slices``). Without ``strict_length`` a shard reads
each short slice padded to ``slice_len`` rows (``rayrb.core.episodes.padded_steps``), so that every read keeps
the rows it was planned; the padding is dropped here, by each row's place in its shard
(``rayrb.core.episodes.short_slices``), and the batch comes out shorter, as TorchRL's does."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rayrb.core.episodes import short_slices
from rayrb.core.schema import RowSpec
from rayrb.core.validation import positive_int
from rayrb.errors import InvalidArgumentError
from rayrb.io.arrays import from_numpy_dict


class Output:
    """The batch size and the finishing of a handle's batches (see the module)."""

    def __init__(self, spec: RowSpec, batch_size: int | None, transform: Any, max_batch_bytes: int,
                 layout: Any = None):
        """``layout``: the buffer's (``rayrb.core.layout.ShardLayout``), which says whether it draws slices."""
        self.spec, self.batch_size, self.transform, self.max_batch_bytes = spec, batch_size, transform, max_batch_bytes
        # batches of slices of episodes: their edges are marked (``mark_slices``)
        self.slice_len = None if layout is None else layout.slice_len
        self.short = self.slice_len is not None and not layout.strict_length  # short slices read padded: dropped

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

    def finish(self, out: Any, return_info: bool, device: Any = None, info: Any = None, sliced: bool = True,
               transform: bool = True):
        """Flat numpy batch (and info) from the object store -> TensorDict (and tensors), transformed. ``info``:
        the rows' provenance where the caller has it and did not ask for it (short slices are found by it);
        ``sliced=False``: rows that are not slices (a side's uniform rows), never trimmed; ``transform=False``: not
        the buffer's transform (a side's own rows, as TorchRL's ``offline_buffer`` / ``online_buffer`` give them)."""
        rows, info = out if return_info else (out, info)
        edges = None
        if self.short and sliced:
            if info is None:
                raise InvalidArgumentError("expected each row's info (return_info=True) with strict_length=False: "
                                           "a batch's short slices are found by it, got rows only")
            keep, *edges = short_slices(np.asarray(info["index"]), self.slice_len)
            rows, info = {k: v[keep] for k, v in rows.items()}, {k: v[keep] for k, v in info.items()}
            edges = [torch.from_numpy(e) for e in edges]
        td = from_numpy_dict(rows)
        if self.slice_len is not None and (sliced or not self.short):
            mark_slices(td, self.slice_len, edges)
        if device is not None:
            td = to_device(td, device)
        if self.transform is not None and transform:
            td = self.transform(td)
        if not return_info:
            return td
        return td, {k: torch.from_numpy(v) for k, v in info.items()}

    def finish_held(self, held: Any, return_info: bool, device: Any = None):
        """A handle's batch (``rayrb.handle.reads.Held``): its provenance built where asked for, or where short
        slices are found by it."""
        info = held.info() if return_info or self.short else None
        return self.finish((held.batch, info) if return_info else held.batch, return_info, device, info=info)

    def finish_tensors(self, out: Any, return_info: bool):
        """A ``(TensorDict, info)`` that arrived over Ray Direct Transport, transformed."""
        td, info = out
        edges = None
        if self.short:
            device = info["index"].device  # the rows' (``rayrb.actors.transport.receive`` puts both on one)
            keep, *edges = (torch.from_numpy(a).to(device) for a in short_slices(info["index"].cpu().numpy(),
                                                                                  self.slice_len))
            td, info = td[keep], {k: v[keep] for k, v in info.items()}
        if self.slice_len is not None:
            mark_slices(td, self.slice_len, edges)
        if self.transform is not None:
            td = self.transform(td)
        return (td, info) if return_info else td


def mark_slices(td: Any, slice_len: int, edges: Any = None) -> None:
    """TorchRL's ``SliceSampler`` marks on a flat batch of slices: ``is_init`` on each slice's first step (a
    recurrent module starts its state there), ``("next", "truncated")`` on its last, and ``("next", "done")`` there
    too where the rows hold it; each OR-ed with the flag the rows hold, in its shape and dtype (``[B, 1]`` bool when
    they hold none). ``edges``: each row's ``(first, last)`` flags where slices differ in length (short slices),
    else every slice is ``slice_len`` rows."""
    if edges is None:
        at = torch.arange(td.shape[0], device=td.device) % slice_len
        first, last = at == 0, at == slice_len - 1
    else:
        first, last = edges
    for key, flag, always in (("is_init", first, True), (("next", "truncated"), last, True),
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
