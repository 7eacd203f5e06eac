"""A lease a live actor holds on its state directory, so that other processes can tell it lives. No Ray.

A buffer's state directory may sit on storage that other nodes share, or be seen
from another PID namespace (containers, KubeRay pods), where the actor's process id
proves nothing. So each actor with a state directory keeps a file ``lease`` there:

* it touches it every ``PERIOD`` seconds from a daemon thread, for as long as its
  process lives, busy or idle. Clean-up (``rayrb.durability.leftovers``) takes a
  directory none of whose files changed for ``rayrb.durability.leftovers.QUIET``
  seconds (ten periods) as abandoned. The clocks of the machines that write and
  judge the files must agree to well within that;
* it holds an exclusive ``flock`` on it for as long as its process lives, which the
  kernel releases the moment the process dies, however it dies. A reader on the same
  node (``rayrb.handle.local``) asks ``held`` before it reads the actor's files: no
  live owner, no local read (its rows may be on their way to another node).

Examples:
    >>> import tempfile, time
    >>> d = tempfile.mkdtemp()
    >>> lease = Lease(d, period=0.05); lease.start()
    >>> first = lease.path.stat().st_mtime_ns; time.sleep(0.2)
    >>> lease.path.stat().st_mtime_ns > first, held(lease.path)  # renewed meanwhile, and held
    (True, True)
    >>> lease.stop(); held(lease.path)
    False
"""
from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

PERIOD = 60.0  # seconds between renewals
RETRY = 0.5  # seconds between tries to take the lock while another process (a dying one) still holds it
FILE = "lease"


class Lease:
    """Holds and renews ``directory/lease`` from a daemon thread once ``start`` ed (see the module)."""

    def __init__(self, directory: str | os.PathLike, period: float = PERIOD):
        self.path, self.period = Path(directory) / FILE, float(period)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        self.locked = False

    def renew(self) -> None:
        """Move the lease's time on; never makes the file or its directory (``shutdown()`` may be removing both
        for good: a lease made again inside a directory being removed would keep it from clean-up)."""
        try:
            os.utime(self.path)
        except OSError:  # a full or gone disk, a removed directory: the actor goes on
            pass

    def _lock(self) -> None:
        if self.locked or self._fd is None:
            return
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.locked = True
        except OSError:  # the process before this one is still dying: the thread tries again
            pass

    def start(self) -> None:
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            self._fd = None
        self._lock()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rayrb-lease", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        waited = 0.0
        while not self._stop.wait(self.period if self.locked else RETRY):
            self._lock()
            waited += RETRY
            if self.locked or waited >= self.period:
                self.renew()
                waited = 0.0

    def stop(self) -> None:
        """Stop renewing and let the lock go (the actor is being shut down for good)."""
        self._stop.set()
        if self._fd is not None:
            try:
                os.close(self._fd)  # releases the lock
            except OSError:
                pass
            self._fd, self.locked = None, False


def held(path: str | os.PathLike, fd: int | None = None) -> bool:
    """Whether a live process holds the lease at ``path`` (through ``fd``, an open descriptor of it, if given)."""
    own = fd is None
    try:
        if own:
            fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        if own:
            os.close(fd)
