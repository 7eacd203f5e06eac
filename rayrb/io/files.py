"""Low-level file work shared by chunk writes and durable state: a file or a directory replaced whole, whole
``pwrite`` s, block reservation, digests, and this process's resident memory. Linux where it helps, portable where
it must be."""
from __future__ import annotations

import os
import shutil
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any


def replace_file(path: str | os.PathLike, data: bytes | str, *, sync: bool = False) -> Path:
    """Write ``data`` to ``path`` whole or not at all: into a file of its own beside it, renamed over it.

    Every file rayrb writes for a reader to trust (``docs/durability.md``, "Files and formats") goes through
    here: a crash leaves the old file or the new one, never part of either, and two writers never share a
    temporary file. ``sync`` flushes the data to the device before the rename (manifests, whose loss a
    reader could not tell from their absence); state files rewritten after every call rely on the page
    cache, which outlives the process.

    >>> import tempfile; d = Path(tempfile.mkdtemp())
    >>> replace_file(d / "a.json", "{}").read_text(), sorted(p.name for p in d.iterdir())
    ('{}', ['a.json'])
    """
    path = Path(path)
    tmp = _beside(path, "tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _beside(path: Path, kind: str) -> Path:
    """A name of its own beside ``path``, hidden: two writers never share one."""
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def replace_dir(path: str | os.PathLike, write: Callable[[Path], Any]) -> Path:
    """Build a directory with ``write(directory)`` beside ``path``, then swap it in whole: a reader of ``path`` sees
    the old directory or the new one, never part of either, and a ``write`` that raises leaves ``path`` as it was
    and nothing beside it.

    Datasets built in place go through here. The swap is one ``renameat2(RENAME_EXCHANGE)`` on
    Linux; where that is missing, the old directory is renamed aside first, so a crash between the two renames
    leaves it beside ``path`` (``.<name>.old-*``), not lost, and a failed second rename puts it back. Where
    ``path`` is a link to a directory, the directory it leads to is replaced (beside itself, on its file system)
    and the link kept.

    >>> import tempfile; d = Path(tempfile.mkdtemp()) / "ds"
    >>> _ = replace_dir(d, lambda t: (t / "a").write_text("1")); _ = replace_dir(d, lambda t: (t / "b").write_text("2"))
    >>> sorted(p.name for p in d.iterdir()), sorted(p.name for p in d.parent.iterdir())
    (['b'], ['ds'])
    """
    given = Path(path)
    # Written through a link: renaming over the link itself would put a real directory in its place.
    path = Path(os.path.realpath(given))
    path.parent.mkdir(parents=True, exist_ok=True)
    new = _beside(path, "tmp")
    new.mkdir()
    try:
        write(new)
        if _exchange(new, path):  # ``new`` now names the old directory
            return given
        old = None
        if path.exists():
            old = _beside(path, "old")
            os.rename(path, old)
        try:
            os.rename(new, path)
        except BaseException:
            if old is not None:
                os.rename(old, path)
            raise
        new = old  # the old directory, removed below; None where there was none
        return given
    finally:
        if new is not None:
            shutil.rmtree(new, ignore_errors=True)


def _linux_renameat2():
    try:
        import ctypes

        f = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    f.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    f.restype = ctypes.c_int
    return f


_RENAMEAT2 = _linux_renameat2()
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step (Linux ``renameat2``); False where ``b`` is absent or the call is
    missing or refused (a file system without it), so the caller renames instead."""
    if _RENAMEAT2 is None or not b.exists():
        return False
    return _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def _linux_fallocate():
    try:
        import ctypes

        f = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    f.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    f.restype = ctypes.c_int
    return f


_FALLOCATE = _linux_fallocate()


def reserve(fd: int, nbytes: int) -> None:
    """Allocate a file's blocks before writing it (a third faster here); best effort.

    Linux ``fallocate``, not ``os.posix_fallocate``: where a file system cannot allocate
    ahead, glibc's fallback writes a zero into every block, twice the work; this just returns.
    """
    if _FALLOCATE is not None:
        _FALLOCATE(fd, 0, 0, nbytes)


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """``pwrite`` all of ``data`` at ``offset`` (a write may be short); raise if one writes nothing."""
    while len(data):
        n = os.pwrite(fd, data, offset)
        if n <= 0:
            raise OSError(f"pwrite wrote nothing at offset {offset} with {len(data)} bytes left")
        data, offset = data[n:], offset + n


def file_digest(path: str | os.PathLike) -> dict[str, Any]:
    """``{"bytes": size, "crc32": hex}`` of a file."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return {"bytes": size, "crc32": f"{crc:08x}"}


def process_memory() -> dict[str, int]:
    """Resident memory split into private (``rss_anon``: copies) and file-backed (``rss_file``: mapped chunks)."""
    out = {"rss_bytes": 0, "rss_anon_bytes": 0, "rss_file_bytes": 0, "rss_peak_bytes": 0}
    names = {"VmRSS:": "rss_bytes", "RssAnon:": "rss_anon_bytes", "RssFile:": "rss_file_bytes",
             "VmHWM:": "rss_peak_bytes"}
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                parts = line.split()
                if parts and parts[0] in names:
                    out[names[parts[0]]] = int(parts[1]) * 1024
    except OSError:
        pass
    return out
