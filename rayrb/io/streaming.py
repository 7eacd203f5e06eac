"""A chunk dataset written from a stream of row batches: sources larger than memory, in bounded memory, resumable.

``write_batches(batches, root)`` takes batches of rows (TensorDicts, or flat or nested dicts of arrays, of any
number of rows each) one at a time and writes a chunk as soon as it holds ``chunk_rows`` rows, so memory holds at
most one chunk's rows and one batch, whatever the source's size. Chunk ``i`` holds rows
``[i * chunk_rows, (i + 1) * chunk_rows)`` of the stream, as ``write_dataset`` cuts the same rows in memory: the
two write the same chunks, with the same hashes.

**Resumable.** After each chunk, the chunks written so far are recorded in ``manifest.partial.json`` (replaced
atomically, like the manifest). The dataset's ``manifest.json`` is written only after the last chunk, so no reader
ever takes a part for the whole. Called again with ``resume=True`` on the same root, it keeps the recorded chunks
(their files checked) and goes on from the first row they do not hold: a callable ``batches`` is called with that
row (``batches(start)`` gives the stream from there: the source seeks), an iterable is read past it. A chunk the
interruption cut short was never recorded, and is written again.

Example:
    >>> import numpy as np, tempfile
    >>> def frames(start):  # a source read from any row on: what resume=True asks of it
    ...     for at in range(start, 1000, 300):
    ...         yield {"obs": np.arange(at, min(at + 300, 1000), dtype=np.float32)[:, None]}
    >>> ds = write_batches(frames, tempfile.mkdtemp() + "/frames", chunk_rows=256)
    >>> len(ds), [c.rows for c in ds.chunks]
    (1000, [256, 256, 256, 232])
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from rayrb.core.schema import RowSpec
from rayrb.core.validation import positive_int
from rayrb.errors import DirectoryNotEmptyError, InvalidArgumentError, SchemaError
from rayrb.io.chunk_dataset import ChunkDataset
from rayrb.io.chunks import default_chunk_rows, flat_arrays, write_chunk
from rayrb.io.claim import Claim
from rayrb.io.manifest import MANIFEST, ChunkInfo, chunk_name, read_manifest, write_manifest
from rayrb.io.progress import progress

PARTIAL = "manifest.partial.json"  # the chunks written so far, while the dataset is being written

Arrays = dict[str, np.ndarray]


def write_batches(batches: Iterable[Any] | Callable[[int], Iterable[Any]], root: str | os.PathLike, *,
                  chunk_rows: int | None = None, rows: int | None = None, resume: bool = False,
                  overwrite: bool = False, pbar: bool = False, source: Any = None, recipe: Any = None
                  ) -> ChunkDataset:
    """Write the stream of row batches as a chunk dataset under ``root`` (see the module).

    Args:
        batches: an iterable of batches, or a callable ``start -> iterable`` giving the batches from row
            ``start`` on (what a resumed write asks for).
        root: the dataset's directory: absent or empty (``overwrite=True`` clears it), or a write to resume.
        chunk_rows: rows per chunk; default about 64 MiB of the first batch's rows (as ``write_dataset``).
        rows: the stream's rows, if known: only for the progress bar.
        resume: go on with the write recorded under ``root``, if any; a root that holds a whole dataset is
            opened as it is.
        pbar: show progress over rows.
        source, recipe: recorded in the manifest, as ``write_dataset`` records them.
    """
    if chunk_rows is not None:
        chunk_rows = positive_int("chunk_rows", chunk_rows)
    root = Path(root)
    if resume and (root / MANIFEST).is_file():
        return ChunkDataset.open(root)
    claim = Claim(root)  # one writer at a time, from here to the end (rayrb.io.claim)
    try:
        return _write_stream(claim, batches, chunk_rows, rows, resume, overwrite, pbar, source, recipe)
    finally:
        claim.release()


def _write_stream(claim: Claim, batches: Any, chunk_rows: int | None, rows: int | None, resume: bool,
                  overwrite: bool, pbar: bool, source: Any, recipe: Any) -> ChunkDataset:
    root = claim.root
    if resume and (root / MANIFEST).is_file():  # finished by a writer that held it a moment ago
        return ChunkDataset.open(root)
    done = _recorded(root) if resume else None
    if done is None and claim.others():
        # a write killed within its first chunk leaves chunks and no record: resumed from row 0
        if overwrite or (resume and all(p.name.startswith("chunk-") for p in claim.others())):
            claim.clear()
        else:
            raise DirectoryNotEmptyError(f"expected an absent or empty directory for a new chunk dataset, or a "
                                         f"write to resume, got non-empty {root}")
    spec, chunks = done if done is not None else (None, [])
    start = sum(c.rows for c in chunks)
    # a stream shorter than one chunk, ended: its one chunk holds every row, fewer than chunk_rows
    short = len(chunks) == 1 and chunk_rows is not None and chunks[0].rows < chunk_rows
    if chunks and chunk_rows is not None and chunks[0].rows != chunk_rows and not short:
        raise InvalidArgumentError(f"expected chunk_rows={chunks[0].rows} to resume the write at {root} (its "
                                   f"chunks hold that many rows), got {chunk_rows}")
    chunk_rows = chunks[0].rows if chunks and not short else chunk_rows
    ended = bool(chunks) and chunks[-1].rows < chunk_rows  # the recorded stream ended with a short chunk
    stream = _from(batches, start)
    bar = progress(rows or 0, desc=f"write {root.name}", unit="rows", initial=start, enabled=pbar)
    held: list[Arrays] = []
    try:
        for i, arrays in enumerate(stream):
            if spec is None:
                spec = RowSpec.from_arrays(arrays)
                chunk_rows = chunk_rows or default_chunk_rows(spec)
            n = _checked(spec, arrays, i, root)
            if n and ended:
                raise InvalidArgumentError(f"expected the stream to end at row {start} (the write at {root} ended "
                                           "there), got more rows: resume a write with the source it was started with")
            held.append(arrays)
            while sum(_rows(a) for a in held) >= chunk_rows:
                block, held = _take(held, chunk_rows)
                chunks.append(_write(root, spec, chunks, block, source, recipe))
                bar.update(chunk_rows)
        if held and sum(_rows(a) for a in held):
            block, held = _take(held, sum(_rows(a) for a in held))
            chunks.append(_write(root, spec, chunks, block, source, recipe))
            bar.update(_rows(block))
    finally:
        bar.close()
    if not chunks:
        raise InvalidArgumentError(f"expected at least one row to write a chunk dataset at {root}, got 0 rows")
    write_manifest(root, spec, chunks, source=source, recipe=recipe)
    (root / PARTIAL).unlink(missing_ok=True)
    return ChunkDataset.open(root)


def _recorded(root: Path) -> tuple[RowSpec, list[ChunkInfo]] | None:
    """The spec and chunks of the write recorded under ``root`` (their files checked), or None where there is none."""
    if not (root / PARTIAL).is_file():
        return None
    part = ChunkDataset(root, read_manifest(root, PARTIAL))
    part.check_files()
    return part.spec, list(part.chunks)


def _from(batches: Iterable[Any] | Callable[[int], Iterable[Any]], start: int) -> Iterator[Arrays]:
    """The stream's batches as flat arrays, from row ``start`` on."""
    if callable(batches):
        yield from (_arrays(b) for b in batches(start))
        return
    skip = start
    for batch in batches:
        arrays = _arrays(batch)
        n = _rows(arrays)
        if skip >= n:  # rows the recorded chunks hold
            skip -= n
            continue
        yield {k: v[skip:] for k, v in arrays.items()} if skip else arrays
        skip = 0


