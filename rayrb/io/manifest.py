"""A chunk dataset's ``manifest.json``: its format, row spec, row count and one entry per chunk.

The manifest is written last and atomically (temp file + rename), so a directory without one is not a dataset.
Reading one checks every field (``check_manifest``): a chunk's path is relative and stays inside the dataset, so a
manifest can never make a buffer serve another dataset's rows.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rayrb.core.schema import RowSpec
from rayrb.errors import ChunkError, SchemaError
from rayrb.io.files import replace_file

FORMAT = "rayrb.chunks"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


@dataclass
class ChunkInfo:
    path: str
    rows: int
    hash: str
    node: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def chunk_name(i: int) -> str:
    return f"chunk-{i:05d}"


def write_manifest(
    root: str | os.PathLike,
    spec: RowSpec,
    chunks: list[ChunkInfo],
    *,
    source: Any = None,
    recipe: Any = None,
    name: str = MANIFEST,
) -> Path:
    """Write ``manifest.json`` (or ``name``) atomically: a reader sees the old state or the whole new one."""
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
    return replace_file(root / name, json.dumps(manifest, indent=1, sort_keys=True), sync=True)


def read_manifest(root: str | os.PathLike, name: str = MANIFEST) -> dict[str, Any]:
    path = Path(root) / name
    if not path.is_file():
        raise ChunkError(f"expected a chunk dataset with {name} at {Path(root)}, found none (absent or incomplete)")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ChunkError(f"{path}: the manifest is not valid JSON ({e}); the dataset is damaged or was not "
                         "written completely: prepare it again") from None
    except OSError as e:  # there, but not readable by this process
        raise ChunkError(f"{path}: the manifest cannot be read ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        manifest = manifest if isinstance(manifest, dict) else {}
        raise ChunkError(
            f"{path}: expected format {FORMAT!r} version {FORMAT_VERSION}, "
            f"got {manifest.get('format')!r} version {manifest.get('version')!r}"
        )
    check_manifest(manifest, path)
    return manifest


# each chunk entry's fields: their types, and the words an error says
_CHUNK_FIELDS = {"path": (str, "a string"), "rows": (int, "an integer in [0, 2**62]"), "hash": (str, "a string"),
                 "node": ((str, type(None)), "a node id or null"), "extra": (dict, "a mapping")}


def check_manifest(manifest: dict[str, Any], where: Any = MANIFEST) -> None:
    """Raise ``ChunkError`` naming the first field of ``manifest`` (read from ``where``) that is not what
    ``write_manifest`` writes: the spec, the rows, each chunk's fields, and its path, which must be relative,
    without ``..`` (symlinks are resolved against the root where the dataset opens, ``ChunkDataset.check_files``).

    >>> good = {"spec": {"x": {"shape": [], "dtype": "int64"}}, "rows": 2, "chunks": [{"path": "chunk-00000",
    ...         "rows": 2, "hash": "xxh3:0"}]}
    >>> check_manifest(good)
    >>> check_manifest({**good, "chunks": [{**good["chunks"][0], "path": "../other/chunk-00000"}]})
    Traceback (most recent call last):
    ...
    rayrb.errors.ChunkError: manifest.json: field chunks[0].path: expected a path relative to the dataset ...
    """
    try:
        RowSpec.from_json(manifest.get("spec"))
    except SchemaError as e:
        raise ChunkError(f"{where}: field spec: {e}") from None
    if not _count(manifest.get("rows")):
        raise ChunkError(f"{where}: field rows: expected an integer in [0, 2**62], got {manifest.get('rows')!r}")
    chunks = manifest.get("chunks")
    if not isinstance(chunks, list):
        raise ChunkError(f"{where}: field chunks: expected a list of chunk entries, got {type(chunks).__name__}")
    seen: set[tuple[str, ...]] = set()
    for i, c in enumerate(chunks):
        field = f"{where}: field chunks[{i}]"
        if not isinstance(c, dict) or not {"path", "rows", "hash"} <= set(c) <= set(_CHUNK_FIELDS):
            got = sorted(map(str, c)) if isinstance(c, dict) else type(c).__name__
            raise ChunkError(f"{field}: expected an entry with path, rows, hash (and node, extra), got {got}")
        for key, value in c.items():
            kind, words = _CHUNK_FIELDS[key]
            if not isinstance(value, kind) or (key == "rows" and not _count(value)):
                raise ChunkError(f"{field}.{key}: expected {words}, got {value!r}")
        parts = Path(c["path"]).parts  # "./a" and "a" are one chunk
        if not parts or Path(c["path"]).is_absolute() or ".." in parts or "\0" in c["path"]:
            raise ChunkError(f"{field}.path: expected a path relative to the dataset and inside it (no '..', not "
                             f"absolute), got {c['path']!r}")
        if parts in seen:
            raise ChunkError(f"{field}.path: expected each chunk once, got {c['path']!r} twice")
        seen.add(parts)
    if sum(c["rows"] for c in chunks) > MAX_ROWS:
        raise ChunkError(f"{where}: field chunks: expected at most 2**62 rows in all, got {sum(c['rows'] for c in chunks)}")


MAX_ROWS = 1 << 62  # rows are counted in int64 offsets


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_ROWS
