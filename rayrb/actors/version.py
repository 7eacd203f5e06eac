"""The coordinator's version: a counter of writes, priority updates, restores and settings changes.

A handle holding batches drawn ahead at an older version gives them back before
its next ``sample()``, so that allocation never uses sizes staler than the previous
call. Handles on the coordinator's node read the counter from a memory map
(``VersionFile``, in ``/dev/shm`` where there is one) without a call; others
read it from the answer to their previous call.
"""
from __future__ import annotations

import os
import re
import tempfile
import uuid

import numpy as np


class VersionFile:
    """The version as 8 bytes in a node-local memory map, made when a handle first asks for it."""

    def __init__(self, name: str):
        self._name, self._map, self.path = name, None, None

    def open(self, version: int) -> str | None:
        """The map's path (made now if needed), or None where no shared folder can be written."""
        if self.path is None:
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            # the pid names the process that keeps it: rayrb.durability.leftovers removes it once that is gone
            path = os.path.join(folder, f"rayrb-{self._name.replace('/', '_')}-{os.getpid()}-"
                                        f"{uuid.uuid4().hex[:8]}.version")
            try:
                self._map = np.memmap(path, dtype=np.int64, mode="w+", shape=(1,))
                self.path = path
            except OSError:  # no shared folder to write: handles ask instead
                return None
        self.write(version)
        return self.path

    def reopen(self, path: str | None, version: int) -> None:
        """After a restart: the file handles on this node already map, if it is still there."""
        if path is not None and os.path.exists(path):
            try:
                mine = re.sub(r"-\d+-([0-9a-f]+)\.version$", rf"-{os.getpid()}-\1.version", path)
                os.rename(path, mine)  # handles' maps stay valid; the name says who keeps it now
                self._map, self.path = np.memmap(mine, dtype=np.int64, mode="r+", shape=(1,)), mine
            except (OSError, ValueError):
                return
            self.write(version)

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

    def __init__(self, name: str):
        self.value = 0
        self.file = VersionFile(name)

    def bump(self) -> int:
        self.value += 1
        self.file.write(self.value)
        return self.value

    def restarted(self, value: int, path: str | None) -> None:
        """After a restart: one past the saved value, so handles give back what they drew before it."""
        self.value = int(value) + 1
        self.file.reopen(path, self.value)
