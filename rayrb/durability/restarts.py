"""How often an actor of a buffer has restarted, kept beside its state so that it survives the restarts. No Ray.

Ray restarts a crashed actor at once, and rayrb starts its actors with unlimited
restarts, so a buffer lives as long as its job. An actor whose start itself crashes
(a damaged state file, a missing chunk) would then spin. Each start reads this log:
when a start before it never got as far as ``RestartLog.ready``, it waits before
going on, twice as long for each such start in a row (from ``FIRST_WAIT`` up to
``MAX_WAIT``), and the actor says why in its log. A restart after a life that got
going waits nothing.

The restart count is Ray's own (its actor table counts every process Ray started
for the actor after the first). A start that died before it reached this log (in its
imports, say) shows as a gap in that count, and counts as a start that crashed.

The log also names the process and the actor (its Ray actor id and cluster), so that
clean-up (``rayrb.durability.leftovers``) can ask the cluster whether the actor lives.

Examples:
    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> log = RestartLog(d)
    >>> log.started(0), log.ready()  # a first start that got going
    (0.0, None)
    >>> log = RestartLog(d); log.started(1, cause="killed")  # a crash later on: no wait
    0.0
    >>> [RestartLog(d).started(n) for n in (2, 3, 4)]  # starts that crash before they are ready
    [0.5, 1.0, 2.0]
    >>> RestartLog(d).started(7)  # two more died before they got here (a gap in Ray's count), and the last one
    16.0
    >>> log = RestartLog(d); log.started(8), log.ready(), log.stats()["restarts"]
    (30.0, None, 8)
    >>> RestartLog(d).started(None), RestartLog(tempfile.mkdtemp()).started(20)  # Ray cannot say; no record here
    (0.0, 0.0)
    >>> log = RestartLog(tempfile.mkdtemp()); log.started(None), log.restarts, log.unsure  # neither can say
    (0.0, 0, True)
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rayrb.io.files import replace_file

FIRST_WAIT = 0.5
MAX_WAIT = 30.0
FILE = "restarts.json"


class RestartLog:
    """Restart count and crash-loop backoff for one actor, in ``directory`` (None: process memory only)."""

    def __init__(self, directory: str | os.PathLike | None, actor: str | None = None, cluster: str | None = None):
        self.path = None if directory is None else Path(directory) / FILE
        self.actor, self.cluster = actor, cluster  # who keeps the directory, for clean-up
        self.restarts, self.failed_starts, self.starting, self.last_cause = 0, 0, False, None
        self.found = False  # a record of an earlier start of this actor is here: this start is a restart
        # neither Ray's actor table nor a record here could say whether this start is the first: what the actor
        # kept elsewhere (the coordinator's GCS copy, a shard's replicas) decides
        self.unsure = False
        self.lease: Any = None  # the directory's lease, kept while the actor lives (rayrb.actors.lifecycle.begin)
        if self.path is not None:
            try:
                saved = json.loads(self.path.read_text())
                self.restarts, self.failed_starts = int(saved["restarts"]), int(saved["failed_starts"])
                self.starting, self.last_cause = bool(saved["starting"]), saved.get("last_cause")
                self.found = actor is None or saved.get("actor") in (None, actor)
            except (OSError, ValueError, KeyError, TypeError):
                pass

    def started(self, ray_restarts: int | None, cause: str | None = None) -> float:
        """Record a start, Ray's ``ray_restarts``-th restart of the actor (0: its first start; None: Ray could
        not say, so the record here decides); the seconds to wait before going on."""
        self.unsure = ray_restarts is None and not self.found
        if ray_restarts is None or (ray_restarts == 0 and self.found):  # a record here: not a first start
            ray_restarts = self.restarts + 1 if self.found else 0
        ray_restarts, wait = int(ray_restarts), 0.0
        if ray_restarts == 0:
            self.restarts, self.failed_starts, self.last_cause = 0, 0, None
        else:
            # starts Ray made since the last one recorded here never got this far (none known without a record)
            unrecorded = max(0, ray_restarts - self.restarts - 1) if self.found else 0
            crashed = unrecorded + int(self.starting)  # the last recorded start crashed before it was ready
            self.restarts, self.last_cause = ray_restarts, cause or self.last_cause
            if crashed:
                self.failed_starts += crashed
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
            replace_file(self.path, json.dumps({"restarts": self.restarts, "failed_starts": self.failed_starts,
                                                "starting": self.starting, "last_cause": self.last_cause,
                                                # for rayrb.durability.leftovers
                                                "pid": os.getpid(), "actor": self.actor, "cluster": self.cluster}))
        except OSError:  # the count is for stats; a full disk must not stop the actor
            pass

    def end(self) -> None:
        """The actor is being shut down for good: stop renewing the lease (its directory is about to go)."""
        if self.lease is not None:
            self.lease.stop()

    def stats(self) -> dict[str, object]:
        return {"restarts": self.restarts, "last_restart_cause": self.last_cause}
