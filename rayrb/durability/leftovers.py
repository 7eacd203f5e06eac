"""Files a buffer leaves when its owner dies without ``shutdown()``: found, and removed once proved dead. No Ray.

A buffer keeps its actors' state under ``storage_dir``: one directory per buffer
instance, one per actor inside, with the actor's memory maps, its ``restarts.json``
(naming its Ray actor id, its cluster and its last process id) and its ``lease``,
which the live actor renews every minute (``rayrb.durability.lease``). The
coordinator's version map lives in its own directory there; a buffer without a
``storage_dir`` keeps that map in ``/dev/shm`` instead
(``rayrb-<buffer>-<cluster>-<actor id>.version``). ``shutdown()`` removes both; a
driver killed first leaves them.

Clean-up removes only what it can prove dead, never judging by local process ids
alone (another node, or another PID namespace, sees other processes):

* a buffer's state directory is left over when its lease lapsed: none of its files
  changed for ``QUIET`` seconds, ten renewal periods; and, where the caller can ask
  the cluster that started its actors (``state``, Ray's actor table), none of them is
  alive or restarting there; and none of the processes it names runs on this node;
* a version map is left over when the cluster that made it (the caller's) says its
  coordinator is dead, or knows it no more. Maps of other clusters are left to theirs.

Every new buffer removes what it finds on its driver's node; ``rayrb gc`` does it on
demand, for any ``storage_dir``.

Examples:
    >>> import tempfile
    >>> shm = Path(tempfile.mkdtemp())
    >>> for actor in ("a" * 32, "b" * 32):
    ...     (shm / f"rayrb-buf-{'c' * 16}-{actor}.version").touch()
    >>> (shm / f"rayrb-buf-{'d' * 16}-{'e' * 32}.version").touch()  # another cluster's
    >>> states = {"a" * 32: "ALIVE", "b" * 32: "DEAD"}
    >>> [p.name[:14] for p in version_files([shm], cluster="c" * 56, state=states.get)]
    ['rayrb-buf-cccc']
    >>> version_files([shm])  # without the cluster's view nothing is proved dead
    []
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from rayrb.core.names import directory_name
from rayrb.durability.lease import FILE as LEASE
from rayrb.durability.restarts import FILE as RESTARTS

QUIET = 600.0  # seconds without a change (ten lease periods) before a state directory may be left over
CLUSTER_CHARS = 16  # of the cluster id, in a version map's name
_VERSION = re.compile(rf"^rayrb-.+-([0-9a-f]{{{CLUSTER_CHARS}}})-([0-9a-f]+)\.version$")
LIVE = ("DEPENDENCIES_UNREADY", "PENDING_CREATION", "ALIVE", "RESTARTING")

ActorState = Callable[[str], "str | None"]  # an actor id -> its state in Ray's actor table, None if unknown


def version_name(buffer: str, cluster: str, actor: str) -> str:
    """The file name of a version map kept in ``/dev/shm`` by coordinator ``actor`` of ``cluster``."""
    return f"rayrb-{directory_name(buffer)}-{cluster[:CLUSTER_CHARS]}-{actor}.version"


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this node (in this PID namespace)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def shm_dirs() -> list[Path]:
    return [Path(d) for d in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(d)]


def _dead(actor: str | None, cluster: str | None, mine: str | None, state: ActorState | None) -> bool | None:
    """Whether the cluster says ``actor`` is dead: None where it cannot say (no view, another cluster)."""
    if actor is None or cluster is None or mine is None or state is None:
        return None
    if cluster[:CLUSTER_CHARS] != mine[:CLUSTER_CHARS]:
        return None
    return state(actor) not in LIVE  # DEAD, or forgotten: the actor table knew it once


def version_files(dirs: Iterable[Path] | None = None, *, cluster: str | None = None,
                  state: ActorState | None = None) -> list[Path]:
    """Version maps whose coordinator the cluster ``cluster`` (the caller's) says is dead (see the module)."""
    out = []
    for d in dirs if dirs is not None else shm_dirs():
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in sorted(names):
            m = _VERSION.match(name)
            if m and _dead(m.group(2), m.group(1), cluster, state):
                out.append(Path(d) / name)
    return out


def state_dirs(root: str | os.PathLike, quiet: float = QUIET, now: float | None = None, *,
               cluster: str | None = None, state: ActorState | None = None) -> list[Path]:
    """Buffer instance directories under ``storage_dir`` ``root`` whose lease lapsed and whose actors are not
    alive as far as this node and the cluster ``cluster`` can tell (see the module)."""
    root, now = Path(root), time.time() if now is None else now
    out = []
    try:
        instances = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError:
        return out
    for inst in instances:
        keepers, leases, newest = [], 0, 0.0
        for f in inst.rglob("*"):
            try:
                newest = max(newest, f.stat().st_mtime)
            except OSError:
                continue
            leases += f.name == LEASE
            if f.name == RESTARTS:
                try:
                    keepers.append(json.loads(f.read_text()))
                except (OSError, ValueError):
                    keepers.append({})  # damaged: judged by its lease alone
        if not (keepers or leases) or now - newest <= quiet:  # not a buffer's (no record, no lease), or live
            continue
        if any(isinstance(k, dict) and isinstance(k.get("pid"), int) and k["pid"] > 0 and alive(k["pid"])
               for k in keepers):
            continue
        if any(isinstance(k, dict) and _dead(k.get("actor"), k.get("cluster"), cluster, state) is False
               for k in keepers):
            continue
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
