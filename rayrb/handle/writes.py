"""The handle's writes: rows into the online buffer, and priorities back to the shards that own their rows.

The handle (:class:`~rayrb.handle.client.BufferClient`) hands its writes to a ``Writer``. A write is checked
against the row spec before anything ships, then goes one of two ways, and returns once every shard holds its
piece (``docs/durability.md``):

- **the shards place it** (``rayrb.handle.direct``; ``write_path="shards"``, the default without a rate limiter
  that bounds samples per insert): appended by this process to a shard's files on its node, or sent to the
  least-written shard, which journals and stores it, in one round trip;
- **the coordinator places it** (``_placed``; ``write_path="coordinator"``, the default under such a rate
  limiter, which admits each write): placed, journalled and sent by the coordinator.

A small write travels inside the call (``INLINE_BYTES``): no object-store put. A larger one is put in the object
store once and each shard fetches its own piece.

``extend(..., wait=False)`` hands the write to this writer's sender thread and returns a ``PendingWrite`` at once:
the write's rows are checked and copied first (the caller may reuse its tensors); a write that can be appended
here with nothing of this writer's on its way to that shard is, at once; the sender keeps up to
``max_writes_in_flight`` of them on their way, sent in the caller's order (so they land in that
order), and each resolves to its indices once acknowledged, or to the error a blocking ``extend`` would raise; a
failed one is asked again under its ``write_id`` exactly as a blocking write is, so it is kept once or changed
nothing. The call blocks while that many are on their way (backpressure, never a dropped write).
"""
from __future__ import annotations

import collections
import queue
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from rayrb.actors.inline import INLINE_BYTES, cut
from rayrb.core.layout import ShardLayout
from rayrb.core.schema import strip_bookkeeping
from rayrb.core.validation import boolean, optional_str
from rayrb.errors import (
    BufferUnavailableError,
    HeldBack,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    RowsLostError,
    SchemaError,
    WriteTimeoutError,
)
from rayrb.handle.direct import DirectWrites
from rayrb.handle.rpc import node_id
from rayrb.io.arrays import as_numpy, is_tensordict, rows_digest, to_numpy_dict


