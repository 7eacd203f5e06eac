"""Chunk checksums: a content hash per chunk over its keys, dtypes, shapes and bytes, stored as ``"<algorithm>:<hex>"``.

Examples:
    >>> import numpy as np
    >>> from rayrb.core.schema import RowSpec
    >>> arrays = {"X": np.zeros((2, 3), "float32")}
    >>> hash_algorithm(hash_arrays(arrays, RowSpec.from_arrays(arrays), "sha256"))
    'sha256'
"""
from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from rayrb.core.schema import RowSpec
from rayrb.errors import ChunkError

# Chunk checksums guard against truncated or altered files, not against an adversary, so the
# fastest is the default: xxh3 (64-bit) hashes at memory speed, about 10x crc32 and 20x sha256
# here. Each hash is stored as "<algorithm>:<hex>", so manifests written with crc32 or sha256
# still verify.
HASH_ALGORITHMS = ("xxh3", "crc32", "sha256")
DEFAULT_HASH = "xxh3"
_BLOCK_BYTES = 1 << 20  # write and checksum in blocks: each block is hashed while it is in cache


class ContentHash:
    """An incremental chunk checksum, ``xxh3``, ``crc32`` (zlib) or ``sha256``, printed as ``"<algorithm>:<hex>"``.

    >>> h = ContentHash("crc32"); h.update(b"ab"); h.update(b"c"); h.hexdigest()
    'crc32:352441c2'
    """

    def __init__(self, algorithm: str = DEFAULT_HASH):
        if algorithm not in HASH_ALGORITHMS:
            raise ChunkError(f"expected a chunk hash algorithm in {HASH_ALGORITHMS}, got {algorithm!r}")
        self.algorithm = algorithm
        self._crc = 0
        if algorithm == "xxh3":
            import xxhash  # here, not at import: reading chunks needs numpy alone

            self._h = xxhash.xxh3_64()
        else:
            self._h = hashlib.sha256() if algorithm == "sha256" else None

    def update(self, data: Any) -> None:
        if self._h is not None:
            self._h.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def header(self, key: str, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        """Keys, dtypes and shapes are part of the content."""
        self.update(f"{key}|{np.dtype(dtype).name}|{tuple(shape)}|".encode())

    def hexdigest(self) -> str:
        digest = self._h.hexdigest() if self._h is not None else f"{self._crc:08x}"
        return f"{self.algorithm}:{digest}"


def hash_algorithm(content_hash: str) -> str:
    """The algorithm a stored ``"<algorithm>:<hex>"`` hash was made with."""
    algorithm, sep, _ = content_hash.partition(":")
    if not sep or algorithm not in HASH_ALGORITHMS:
        raise ChunkError(f"expected a chunk hash '<algorithm>:<hex>' with algorithm in {HASH_ALGORITHMS}, "
                         f"got {content_hash!r}")
    return algorithm


def byte_blocks(a: np.ndarray) -> Iterator[memoryview]:
    """The bytes of ``a`` in C order, in blocks of about 1 MiB; a strided array is copied one block at a time."""
    if a.ndim == 0 or a.shape[0] == 0 or a.nbytes == 0:
        return
    if a.flags.c_contiguous:
        flat = memoryview(a.reshape(-1).view(np.uint8))
        for start in range(0, len(flat), _BLOCK_BYTES):
            yield flat[start:start + _BLOCK_BYTES]
        return
    step = max(1, _BLOCK_BYTES // max(1, a[0].nbytes))
    for start in range(0, a.shape[0], step):
        yield memoryview(np.ascontiguousarray(a[start:start + step]).reshape(-1).view(np.uint8))


def hash_arrays(arrays: Mapping[str, np.ndarray], spec: RowSpec, algorithm: str = DEFAULT_HASH) -> str:
    """Content hash of one chunk: keys, dtypes, shapes and bytes, in spec order."""
    h = ContentHash(algorithm)
    for k in spec:
        a = np.asarray(arrays[k])
        h.header(k, a.dtype, a.shape)
        for block in byte_blocks(a):
            h.update(block)
    return h.hexdigest()
