"""One writer at a time for a new dataset's directory.

Two processes writing a dataset into one directory at once would overwrite each other's chunks and leave a
manifest of one over the rows of the other, which opens and serves them. So a writer holds the directory for its
whole write: an exclusive ``flock`` on its ``CLAIM`` file, taken *before* the directory is checked, so of two
writers starting together one is refused whichever looked first. The lock goes with the process (a killed
writer's is free at once); the file is removed when the write ends.

Examples:
    >>> import tempfile, os
    >>> root = os.path.join(tempfile.mkdtemp(), "ds")
    >>> first = Claim(root)
    >>> Claim(root)
    Traceback (most recent call last):
    rayrb.errors.DirectoryNotEmptyError: expected no other writer of the dataset at ..., got one writing it now
    >>> first.others(), first.release()
    ([], None)
    >>> os.path.exists(root)
    True
"""
from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from rayrb.errors import DirectoryNotEmptyError

CLAIM = ".rayrb-writing"  # locked by the one process writing a dataset into the directory


class Claim:
    """``root`` held by this process until ``release`` (made if absent; ``made``: it was)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():  # never removed: it is not a dataset
            raise DirectoryNotEmptyError(f"expected an absent or empty directory for a new chunk dataset, got a file "
                                         f"at {self.root}")
        self.made = not self.root.exists()
        self.root.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.root / CLAIM, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise DirectoryNotEmptyError(f"expected no other writer of the dataset at {self.root}, got one writing it "
                                         "now") from None

    def others(self) -> list[Path]:
        """What the directory holds besides the claim."""
        return sorted(p for p in self.root.iterdir() if p.name != CLAIM)

    def clear(self) -> None:
        """Remove everything the directory holds besides the claim."""
        for p in self.others():
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()

    def release(self, undo: bool = False) -> None:
        """Let the directory go; ``undo``: the write failed, so what it made goes too (the directory, if it made
        it; else its contents)."""
        if self._fd < 0:
            return
        try:
            if undo and self.made:
                shutil.rmtree(self.root, ignore_errors=True)
            else:
                if undo:
                    self.clear()
                (self.root / CLAIM).unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = -1
