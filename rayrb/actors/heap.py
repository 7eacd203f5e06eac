"""Shard processes hand the buffers of large reads back to the system once they are freed.

A read gathers its rows into a fresh array, which Ray copies into the object store
before it is freed. At ``B=65536`` over 4 offline shards with ``prefetch=16`` that
array is 16 batches x 8,192 rows x 224 bytes = 29 MiB per shard. glibc maps the
first such array on its own and, when it is freed, raises its mmap threshold to
that size (up to 32 MiB) and its trim threshold to twice that. Every later read
of that size then comes from the heap, which keeps up to 64 MiB it never
gives back: 4 offline shards held 150 MiB more after one such iterator, for
good (``docs/benchmarks.md``, "Memory").

Setting the threshold (``mallopt(M_MMAP_THRESHOLD)``) turns that adjustment off:
arrays of ``MMAP_THRESHOLD`` bytes and more are mapped and unmapped, and the heap's
top is trimmed past glibc's default 128 KiB. The cost is the page faults of
mapping each large read afresh, small next to the gather that fills it.
"""
from __future__ import annotations

import ctypes
import ctypes.util

MMAP_THRESHOLD = 4 << 20  # a B=4096 group's read (2.7 MiB per shard) stays on the heap; larger ones are mapped
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_done = False


def return_large_frees(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold in this process (once); False where the C library is not glibc.

    >>> isinstance(return_large_frees(), bool)
    True
    """
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl, macOS: no mallopt, and no dynamic threshold to fix
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = mallopt(_M_MMAP_THRESHOLD, int(threshold)) == 1
    return _done
