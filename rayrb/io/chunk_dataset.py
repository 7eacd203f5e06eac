"""Reading a chunk dataset: ``ChunkDataset`` maps each chunk's files read-only and gathers rows out of the maps.

Reading needs only numpy: chunks are mapped read-only, so shard actors can map a dataset without importing torch,
nothing is copied into RAM until rows are gathered, and writes raise. A gather copies rows in the page cache out of
the maps and reads the others from the files with many requests in flight (``rayrb.io.gather``).
"""
from __future__ import annotations

import math
import os
import shutil
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from rayrb.core.schema import SEP, RowSpec, file_part
from rayrb.errors import ChunkError, InvalidArgumentError, ReadOnlyError, RowIndexError
from rayrb.io.gather import READ_THREADS, ColdReads, ColumnFile, ReadPolicy, copy_out, open_columns
from rayrb.io.hashing import hash_algorithm, hash_arrays
from rayrb.io.manifest import MANIFEST, ChunkInfo, read_manifest
from rayrb.io.read_ahead import Ahead


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


def key_file(directory: str | os.PathLike, key: str) -> Path:
    """The file of ``key`` in a chunk: its parts named as tensordict names them (``rayrb.core.schema.file_part``),
    or as they are, as a tensordict that did not encode them wrote them."""
    *parents, leaf = parts = key.split(SEP)
    encoded = Path(directory).joinpath(*map(file_part, parents), f"{file_part(leaf)}.memmap")
    if all(file_part(p) == p for p in parts) or encoded.exists():
        return encoded
    raw = Path(directory).joinpath(*parents, f"{leaf}.memmap")
    return raw if raw.exists() else encoded


