"""Map a dataset through a user function with Ray tasks, into a new chunk dataset.

TorchRL's ``preprocess`` runs a multiprocessing pool on one node. Here each input
range is one Ray task that reads its rows (memory maps or a Parquet file), applies
``fn`` and writes its output chunk as a tensordict memmap straight under ``dest``:
no chunk's data passes through the driver, and at most ``num_workers`` tasks run
at once (``ray.wait`` back-pressure), so memory per worker is bounded by the
chunk size.

A run is resumable. ``dest/.rayrb-job.json`` records what the run computes, and
each finished chunk leaves ``chunk-XXXXX.done.json`` beside it; a rerun with the
same arguments recomputes only chunks whose marker is missing or whose files
fail their hash. ``manifest.json`` is written last, atomically.

Examples:
    >>> import numpy as np
    >>> def double(td):  # batched: one chunk as a TensorDict
    ...     td["X"] = td["X"] * 2
    ...     return td
    >>> out = preprocess({"X": np.ones((10, 2), "float32")}, double, tmp_path / "out",
    ...                  batched=True, chunk_rows=4, pbar=False)  # doctest: +SKIP
    >>> out.read()["X"][0].tolist()  # doctest: +SKIP
    [2.0, 2.0]
"""
from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from rayrb.core.schema import RowSpec
from rayrb.errors import (
    InvalidArgumentError,
    InvalidArgumentTypeError,
    PreprocessError,  # noqa: F401  (re-exported)
)
from rayrb.io.arrow import arrow_to_arrays  # re-exported: part of this module's API
from rayrb.io.chunks import (
    MANIFEST,
    ChunkDataset,
    ChunkError,
    ChunkInfo,
    chunk_name,
    default_chunk_rows,
    hash_algorithm,
    hash_arrays,
    map_chunk,
    write_chunk,
    write_manifest,
)
from rayrb.io.destination import entries, fn_fingerprint, prepare_dest, roll_back
from rayrb.io.files import replace_file
from rayrb.io.parquet import export_parquet, parquet_files  # noqa: F401  (export_parquet: re-exported)


# ---------------------------------------------------------------------------- sources
def _units(source: Any, chunk_rows: int | None, num_workers: int, num_frames: int | None):
    """Input work units ``(kind, where, start, stop)`` and a fingerprint of the source."""
    from rayrb.io.datasets.registry import as_chunk_dataset

    if isinstance(source, (str, os.PathLike)) and (
        str(source).endswith(".parquet") or (Path(source).is_dir() and any(Path(source).glob("*.parquet")))
    ):
        import pyarrow.parquet as pq

        files = parquet_files(Path(source))
        rows = [pq.ParquetFile(f).metadata.num_rows for f in files]
        units, total = [], 0
        for f, n in zip(files, rows):
            if num_frames is not None:
                n = min(n, num_frames - total)
            if n <= 0:
                break
            units.append(("parquet", str(f), 0, n))
            total += n
        fp = {"parquet": [str(f) for f in files], "sizes": [f.stat().st_size for f in files]}
        return units, fp, None
    try:
        import pyarrow as pa

        if isinstance(source, pa.Table):
            source = arrow_to_arrays(source)
    except ImportError:
        pass
    ds, owned = as_chunk_dataset(source)
    n = len(ds) if num_frames is None else min(num_frames, len(ds))
    if chunk_rows is None:
        chunk_rows = min(default_chunk_rows(ds.spec), max(1, math.ceil(n / (4 * num_workers))))
    units = [("chunks", str(ds.root), a, min(a + chunk_rows, n)) for a in range(0, n, chunk_rows)]
    fp = {"rows": len(ds), "hashes": [c.hash for c in ds.chunks]}  # content, not location: resumable
    return units, fp, (ds if owned else None)


