"""Rows carried inside an actor call, not through the object store.

Ray puts each task argument larger than its inline size (``max_direct_call_object_size``, 100 KiB) in the
object store: the callee's raylet then fetches it from the caller's node (an object directory lookup, a pull,
a plasma object created and sealed), which on the development machine cost 4.3 ms of CPU per call of 219 KiB
against 1.3 ms for the same rows in the call (``docs/benchmarks.md``, "Rows in the call"). Arguments under
that size travel in the call's own message, up to ``task_rpc_inlined_bytes_limit`` (10 MiB) in all. So a write
of up to ``INLINE_BYTES`` is cut, by rows, into parts of at most ``PART_BYTES`` each, passed as separate
arguments (``*parts``) and joined by the callee. Larger writes go through the object store as one argument: in
an exploratory measurement parts gained no time at 2.1 MiB and lost some at 8.5 MiB.

>>> import numpy as np
>>> rows = {"x": np.zeros((1000, 54), np.float32), "y": np.zeros(1000, np.int64)}  # 224 bytes a row
>>> [len(p["y"]) for p in cut(rows)]
[406, 406, 188]
>>> joined(cut(rows))["x"].shape
(1000, 54)
>>> cut({"x": np.zeros((10_000, 54), np.float32)}) is None  # 2.1 MiB: the object store
True
>>> cut({"x": np.zeros((2, 40_000), np.float32)}) is None  # one row is larger than a part
True
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

PART_BYTES = 90 << 10  # under Ray's inline size (100 KiB), with room for the framing below
ARRAY_BYTES = 512  # what each array adds to a part's serialized size: its key, pickle framing, metadata, alignment
INLINE_BYTES = 1 << 20  # writes up to this size travel in the call


def cut(rows: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], ...] | None:
    """``rows`` cut by rows into parts Ray carries in the call (views, not copies), or None where they go
    through the object store: more than ``INLINE_BYTES`` in all, a row larger than a part's room for rows
    (``PART_BYTES`` less ``ARRAY_BYTES`` an array), or no rows."""
    arrays = list(rows.values())
    n = len(arrays[0]) if arrays else 0
    total = sum(a.nbytes for a in arrays)
    if n == 0 or total > INLINE_BYTES:
        return None
    room = PART_BYTES - ARRAY_BYTES * len(arrays)
    per_part = room * n // max(total, 1) if room > 0 else 0  # every row of one write has the same size
    if per_part < 1:
        return None
    return tuple({k: v[a:a + per_part] for k, v in rows.items()} for a in range(0, n, per_part))


def joined(parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The rows ``cut`` cut, whole again (one part is taken as it is)."""
    if len(parts) == 1:
        return dict(parts[0])
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