class Writer:
    """A handle's ``extend`` and ``update_priority`` (see the module; their arguments are documented there)."""

    def __init__(self, rpc: Any, spec: Any, max_in_flight: int = 8, ordered_one_by_one: bool = False,
                 shards_place: bool = False, layout: ShardLayout | None = None, local: bool = True):
        self.rpc, self._spec, self.max_in_flight = rpc, spec, max_in_flight
        self.shards_place = shards_place
        # the shards place writes: appended here where a shard's files are on this node, else sent there
        self._direct = DirectWrites(rpc, spec, layout, local) if shards_place else None
        self._slots = threading.BoundedSemaphore(max_in_flight)  # writes on their way: the caller waits for one
        # Coordinator calls sent ahead of the answers: with a rate limiter that may hold a write back, one at a
        # time, so that a held write is never overtaken by the next one
        self._depth = 1 if ordered_one_by_one else max_in_flight
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: list[PendingWrite] = []  # since the last flush
        self._sender: threading.Thread | None = None
        self._lock = threading.Lock()
        self._offline_rows: int | None = None  # learned at the first rows_held

    def rows(self, data: Any, what: str) -> dict[str, np.ndarray]:
        """``data`` as flat numpy arrays, checked against the row spec (``what`` names it in errors)."""
        if isinstance(data, (list, tuple)):  # TorchRL's extend takes a list of rows (or of batches)
            return self._joined([self.rows_of(d, what) for d in data], what)
        arrays = self.rows_of(data, what)
        self._spec.validate(arrays, what=what)
        return arrays

    def rows_of(self, data: Any, what: str) -> dict[str, np.ndarray]:
        """One TensorDict or dict of arrays as flat numpy arrays (bookkeeping keys left out), unchecked."""
        if not (isinstance(data, Mapping) or is_tensordict(data)):
            raise InvalidArgumentTypeError(f"expected {what} as a TensorDict or a dict of tensors or arrays (or a "
                                           f"list of them), got {type(data).__name__}")
        return strip_bookkeeping(to_numpy_dict(data), keep=self._spec.keys)

    def _joined(self, parts: list[dict[str, np.ndarray]], what: str) -> dict[str, np.ndarray]:
        """A list's items as one write: rows (no batch dimension) stacked, batches concatenated; checked whole."""
        spec = self._spec
        if not parts:
            return {k: np.empty((0, *f.shape), f.dtype) for k, f in spec.items()}
        odd = next((i for i, p in enumerate(parts) if set(p) != set(parts[0])), None)
        if odd is not None:
            raise SchemaError(f"expected the same keys in every item of the list for {what}, got "
                              f"{sorted(parts[0])} in item 0 and {sorted(parts[odd])} in item {odd}")
        one_row = [all(k in p and p[k].shape == spec[k].shape for k in spec) for p in parts]
        if all(one_row):
            arrays = {k: np.stack([np.asarray(p[k]) for p in parts]) for k in parts[0]}
        elif any(one_row):
            raise InvalidArgumentTypeError(f"expected a list of rows or a list of batches for {what}, got both "
                                           f"(item {one_row.index(True)} is one row, item {one_row.index(False)} not)")
        else:
            for i, p in enumerate(parts):
                spec.validate(p, what=f"{what} (item {i} of the list)")
            arrays = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        spec.validate(arrays, what=what)
        return arrays

    def extend(self, data: Any, *, write_id: str | None = None, prefill: bool = False, wait: bool = True
               ) -> Written:
        """Check, ship and land the rows: their online indices once the shards hold them, or with ``wait=False``
        a ``PendingWrite`` that resolves to them (see the module)."""
        write_id, prefill = optional_str("write_id", write_id), boolean("prefill", prefill)
        wait = boolean("wait", wait)
        arrays = self.rows(data, "online data")
        n = next(iter(arrays.values())).shape[0]
        if n == 0:
            return torch.empty(0, dtype=torch.int64) if wait else PendingWrite.resolved(write_id)
        look = write_id is not None  # named by the caller: maybe a retry from another handle
        write_id = write_id if write_id is not None else uuid.uuid4().hex
        if self._direct is not None:
            self._direct.mark(write_id, arrays)  # slices: an episode's writes go to one shard
        digest = rows_digest(arrays)  # the rows the id names: a retry sends these, other rows are refused
        if all(p.done() for p in self._pending):  # nothing on its way that this must land after
            if wait:
                return _indices(self._land(_payload(arrays, copy=False), n, write_id, prefill, digest, look))
            if self._direct is not None:  # appended here at once where it can be: nothing left on its way
                try:
                    here = self._direct.here(arrays, n, write_id, digest, look)
                except Exception as e:  # flush() raises it, as a failure of a write sent
                    failed = PendingWrite.resolved(write_id, error=e)
                    with self._lock:
                        self._pending.append(failed)
                    return failed
                if here is not None:
                    return PendingWrite.resolved(write_id, _indices(here))
        pending = self._send_later((_payload(arrays, copy=True), n, write_id, prefill, digest, look))
        return pending.result() if wait else pending

    def stats(self) -> dict[str, int]:
        """This handle's writes by how they went, where the shards place them (``rayrb.handle.direct``):
        ``writes_appended_here``, ``writes_sent``, ``writes_relayed``, ``writes_told``, and ``rows_local``, the
        rows placed in shards on its node."""
        if self._direct is None:
            return {}
        return {k if k.startswith("rows") else f"writes_{k}": v for k, v in self._direct.stats.items()}

    def rows_held(self, sizes: Any) -> int:
        """Rows the buffer holds: the online ones read without a call where this process can
        (``DirectWrites.online_rows``), else ``sizes()`` asked of the coordinator (offline rows never change)."""
        online = self._direct.online_rows() if self._direct is not None and self._offline_rows is not None else None
        if online is None:
            asked = sizes()
            self._offline_rows, online = int(sum(asked["offline"])), int(sum(asked["online"]))
        return self._offline_rows + online

    def flush(self) -> None:
        """Wait for every write ``extend(..., wait=False)`` sent since the last flush; raise the first that
        failed (the others were each kept once or changed nothing)."""
        with self._lock:
            pending, self._pending = self._pending, []
        errors = [e for e in (p.exception() for p in pending) if e is not None]
        if errors:
            raise errors[0]

    def _send_later(self, write: tuple) -> PendingWrite:
        """Queue ``write`` for the sender thread, once fewer than ``max_writes_in_flight`` are on their way."""
        self._slots.acquire()  # backpressure: the caller waits here, nothing is dropped
        pending = PendingWrite(write[2], write[1])
        pending.add_done_callback(lambda _: self._slots.release())
        with self._lock:
            self._pending = [p for p in self._pending if not p.done() or p.exception() is not None] + [pending]
            if self._sender is None or not self._sender.is_alive():
                self._sender = threading.Thread(target=self._send_all, name="rayrb-writer", daemon=True)
                self._sender.start()
        self._queue.put((pending, write))
        return pending

    def _send_all(self) -> None:
        """The sender thread: coordinator calls in the caller's order, up to ``_depth`` ahead of their answers;
        each write resolved, oldest first, once its shards acknowledged it."""
        sent: collections.deque = collections.deque()
        while True:
            if not sent:
                self._submit(sent, *self._queue.get())
            while sent and len(sent) < self._depth:
                try:
                    self._submit(sent, *self._queue.get_nowait())
                except queue.Empty:
                    break
            if sent:
                self._confirm(*sent.popleft())

    def _submit(self, sent: collections.deque, pending: PendingWrite, write: tuple) -> None:
        """Send ``write`` (onto ``sent``), or append it here where its shard is on this node and no write of this
        writer is on its way to that shard (so each shard's slots stay in the caller's order): resolved at once."""
        payload, n, write_id, prefill, digest, look = write
        try:
            if self.rpc.closed:
                ref = None
            elif self._direct is not None:
                if isinstance(payload, dict):
                    busy = {shard for _, _, on_way in sent if on_way is not None for shard, _, _ in on_way.pieces}
                    here = self._direct.here(payload, n, write_id, digest, look, busy=busy)
                    if here is not None:
                        pending.set_result(_indices(here))
                        return
                ref = self._direct.send(payload, n, write_id, digest, look)
            else:
                method, args, how = _extend_call(payload, n, write_id=write_id, prefill=prefill, digest=digest)
                ref = self.rpc.tell(method, *args, **how)
        except Exception:  # asked again in _confirm, which raises what a blocking write would
            ref = None
        sent.append((pending, write, ref))

    def _confirm(self, pending: PendingWrite, write: tuple, ref: Any) -> None:
        """Resolve ``pending`` once its shards acknowledged it; anything else (held back, an actor dead, a
        refusal) asks again as a blocking write does, under the same write id: kept once, or nothing changed."""
        try:
            if ref is not None and self._direct is not None:
                pending.set_result(_indices(self._direct.receive(ref)))
                return
            out = self.rpc.get(ref) if ref is not None else None
            if out is not None and not isinstance(out, HeldBack):
                self.rpc.get(out[1])
                pending.set_result(_indices(out[0]))
                return
        except Exception:
            pass
        try:  # asked again under its id, the shards asked first where they place writes (it may have landed)
            pending.set_result(_indices(self._land(*write[:-1], look=True)))
        except BaseException as e:
            pending.set_exception(e)

    def _land(self, ref: Any, n: int, write_id: str, prefill: bool, digest: str, look: bool = False) -> Any:
        """The write's indices once the shards hold it: sent to the shards where they place writes
        (``rayrb.handle.direct``), else through the coordinator (``_placed``)."""
        if self._direct is None:
            return self._placed(ref, n, write_id, prefill, digest)
        try:
            return self._direct.land(ref, n, write_id, digest, look)
        except TimeoutError as e:  # the write may still land: name it, so that a retry lands it once
            raise WriteTimeoutError(f"{e}; the write may still be applied: retry it with write_id={write_id!r} "
                                    "to apply it once", write_id) from e
        except BufferUnavailableError as e:
            raise _named(e, write_id) from e

    def _placed(self, ref: Any, n: int, write_id: str, prefill: bool, digest: str) -> Any:
        """The coordinator's indices for the write of ``ref`` once the shards hold it, asked again under its id
        where that is safe: the coordinator died with the call, or a shard lost (with its node) the rows a piece
        was placed after."""
        accepted = False  # the coordinator took the write: from here a failure may leave some of it applied
        try:
            coordinator = _actor_id(self.rpc.coord)
            for attempt in range(MAX_ASKS):
                try:
                    method, args, how = _extend_call(ref, n, write_id=write_id, prefill=prefill, digest=digest)
                    indices, acks = self.rpc.call(method, *args, **how)
                    accepted = True
                    self.rpc.get(acks)
                    return indices
                except BufferUnavailableError as e:
                    # The coordinator died with the call (Ray's re-sends of it ran out) or holding the shards'
                    # acknowledgements: ask it again under the same write id; restarted, it answers from its
                    # journal and sends only what did not land. A piece refused for lost rows is placed anew.
                    if self.rpc.closed:
                        raise
                    accepted = True
                    again = _coordinator_died(e, coordinator) or isinstance(e, RowsLostError)
                    if not again or attempt == MAX_ASKS - 1:
                        raise _named(e, write_id) from e
                    time.sleep(min(1.0, 0.01 * 2 ** attempt))
        except TimeoutError as e:  # the write may still land: name it, so that a retry lands it once
            raise WriteTimeoutError(f"{e}; the write may still be applied: retry it with write_id={write_id!r} "
                                    "to apply it once", write_id) from e
        except Exception as e:  # the shards' own counts, so the next write goes where rows really are
            if accepted or not isinstance(e, (ValueError, TypeError, IndexError)):  # not a refusal: resync
                try:
                    self.rpc.get(self.rpc.coord.resync.remote())
                except Exception:
                    pass
            raise

    @staticmethod
    def one_row(data: Any) -> dict[str, np.ndarray]:
        """One row (no batch dimension) as a batch of one."""
        return {k: np.asarray(v)[None] for k, v in to_numpy_dict(data).items()}

    def update_priority(self, info: dict, priority: Any) -> int:
        """Send the priorities of sampled rows to the shards that own them; how many rows were sent."""
        missing = [k for k in ("offline", "shard", "index", "generation") if k not in info]
        if missing:
            raise InvalidArgumentError(f"info must come from sample(return_info=True); missing keys {missing}")
        n, acks = self.rpc.get(self.rpc.coord.update_priority.remote(
            as_numpy(info["offline"]), as_numpy(info["shard"]), as_numpy(info["index"]), as_numpy(info["generation"]),
            as_numpy(priority).reshape(-1)))
        self.rpc.get(acks)
        return int(n)