def _read_unit(kind: str, where: str, start: int, stop: int) -> dict[str, np.ndarray]:
    if kind == "parquet":
        import pyarrow.parquet as pq

        return {k: v[start:stop] for k, v in arrow_to_arrays(pq.read_table(where)).items()}
    return ChunkDataset.open(where).view(start, stop)  # copy-on-write: fn may write in place


# ---------------------------------------------------------------------------- the task
def _apply(fn: Callable, arrays: dict[str, np.ndarray], batched: bool, name: str, start: int):
    import torch

    from rayrb.io.arrays import from_numpy_dict, to_numpy_dict

    td = from_numpy_dict({k: v if v.flags.writeable else np.array(v) for k, v in arrays.items()})
    if batched:
        try:
            out = fn(td)
        except Exception as e:
            raise PreprocessError(f"fn failed on {name} (rows {start}..{start + len(td) - 1}): "
                                  f"{type(e).__name__}: {e}") from e
        if out is None or out.batch_size[:1] != td.batch_size:
            raise PreprocessError(f"fn on {name}: expected a TensorDict with batch size {list(td.batch_size)}, "
                                  f"got {None if out is None else list(out.batch_size)}")
        return to_numpy_dict(out)
    rows = []
    for i in range(len(td)):
        try:
            rows.append(fn(td[i]))
        except Exception as e:
            raise PreprocessError(f"fn failed on {name}, row {start + i}: {type(e).__name__}: {e}") from e
    try:
        return to_numpy_dict(torch.stack(rows))
    except Exception as e:
        spec0 = RowSpec.from_arrays({k: v[None] for k, v in to_numpy_dict(rows[0]).items()})
        for i, r in enumerate(rows):
            spec = RowSpec.from_arrays({k: v[None] for k, v in to_numpy_dict(r).items()})
            if spec != spec0:
                raise PreprocessError(f"fn on {name}, row {start + i}: returned {spec!r}, but row {start} "
                                      f"returned {spec0!r}") from None
        raise PreprocessError(f"fn on {name}: rows could not be stacked: {e}") from e


def _process(unit: tuple, index: int, fn: Callable, batched: bool, dest: str) -> dict[str, Any]:
    import ray

    kind, where, start, stop = unit
    name = chunk_name(index)
    out = _apply(fn, _read_unit(kind, where, start, stop), batched, name, start)
    spec = RowSpec.from_arrays(out)
    info = write_chunk(out, Path(dest) / name, spec)
    info.node = ray.get_runtime_context().get_node_id()
    from rayrb.io.files import process_memory

    # peak RSS of the worker process so far (bounded by the chunk size, not the dataset size)
    info.extra = {"input": [start, stop], "spec": spec.to_json(), "worker_rss_bytes": process_memory()["rss_peak_bytes"]}
    marker = Path(dest) / f"{name}.done.json"
    replace_file(marker, json.dumps(asdict(info)))
    return asdict(info)


# ---------------------------------------------------------------------------- the driver
def _finished(dest: Path, index: int) -> dict[str, Any] | None:
    """The recorded info of a finished chunk whose files still match its hash, else None."""
    marker = dest / f"{chunk_name(index)}.done.json"
    try:
        info = json.loads(marker.read_text())
        spec = RowSpec.from_json(info["extra"]["spec"])
        arrays = map_chunk(dest / info["path"], spec, info["rows"])
        if hash_arrays(arrays, spec, hash_algorithm(info["hash"])) == info["hash"]:
            return info
    except (OSError, ValueError, KeyError, ChunkError):
        pass
    return None


