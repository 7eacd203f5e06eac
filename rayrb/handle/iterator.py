"""Iterating over batches with a bounded number of sample requests in flight."""
from __future__ import annotations

import sys
import time
import uuid
import weakref
from collections import deque
from typing import Any

import numpy as np

from rayrb.core.planner import MAX_AHEAD
from rayrb.core.plans import Blocked, assemble, split_group
from rayrb.core.validation import optional_positive_int, positive_int


def fetch_group(rb: Any, group: Any) -> list:
    """The rows of a planned group. If the coordinator that submitted its reads died owning them (it is
    restarted), they are read again from here, with the same counts and seeds: the same rows."""
    from rayrb.handle.client import BufferUnavailableError

    try:
        return rb._get(group.refs)
    except BufferUnavailableError as e:
        from ray.exceptions import OwnerDiedError

        if not isinstance(e.__cause__, OwnerDiedError) or len(group.args) != len(group.reads):
            raise
    shards = _shards_by_side(rb)  # waits for the restarted coordinator
    return rb._get([shards[side][i].sample_many.remote(counts, seeds, epochs, written)
                    for (side, i), (counts, seeds, epochs, written) in zip(group.reads, group.args)])


def copy_batch(out: Any) -> Any:
    """A batch copied out of its group's object, so that handing it over does not pin the whole group."""
    if isinstance(out, tuple):
        return tuple(copy_batch(o) for o in out)
    return {k: np.array(v) for k, v in out.items()}


DIRECT_TRANSPORT: str | None = "cuda_ipc"  # GPU shards to the GPU actor that iterates (None: object store)