class PendingWrite(Future):
    """A write ``extend(..., wait=False)`` sent: ``result(timeout=None)`` is its indices (int64) once every shard
    holds its rows, or raises what a blocking ``extend`` would have; ``write_id`` names it for a retry."""

    def __init__(self, write_id: str | None, rows: int):
        super().__init__()
        self.write_id, self.rows = write_id, rows

    @classmethod
    def resolved(cls, write_id: str | None, indices: torch.Tensor | None = None,
                 error: BaseException | None = None) -> PendingWrite:
        """A write done already: its ``indices`` (none: an empty write), or the ``error`` it raised."""
        indices = torch.empty(0, dtype=torch.int64) if indices is None else indices
        pending = cls(write_id, len(indices))
        if error is not None:
            pending.set_exception(error)
        else:
            pending.set_result(indices)
        return pending


Written = torch.Tensor | PendingWrite  # what extend returns: the indices, or with wait=False a PendingWrite



def _payload(arrays: dict[str, np.ndarray], copy: bool) -> Any:
    """What the coordinator is sent for the rows: the arrays themselves when small (copied when the caller may
    change them before they are sent), else one object-store ref to them, which each shard reads its piece of."""
    import ray

    if sum(a.nbytes for a in arrays.values()) > INLINE_BYTES:
        return ray.put(arrays)
    return {k: np.array(v) for k, v in arrays.items()} if copy else arrays


