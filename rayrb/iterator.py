"""Iterating over batches with a bounded number of sample requests in flight."""
from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np

from rayrb.plans import Blocked, assemble, split_group
from rayrb.validation import optional_positive_int, positive_int


def _copy_batch(out: Any) -> Any:
    if isinstance(out, tuple):
        return tuple(_copy_batch(o) for o in out)
    return {k: np.array(v) for k, v in out.items()}


class BatchIterator:
    """Iterates over sampled batches with a bounded number of requests in flight.

    Batches are requested in groups of ``ceil(prefetch / 2)`` (one read task per
    shard per group), and a new group goes out as soon as it fits, so
    ``in_flight`` (batches requested and not yet handed over) never exceeds
    ``prefetch``. The stream is the one consecutive :meth:`sample` calls give.
    Once the buffer's handle is closed, no further batch is handed over.
    """

    def __init__(self, rb: Any, batch_size: int, *, prefetch: int = 2, device: Any = None,
                 return_info: bool = False, num_batches: int | None = None):
        self._rb, self._batch_size = rb, batch_size
        self.prefetch = positive_int("prefetch", prefetch)
        self._left = optional_positive_int("num_batches", num_batches)
        self._device, self._return_info = device, return_info
        self._group = max(1, -(-self.prefetch // 2))
        self._pending: deque = deque()  # (group ref, batches in it)
        self._ready: deque = deque()  # batches fetched and copied out, not handed over
        self.max_in_flight = 0

    @property
    def in_flight(self) -> int:
        return sum(k for _, k in self._pending) + len(self._ready)

    def _fill(self) -> None:
        while True:
            k = min(self._group, self.prefetch - self.in_flight)
            if self._left is not None:
                k = min(k, self._left - self.in_flight)
            if k <= 0 or (k < self._group and self._pending):
                break
            self._pending.append((self._rb._coord.sample_group.remote(self._batch_size, k), k))
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _backoff(self, waited: float, blocked: Blocked) -> float:
        timeout = self._rb._timeout
        delay = min(0.05, 0.001 + waited)
        if timeout is not None and waited + delay > timeout:
            raise TimeoutError(f"waited {timeout}s for the rate limiter: {blocked.reason}")
        time.sleep(delay)
        return waited + delay

    def __iter__(self) -> "BatchIterator":
        return self

    def __next__(self):
        if self._left is not None and self._left <= 0:
            raise StopIteration
        if self._rb._closed:
            self._pending.clear()
            self._ready.clear()
        self._fill()
        waited = 0.0
        while not self._ready:
            group = self._rb._get(self._pending[0][0])
            self._pending.popleft()
            if isinstance(group, Blocked):  # the rate limiter holds sampling back: ask again shortly
                waited = self._backoff(waited, group)
                self._fill()
                continue
            results = self._rb._get(group.refs)
            # Copy every batch out of the group's objects now, so the object store holds no more
            # than the requests in flight (a view would pin a whole group).
            for plan, parts in split_group(group, results):
                out = assemble(plan, parts, self._return_info)
                self._ready.append(_copy_batch(out) if len(parts) == 1 else out)
            del group, results  # a without-replacement group may hold fewer than k batches
        out = self._ready.popleft()
        if self._left is not None:
            self._left -= 1
        self._fill()  # request more before handing the batch over, so sampling overlaps training
        return self._rb._finish(out, self._return_info, self._device)
