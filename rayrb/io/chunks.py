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

import hashlib
import json
import os
import shutil
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rayrb.core.schema import SEP, RowSpec, native_order
from rayrb.errors import (
    ChunkError,  # noqa: F401  (re-exported)
    DirectoryNotEmptyError,
    InvalidArgumentError,
    ReadOnlyError,  # noqa: F401  (re-exported)
    RowIndexError,
)
from rayrb.io.files import pwrite_all, replace_file, reserve

FORMAT = "rayrb.chunks"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DEFAULT_CHUNK_BYTES = 64 << 20




@dataclass
class ChunkInfo:
    path: str
    rows: int
    hash: str
    node: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def default_chunk_rows(spec: RowSpec, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    return max(1, chunk_bytes // max(1, spec.row_bytes))


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


def _blocks(a: np.ndarray) -> Iterator[memoryview]:
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
        for block in _blocks(a):
            h.update(block)
    return h.hexdigest()


def chunk_name(i: int) -> str:
    return f"chunk-{i:05d}"


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
        *parents, leaf = k.split(SEP)
        fd = os.open(directory.joinpath(*parents, f"{leaf}.memmap"), os.O_WRONLY)
        try:
            reserve(fd, a.nbytes)
            offset = 0
            for block in _blocks(a):
                pwrite_all(fd, block, offset)
                h.update(block)
                offset += len(block)
        finally:
            os.close(fd)
    return ChunkInfo(path=directory.name, rows=rows, hash=h.hexdigest())


def write_manifest(
    root: str | os.PathLike,
    spec: RowSpec,
    chunks: list[ChunkInfo],
    *,
    source: Any = None,
    recipe: Any = None,
) -> Path:
    """Write ``manifest.json`` atomically: a reader sees the old state or the whole new one."""
    root = Path(root)
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "spec": spec.to_json(),
        "rows": int(sum(c.rows for c in chunks)),
        "chunks": [asdict(c) for c in chunks],
        "source": source,
        "recipe": recipe,
    }
    return replace_file(root / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True), sync=True)


def new_dataset_root(root: str | os.PathLike, overwrite: bool = False) -> Path:
    """Make ``root`` ready for a new dataset: it must be absent or empty, unless ``overwrite`` clears it."""
    root = Path(root)
    if root.exists() and any(root.iterdir()):
        if not overwrite:
            raise DirectoryNotEmptyError(
                f"expected an absent or empty directory for a new chunk dataset, got non-empty {root}")
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    return root


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

    ``root`` must be absent or empty unless ``overwrite=True``. The manifest is
    written after every chunk, so an interrupted call leaves no dataset. ``pbar``
    shows a progress bar over chunks.
    """
    if isinstance(data, Mapping) and all(isinstance(v, np.ndarray) for v in data.values()):
        arrays = dict(data)
    else:
        from rayrb.io.arrays import to_numpy_dict

        arrays = to_numpy_dict(data)
    spec = RowSpec.from_arrays(arrays)
    rows = spec.validate(arrays)
    if rows == 0:
        raise InvalidArgumentError("expected at least one row to write a chunk dataset, got 0 rows")
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(spec)
    from rayrb.core.validation import positive_int

    chunk_rows = positive_int("chunk_rows", chunk_rows)
    root = new_dataset_root(root, overwrite)
    from rayrb.io.progress import progress

    bar = progress(-(-rows // chunk_rows), unit="chunks", desc=f"write {root.name}", enabled=pbar)
    chunks = []
    try:
        for i, block in enumerate(iter_row_blocks(arrays, rows, chunk_rows)):
            chunks.append(write_chunk(block, root / chunk_name(i), spec))
            bar.update(1)
    finally:
        bar.close()
    write_manifest(root, spec, chunks, source=source, recipe=recipe)
    return ChunkDataset.open(root)


def build_in_place(dest: str | os.PathLike, write: Callable[[Path], Any]) -> Path:
    """Run ``write(directory)`` for a directory beside ``dest``, then swap it in for ``dest``: readers never see a
    half-built dataset, and a ``write`` that raises leaves ``dest`` as it was and nothing beside it."""
    import tempfile

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        write(tmp / "ds")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp / "ds", dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def read_manifest(root: str | os.PathLike) -> dict[str, Any]:
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise ChunkError(f"expected a chunk dataset with {MANIFEST} at {Path(root)}, found none (absent or incomplete)")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ChunkError(f"{path}: the manifest is not valid JSON ({e}); the dataset is damaged or was not "
                         "written completely: prepare it again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        manifest = manifest if isinstance(manifest, dict) else {}
        raise ChunkError(
            f"{path}: expected format {FORMAT!r} version {FORMAT_VERSION}, "
            f"got {manifest.get('format')!r} version {manifest.get('version')!r}"
        )
    return manifest


def map_chunk(directory: str | os.PathLike, spec: RowSpec, rows: int, mode: str = "r") -> dict[str, np.memmap]:
    """Map one chunk's files read-only (``mode="c"``: copy-on-write, private writes never reach the file).

    Raises ``ChunkError`` naming the chunk if a file is missing or short.
    """
    if mode not in ("r", "c"):
        raise InvalidArgumentError(f"mode must be 'r' (read-only) or 'c' (copy-on-write), got {mode!r}")
    out = {}
    for k, (path, shape, dtype) in _chunk_files(directory, spec, rows).items():
        want = int(np.prod(shape, dtype=np.int64))
        out[k] = np.memmap(path, dtype=dtype, mode=mode, shape=shape) if want else np.zeros(shape, dtype)
    return out


def _chunk_files(directory: str | os.PathLike, spec: RowSpec, rows: int) -> dict[str, tuple[Path, tuple, np.dtype]]:
    """Each key's ``(file, shape, dtype)`` in one chunk, after checking the file exists with its exact size."""
    directory = Path(directory)
    out = {}
    for k, f in spec.items():
        *parents, leaf = k.split(SEP)
        path = directory.joinpath(*parents, f"{leaf}.memmap")
        shape = (rows, *f.shape)
        want = int(np.prod(shape, dtype=np.int64)) * np.dtype(f.dtype).itemsize
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            if want == 0:  # a key with no bytes (a zero-width column) may have no file: nothing to map
                out[k] = (path, shape, np.dtype(f.dtype))
                continue
            raise ChunkError(f"chunk {directory.name}: file for key {k!r} is missing ({path})") from None
        if size != want:
            raise ChunkError(f"chunk {directory.name}: key {k!r} expected {want} bytes in {path.name}, found {size}")
        out[k] = (path, shape, np.dtype(f.dtype))
    return out


