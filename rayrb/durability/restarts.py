"""How often an actor of a buffer has restarted, kept beside its state so that it survives the restarts. No Ray.

Ray restarts a crashed actor at once, and rayrb starts its actors with unlimited
restarts, so a buffer lives as long as its job. An actor whose start itself crashes
(a damaged state file, a missing chunk) would then spin. Each start reads this log:
when the previous start never got as far as ``RestartLog.ready``, it waits before
going on, twice as long each time (from ``FIRST_WAIT`` up to ``MAX_WAIT``), and
the actor says why in its log. A restart after a life that got going waits nothing.

Examples:
    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> log = RestartLog(d)
    >>> log.started(restarted=False), log.ready()  # a first start that got going
    (0.0, None)
    >>> log = RestartLog(d); log.started(restarted=True, cause="killed")  # a crash later on: no wait
    0.0
    >>> [RestartLog(d).started(restarted=True) for _ in range(3)]  # starts that crash before they are ready
    [0.5, 1.0, 2.0]
    >>> log = RestartLog(d); log.started(restarted=True), log.ready(), log.stats()["restarts"]
    (4.0, None, 5)
"""
from __future__ import annotations

import json
import os
from pathlib import Path

FIRST_WAIT = 0.5
MAX_WAIT = 30.0
FILE = "restarts.json"


class RestartLog:
    """Restart count and crash-loop backoff for one actor, in ``directory`` (None: process memory only)."""

    def __init__(self, directory: str | os.PathLike | None):
        self.path = None if directory is None else Path(directory) / FILE
        self.restarts, self.failed_starts, self.starting, self.last_cause = 0, 0, False, None
        if self.path is not None:
            try:
                saved = json.loads(self.path.read_text())
                self.restarts, self.failed_starts = int(saved["restarts"]), int(saved["failed_starts"])
                self.starting, self.last_cause = bool(saved["starting"]), saved.get("last_cause")
            except (OSError, ValueError, KeyError, TypeError):
                pass

    def started(self, restarted: bool, cause: str | None = None) -> float:
        """Record a start (``restarted``: Ray reconstructed the actor); the seconds to wait before going on."""
        wait = 0.0
        if not restarted:
            self.restarts, self.failed_starts, self.last_cause = 0, 0, None
        else:
            self.restarts += 1
            self.last_cause = cause or self.last_cause
            if self.starting:  # the previous start crashed before it was ready
                self.failed_starts += 1
                wait = min(MAX_WAIT, FIRST_WAIT * 2 ** (self.failed_starts - 1))
            else:
                self.failed_starts = 0
        self.starting = True
        self._save()
        return wait

    def ready(self) -> None:
        """This start got going: a crash from now on is not part of a loop of failed starts."""
        self.starting, self.failed_starts = False, 0
        self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"restarts": self.restarts, "failed_starts": self.failed_starts,
                                       "starting": self.starting, "last_cause": self.last_cause,
                                       "pid": os.getpid()}))  # for rayrb.durability.leftovers
            os.replace(tmp, self.path)
        except OSError:  # the count is for stats; a full disk must not stop the actor
            pass

    def stats(self) -> dict[str, object]:
        return {"restarts": self.restarts, "last_restart_cause": self.last_cause}