class BatchIterator:
    """Iterates over sampled batches with a bounded number of requests in flight.

    Batches are requested in groups of ``ceil(prefetch / 2)`` (one read task per
    shard per group), and a new group goes out as soon as it fits, so
    ``in_flight`` (batches requested and not yet handed over) never exceeds
    ``prefetch``, nor 256, the most the coordinator can give back. The stream is
    the one consecutive :meth:`sample` calls give.
    Once the buffer's handle is closed, no further batch is handed over.

    Closing the iterator (:meth:`close`, leaving a ``with`` block, or dropping the
    last reference, as ``break`` out of a ``for`` loop does) gives back the batches
    it drew and did not hand over, as a handle's plain ``sample()`` loop does: the
    stream goes on as if they had never been drawn, so an abandoned iterator skips
    no row of an epoch without replacement. If another caller drew in between, the
    draws stand and the batches are dropped (their rows are missed by that epoch).
    The batches handed over are reported to
    the coordinator with each request for more (no call of their own), and before a
    ``state_dict`` or ``dumps`` from this process, so such a save leaves out exactly
    the batches drawn ahead; one from another process may also leave out those
    handed over since the last request (at most a group), which a restore serves
    again. (The GPU path, which plans groups for its own reads, gives nothing back.)
    """

    def __init__(self, rb: Any, batch_size: int, *, prefetch: int = 2, device: Any = None,
                 return_info: bool = False, num_batches: int | None = None):
        self._rb, self._batch_size = rb, batch_size
        self.prefetch = positive_int("prefetch", prefetch)
        self._left = optional_positive_int("num_batches", num_batches)
        self._device, self._return_info = device, return_info
        self._direct = _direct_reads(rb, device)  # shard handles, when reads go GPU to GPU from here
        # No deeper than the coordinator can give back on close: past that, rows drawn ahead would be lost.
        self._depth = self.prefetch if self._direct is not None else min(self.prefetch, MAX_AHEAD)
        self._group = max(1, -(-self._depth // 2))
        self._pending: deque = deque()  # (group ref, batches in it)
        self._ready: deque = deque()  # (batch fetched and copied out, its draw's number), not handed over
        self._id = uuid.uuid4().hex  # names this iterator's draws at the coordinator
        self._served = self._reported = -1  # numbers of the last draw handed over, and told to the coordinator
        self._closed = False
        self.max_in_flight = 0
        _LIVE.add(self)

    @property
    def in_flight(self) -> int:
        return sum(k for _, k in self._pending) + len(self._ready)

    def _fill(self) -> None:
        while True:
            k = min(self._group, self._depth - self.in_flight)
            if self._left is not None:
                k = min(k, self._left - self.in_flight)
            if k <= 0 or (k < self._group and self._pending):
                break
            if self._direct is None:
                served, self._reported = self._unreported(), max(self._served, self._reported)
                self._pending.append((self._rb._coord.sample_group.remote(self._batch_size, k, ahead=self._id,
                                                                          served=served, call=uuid.uuid4().hex), k))
            else:
                self._pending.append((self._submit_direct(k), k))
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def __iter__(self) -> "BatchIterator":
        return self

    def __enter__(self) -> "BatchIterator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and not sys.is_finalizing():
            try:
                self.close()
            except Exception:  # the buffer or Ray may be gone already: nothing to give back to
                pass

    def close(self) -> None:
        """Give back what was drawn and not handed over; the iterator then stops."""
        if self._closed:
            return
        self._closed = True
        outstanding = sum(k for _, k in self._pending) + len(self._ready)
        self._pending.clear()
        self._ready.clear()
        if self._direct is not None:
            return
        self.report()  # even with nothing outstanding: once dropped, a later save cannot ask this iterator
        if outstanding and not self._rb._closed:
            # Queued after this iterator's draws at the coordinator, which runs one caller's calls in order,
            # so nothing needs to be waited for.
            self._rb._coord.undo.remote(self._id, None)

    def _unreported(self) -> int | None:
        return self._served if self._served > self._reported else None

    def report(self) -> None:
        """Tell the coordinator which of this iterator's draws were handed over (fire and forget)."""
        served = self._unreported()
        if served is not None and not self._rb._closed:
            self._reported = served
            self._rb._coord.seen.remote(self._id, served)

    def __next__(self):
        if self._closed or (self._left is not None and self._left <= 0):
            raise StopIteration
        if self._rb._closed:
            self._pending.clear()
            self._ready.clear()
        self._fill()
        waited = 0.0
        while not self._ready:
            head = self._pending[0][0]
            group = head.value if isinstance(head, _Ready) else self._rb._get(head)
            self._pending.popleft()
            if isinstance(group, Blocked):  # the rate limiter holds sampling back: ask again shortly
                waited = self._rb._backoff(waited, group)
                self._fill()
                continue
            results = fetch_group(self._rb, group) if self._direct is None else self._fetch_direct(group)
            if self._direct is not None:
                from rayrb.actors.transport import receive, split_flat

                for plan, parts in split_group(group, [split_flat(r) for r in results]):
                    out = receive(plan, *parts)
                    self._ready.append((out if self._return_info else out[0], -1))
                continue
            # Copy every batch out of the group's objects now, so the object store holds no more
            # than the requests in flight (a view would pin a whole group).
            for j, (plan, parts) in enumerate(split_group(group, results)):
                out = assemble(plan, parts, self._return_info)
                self._ready.append((copy_batch(out) if len(parts) == 1 else out,
                                    group.first + j if group.first >= 0 else -1))
            del group, results  # a without-replacement group may hold fewer than k batches
        out, number = self._ready.popleft()
        self._served = max(self._served, number)
        if self._left is not None:
            self._left -= 1
        self._fill()  # request more before handing the batch over, so sampling overlaps training
        if self._direct is not None:  # already a TensorDict on this actor's GPU
            return self._rb._transformed(out, self._return_info)
        return self._rb._finish(out, self._return_info, self._device)

    def _submit_direct(self, k: int) -> Any:
        """Plan a group at the coordinator, then read it from the GPU shards here, over CUDA IPC.

        This actor owns the reads' refs, as Ray's one-sided CUDA IPC transport needs.
        """
        group = self._rb._get(self._rb._coord.sample_group.remote(self._batch_size, k, submit=False,
                                                                   call=uuid.uuid4().hex))
        if isinstance(group, Blocked):
            return _Ready(group)
        group.refs = [self._read_direct(side, i, args) for (side, i), args in zip(group.reads, group.args)]
        return _Ready(group)

    def _read_direct(self, side: str, i: int, args: tuple) -> Any:
        counts, seeds, epochs, written = args
        method = self._direct[side][i].sample_many_tensors
        if DIRECT_TRANSPORT is not None:
            method = method.options(tensor_transport=DIRECT_TRANSPORT)
        return method.remote(counts, seeds, epochs, written=written)

    def _fetch_direct(self, group: Any) -> list:
        """The group's reads, asking again those that reached an online shard before its planned writes."""
        results, waited = self._rb._get(group.refs), 0.0
        while True:
            behind = [j for j, r in enumerate(results) if "behind" in r]
            if not behind:
                return results
            timeout = self._rb._timeout
            if timeout is not None and waited > timeout:
                raise TimeoutError(f"online shards {[group.reads[j] for j in behind]} did not apply the writes "
                                   f"this group was planned with within timeout={timeout}s")
            time.sleep(0.001)
            waited += 0.001
            again = [self._read_direct(*group.reads[j], group.args[j]) for j in behind]
            for j, r in zip(behind, self._rb._get(again)):
                results[j] = r


_LIVE: "weakref.WeakSet[BatchIterator]" = weakref.WeakSet()


def report_served(rb: Any) -> None:
    """Report what this process's iterators over ``rb``'s buffer have handed over, before a save counts it."""
    for it in list(_LIVE):
        if it._rb._name == rb._name:
            it.report()


class _Ready:
    """A group already planned (or refused) here, in the pending queue beside ObjectRefs."""

    def __init__(self, value: Any):
        self.value = value


def _direct_reads(rb: Any, device: Any) -> dict[str, list] | None:
    """The shard handles by side, when batches can go from GPU shards to this process's GPU over CUDA IPC:
    ``device`` is CUDA, the shards hold their rows on a GPU, and Ray gave this actor that GPU. Else None."""
    if device is None or getattr(rb, "_storage_device", "cpu") == "cpu":
        return None
    import torch

    if torch.device(device).type != "cuda":
        return None
    import ray

    from rayrb.actors.transport import Place, choose

    try:
        mine = Place("consumer", ray.get_runtime_context().get_node_id(), tuple(str(g) for g in ray.get_gpu_ids()))
    except Exception:
        return None
    shard_places = rb._get([s.place.remote() for s in rb._shards])
    if not all(choose(Place(str(i), p["node"], tuple(p["gpus"])), mine) == "cuda_ipc"
               for i, p in enumerate(shard_places)):
        return None
    return _shards_by_side(rb)


def _shards_by_side(rb: Any) -> dict[str, list]:
    """A handle's shard actors by side (its list holds the offline shards first)."""
    m = len(rb.sizes()["offline"])
    return {"offline": rb._shards[:m], "online": rb._shards[m:]}
