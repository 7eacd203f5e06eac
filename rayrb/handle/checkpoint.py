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
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from rayrb.core.allocation import split_evenly
from rayrb.durability.writelog import slots
from rayrb.errors import SavedStateError
from rayrb.io.files import file_digest, replace_dir, replace_file

# 3: the manifest carries a digest of itself; 4: and the priority exponents its priorities were stored under
FORMAT, VERSION = "rayrb.buffer", 4
READABLE = (2, 3, 4)
MANIFEST = "buffer.json"


def dataset_fingerprint(dataset: Any) -> str:
    """Identifies an offline dataset by its chunks' row counts and content hashes."""
    chunks = [[c.rows, c.hash] for c in dataset.chunks]
    return hashlib.sha256(json.dumps([dataset.spec.to_json(), chunks], sort_keys=True).encode()).hexdigest()[:32]


def save(rb: Any, path: Path) -> None:
    from rayrb.io.chunks import ChunkDataset

    def write(tmp: Path) -> None:
        cut = rb.rpc.get(rb.rpc.coord.checkpoint.remote(str(tmp)))
        files = dict(rb.rpc.get(cut["acks"]))
        meta = {"format": FORMAT, "version": VERSION, "dataset": rb.dataset_root,
                "dataset_fingerprint": dataset_fingerprint(ChunkDataset.open(rb.dataset_root)),
                "spec": rb.spec.to_json(), "sampler": rb.sampler_name, "priority": rb.priority_options,
                "sizes": cut["sizes"], "coordinator": cut["state"], "files": files}
        meta = json.loads(json.dumps(meta, default=int))  # as it will be read back
        meta["digest"] = manifest_digest(meta)
        replace_file(tmp / MANIFEST, json.dumps(meta), sync=True)

    replace_dir(path, write)


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
        f = path / name
        if not f.is_file():
            raise SavedStateError(f"checkpoint {path} is missing {name}")
        got = file_digest(f)
        if got != want:
            raise SavedStateError(f"checkpoint file {f} is damaged: expected {want}, got {got}")
    return meta


def check_compatible(meta: dict[str, Any], rb: Any, sizes: dict[str, list[int]]) -> None:
    """Raise, naming what differs, unless ``rb`` can load this checkpoint."""
    from rayrb.core.schema import RowSpec
    from rayrb.io.chunks import ChunkDataset

    diffs = []
    if RowSpec.from_json(meta["spec"]) != rb.spec:
        diffs.append(f"row spec {meta['spec']} vs {rb.spec.to_json()}")
    if meta["sampler"] != rb.sampler_name:
        diffs.append(f"sampler {meta['sampler']!r} vs {rb.sampler_name!r}")
    if meta["dataset_fingerprint"] != dataset_fingerprint(ChunkDataset.open(rb.dataset_root)):
        diffs.append(f"offline dataset {meta['dataset']} vs {rb.dataset_root} (different rows)")
    if "prioritized" in str(rb.sampler_name):  # stored priorities are (|p| + eps)^alpha: they mean nothing under others
        saved_prio = meta.get("priority")
        if saved_prio is None:
            diffs.append(f"priority exponents: a version {meta['version']} checkpoint does not record its alpha and "
                         f"eps, this buffer samples by priority with {rb.priority_options}")
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


def restore(rb: Any, path: Path) -> None:
    """Load checkpoint ``path`` into ``rb`` whole, or leave ``rb`` as it was.

    Every part is checked before any actor changes: the manifest (format, version, its
    digest), each file's size and checksum, spec, sampler, dataset and layout, the
    coordinator's section (a draw is tried on a copy of the sampling state), and each
    shard's file by that shard. Then the buffer as it is is saved beside ``path`` and
    the checkpoint applied; if applying still fails, that save is put back (and if even
    that fails, the error says the buffer is unusable).
    """
    path = Path(path)
    meta = read_checkpoint(path)
    sizes = rb.sizes()
    check_compatible(meta, rb, sizes)
    names = sorted(meta["files"], key=lambda n: int(n.split("-")[1].split(".")[0]))
    state = dict(meta["coordinator"])
    tmp = None
    if not same_layout(meta["sizes"], sizes):
        # Another shard layout: re-cut the saved shards, and start the epochs afresh over the new shards.
        saved = []
        for n in names:
            with np.load(path / n) as f:
                saved.append(dict(f))
        states = reshard(saved, (meta["sizes"]["offline"], sizes["offline"]),
                         (meta["sizes"]["online_capacity"], sizes["online_capacity"]))
        tmp = Path(tempfile.mkdtemp(prefix=".reshard-", dir=path.parent))
        names = []
        for j, st in enumerate(states):
            np.savez(tmp / f"shard-{j}.npz", **st)
            names.append(str(tmp / f"shard-{j}.npz"))
        state.pop("allocator", None)
    backup = None
    try:
        rb.rpc.get(rb.rpc.coord.check_state_dict.remote(state))
        # Every shard checks its file before any shard loads one: a refused file changes no shard.
        rb.rpc.get([s.check.remote(str(path / n)) for s, n in zip(rb.rpc.shards, names)])
        backup = path.parent / f".{path.name}.before-{uuid.uuid4().hex[:8]}"
        save(rb, backup)
        try:
            _apply(rb, [str(path / n) for n in names], state)
        except BaseException as e:
            _put_back(rb, backup, e)
            raise
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if backup is not None:
            shutil.rmtree(backup, ignore_errors=True)


def _apply(rb: Any, files: list[str], state: dict[str, Any]) -> None:
    rb.rpc.get([s.load.remote(f) for s, f in zip(rb.rpc.shards, files)])
    rb.rpc.get(rb.rpc.coord.resync.remote())
    rb.rpc.get(rb.rpc.coord.load_state_dict.remote(state))


def _put_back(rb: Any, backup: Path, error: BaseException) -> None:
    """After a restore failed halfway: the buffer as it was before it, from the save taken then."""
    from rayrb.errors import BufferUnavailableError

    try:
        meta = read_checkpoint(backup)
        names = sorted(meta["files"], key=lambda n: int(n.split("-")[1].split(".")[0]))
        _apply(rb, [str(backup / n) for n in names], meta["coordinator"])
    except BaseException as again:
        raise BufferUnavailableError(
            f"restoring the checkpoint failed halfway ({type(error).__name__}: {error}) and putting the buffer "
            f"back as it was failed too ({type(again).__name__}: {again}): it is unusable; shut it down") from again
