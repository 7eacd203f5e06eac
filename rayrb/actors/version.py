"""The coordinator's version: a counter of writes, priority updates, restores and settings changes.

A handle holding batches drawn ahead at an older version gives them back before
its next ``sample()``, so that allocation never uses sizes staler than the previous
call. Handles on the coordinator's node read the counter from a memory map
(``VersionFile``) without a call; others read it from the answer to their previous call.

The map lives in the coordinator's state directory (``version``), where a restarted
coordinator finds it again, whenever it was made, and clean-up treats it with the rest
of the buffer's state. A coordinator without a state directory never restarts; it keeps
the map in ``/dev/shm``, named by its cluster and actor id
(``rayrb.durability.leftovers.version_name``), which clean-up asks Ray about.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from rayrb.actors.lifecycle import whoami
from rayrb.durability.leftovers import version_name

FILE = "version"


class VersionFile:
    """The version as 8 bytes in a node-local memory map, made when a handle first asks for it (or reopened)."""

    def __init__(self, name: str, directory: str | os.PathLike | None = None):
        self._name, self._directory = name, None if directory is None else Path(directory)
        self._map, self.path = None, None

    def _where(self) -> str:
        if self._directory is not None:
            return str(self._directory / FILE)
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        actor, cluster, _, _ = whoami()
        return os.path.join(folder, version_name(self._name, cluster or "0" * 16, actor or os.urandom(16).hex()))

    def open(self, version: int) -> str | None:
        """The map's path (made now if needed), or None where no shared folder can be written."""
        if self.path is None:
            path = self._where()
            try:  # a restarted coordinator maps the file handles on this node already map
                self._map = np.memmap(path, dtype=np.int64, mode="r+" if os.path.exists(path) else "w+", shape=(1,))
                self.path = path
            except (OSError, ValueError):  # no folder to write, or a damaged file: handles ask instead
                return None
        self.write(version)
        return self.path

    def reopen(self, version: int) -> None:
        """After a restart: write the version into the map handles already read, if one was made."""
        if self._directory is not None and (self._directory / FILE).exists():
            self.open(version)

    def write(self, version: int) -> None:
        if self._map is not None:
            self._map[0] = version

    def remove(self) -> None:
        if self.path is not None:
            self._map = None
            try:
                os.remove(self.path)
            except OSError:
                pass
            self.path = None


class Version:
    """The counter and its file; ``bump`` after every change handles must see."""

    def __init__(self, name: str, directory: str | os.PathLike | None = None):
        self.value = 0
        self.file = VersionFile(name, directory)

    def bump(self) -> int:
        self.value += 1
        self.file.write(self.value)
        return self.value

    def restarted(self, value: int) -> None:
        """After a restart: one past the saved value, so handles give back what they drew before it."""
        self.value = int(value) + 1
        self.file.reopen(self.value)
