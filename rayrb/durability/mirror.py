"""A copy of the coordinator's files off its node: in the Ray cluster's own key-value store (the GCS).

A coordinator whose buffer keeps replicas of its online shards writes each of its files
(``rayrb.durability.coordinator_state.CoordinatorState``: the two state slots, the journal's lines,
the plan answers) both to its node's disk and here. Restarted on another node, it finds
its directory empty and copies the files down before it reads them, so it comes back
with its stream, its write log and its answers kept, as after a restart in place.

The GCS runs on the head node, the one node whose loss ends the cluster (a head node
with GCS fault tolerance, an external Redis, keeps it: Ray's own limit). Ray Serve keeps
its controller's checkpoints there for the same reason.

>>> m = DictMirror(); m.put("d/state.0", b"x"); m.put("d/writes/000001", b"y")
>>> m.get("d/state.0"), m.get("d/none"), m.keys("d/writes/")
(b'x', None, ['d/writes/000001'])
>>> m.delete("d/", prefix=True); m.keys("d/")
[]
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rayrb.errors import InvalidStateError

NAMESPACE = "rayrb"


class Mirror:
    """Where copies of a state directory's files go: put, get, delete, list by key."""

    def put(self, key: str, value: bytes) -> None:
        raise NotImplementedError

    def get(self, key: str) -> bytes | None:
        raise NotImplementedError

    def delete(self, key: str, prefix: bool = False) -> None:
        raise NotImplementedError

    def keys(self, prefix: str) -> list[str]:
        """The keys under ``prefix``, sorted."""
        raise NotImplementedError


class DictMirror(Mirror):
    """In this process's memory (tests of the parts)."""

    def __init__(self) -> None:
        self.items: dict[str, bytes] = {}

    def put(self, key: str, value: bytes) -> None:
        self.items[key] = bytes(value)

    def get(self, key: str) -> bytes | None:
        return self.items.get(key)

    def delete(self, key: str, prefix: bool = False) -> None:
        for k in [k for k in self.items if (k.startswith(key) if prefix else k == key)]:
            del self.items[k]

    def keys(self, prefix: str) -> list[str]:
        return sorted(k for k in self.items if k.startswith(prefix))


class GcsMirror(Mirror):
    """In the Ray cluster's key-value store (``ray.experimental.internal_kv``), namespace ``rayrb``.

    A call the GCS fails raises ``OSError``, as a disk would: the coordinator then treats a copy it could not make
    as a save that failed (counted, the call's answer kept), and a journal line it could not copy as a write it
    must not send.
    """

    def __init__(self) -> None:
        from ray.experimental import internal_kv

        if not internal_kv._internal_kv_initialized():
            raise InvalidStateError("expected to run inside a Ray cluster (the GCS keeps the coordinator's copy), "
                                    "got no connection to one")
        self._kv = internal_kv

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, namespace=NAMESPACE, **kwargs)
        except Exception as e:  # gRPC or GCS errors: to the caller as the I/O failure they are
            raise OSError(f"expected the GCS to {what}, got {type(e).__name__}: {e}") from e

    def put(self, key: str, value: bytes) -> None:
        self._call(f"keep {key}", self._kv._internal_kv_put, key, bytes(value), overwrite=True)

    def get(self, key: str) -> bytes | None:
        return self._call(f"read {key}", self._kv._internal_kv_get, key)

    def delete(self, key: str, prefix: bool = False) -> None:
        self._call(f"delete {key}", self._kv._internal_kv_del, key, del_by_prefix=prefix)

    def keys(self, prefix: str) -> list[str]:
        return sorted(k.decode() for k in self._call(f"list {prefix}", self._kv._internal_kv_list, prefix))