def _chunk_files(directory: str | os.PathLike, spec: RowSpec, rows: int) -> dict[str, tuple[Path, tuple, np.dtype]]:
    """Each key's ``(file, shape, dtype)`` in one chunk, after checking the file exists with its exact size."""
    directory = Path(directory)
    out = {}
    for k, f in spec.items():
        path = key_file(directory, k)
        shape = (rows, *f.shape)
        want = math.prod(shape) * np.dtype(f.dtype).itemsize  # exact: a manifest's shape may be huge, never wraps
        try:
            info = path.stat()
        except FileNotFoundError:
            if want == 0:  # a key with no bytes (a zero-width column) may have no file: nothing to map
                out[k] = (path, shape, np.dtype(f.dtype))
                continue
            raise ChunkError(f"chunk {directory.name}: file for key {k!r} is missing ({path})") from None
        except OSError as e:  # a symlink loop, a chunk that is a file, a file this process may not read
            raise ChunkError(f"chunk {directory.name}: file for key {k!r} cannot be read ({e})") from None
        size = info.st_size
        if not stat.S_ISREG(info.st_mode):
            raise ChunkError(f"chunk {directory.name}: expected a file for key {k!r} at {path}, found no plain file")
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
        self._starts = self.offsets.tolist()
        self._maps: dict[tuple[int, str], dict[str, np.memmap]] = {}
        self._files: dict[int, dict[str, ColumnFile]] = {}  # each gathered chunk's files, open and mapped
        self._policy, self.read_threads = ReadPolicy(), READ_THREADS
        self._ahead = Ahead()  # hints of rows planned next, wanted once a batch was found cold

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
        root = self.root.resolve()
        for c in self.chunks:
            files = _chunk_files(self.root / c.path, self.spec, c.rows)
            for path in [self.root / c.path, *(f for f, _, _ in files.values())]:
                if not path.resolve().is_relative_to(root):  # a symlink out: another dataset's rows
                    raise ChunkError(f"chunk {c.path}: expected its files inside the dataset {root}, but "
                                     f"{path} leads to {path.resolve()}")

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

    def column(self, key: str, start: int, stop: int) -> np.ndarray:
        """One key's rows ``[start, stop)``: a read-only map where they lie in one chunk, else a fresh array."""
        if key not in self.spec or not 0 <= start <= stop <= len(self):
            raise RowIndexError(f"expected a key of {sorted(self.spec)} and 0 <= start <= stop <= {len(self)}, got "
                                f"{key!r} and [{start}, {stop})")
        pieces = []
        for c in range(len(self.chunks)):
            a, b = max(start, self.offsets[c]), min(stop, self.offsets[c + 1])
            if a < b:
                pieces.append(self.chunk_arrays(c)[key][a - self.offsets[c]:b - self.offsets[c]])
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces) if pieces else np.zeros(0)

    def gather(self, indices: np.ndarray, out: Mapping[str, np.ndarray] | None = None, *,
               checked: bool = True) -> dict[str, np.ndarray]:
        """Rows at global ``indices`` (any order, repeats allowed) as fresh arrays, or into ``out``'s.
        ``checked=False``: the caller drew the indices within the rows itself.

        Rows in the page cache are copied out of the maps; a batch whose rows are not is read from the files with
        many requests in flight (``rayrb.io.gather``; ``reads`` picks: ``"auto"``, ``"map"`` or ``"read"``)."""
        indices = np.asarray(indices, dtype=np.int64)
        # unchecked over several chunks, the chunks the indices fall in tell (_columns_of): a row out of range would
        # be copied as a clipped one (copy_out), never an error, so one chunk's are checked here either way
        if (checked or len(self.chunks) == 1) and indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise self._out_of_range(indices)
        if out is None:
            out = {k: np.empty((indices.size, *f.shape), dtype=f.dtype) for k, f in self.spec.items()}
        cols, chunk_of, chunks = self._columns_of(indices)
        if self._ahead.reads(self._policy, cols, indices, self._starts):
            reads = ColdReads(self.read_threads)
            for k in out:  # one plan a key over all its chunks: the batch's rows in offset order
                reads.add({c: cols[c][k] for c in chunks}, indices, out[k], starts=self._starts)
            reads.run()
            return out
        t0 = time.perf_counter()
        copy_out(cols, chunks, chunk_of, indices, self._starts, out)
        self._policy.copied(indices.size, time.perf_counter() - t0)
        return out

    @property
    def ahead_wanted(self) -> bool:
        """Whether hints of rows to gather next are wanted (``read_ahead``): a batch was found cold lately."""
        return self._ahead.wanted and self._policy.mode != "map"

    def read_ahead(self, indices: np.ndarray) -> bool | None:
        """Start reading the rows at global ``indices`` into the page cache without waiting for them
        (``rayrb.io.read_ahead``), if hints are wanted (``ahead_wanted``). True: queued; False: dropped, too many
        wait (ask again later); None: not wanted, or not possible here (the gather of these rows will say why)."""
        if not self.ahead_wanted:
            return None
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size == 0 or indices.min() < 0 or indices.max() >= len(self):
            return None
        try:
            cols = self._columns_of(indices)[0]
        except ChunkError:
            return None
        return self._ahead.hint(cols, indices, self._starts)

    @property
    def reads(self) -> str:
        """How gathers reach rows: ``"auto"`` (cached batches out of the maps, others read from the files),
        ``"map"`` (always out of the maps) or ``"read"`` (always read)."""
        return self._policy.mode

    @reads.setter
    def reads(self, mode: str) -> None:
        self._policy.set_mode(mode)

    def _columns_of(self, indices: np.ndarray) -> tuple[dict[int, dict[str, ColumnFile]], np.ndarray | None, list]:
        """The files of the chunks global ``indices`` fall in (``_columns``), each row's chunk (None with one
        chunk: the common case, no lookups) and those chunks."""
        if len(self.chunks) == 1:
            return {0: self._columns(0)}, None, [0]
        chunk_of = np.searchsorted(self.offsets, indices, side="right") - 1
        chunks = np.unique(chunk_of).tolist()
        if chunks and (chunks[0] < 0 or chunks[-1] >= len(self.chunks)):  # indices not checked by the caller
            raise self._out_of_range(indices)
        return {c: self._columns(c) for c in chunks}, chunk_of, chunks  # each file's size checked before any read

    def _out_of_range(self, indices: np.ndarray) -> RowIndexError:
        return RowIndexError(f"expected row indices in [0, {len(self)}), got range [{indices.min()}, "
                             f"{indices.max()}]")

    def _columns(self, i: int) -> dict[str, ColumnFile]:
        """Chunk ``i``'s files, each open and mapped once, after checking that none of them has become shorter
        than mapped since it was opened."""
        if i not in self._files:
            c = self.chunks[i]
            self._files[i] = open_columns(_chunk_files(self.root / c.path, self.spec, c.rows), c.path)
        for k, col in self._files[i].items():
            # Reading a page past the end of a file truncated under its maps kills the process (SIGBUS): the
            # dataset is immutable, so a file cut short is refused before any read, naming it. A cut between this
            # check and a copy out of the maps still kills the reader: no check can close that window (reads from
            # the files refuse a short read instead).
            size = col.size_now()
            if size < col.nbytes:
                raise ChunkError(f"chunk {self.chunks[i].path}: key {k!r} expected {col.nbytes} bytes, its file holds "
                                 f"{size}: the dataset was changed under its readers (it is immutable); "
                                 "prepare it again")
        return self._files[i]

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
            self._files.pop(i, None)
            got = hash_arrays(self.chunk_arrays(i), self.spec, hash_algorithm(c.hash))
            if got != c.hash:
                raise ChunkError(f"chunk {c.path}: content hash {got} does not match the manifest's {c.hash}")

    def delete(self) -> None:
        """Remove the dataset from disk (manifest first, so a partial delete is never a dataset)."""
        self._maps.clear()
        self._files.clear()
        (self.root / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def _read_only(self, *args: Any, **kwargs: Any):
        raise ReadOnlyError(f"offline dataset {self.root} is immutable: extend the online buffer instead")

    __setitem__ = extend = add = set = _read_only
