"""A chunk dataset's ``manifest.json``: its format, row spec, row count and one entry per chunk.

The manifest is written last and atomically (temp file + rename), so a directory without one is not a dataset.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rayrb.core.schema import RowSpec
from rayrb.errors import ChunkError
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
