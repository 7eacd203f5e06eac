"""Where a preprocess run writes (``rayrb.io.preprocess``): its destination, claimed for one job, resumed after
an interruption, and left as it was found by a run that raises (contract 9).

A destination holds the job it is for (``JOB_FILE``: the source, ``fn`` and arguments), the chunks finished so
far and their markers, and, once the run finished, a manifest. A run resumes only the chunks of the same job:
``fn`` counts by its name, its source and what a closure or a default captured. A run that raises
(``fn`` raised, a chunk's task failed) removes what it made, so a destination is never left half written by a
failure; an interruption (Ctrl-C, a killed driver) keeps the finished chunks for the next run.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from rayrb.errors import InvalidArgumentError
from rayrb.io.files import replace_file

JOB_FILE = ".rayrb-job.json"


def fn_fingerprint(fn: Callable) -> str:
    """``fn`` by its name, its source (or its repr, for a callable object) and what its source does not say: the
    values its closure captured and its defaults (``make_fn(2)`` and ``make_fn(3)`` share one source text), by
    their reprs, memory addresses left out, so that a rerun in another process finds the same job."""
    try:
        body = inspect.getsource(fn)
    except (OSError, TypeError):
        body = repr(fn)
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", body + "\0" + _captured(fn))
    return name + ":" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _captured(fn: Callable) -> str:
    """A function's (or a bound method's) closure values and defaults, by repr."""
    f = getattr(fn, "__func__", fn)
    cells = []
    for cell in getattr(f, "__closure__", None) or ():
        try:
            cells.append(repr(cell.cell_contents))
        except ValueError:  # a cell not filled yet
            cells.append("<empty>")
    return repr((cells, getattr(f, "__defaults__", None), getattr(f, "__kwdefaults__", None)))


def prepare_dest(dest: Path, job: dict, resume: bool) -> None:
    """Make ``dest`` ready for ``job``: absent or empty, or an interrupted run of it (``resume=False``: cleared,
    as is an unfinished run of another job); else refused."""
    job_file = dest / JOB_FILE
    if dest.exists() and any(dest.iterdir()):
        try:
            previous = json.loads(job_file.read_text())
        except (OSError, ValueError):
            previous = None
        if previous != job and not (previous is not None and not resume and unfinished_run(dest)):
            raise InvalidArgumentError(
                f"dest {dest} is not empty and is not an interrupted run of this job "
                f"({'no ' + JOB_FILE if previous is None else 'different source, fn or arguments'}); "
                "choose an empty directory"
            )
        if not resume:
            for p in dest.iterdir():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    dest.mkdir(parents=True, exist_ok=True)
    if not job_file.exists():
        replace_file(job_file, json.dumps(job))


def unfinished_run(dest: Path) -> bool:
    """Whether ``dest`` holds only what an unfinished preprocess run leaves (its job file, chunks and their
    markers; no manifest): what ``resume=False`` may clear for another job."""
    return all(p.name == JOB_FILE or p.name.startswith("chunk-") for p in dest.iterdir())


def entries(dest: Path) -> set[str] | None:
    """What ``dest`` holds before a run (None: it does not exist)."""
    return set(os.listdir(dest)) if dest.is_dir() else None


def roll_back(dest: Path, before: set[str] | None) -> None:
    """A run that raised leaves ``dest`` as it found it (contract 9): what it made goes (``dest`` too, where it
    made it); an earlier run's finished chunks, kept for a resume, stay."""
    if before is None:
        shutil.rmtree(dest, ignore_errors=True)
        return
    for name in set(os.listdir(dest)) - before if dest.is_dir() else ():
        path = dest / name
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
