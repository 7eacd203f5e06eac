"""The handle's writes: rows into the online buffer, and priorities back to the shards that own their rows.

The handle (:class:`~rayrb.handle.client.BufferClient`) hands its writes to a ``Writer``. A write is checked against the row spec before anything
ships, put in the object store once, and placed, journalled and sent by the coordinator; it returns once every
shard holds its piece (``docs/durability.md``).
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from rayrb.core.schema import strip_bookkeeping
from rayrb.core.validation import boolean, optional_str
from rayrb.errors import (
    BufferUnavailableError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    RowsLostError,
    WriteTimeoutError,
)
from rayrb.handle.rpc import node_id
from rayrb.io.arrays import rows_digest, to_numpy_dict


def _numpy(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


class Writer:
    """A handle's ``extend`` and ``update_priority`` (see the module; their arguments are documented there)."""

    def __init__(self, rpc: Any, spec: Any):
        self.rpc, self._spec = rpc, spec

    def rows(self, data: Any, what: str) -> dict[str, np.ndarray]:
        """``data`` as flat numpy arrays, checked against the row spec (``what`` names it in errors)."""
        if isinstance(data, (list, tuple)):
            raise InvalidArgumentTypeError(
                f"expected one TensorDict or dict of arrays for {what}, got a {type(data).__name__} "
                f"of {len(data)}: concatenate them first (torch.cat)")
        if not isinstance(data, (TensorDictBase, Mapping)):
            raise InvalidArgumentTypeError(f"expected {what} as a TensorDict or a dict of tensors or arrays, got "
                                           f"{type(data).__name__}")
        arrays = strip_bookkeeping(to_numpy_dict(data), keep=self._spec.keys)
        self._spec.validate(arrays, what=what)
        return arrays

    def extend(self, data: Any, *, write_id: str | None = None, prefill: bool = False) -> torch.Tensor:
        """Check, ship and land the rows; their online indices once the shards hold them."""
        import ray

        write_id, prefill = optional_str("write_id", write_id), boolean("prefill", prefill)
        arrays = self.rows(data, "online data")
        n = next(iter(arrays.values())).shape[0]
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        write_id = write_id if write_id is not None else uuid.uuid4().hex
        digest = rows_digest(arrays)  # the rows the id names: a retry sends these, other rows are refused
        ref = ray.put(arrays)  # one object; each shard copies its own contiguous piece out of it
        return torch.from_numpy(np.array(self._land(ref, n, write_id, prefill, digest)))  # a writable copy

    def _land(self, ref: Any, n: int, write_id: str, prefill: bool, digest: str) -> Any:
        """The coordinator's indices for the write of ``ref`` once the shards hold it, asked again under its id
        where that is safe: the coordinator died with the call, or a shard lost (with its node) the rows a piece
        was placed after."""
        accepted = False  # the coordinator took the write: from here a failure may leave some of it applied
        try:
            coordinator = _actor_id(self.rpc.coord)
            for attempt in range(MAX_ASKS):
                try:
                    indices, acks = self.rpc.call("extend", [ref], n, write_id=write_id, prefill=prefill,
                                                  node=node_id(), digest=digest)
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
            _numpy(info["offline"]), _numpy(info["shard"]), _numpy(info["index"]), _numpy(info["generation"]),
            _numpy(priority).reshape(-1)))
        self.rpc.get(acks)
        return int(n)


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
