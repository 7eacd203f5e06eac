"""On-disk chunk datasets: ``manifest.json`` plus one tensordict memmap directory per chunk.

Layout::

    root/
      manifest.json          written last, atomically (temp file + rename)
      chunk-00000/           TensorDict.memmap(...) of rows [0, n0)
        meta.json
        X.memmap
        nested/meta.json
        nested/key.memmap
      chunk-00001/ ...

A directory without ``manifest.json`` is not a dataset, so a crash between the
chunks and the manifest never leaves something that looks complete. Each chunk
is also a plain tensordict memmap: ``TensorDict.load_memmap(root / "chunk-00000")``
works.

Reading needs only numpy: chunks are mapped read-only with ``np.memmap(mode="r")``,
so shard actors can map a dataset without importing torch, nothing is copied into
RAM until rows are gathered, and writes raise.

This module writes chunks and datasets; the reader (``ChunkDataset``) is
``rayrb.io.chunk_dataset``, the manifest ``rayrb.io.manifest`` and the chunk
checksums ``rayrb.io.hashing``. Their names are importable from here too.

Examples:
    >>> import numpy as np, tempfile, os
    >>> root = os.path.join(tempfile.mkdtemp(), "ds")
    >>> ds = write_dataset({"X": np.arange(10, dtype="float32").reshape(5, 2)}, root, chunk_rows=2)
    >>> len(ds), [c.rows for c in ds.chunks]
    (5, [2, 2, 1])
    >>> ds.gather(np.array([4, 0]))["X"].tolist()
    [[8.0, 9.0], [0.0, 1.0]]
    >>> ds.verify()
    >>> ChunkDataset.open(root).spec
    RowSpec(X: float32[2])
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from rayrb.core.schema import SEP, RowSpec, native_order
from rayrb.errors import (
    ChunkError,  # noqa: F401  (re-exported)
    DirectoryNotEmptyError,
    InvalidArgumentError,
    ReadOnlyError,  # noqa: F401  (re-exported)
)
from rayrb.io.chunk_dataset import ChunkDataset, key_file, map_chunk  # noqa: F401  (re-exported)
from rayrb.io.claim import Claim
from rayrb.io.files import pwrite_all, reserve
from rayrb.io.hashing import (  # noqa: F401  (re-exported)
    DEFAULT_HASH,
    HASH_ALGORITHMS,
    ContentHash,
    byte_blocks,
    hash_algorithm,
    hash_arrays,
)
from rayrb.io.manifest import (  # noqa: F401  (re-exported)
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    ChunkInfo,
    chunk_name,
    read_manifest,
    write_manifest,
)

DEFAULT_CHUNK_BYTES = 64 << 20


def default_chunk_rows(spec: RowSpec, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    return max(1, chunk_bytes // max(1, spec.row_bytes))


def write_chunk(arrays: Mapping[str, np.ndarray], directory: str | os.PathLike, spec: RowSpec | None = None,
                algorithm: str = DEFAULT_HASH) -> ChunkInfo:
    """Write one chunk as a tensordict memmap directory; return its info (path relative to the parent).

    tensordict lays out the directory (``meta.json`` files, sized ``.memmap`` files); the rows are
    then written with ``pwrite`` in 1 MiB blocks straight from ``arrays`` (strided arrays too, one
    contiguous block at a time) and each block is checksummed right after, while in cache.
    ``pwrite``, not a mapped copy: the kernel fills the page cache in large folios, where stores
    through a mapping fault on every 4 KiB page (about 6x slower here for a 16 MiB column).
    """
    import torch  # only where chunks are written: readers need numpy alone
    from tensordict import TensorDict

    arrays = {k: native_order(a) for k, a in arrays.items()}
    spec = spec or RowSpec.from_arrays(arrays)
    rows = spec.validate(arrays, what="chunk")
    directory = Path(directory)
    if directory.exists():
        shutil.rmtree(directory)
    # A zero-stride stand-in per key: memmap_like needs only shapes and dtypes, not the data.
    nested: dict[str, Any] = {}
    for k in spec:
        *parents, leaf = k.split(SEP)
        node = nested
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = torch.from_numpy(np.zeros(1, arrays[k].dtype))[0].expand(arrays[k].shape)
    TensorDict(nested, batch_size=[rows]).memmap_like(str(directory), num_threads=0)
    h = ContentHash(algorithm)
    for k in spec:
        a = np.asarray(arrays[k])
        h.header(k, a.dtype, a.shape)
        if a.nbytes == 0:
            continue
        fd = os.open(key_file(directory, k), os.O_WRONLY)
        try:
            reserve(fd, a.nbytes)
            offset = 0
            for block in byte_blocks(a):
                pwrite_all(fd, block, offset)
                h.update(block)
                offset += len(block)
        finally:
            os.close(fd)
    return ChunkInfo(path=directory.name, rows=rows, hash=h.hexdigest())

def new_dataset_root(root: str | os.PathLike, overwrite: bool = False) -> Claim:
    """``root`` held for a new dataset (``rayrb.io.claim``): it must be absent or empty, unless ``overwrite`` clears
    it. The caller releases the claim when its write ends (``undo=True`` where it failed)."""
    claim = Claim(root)
    if claim.others():
        if not overwrite:
            claim.release()
            raise DirectoryNotEmptyError(
                f"expected an absent or empty directory for a new chunk dataset, got non-empty {claim.root}")
        claim.clear()
    return claim


def flat_arrays(data: Any) -> dict[str, np.ndarray]:
    """Rows as ``{flat key: array}``: a dict of arrays as it is (no torch imported), anything else through
    ``rayrb.io.arrays.to_numpy_dict``."""
    if isinstance(data, Mapping) and all(isinstance(v, np.ndarray) for v in data.values()):
        return dict(data)
    from rayrb.io.arrays import to_numpy_dict

    return to_numpy_dict(data)


def iter_row_blocks(arrays: Mapping[str, np.ndarray], rows: int, chunk_rows: int) -> Iterator[dict[str, np.ndarray]]:
    for start in range(0, rows, chunk_rows):
        yield {k: v[start:start + chunk_rows] for k, v in arrays.items()}


def write_dataset(
    data: Any,
    root: str | os.PathLike,
    *,
    chunk_rows: int | None = None,
    source: Any = None,
    recipe: Any = None,
    overwrite: bool = False,
    pbar: bool = False,
) -> "ChunkDataset":
    """Write rows (a TensorDict or a flat/nested dict of arrays) as a chunk dataset under ``root``.

    ``root`` must be absent or empty unless ``overwrite=True``, and written by one
    writer at a time (``rayrb.io.claim``). The manifest is written after the last
    chunk, so an interrupted call leaves no dataset; one that raises leaves ``root``
    as it found it (removed, where it made it). ``pbar``
    shows a progress bar over chunks. Rows that do not fit in memory: ``write_batches``
    (``rayrb.io.streaming``) writes the same chunks from a stream of batches, resumably.
    """
    arrays = flat_arrays(data)
    spec = RowSpec.from_arrays(arrays)
    rows = spec.validate(arrays)
    if rows == 0:
        raise InvalidArgumentError("expected at least one row to write a chunk dataset, got 0 rows")
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(spec)
    from rayrb.core.validation import positive_int

    chunk_rows = positive_int("chunk_rows", chunk_rows)
    claim = new_dataset_root(root, overwrite)
    root = claim.root
    from rayrb.io.progress import progress

    bar = progress(-(-rows // chunk_rows), unit="chunks", desc=f"write {root.name}", enabled=pbar)
    chunks = []
    try:
        for i, block in enumerate(iter_row_blocks(arrays, rows, chunk_rows)):
            chunks.append(write_chunk(block, root / chunk_name(i), spec))
            bar.update(1)
        write_manifest(root, spec, chunks, source=source, recipe=recipe)
    except BaseException:  # a write that fails leaves the directory as it found it (or none)
        claim.release(undo=True)
        raise
    finally:
        bar.close()
    claim.release()
    return ChunkDataset.open(root)