class ChunkDataset:
    """A read-only chunk dataset. Rows are gathered out of memory maps; nothing is loaded up front."""

    def __init__(self, root: str | os.PathLike, manifest: Mapping[str, Any]):
        self.root = Path(root)
        self.manifest = dict(manifest)
        self.spec = RowSpec.from_json(manifest["spec"])
        self.chunks = [ChunkInfo(**c) for c in manifest["chunks"]]
        self.offsets = np.cumsum([0] + [c.rows for c in self.chunks])
        self._maps: dict[tuple[int, str], dict[str, np.memmap]] = {}

    @classmethod
    def open(cls, root: str | os.PathLike, *, verify: bool = False) -> "ChunkDataset":
        """Open a dataset, checking that the manifest adds up and every chunk file is present with its size.

        ``verify=True`` also checks every chunk's content hash (reads every byte).
        """
        try:
            ds = cls(root, read_manifest(root))
        except (KeyError, TypeError, ValueError) as e:
            raise ChunkError(f"{Path(root) / MANIFEST}: the manifest is malformed ({type(e).__name__}: {e})") from None
        ds.check_files()
        if verify:
            ds.verify()
        return ds

    def check_files(self) -> None:
        """Raise ``ChunkError`` unless the rows add up and each chunk's files exist with the right sizes."""
        total = self.manifest.get("rows")
        if total is not None and int(total) != len(self):
            raise ChunkError(f"{self.root / MANIFEST}: says {total} rows, but its chunks hold {len(self)}")
        for c in self.chunks:
            _chunk_files(self.root / c.path, self.spec, c.rows)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def rows(self) -> int:
        return len(self)

    @property
    def source(self) -> Any:
        return self.manifest.get("source")

    @property
    def recipe(self) -> Any:
        return self.manifest.get("recipe")

    @property
    def nbytes(self) -> int:
        return len(self) * self.spec.row_bytes

    def __repr__(self) -> str:
        return f"ChunkDataset({str(self.root)!r}, rows={len(self)}, chunks={len(self.chunks)}, spec={self.spec!r})"

    def chunk_arrays(self, i: int, mode: str = "r") -> dict[str, np.memmap]:
        """Memory maps of chunk ``i``: read-only (writing raises ``ValueError``) or copy-on-write (``"c"``)."""
        if (i, mode) not in self._maps:
            c = self.chunks[i]
            self._maps[(i, mode)] = map_chunk(self.root / c.path, self.spec, c.rows, mode)
        return self._maps[(i, mode)]

    def read(self, start: int = 0, stop: int | None = None) -> dict[str, np.ndarray]:
        """Rows ``[start, stop)`` as fresh arrays."""
        stop = len(self) if stop is None else stop
        return self.gather(np.arange(start, stop, dtype=np.int64))

    def view(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Rows ``[start, stop)`` without a copy where they lie in one chunk: copy-on-write views.

        Writes to the result stay private to this process; the files never change.
        """
        if not 0 <= start <= stop <= len(self):
            raise RowIndexError(f"expected 0 <= start <= stop <= {len(self)}, got [{start}, {stop})")
        first = int(np.searchsorted(self.offsets, start, side="right") - 1)
        last = int(np.searchsorted(self.offsets, max(start, stop - 1), side="right") - 1)
        pieces = []
        for c in range(first, last + 1):
            a, b = max(start, self.offsets[c]) - self.offsets[c], min(stop, self.offsets[c + 1]) - self.offsets[c]
            pieces.append({k: v[a:b] for k, v in self.chunk_arrays(c, "c").items()})
        if len(pieces) == 1:
            return pieces[0]
        return {k: np.concatenate([p[k] for p in pieces]) for k in self.spec}

    def gather(self, indices: np.ndarray, out: Mapping[str, np.ndarray] | None = None, *,
               checked: bool = True) -> dict[str, np.ndarray]:
        """Rows at global ``indices`` (any order, repeats allowed) as fresh arrays, or into ``out``'s.
        ``checked=False``: the caller drew the indices within the rows itself."""
        indices = np.asarray(indices, dtype=np.int64)
        if checked and indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise RowIndexError(
                f"expected row indices in [0, {len(self)}), got range [{indices.min()}, {indices.max()}]")
        if out is None:
            out = {k: np.empty((indices.size, *f.shape), dtype=f.dtype) for k, f in self.spec.items()}
        if len(self.chunks) == 1:  # the common case: no chunk lookups, no selection masks
            maps = self._plain(0)
            for k in out:
                maps[k].take(indices, axis=0, out=out[k])
            return out
        chunk_of = np.searchsorted(self.offsets, indices, side="right") - 1
        chunks = np.unique(chunk_of)
        if chunks.size == 1:
            local = indices - self.offsets[chunks[0]]
            maps = self._plain(int(chunks[0]))
            for k in out:
                np.take(maps[k], local, axis=0, out=out[k])
            return out
        for c in chunks:
            sel = np.nonzero(chunk_of == c)[0]
            local = indices[sel] - self.offsets[c]
            maps = self._plain(int(c))
            for k in out:
                out[k][sel] = maps[k][local]
        return out

    def _plain(self, i: int) -> dict[str, np.ndarray]:
        """Chunk ``i``'s read-only maps as plain arrays: ``np.memmap``'s own indexing costs more than small reads."""
        key = (i, "plain")
        if key not in self._maps:
            self._maps[key] = {k: np.asarray(v) for k, v in self.chunk_arrays(i).items()}
        return self._maps[key]

    def __getitem__(self, index: Any):
        """Rows by integer, slice or index array, copied into a TensorDict (no batch dim for an integer)."""
        from rayrb.io.arrays import from_numpy_dict

        if isinstance(index, slice):
            idx = np.arange(len(self))[index]
        else:
            idx = np.asarray(index, dtype=np.int64)
        scalar = idx.ndim == 0
        idx = np.atleast_1d(idx)
        td = from_numpy_dict(self.gather(np.where(idx < 0, idx + len(self), idx)))  # negatives count from the end
        return td[0] if scalar else td

    def sample(self, batch_size: int, seed: int | None = None):
        """``batch_size`` rows drawn uniformly with replacement, as a TensorDict (TorchRL's ``sample``)."""
        from rayrb.core.allocation import check_batch_size

        idx = np.random.default_rng(seed).integers(0, len(self), check_batch_size(batch_size))
        return self[idx]

    def to_tensordict(self):
        """All rows, copied into a TensorDict."""
        from rayrb.io.arrays import from_numpy_dict

        return from_numpy_dict(self.read(), len(self))

    def verify(self) -> None:
        """Re-hash every chunk (with the algorithm its manifest entry names); raise ``ChunkError``
        naming the first one that differs."""
        for i, c in enumerate(self.chunks):
            self._maps.pop((i, "r"), None)
            self._maps.pop((i, "plain"), None)
            got = hash_arrays(self.chunk_arrays(i), self.spec, hash_algorithm(c.hash))
            if got != c.hash:
                raise ChunkError(f"chunk {c.path}: content hash {got} does not match the manifest's {c.hash}")

    def delete(self) -> None:
        """Remove the dataset from disk (manifest first, so a partial delete is never a dataset)."""
        self._maps.clear()
        (self.root / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def _read_only(self, *args: Any, **kwargs: Any):
        raise ReadOnlyError(f"offline dataset {self.root} is immutable: extend the online buffer instead")

    __setitem__ = extend = add = set = _read_only
