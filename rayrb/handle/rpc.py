"""The one narrow way a handle reaches its buffer's actors: calls, waits, backoff and shard reads.

Every remote call of a handle goes through ``Rpc``, which bounds each wait by
``timeout`` and turns Ray's failures into ``TimeoutError``,
``BufferUnavailableError`` or the actor's own ``ValueError``. The
handle's other modules (the stream, views, checkpoints) use this interface, never
the handle's private attributes.

Reads go from here to the shards: a plan from the coordinator names, per shard, one
read for a whole group of batches, with the online write count it was planned at.
A read that reaches an online shard before those writes have landed there draws
nothing (the shard answers None) and is sent again, within the same ``timeout``.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rayrb.core.layout import shard_id  # noqa: F401  (its home before the layout had a module)
from rayrb.core.plans import OFFLINE, ONLINE
from rayrb.errors import BufferUnavailableError, CallTimeoutError, HeldBack, HeldBackTimeout, RowsLostError

DIRECT_TRANSPORT: str | None = "cuda_ipc"  # GPU shards to a GPU actor reading directly (None: object store)


class Rpc:
    """A handle's connection to the coordinator and shards of buffer ``name``."""

    def __init__(self, coord: Any, shards: Sequence[Any], num_offline: int, *, name: str, timeout: float | None):
        self.coord, self.name, self.timeout = coord, name, timeout
        self.shards = list(shards)  # offline first
        self.by_side = {OFFLINE: self.shards[:num_offline], ONLINE: self.shards[num_offline:]}
        self.closed = False
        self._version_map: Any = None  # the coordinator's counts map, when on this node (False: not)
        self.told: Any = None  # this handle's latest tell of a write its shard placed (rayrb.handle.direct)

    def get(self, refs: Any, timeout: float | None | str = "call") -> Any:
        """``ray.get`` within ``timeout``, Ray's failures turned into this package's errors."""
        import ray
        from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayTaskError

        if self.closed:
            raise BufferUnavailableError(f"buffer {self.name!r} was shut down")
        timeout = self.timeout if timeout == "call" else timeout
        try:
            return ray.get(refs, timeout=timeout)
        except GetTimeoutError as e:
            raise CallTimeoutError(f"buffer {self.name!r}: no answer within timeout={timeout}s") from e
        except (RayActorError, ObjectLostError) as e:
            raise BufferUnavailableError(
                f"buffer {self.name!r}: an actor of this buffer is dead (killed, shut down, or its node failed)"
            ) from e
        except RayTaskError as e:
            if isinstance(e.cause, (ValueError, TypeError, IndexError, PermissionError, RowsLostError)):
                raise e.cause from None
            raise

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The coordinator's ``method(*args, **kwargs)``, asked again while the rate limiter holds it back.

        The wait is bounded by ``timeout``; past it ``HeldBackTimeout``
        is raised and nothing was drawn or written. The call that goes through reports
        how long it waited.
        """
        since, waited = time.monotonic(), 0.0
        while True:
            extra = {"waited": waited} if waited else {}
            out = self.get(getattr(self.coord, method).remote(*args, **kwargs, **extra))
            if not isinstance(out, HeldBack):
                return out
            waited = self.backoff(since, out)

    def backoff(self, since: float, held: HeldBack) -> float:
        """Sleep before asking again a call the rate limiter held back, first asked at ``since``
        (``time.monotonic()``); once ``timeout`` has passed since then, raise. Returns the seconds since.

        Wall time, not the sum of the sleeps: on a loaded machine each round trip adds to the wait, and
        both the timeout and the blocked time the call reports are about how long the caller waited.
        """
        waited = time.monotonic() - since
        if self.timeout is not None and waited >= self.timeout:
            self.tell("gave_up", held.call, waited)  # counted in stats(), not waited on: the caller is told now
            raise HeldBackTimeout(f"buffer {self.name!r}: waited {self.timeout}s for the rate limiter: {held.reason}")
        delay = min(0.05, 0.001 + waited)
        if self.timeout is not None:
            delay = min(delay, self.timeout - waited)
        time.sleep(delay)
        return time.monotonic() - since

    def tell(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Send the coordinator ``method(*args, **kwargs)`` without waiting; its ref (None once closed)."""
        if self.closed:
            return None
        return getattr(self.coord, method).remote(*args, **kwargs)

    # reads ------------------------------------------------------------------------
    def read(self, side: str, i: int, args: tuple, direct: dict[str, list] | None = None,
             route: str | None = None, device: str | None = None) -> Any:
        """Shard ``i`` of ``side``'s read ``args = (counts, seeds, epochs, written)``, the one place shard reads are
        submitted: numpy rows through the object store; with ``direct`` (the shards by side, on this actor's GPU)
        CUDA tensors over Ray Direct Transport; with ``route`` (a learner's: ``"gloo"``, ``"nccl"``, ...) tensors
        that way, moved to ``device``."""
        counts, seeds, epochs, written = args
        if route is not None and route != "object_store":
            method = self.by_side[side][i].sample_many_tensors.options(tensor_transport=route)
            return method.remote(counts, seeds, epochs, device=device, written=written)
        if direct is None:
            return self.by_side[side][i].sample_many.remote(counts, seeds, epochs, written)
        method = direct[side][i].sample_many_tensors
        if DIRECT_TRANSPORT is not None:
            method = method.options(tensor_transport=DIRECT_TRANSPORT)
        return method.remote(counts, seeds, epochs, written=written)

    def fetch_read(self, read: tuple, ref: Any, direct: dict[str, list] | None = None) -> Any:
        """The result of ``read = (side, i, args)`` submitted as ``ref``, sending it again while it reaches its
        online shard before the writes it was planned over have landed there; bounded by ``timeout``."""
        t0 = time.monotonic()
        result = self.get(ref)
        late = CallTimeoutError(f"buffer {self.name!r}: online shard {read[:2]} did not apply the writes this read "
                                f"was planned with within timeout={self.timeout}s")
        while result is None or (direct is not None and "behind" in result):
            if self.timeout is not None and time.monotonic() - t0 > self.timeout:
                raise late
            time.sleep(0.001)
            left = None if self.timeout is None else max(0.0, self.timeout - (time.monotonic() - t0))
            try:
                result = self.get(self.read(*read, direct=direct), timeout=left)
            except CallTimeoutError:  # named by the configured timeout, not by what was left of it
                raise late from None
        return result

    def node_of(self, actor: int | str) -> str:
        """The node of shard ``actor`` (its index) or of the actor of that name."""
        import ray

        target = self.shards[actor] if isinstance(actor, int) else ray.get_actor(actor)
        return self.get(target.place.remote())["node"]

    def answered_at(self, version: int) -> None:
        """An answer of the coordinator's carried ``version``. The map is written before any answer leaves, so a
        map behind it is no longer the coordinator's (restarted on another node): look it up again."""
        if self._version_map is not None and self._version_map is not False and self._version_map.version() < version:
            self._version_map = None

    def told_version(self) -> Any:
        """The coordinator's version once it took this handle's latest write (a callable, waited for only when
        called), or None when none was told since the last ask: a draw planned before is given back."""
        told, self.told = self.told, None
        if told is None:
            return None

        def version() -> int:
            try:
                return int(self.get(told)[0])
            except Exception:  # the coordinator died with it: its restart goes past every version a draw has
                return 0

        return version

    def counts_map(self) -> Any:
        """The coordinator's counts map (``rayrb.durability.published``), when it runs on this node (else None)."""
        if self._version_map is None:
            import ray

            from rayrb.durability.published import CountsMap

            self._version_map = False
            try:
                node, path = self.get(self.coord.version_file.remote())
                if path is not None and node == ray.get_runtime_context().get_node_id():
                    self._version_map = CountsMap.open(path) or False
            except (OSError, ValueError):
                pass
        return self._version_map or None

    def version(self) -> int | None:
        """The coordinator's version read from its counts map, when it runs on this node (else None)."""
        counts = self.counts_map()
        return None if counts is None else counts.version()


def node_id() -> str | None:
    """This process's node: writes prefer its online shards, reads gather its shards' rows here (None where Ray
    does not say)."""
    import ray

    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:
        return None