def preprocess(
    source: Any,
    fn: Callable,
    dest: str | os.PathLike,
    *,
    batched: bool = False,
    num_workers: int | None = None,
    chunk_rows: int | None = None,
    num_frames: int | None = None,
    pbar: bool = True,
    resume: bool = True,
    task_options: dict | None = None,
) -> ChunkDataset:
    """Map ``source`` through ``fn`` into a new chunk dataset at ``dest``; return it.

    Args:
        source: a chunk dataset (path, ``load_dataset`` id or object), a TensorDict or
            dict of arrays, a ``pyarrow.Table``, a Parquet file or directory, or a
            ``ray.data.Dataset`` (written once as a chunk dataset by Ray tasks, then mapped).
        fn: TorchRL's contract, one row (a TensorDict with no batch dimension) in and
            one row out; with ``batched=True``, one chunk (a ``[n]`` TensorDict) in and
            ``[n]`` rows out (the fast path). The output spec is taken from the first
            chunk and every chunk must match it.
        dest: the new dataset's directory: absent, empty, or an interrupted run of the
            same job, resumed (``rayrb.io.destination``: a run that raises leaves it as it was).
        num_workers: tasks running at once (default: the cluster's CPUs).
        chunk_rows: input rows per task and output chunk.
        num_frames: transform only the first ``num_frames`` rows (to debug ``fn``).
        pbar: show a progress bar over rows (rows/s, ETA).
        resume: keep finished chunks of an interrupted run; False recomputes them (even another job's).
        task_options: extra ``.options(...)`` for the tasks (default ``num_cpus=1``,
            spread over nodes).
    """
    import ray

    from rayrb.core.validation import optional_positive_int, positive_int

    if not callable(fn):
        raise InvalidArgumentTypeError(f"fn must be callable, got {type(fn).__name__}")
    num_frames = optional_positive_int("num_frames", num_frames)
    chunk_rows = optional_positive_int("chunk_rows", chunk_rows)
    if num_workers is None:
        num_workers = max(1, int(ray.cluster_resources().get("CPU", 1)) if ray.is_initialized() else os.cpu_count() or 1)
    num_workers = positive_int("num_workers", num_workers)

    dest = Path(dest).resolve()
    src_root = _source_root(source)
    if src_root is not None and (dest == src_root or src_root in dest.parents):
        raise InvalidArgumentError(
            f"dest must not be the source dataset or inside it, got dest={dest} for source {src_root}")
    units, fingerprint, owned = _units(source, chunk_rows, num_workers, num_frames)
    if not units:
        raise InvalidArgumentError("expected at least one row to preprocess, got 0")
    job = {"source": fingerprint, "fn": fn_fingerprint(fn), "batched": bool(batched),
           "units": [list(u[2:]) for u in units], "num_frames": num_frames}
    try:
        return _run(units, job, fn, dest, batched, num_workers, pbar, resume, task_options or {})
    finally:
        if owned is not None:
            shutil.rmtree(owned.root.parent, ignore_errors=True)


def _source_root(source: Any) -> Path | None:
    if isinstance(source, ChunkDataset):
        return source.root.resolve()
    if isinstance(source, (str, os.PathLike)) and Path(source).exists():
        return Path(source).resolve()
    return None


def _check_spec(infos: dict[int, dict], i: int) -> None:
    """Chunk ``i``'s output spec must equal the first finished chunk's."""
    ref = min(infos, key=lambda j: (j != 0, j))  # chunk 0 when it is done, else the lowest finished
    want, got = (RowSpec.from_json(infos[j]["extra"]["spec"]) for j in (ref, i))
    if got != want:
        raise PreprocessError(f"fn returned {got!r} for {chunk_name(i)}, but {want!r} for {chunk_name(ref)}; "
                              "every chunk must have the same keys, shapes and dtypes")


def in_flight_limit(num_workers: int, cluster_cpus: float, task_cpus: float) -> int:
    """How many tasks to keep submitted so that at most ``num_workers`` run at once.

    When the cluster cannot run more than ``num_workers`` of them anyway, as many again wait
    queued in Ray: a worker that finishes a chunk starts the next on the same lease, without
    waiting for the driver to hear of it and submit another (2-5 ms a chunk on 2 cores). When
    the cluster has room for more, extra tasks would run, not wait, so none are queued.

    >>> in_flight_limit(2, cluster_cpus=2, task_cpus=1)
    4
    >>> in_flight_limit(2, cluster_cpus=16, task_cpus=1)
    2
    >>> in_flight_limit(4, cluster_cpus=16, task_cpus=4)
    8
    >>> in_flight_limit(3, cluster_cpus=8, task_cpus=0)  # tasks that take no CPU: no cap from the cluster
    3
    >>> in_flight_limit(19, cluster_cpus=2, task_cpus=0.1)  # 20 fit, so none may wait queued
    19
    """
    # Ray counts resources in fixed point (1/10000 of a unit), not float: 2 // 0.1 is 19.0, yet 20 such tasks fit.
    unit = round(task_cpus * 10000)
    if unit <= 0 or num_workers < round(cluster_cpus * 10000) // unit:
        return num_workers
    return 2 * num_workers