def _arrays(batch: Any) -> Arrays:
    """A batch as flat arrays, each with a row dimension (``RowSpec.from_arrays``' rule, as ``write_dataset``)."""
    arrays = flat_arrays(batch)
    RowSpec.from_arrays(arrays)  # a scalar or no key at all: refused here, before its rows are counted
    return arrays


def _rows(arrays: Arrays) -> int:
    return len(next(iter(arrays.values()))) if arrays else 0


def _checked(spec: RowSpec, arrays: Arrays, i: int, root: Path) -> int:
    try:
        return spec.validate(arrays, what=f"batch {i} of the stream")
    except SchemaError as e:
        raise SchemaError(f"batch {i} of the stream: {e} (every batch written to {root} takes the first batch's "
                          "keys, shapes and dtypes)") from None


def _take(held: list[Arrays], k: int) -> tuple[Arrays, list[Arrays]]:
    """The first ``k`` rows of the held batches as one block, and what is left of them."""
    parts, rest, need = [], [], k
    for arrays in held:
        n = _rows(arrays)
        if need >= n:
            parts.append(arrays)
            need -= n
        elif need > 0:
            parts.append({key: v[:need] for key, v in arrays.items()})
            rest.append({key: v[need:] for key, v in arrays.items()})
            need = 0
        else:
            rest.append(arrays)
    block = parts[0] if len(parts) == 1 else {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
    return block, rest


def _write(root: Path, spec: RowSpec, chunks: list[ChunkInfo], block: Arrays, source: Any, recipe: Any
           ) -> ChunkInfo:
    """Write the next chunk, then record it with the ones before (the record names only whole chunks)."""
    info = write_chunk(block, root / chunk_name(len(chunks)), spec)
    write_manifest(root, spec, [*chunks, info], source=source, recipe=recipe, name=PARTIAL)
    return info
