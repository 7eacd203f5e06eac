"""Buffer checkpoints: a directory with one state file per shard and ``buffer.json``, written last.

Saving is a consistent cut. The coordinator submits every shard's dump behind
every write it has sent, and records its own state (write counts, RNG, step,
epochs) at that same moment, so every acknowledged write is in the checkpoint and
the saved counts match the saved rows. ``dumps(path)`` writes into ``path`` as
TorchRL's does, and touches nothing there that is not its own: the shard files go
to a directory of their own inside it (``buffer-<hex>/``), each with its size and
CRC-32 in the manifest, and the checkpoint changes in one step when
``path/buffer.json`` is renamed over the previous manifest; only then are the
files the previous manifest named removed. A path that is a link to a directory
is written through, on the target's file system.

Restoring checks the whole checkpoint first: the manifest, the row spec, the
sampler, the offline dataset (by its chunks' hashes) and the shard layout, and
each file's size and checksum. Only then do shards load it, so a refused
checkpoint leaves the buffer as it was. Restoring only reads the checkpoint: the
buffer's state kept to put it back, and shard states re-cut for another layout,
travel in Ray's object store, so a checkpoint on read-only storage loads.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from rayrb.core.allocation import split_evenly
from rayrb.durability.writelog import slots
from rayrb.errors import InvalidArgumentError, SavedStateError
from rayrb.io.files import file_digest, replace_file

# 3: the manifest carries a digest of itself; 4: and the priority exponents its priorities were stored under;
# 5: the shard files in a directory of their own beside the manifest (their names are paths relative to it)
FORMAT, VERSION = "rayrb.buffer", 5
READABLE = (2, 3, 4, 5)
MANIFEST = "buffer.json"


def dataset_fingerprint(dataset: Any) -> str:
    """Identifies an offline dataset by its chunks' row counts and content hashes."""
    chunks = [[c.rows, c.hash] for c in dataset.chunks]
    return hashlib.sha256(json.dumps([dataset.spec.to_json(), chunks], sort_keys=True).encode()).hexdigest()[:32]


def save(rb: Any, path: Path) -> None:
    """Write a checkpoint of ``rb`` into the directory ``path`` (made if missing), replacing only a previous
    checkpoint there: its manifest, then the files that manifest named. Other entries in ``path`` stay as they
    are; a save that raises leaves the previous checkpoint whole and nothing of its own behind."""
    from rayrb.io.chunks import ChunkDataset

    target = _checkpoint_dir(Path(path))
    previous = _previous_files(target)
    data = f"buffer-{uuid.uuid4().hex[:8]}"
    (target / data).mkdir()
    try:
        cut = rb.rpc.get(rb.rpc.coord.checkpoint.remote(str(target / data)))
        files = {f"{data}/{name}": digest for name, digest in rb.rpc.get(cut["acks"])}
        meta = {"format": FORMAT, "version": VERSION, "dataset": rb.dataset_root,
                "dataset_fingerprint": dataset_fingerprint(ChunkDataset.open(rb.dataset_root)),
                "spec": rb.spec.to_json(), "sampler": rb.sampler_name, "priority": rb.priority_options,
                "sizes": cut["sizes"], "coordinator": cut["state"], "files": files}
        meta = json.loads(json.dumps(meta, default=int))  # as it will be read back
        meta["digest"] = manifest_digest(meta)
        replace_file(target / MANIFEST, json.dumps(meta), sync=True)  # the one step that changes the checkpoint
    except BaseException:
        shutil.rmtree(target / data, ignore_errors=True)
        raise
    _remove_files(target, [n for n in previous if n not in files])


def _checkpoint_dir(path: Path) -> Path:
    """The directory a checkpoint at ``path`` is written in: ``path`` itself, or where the links it is lead (so
    the link stays, and the files land on the target's file system). Refused: a file, or a ``buffer.json``
    there that is not a rayrb manifest (a user's file of that name is never overwritten)."""
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_dir():
        raise InvalidArgumentError(f"expected a directory (or nothing) at {path} to write a checkpoint in, got a file")
    target.mkdir(parents=True, exist_ok=True)
    manifest = target / MANIFEST
    if manifest.exists() or manifest.is_symlink():
        try:
            ours = json.loads(manifest.read_text()).get("format") == FORMAT
        except (OSError, ValueError, AttributeError):
            ours = False
        if not ours:
            raise InvalidArgumentError(f"expected {manifest} to be a rayrb checkpoint's manifest (format "
                                       f"{FORMAT!r}) or absent, got another file (or a damaged manifest): it is "
                                       "left as it is; save the checkpoint elsewhere, or move that file away")
    return target