def _run(units, job, fn, dest: Path, batched, num_workers, pbar, resume, task_options) -> ChunkDataset:


    before = entries(dest)
    prepare_dest(dest, job, resume)
    try:
        return _map(units, job, fn, dest, batched, num_workers, pbar, resume, task_options)
    except Exception:  # an interruption (Ctrl-C, a killed driver) keeps what was made, for a resumed run
        roll_back(dest, before)
        raise


def _map(units, job, fn, dest: Path, batched, num_workers, pbar, resume, task_options) -> ChunkDataset:
    import ray

    from rayrb.io.progress import progress

    (dest / MANIFEST).unlink(missing_ok=True)  # only a finished run has one
    infos: dict[int, dict] = {}
    todo = []
    for i in range(len(units)):
        done = _finished(dest, i) if resume else None
        if done is not None:
            infos[i] = done
        else:
            todo.append(i)
    total_rows = sum(u[3] - u[2] for u in units)
    bar = progress(total_rows, unit="rows", enabled=pbar, desc=f"preprocess -> {dest.name}",
                   initial=sum(infos[i]["rows"] for i in infos))
    options = {"num_cpus": 1, "scheduling_strategy": "SPREAD", **task_options}
    task = ray.remote(_process).options(**options)
    fn_ref = ray.put(fn)
    limit = in_flight_limit(num_workers, ray.cluster_resources().get("CPU", 0), options["num_cpus"])
    in_flight: dict[Any, int] = {}
    pending = list(todo)
    try:
        while pending or in_flight:
            while pending and len(in_flight) < limit:
                i = pending.pop(0)
                in_flight[task.remote(units[i], i, fn_ref, batched, str(dest))] = i
            ready, _ = ray.wait(list(in_flight), num_returns=1)
            i = in_flight.pop(ready[0])
            try:
                infos[i] = ray.get(ready[0])
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if isinstance(e.cause, PreprocessError) else e
                raise PreprocessError(str(cause)) from e.cause
            except ray.exceptions.RayError as e:  # its worker died every time Ray tried it (or the node did)
                raise PreprocessError(f"{chunk_name(i)} (input rows {units[i][2]} to {units[i][3]}): its task "
                                      f"failed: {type(e).__name__}: {str(e)[:500]}") from e
            _check_spec(infos, i)
            bar.update(infos[i]["rows"])
    except KeyboardInterrupt:
        for ref in in_flight:
            ray.cancel(ref)
        raise
    finally:
        bar.close()
        # Let submitted tasks finish rather than cancel them: a task cancelled while its worker imports
        # torch leaves that pooled worker half-initialized, and the next preprocess fails on it. Which of
        # them already run cannot be told, so the queued ones (at most num_workers) run too; their chunks
        # count for a resumed run.
        if in_flight:
            ray.wait(list(in_flight), num_returns=len(in_flight), timeout=120)
    for i in sorted(set(infos) - set(todo)):  # chunks kept from an earlier run; new ones were checked above
        _check_spec(infos, i)
    first = RowSpec.from_json(infos[0]["extra"]["spec"])
    chunks = [ChunkInfo(**infos[i]) for i in range(len(units))]
    write_manifest(dest, first, chunks, source=job["source"], recipe={"preprocess": job})
    return ChunkDataset.open(dest)