def _extend_call(payload: Any, n: int, **how: Any) -> tuple[str, tuple, dict[str, Any]]:
    """The coordinator's ``extend`` for these rows from this node, as ``(method, args, kwargs)``: the rows in the
    call, in parts where they fit (``rayrb.actors.inline``), else as they are (the arrays, or one object-store
    ref)."""
    parts = cut(payload) if isinstance(payload, dict) else None
    if parts is None:
        return "extend", ([payload], n), {**how, "node": node_id()}
    return "extend_parts", ({"rows": n, "node": node_id(), **how}, *parts), {}


def _indices(indices: Any) -> torch.Tensor:
    return torch.from_numpy(np.array(indices))  # a writable copy


MAX_ASKS = 100  # times extend() asks again a coordinator that keeps dying before its acknowledgements are read


def _coordinator_died(e: BaseException, coordinator: str | None) -> bool:
    """Whether ``e`` says the coordinator (hex id ``coordinator``) died, during the call or holding the
    acknowledgements it owns: an actor's death that Ray pins on it or on no actor. A dead shard (its death
    named in the coordinator's answer, or in an acknowledgement) fails the write at once: asking again would not
    bring it back.

    >>> from ray.exceptions import OwnerDiedError, RayActorError
    >>> def died(cause, coordinator):
    ...     try:
    ...         raise ValueError() from cause
    ...     except ValueError as e:
    ...         return _coordinator_died(e, coordinator)
    >>> died(RayActorError(), "cd"), died(RayActorError("ab"), "cd"), died(RayActorError("cd"), "cd")
    (True, False, True)
    >>> died(OwnerDiedError.__new__(OwnerDiedError), "cd"), died(TimeoutError(), None)
    (True, False)
    """
    from ray.exceptions import OwnerDiedError, RayActorError

    cause = e.__cause__
    if isinstance(cause, OwnerDiedError):
        return True
    if not isinstance(cause, RayActorError):
        return False
    return getattr(cause, "actor_id", None) in (None, coordinator)


def _actor_id(handle: Any) -> str | None:
    """An actor handle's id as Ray's errors write it (hex), or None."""
    actor_id = getattr(handle, "_actor_id", None)
    return actor_id.hex() if actor_id is not None else None


def _named(e: BufferUnavailableError, write_id: str) -> BufferUnavailableError:
    """``e``, saying that the write may have been applied and naming it, so that a retry applies it once."""
    err = BufferUnavailableError(f"{e}; the write may have been applied: once the buffer answers again, retry it "
                                 f"with write_id={write_id!r} to apply it once")
    err.write_id = write_id
    return err