def _previous_files(target: Path) -> list[str]:
    """The files the checkpoint now in ``target`` names (none if there is none, or its manifest is damaged)."""
    try:
        meta = json.loads((target / MANIFEST).read_text())
        names = list(meta["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [n for n in names if _inside(n) and _SHARD_FILE.fullmatch(n)]  # what dumps writes, nothing else


def _remove_files(target: Path, names: list[str]) -> None:
    """Remove these checkpoint files, then the directories of their own that held them, once empty; best effort:
    the new checkpoint is already in place."""
    dirs = set()
    for name in names:
        (target / name).unlink(missing_ok=True)
        if len(PurePosixPath(name).parts) == 2:
            dirs.add(target / PurePosixPath(name).parts[0])
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            pass  # not empty: something else lives there too, and stays


_SHARD_FILE = re.compile(r"(buffer-[0-9a-f]{8}/)?shard-[0-9]+\.npz")  # the names dumps gives (versions 2-4: no dir)


def _inside(name: Any) -> bool:
    """Whether a manifest's file name stays inside its checkpoint (a relative path without ``..``)."""
    p = PurePosixPath(name) if isinstance(name, str) else None
    return p is not None and not p.is_absolute() and ".." not in p.parts and len(p.parts) in (1, 2)


def manifest_digest(meta: dict[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON, its own ``digest`` left out: an edited manifest fails it."""
    body = {k: v for k, v in meta.items() if k != "digest"}
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The manifest of a checkpoint, after checking that every file it names is whole."""
    path = Path(path)
    try:
        meta = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise SavedStateError(f"expected a rayrb checkpoint at {path}, but {path / MANIFEST} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SavedStateError(f"checkpoint manifest {path / MANIFEST} is not valid JSON ({e}): the checkpoint is "
                              "damaged") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") not in READABLE:
        got = (meta.get("format"), meta.get("version")) if isinstance(meta, dict) else type(meta).__name__
        raise SavedStateError(f"expected a {FORMAT} checkpoint of version {' or '.join(map(str, READABLE))} at {path}, "
                              f"got {got}")
    if meta["version"] >= 3 and meta.get("digest") != manifest_digest(meta):
        raise SavedStateError(f"checkpoint manifest {path / MANIFEST} was changed after it was written: its digest "
                              f"{meta.get('digest')!r} does not match its contents ({manifest_digest(meta)})")
    missing = [k for k in ("dataset_fingerprint", "spec", "sampler", "sizes", "coordinator", "files") if k not in meta]
    if missing:
        raise SavedStateError(f"checkpoint manifest {path / MANIFEST} lacks {missing}")
    for name, want in meta["files"].items():
        if not _inside(name):
            raise SavedStateError(f"checkpoint manifest {path / MANIFEST} names a file outside the checkpoint: "
                                  f"{name!r}")
        f = path / name
        if not f.is_file():
            raise SavedStateError(f"checkpoint {path} is missing {name}")
        got = file_digest(f)
        if got != want:
            raise SavedStateError(f"checkpoint file {f} is damaged: expected {want}, got {got}")
    return meta


def check_compatible(meta: dict[str, Any], rb: Any, sizes: dict[str, list[int]],
                     priority_exponents: Mapping[str, float] | None = None) -> None:
    """Raise, naming what differs, unless ``rb`` can load this checkpoint. ``priority_exponents``: the ``alpha`` and
    ``eps`` the caller says a checkpoint that does not record them (version 2 or 3) was written with."""
    from rayrb.core.schema import RowSpec
    from rayrb.io.chunks import ChunkDataset

    diffs = []
    if RowSpec.from_json(meta["spec"]) != rb.spec:
        diffs.append(f"row spec {meta['spec']} vs {rb.spec.to_json()}")
    if meta["sampler"] != rb.sampler_name:
        diffs.append(f"sampler {meta['sampler']!r} vs {rb.sampler_name!r}")
    if meta["dataset_fingerprint"] != dataset_fingerprint(ChunkDataset.open(rb.dataset_root)):
        diffs.append(f"offline dataset {meta['dataset']} vs {rb.dataset_root} (different rows)")
    saved_prio = _saved_exponents(meta, priority_exponents)  # the caller's word checked whatever the sampler
    if "prioritized" in str(rb.sampler_name):  # stored priorities are (|p| + eps)^alpha: they mean nothing under others
        if saved_prio is None:
            diffs.append(f"priority exponents: a version {meta['version']} checkpoint does not record its alpha and "
                         f"eps, this buffer samples by priority with {rb.priority_options}; if it was written with "
                         f"them, say so: loads(path, priority_exponents={rb.priority_options})")
        else:
            diffs += [f"{k} {saved_prio.get(k)!r} vs {v!r}" for k, v in rb.priority_options.items()
                      if saved_prio.get(k) != v]
    saved_limiter = meta["coordinator"].get("rate_limiter", {}).get("config")
    if saved_limiter is not None and saved_limiter != _plain(rb.rate_limiter_config):
        diffs.append(f"rate limiter {saved_limiter} vs {_plain(rb.rate_limiter_config)} (flow control stays the "
                     "buffer's own: build the buffer with the checkpoint's rate limiter to load it)")
    saved = meta["sizes"]
    if sum(saved["online_capacity"]) != sum(sizes["online_capacity"]):
        diffs.append(f"shard layout with online capacity {sum(saved['online_capacity'])} "
                     f"({saved['online_capacity']}) vs {sum(sizes['online_capacity'])} ({sizes['online_capacity']}); "
                     "shard counts may differ, the total capacity may not")
    if diffs:
        raise SavedStateError("the checkpoint does not fit this buffer: " + "; ".join(diffs))


def _saved_exponents(meta: dict[str, Any], said: Mapping[str, float] | None) -> dict[str, float] | None:
    """The exponents the checkpoint's priorities were stored under: its own record, else what the caller said. A
    caller's word that contradicts the record is refused: the record is what the priorities were stored under."""
    if said is not None:
        from rayrb.core.validation import priority_options

        if not isinstance(said, Mapping) or set(said) != {"alpha", "eps"}:
            raise InvalidArgumentError(f"expected priority_exponents as {{'alpha': ..., 'eps': ...}}, got {said!r}")
        said = {k: v for k, v in priority_options(alpha=said["alpha"], eps=said["eps"]).items() if k != "beta"}
    saved = meta.get("priority")
    if saved is not None and said is not None and said != saved:
        raise SavedStateError(f"priority_exponents={said} contradicts the checkpoint's own record {saved}: "
                              "pass priority_exponents only for a checkpoint that does not record them")
    return saved if saved is not None else said


def _plain(value: Any) -> Any:
    """``value`` as JSON reads it back (tuples as lists), for comparing with a manifest."""
    return json.loads(json.dumps(value))


def same_layout(saved: dict[str, list[int]], sizes: dict[str, list[int]]) -> bool:
    return len(saved["offline"]) == len(sizes["offline"]) and saved["online_capacity"] == sizes["online_capacity"]


def _live_slots(written: int, capacity: int) -> np.ndarray:
    """A circular shard's occupied slots, oldest row first."""
    size = min(written, capacity)
    return slots(written - size, size, capacity)


def reshard(states: list[dict[str, np.ndarray]], offline_sizes: tuple[list[int], list[int]],
            online_capacity: tuple[list[int], list[int]]) -> list[dict[str, np.ndarray]]:
    """Saved shard states (offline shards first) re-cut for another shard layout of the same rows.

    Offline priorities follow their global row. Online rows keep their order of
    age, and are dealt out evenly over the new shards (the oldest dropped if the new
    capacity is smaller); each lands in a fresh slot, as if written once, with its
    priority. ``offline_sizes`` and ``online_capacity`` are ``(saved, new)`` pairs.

    >>> old = [{"sampler/priority": np.array([1., 2.]), "sampler/max_priority": np.float64(2)},
    ...        {"rows/x": np.array([7, 8, 9]), "generation": np.array([2, 1, 1]), "written": np.int64(4),
    ...         "sampler/priority": np.array([5., 6., 4.]), "sampler/max_priority": np.float64(6)}]
    >>> new = reshard(old, ([2], [1, 1]), ([3], [2, 2]))
    >>> [s["sampler/priority"].tolist() for s in new[:2]], [s["rows/x"][:int(s["written"])].tolist() for s in new[2:]]
    ([[1.0], [2.0]], [[8, 9], [7]])
    """
    (old_off, new_off), (old_cap, new_cap) = offline_sizes, online_capacity
    m_old = len(old_off)
    out: list[dict[str, np.ndarray]] = []
    prio = [s.get("sampler/priority") for s in states]
    max_p = max([float(s["sampler/max_priority"]) for s in states if "sampler/max_priority" in s], default=None)
    if prio[0] is not None:
        flat = np.concatenate([p[:n] for p, n in zip(prio[:m_old], old_off)])
        starts = np.concatenate([[0], np.cumsum(new_off)[:-1]])
        for a, n in zip(starts, new_off):
            out.append({"sampler/priority": flat[a:a + n].copy(), "sampler/max_priority": np.float64(max_p)})
    else:
        out.extend({} for _ in new_off)
    online = states[m_old:]
    keys = [k for k in online[0] if k.startswith("rows/")]
    live = [_live_slots(int(s["written"]), c) for s, c in zip(online, old_cap)]
    rows = {k: np.concatenate([s[k][i] for s, i in zip(online, live)]) for k in keys}
    p_on = np.concatenate([s["sampler/priority"][i] for s, i in zip(online, live)]) \
        if "sampler/priority" in online[0] else None
    total = min(len(next(iter(rows.values()))), int(sum(new_cap)))
    first = len(next(iter(rows.values()))) - total  # drop the oldest rows that no longer fit
    counts = np.minimum(split_evenly(total, len(new_cap)), new_cap)
    counts[0] += total - counts.sum()
    at = first
    for c, n in zip(new_cap, counts):
        state = {k: np.zeros((c, *v.shape[1:]), v.dtype) for k, v in rows.items()}
        for k in keys:
            state[k][:n] = rows[k][at:at + n]
        state["generation"] = (np.arange(c) < n).astype(np.int64)
        state["written"] = np.int64(n)
        if p_on is not None:
            state["sampler/priority"] = np.zeros(c)
            state["sampler/priority"][:n] = p_on[at:at + n]
            state["sampler/max_priority"] = np.float64(max_p)
        out.append(state)
        at += n
    return out


def restore(rb: Any, path: Path, priority_exponents: Mapping[str, float] | None = None) -> None:
    """Load checkpoint ``path`` into ``rb`` whole, or leave ``rb`` as it was.

    Every part is checked before any actor changes: the manifest (format, version, its
    digest), each file's size and checksum, spec, sampler, dataset and layout, the
    coordinator's section (a draw is tried on a copy of the sampling state), and each
    shard's file by that shard. Then the buffer as it is is kept (each shard's state in
    the object store, at one cut) and the checkpoint applied; if applying still fails,
    that is put back (and if even that fails, the error says the buffer is unusable).
    Nothing is written to the file system: ``path`` may be read-only.
    """
    import ray

    path = Path(path)
    meta = read_checkpoint(path)
    sizes = rb.sizes()
    check_compatible(meta, rb, sizes, priority_exponents)
    sources: list[Any] = [str(path / n) for n in _shard_files(meta)]  # each shard reads its file
    state = dict(meta["coordinator"])
    if not same_layout(meta["sizes"], sizes):
        # Another shard layout: re-cut the saved shards, and start the epochs afresh over the new shards.
        saved = []
        for n in _shard_files(meta):
            with np.load(path / n) as f:
                saved.append(dict(f))
        states = reshard(saved, (meta["sizes"]["offline"], sizes["offline"]),
                         (meta["sizes"]["online_capacity"], sizes["online_capacity"]))
        sources = [ray.put(st) for st in states]
        state.pop("allocator", None)
    rb.rpc.get(rb.rpc.coord.check_state_dict.remote(state))
    # Every shard checks its part before any shard loads one: a refused part changes no shard.
    rb.rpc.get([s.check.remote(x) if isinstance(x, str) else s.check_state.remote(x)
                for s, x in zip(rb.rpc.shards, sources)])
    before = rb.rpc.get(rb.rpc.coord.checkpoint.remote(None))  # refs to each shard's state now, and the coordinator's
    try:
        _apply(rb, sources, state)
    except BaseException as e:
        _put_back(rb, before, e)
        raise


def _shard_files(meta: dict[str, Any]) -> list[str]:
    """The manifest's shard files in shard order (``[<dir>/]shard-<j>.npz``)."""
    return sorted(meta["files"], key=lambda n: int(PurePosixPath(n).name.split("-")[1].split(".")[0]))


def _apply(rb: Any, sources: list[Any], state: dict[str, Any]) -> None:
    """Give each shard its part (a file's path, or its state in the object store), then the coordinator its."""
    rb.rpc.get([s.load.remote(x) if isinstance(x, str) else s.load_state.remote(x)
                for s, x in zip(rb.rpc.shards, sources)])
    rb.rpc.get(rb.rpc.coord.resync.remote())
    rb.rpc.get(rb.rpc.coord.load_state_dict.remote(state))


def _put_back(rb: Any, before: dict[str, Any], error: BaseException) -> None:
    """After a restore failed halfway: the buffer as it was before it, from the states kept then."""
    from rayrb.errors import BufferUnavailableError

    try:
        _apply(rb, list(before["acks"]), before["state"])
    except BaseException as again:
        raise BufferUnavailableError(
            f"restoring the checkpoint failed halfway ({type(error).__name__}: {error}) and putting the buffer "
            f"back as it was failed too ({type(again).__name__}: {again}): it is unusable; shut it down") from again
