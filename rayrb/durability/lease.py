"""A lease a live actor renews on its state directory, so that clean-up on any node can tell it lives. No Ray.

A buffer's state directory may sit on storage that other nodes share, or be seen
from another PID namespace (containers, KubeRay pods), where the actor's process id
proves nothing. So each actor with a state directory keeps a file ``lease`` there and
touches it every ``PERIOD`` seconds from a daemon thread, for as long as its process
lives, busy or idle. Clean-up (``rayrb.durability.leftovers``) takes a directory
none of whose files changed for ``rayrb.durability.leftovers.QUIET`` seconds (ten
periods) as abandoned: its actors stopped renewing. The clocks of the machines that
write and judge the files must agree to well within that.

Examples:
    >>> import tempfile, time
    >>> d = tempfile.mkdtemp()
    >>> lease = Lease(d, period=0.05); lease.start()
    >>> first = lease.path.stat().st_mtime_ns; time.sleep(0.2)
    >>> lease.path.stat().st_mtime_ns > first  # renewed meanwhile
    True
    >>> lease.stop()
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

PERIOD = 60.0  # seconds between renewals
FILE = "lease"


class Lease:
    """Renews ``directory/lease`` every ``period`` seconds from a daemon thread once ``start`` ed."""

    def __init__(self, directory: str | os.PathLike, period: float = PERIOD):
        self.path, self.period = Path(directory) / FILE, float(period)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def renew(self) -> None:
        """Move the lease's time on; never makes the file or its directory (``shutdown()`` may be removing both
        for good: a lease made again inside a directory being removed would keep it from clean-up)."""
        try:
            os.utime(self.path)
        except OSError:  # a full or gone disk, a removed directory: the actor goes on
            pass

    def start(self) -> None:
        try:
            self.path.touch()
        except OSError:
            pass
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rayrb-lease", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.renew()

    def stop(self) -> None:
        self._stop.set()
