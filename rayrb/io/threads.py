"""Thread pools kept per process: the disk readers and the read-ahead thread each use one.

A pool made in a parent does not survive ``fork`` (its threads stay behind), so each pool remembers the process
that made it and is made again in a child; a pool asked for more threads than it has is replaced by a larger one
(the old one's queued work still runs).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor


class ProcessThreads:
    """``get(n)``: this process's pool of at least ``n`` threads named ``prefix-...``.

    >>> pool = ProcessThreads("rayrb-doc")
    >>> pool.get(2) is pool.get(1)
    True
    >>> pool.get(3)._max_workers
    3
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._lock = threading.Lock()
        self._made: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, threads, pool)

    def get(self, n: int = 1) -> ThreadPoolExecutor:
        with self._lock:
            if self._made is None or self._made[0] != os.getpid() or self._made[1] < n:
                self._made = (os.getpid(), n, ThreadPoolExecutor(n, thread_name_prefix=self.prefix))
            return self._made[2]
