"""Buffer checkpoints: a directory with one state file per shard and ``buffer.json``, written last.

Saving is a consistent cut. The coordinator submits every shard's dump behind
every write it has sent, and records its own state (write counts, RNG, step,
epochs) at that same moment, so every acknowledged write is in the checkpoint and
the saved counts match the saved rows. The files go to a temporary directory
beside the target, each with its size and CRC-32 in the manifest, and the
directory is renamed into place only when the manifest is written.

Restoring checks the whole checkpoint first: the manifest, the row spec, the
sampler, the offline dataset (by its chunks' hashes) and the shard layout, and
each file's size and checksum. Only then do shards load it, so a refused
checkpoint leaves the buffer as it was.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
import zlib
from pathlib import Path
from typing import Any

FORMAT, VERSION = "rayrb.buffer", 2
MANIFEST = "buffer.json"


def file_digest(path: str | os.PathLike) -> dict[str, Any]:
    """``{"bytes": size, "crc32": hex}`` of a file."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return {"bytes": size, "crc32": f"{crc:08x}"}


def dataset_fingerprint(dataset: Any) -> str:
    """Identifies an offline dataset by its chunks' row counts and content hashes."""
    chunks = [[c.rows, c.hash] for c in dataset.chunks]
    return hashlib.sha256(json.dumps([dataset.spec.to_json(), chunks], sort_keys=True).encode()).hexdigest()[:32]


def save(rb: Any, path: Path) -> None:
    from rayrb.chunks import ChunkDataset

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        cut = rb._get(rb._coord.checkpoint.remote(str(tmp)))
        files = dict(rb._get(cut["acks"]))
        meta = {"format": FORMAT, "version": VERSION, "dataset": rb._dataset_root,
                "dataset_fingerprint": dataset_fingerprint(ChunkDataset.open(rb._dataset_root)),
                "spec": rb.spec.to_json(), "sampler": rb._sampler_name, "sizes": cut["sizes"],
                "coordinator": cut["state"], "files": files}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(meta, f, default=int)
            f.flush()
            os.fsync(f.fileno())
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            path.rename(old)
        tmp.rename(path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The manifest of a checkpoint, after checking that every file it names is whole."""
    path = Path(path)
    try:
        meta = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise ValueError(f"expected a rayrb checkpoint at {path}, but {path / MANIFEST} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"checkpoint manifest {path / MANIFEST} is not valid JSON ({e}): the checkpoint is "
                         "damaged") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        got = (meta.get("format"), meta.get("version")) if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"expected a {FORMAT} checkpoint of version {VERSION} at {path}, got {got}")
    for name, want in meta["files"].items():
        f = path / name
        if not f.is_file():
            raise ValueError(f"checkpoint {path} is missing {name}")
        got = file_digest(f)
        if got != want:
            raise ValueError(f"checkpoint file {f} is damaged: expected {want}, got {got}")
    return meta


def check_compatible(meta: dict[str, Any], rb: Any, sizes: dict[str, list[int]]) -> None:
    """Raise, naming what differs, unless ``rb`` can load this checkpoint."""
    from rayrb.chunks import ChunkDataset
    from rayrb.schema import RowSpec

    diffs = []
    if RowSpec.from_json(meta["spec"]) != rb.spec:
        diffs.append(f"row spec {meta['spec']} vs {rb.spec.to_json()}")
    if meta["sampler"] != rb._sampler_name:
        diffs.append(f"sampler {meta['sampler']!r} vs {rb._sampler_name!r}")
    if meta["dataset_fingerprint"] != dataset_fingerprint(ChunkDataset.open(rb._dataset_root)):
        diffs.append(f"offline dataset {meta['dataset']} vs {rb._dataset_root} (different rows)")
    saved = meta["sizes"]
    if [len(saved[k]) for k in ("offline", "online")] != [len(sizes[k]) for k in ("offline", "online")] or \
            saved["online_capacity"] != sizes["online_capacity"]:
        diffs.append(f"shard layout {saved} vs {sizes}")
    if diffs:
        raise ValueError("the checkpoint does not fit this buffer: " + "; ".join(diffs))


def restore(rb: Any, path: Path) -> None:
    meta = read_checkpoint(Path(path))
    check_compatible(meta, rb, rb.sizes())
    names = sorted(meta["files"], key=lambda n: int(n.split("-")[1].split(".")[0]))
    # Each shard checks its file whole before it changes anything.
    rb._get([s.load.remote(str(Path(path) / n)) for s, n in zip(rb._shards, names)])
    rb._get(rb._coord.resync.remote())
    rb.load_state_dict(meta["coordinator"])
