"""Room for the chunk files a dataset keeps open: the process's soft limit of open files raised as they are opened.

A gathered chunk's files stay open and mapped (``rayrb.io.gather.ColumnFile``: a descriptor and the map's own, two
a file), so a dataset larger than memory, thousands of chunks read at random, needs thousands of descriptors,
past the usual soft limit of 1,024. Before a chunk's files are opened, ``make_room`` raises the soft limit towards
the hard one (``ulimit -Hn``: a process may raise its own soft limit that far) when the descriptors this module
has counted would come within ``RESERVE`` of it. Where the hard limit is reached, an open fails with ``EMFILE``,
which ``too_many`` words for the user.
"""
from __future__ import annotations

import threading

RESERVE = 256  # descriptors left for everything else the process opens (sockets, Ray, other files)
_lock = threading.Lock()
_held = 0  # descriptors held by open chunk files in this process


def make_room(more: int) -> None:
    """Before ``more`` descriptors are opened (and counted, ``held``): raise the soft limit if they would come
    within ``RESERVE`` of it (to twice what they need, at most the hard limit)."""
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to raise
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = _held + more + RESERVE
    if soft == resource.RLIM_INFINITY or need <= soft or soft == hard:
        return
    target = 2 * need if hard == resource.RLIM_INFINITY else min(hard, 2 * need)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError):  # refused: the open that runs out reports it (too_many)
        pass


def held(delta: int) -> None:
    """Count ``delta`` descriptors opened (positive) or closed (negative) by chunk files."""
    global _held
    with _lock:
        _held += delta


def too_many(label: str) -> str:
    """The error for an open that ran out of descriptors, with the limit and what to do."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except ImportError:
        soft = hard = -1
    return (f"{label}: expected to open its file, but this process has no descriptor left (its limit of open files "
            f"is {soft}, at most {hard}; each chunk file read takes two, {_held} are held): raise the hard limit "
            "(`ulimit -Hn`, or LimitNOFILE for a service) or write the dataset in fewer, larger chunks (chunk_rows)")
