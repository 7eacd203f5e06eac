"""The coordinator's version: a counter of writes, priority updates, restores and settings changes, plus the
appends its online shards published on its node (``rayrb.durability.published``).

A handle holding batches drawn ahead at an older version gives them back before
its next ``sample()``, so that allocation never uses sizes staler than the previous
call. Handles on the coordinator's node read the version from its counts map
(``VersionFile``) without a call; others read it from the answer to their previous call.
Appends to shards on the coordinator's node publish their write counts in the same map, so
the coordinator learns them before each plan (``Version.poll``) without anyone calling it.

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
from rayrb.core.ahead import past_any_number
from rayrb.durability.leftovers import version_name
from rayrb.durability.published import CountsMap

FILE = "version"


class VersionFile:
    """The counts map in a node-local file, made at the coordinator's start (or reopened)."""

    def __init__(self, name: str, directory: str | os.PathLike | None = None, shards: int = 0):
        self._name, self._directory, self._shards = name, None if directory is None else Path(directory), shards
        self.map: CountsMap | None = None
        self.path: str | None = None

    def _where(self) -> str:
        if self._directory is not None:
            return str(self._directory / FILE)
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        actor, cluster, _, _ = whoami()
        return os.path.join(folder, version_name(self._name, cluster or "0" * 16, actor or os.urandom(16).hex()))

    def open(self, version: int) -> str | None:
        """The map's path (made now if needed, the shards' words kept if it was there), or None where no shared
        folder can be written."""
        if self.path is None:
            path = self._where()
            if self._directory is not None:
                self._directory.mkdir(parents=True, exist_ok=True)
            self.map = CountsMap.open(path, self._shards, create=True)  # a restart keeps the shards' words
            if self.map is None:  # no folder to write: handles ask instead, shards are told by their writers
                return None
            self.path = path
        self.map.own = version
        return self.path

    def remove(self) -> None:
        if self.path is not None:
            self.map = None
            try:
                os.remove(self.path)
            except OSError:
                pass
            self.path = None


class Version:
    """The version (see the module): ``own`` counts this coordinator's changes, ``bump`` after every one handles
    must see; ``value`` adds the appends published in the map as of the last ``poll``."""

    def __init__(self, name: str, directory: str | os.PathLike | None = None, shards: int = 0):
        self.own = 0
        self.file = VersionFile(name, directory, shards)
        self._changes = np.zeros(shards, np.int64)  # each shard's published changes, as last polled

    @property
    def value(self) -> int:
        return self.own + int(self._changes.sum())

    def open(self) -> str | None:
        return self.file.open(self.own)

    def bump(self) -> int:
        self.own += 1
        if self.file.map is not None:
            self.file.map.own = self.own
        return self.value

    def poll(self) -> dict[int, int]:
        """The shards whose published count moved since the last poll: shard -> its write count."""
        m = self.file.map
        if m is None:
            return {}
        changes = m.changes()  # before the counts: a change seen is a count seen
        written = m.written()
        moved = np.flatnonzero(changes != self._changes)
        self._changes = changes
        return {int(i): int(written[i]) for i in moved}

    def restarted(self, value: int | None) -> None:
        """After a restart: past every version handed out before it (``value``, the last saved, or any at all
        where none was saved: ``past_any_number``), so handles give back what they drew before it."""
        self.own = max(int(value or 0) + 1, past_any_number())
        self.open()
        self.poll()
