"""Files a buffer leaves on a node when its owner dies without ``shutdown()``: found and removed. No Ray here.

A buffer writes two kinds of node-local files: its coordinator's version map in
``/dev/shm`` (``rayrb-<buffer>-<pid>-<id>.version``) and its actors' state under
``storage_dir`` (one directory per buffer instance, one per actor inside, each with
``restarts.json`` naming the process that last started there). ``shutdown()`` removes
both; a driver killed first leaves them. A file is left over when no process named in
it is alive on this node: a version map whose coordinator pid is gone, or a buffer's
state directory none of whose actors' last pids is alive and none of whose files
changed for ``quiet`` seconds (a crashed actor restarts within seconds; its new
process rewrites ``restarts.json``). Every new buffer removes what it finds on its
driver's node; ``rayrb gc`` does it on demand, for any ``storage_dir``.

Examples:
    >>> import os, tempfile
    >>> shm = Path(tempfile.mkdtemp())
    >>> (shm / f"rayrb-b1-{os.getpid()}-aa.version").touch()  # this process: alive
    >>> (shm / "rayrb-b2-999999999-bb.version").touch()  # no such process
    >>> [p.name for p in version_files([shm])]
    ['rayrb-b2-999999999-bb.version']
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

_VERSION = re.compile(r"^rayrb-.+-(\d+)-[0-9a-f]+\.version$")
QUIET = 600.0  # seconds without a change before a state directory of dead processes is left over


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this node."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def shm_dirs() -> list[Path]:
    return [Path(d) for d in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(d)]


def version_files(dirs: Iterable[Path] | None = None) -> list[Path]:
    """Version maps whose coordinator process is gone."""
    out = []
    for d in dirs if dirs is not None else shm_dirs():
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in sorted(names):
            m = _VERSION.match(name)
            if m and not alive(int(m.group(1))):
                out.append(Path(d) / name)
    return out


def state_dirs(root: str | os.PathLike, quiet: float = QUIET, now: float | None = None) -> list[Path]:
    """Buffer instance directories under ``storage_dir`` ``root`` whose actors are all gone (see the module)."""
    root, now = Path(root), time.time() if now is None else now
    out = []
    try:
        instances = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError:
        return out
    for inst in instances:
        pids, newest = [], 0.0
        for f in inst.rglob("*"):
            try:
                newest = max(newest, f.stat().st_mtime)
            except OSError:
                continue
            if f.name == "restarts.json":
                try:
                    pids.append(int(json.loads(f.read_text())["pid"]))
                except (OSError, ValueError, KeyError, TypeError):
                    pids.append(-1)  # written by a release before pids were kept: judged by age alone
        if pids and not any(alive(p) for p in pids if p > 0) and now - newest > quiet:
            out.append(inst)
    return out


def remove(paths: Iterable[Path]) -> list[Path]:
    """Remove these files and directories; the ones removed."""
    done = []
    for p in paths:
        try:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            done.append(p)
        except OSError:
            pass
    return done
