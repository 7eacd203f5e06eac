"""An actor's start: counted, held back when starts keep crashing (``rayrb.durability.restarts``), its state
directory leased; and what Ray's actor table says of actors, for clean-up (``rayrb.durability.leftovers``)."""
from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any

from rayrb.durability.lease import Lease
from rayrb.durability.restarts import RestartLog

logger = logging.getLogger("rayrb")


def actor_class(cls: type, **options: Any) -> Any:
    """``ray.remote(**options)(cls)``, made once per process for each class and options.

    Ray exports an actor class the first time each such object starts an actor, and its export
    disassembles the class's code: about 0.1 s of the caller's CPU per class, which a fresh
    ``ray.remote`` per buffer paid for every shard and coordinator it started.
    """
    return _actor_class(cls, tuple(sorted(options.items())))


@functools.cache
def _actor_class(cls: type, options: tuple) -> Any:
    import ray

    return ray.remote(**dict(options))(cls) if options else ray.remote(cls)


def begin(directory: str | None, what: str) -> RestartLog:
    """Record this start of actor ``what`` in ``directory``; wait first if the starts before it kept crashing,
    then keep the directory's lease while this process lives (``rayrb.durability.lease``).

    Call ``RestartLog.ready`` once the actor is up.
    """
    actor, cluster, restarts, cause = whoami()
    log = RestartLog(directory, actor=actor, cluster=cluster)
    wait = log.started(restarts, cause)
    if log.restarts and not restarts:  # Ray's table did not say; the record here did: a restart all the same
        logger.warning("rayrb: %s restarts (its record says so) though Ray's actor table did not answer", what)
    if wait:
        logger.warning("rayrb: %s crashed before it finished starting %d time(s) in a row (last cause: %s); "
                       "waiting %.1f s before starting again", what, log.failed_starts, log.last_cause, wait)
        time.sleep(wait)
    if directory is not None:
        log.lease = Lease(directory)
        log.lease.start()
    return log


def whoami() -> tuple[str | None, str | None, int | None, str | None]:
    """``(actor id, cluster id, restarts, last death cause)`` of the actor this runs in, from Ray's actor table:
    ``(None, None, 0, None)`` outside an actor (tests of the parts); restarts None where the table does not
    answer (the caller then goes by its own record: ``RestartLog.started``)."""
    try:
        import ray

        if not ray.is_initialized():
            return None, None, 0, None
        actor = ray.get_runtime_context().get_actor_id()
    except Exception:
        return None, None, 0, None
    if actor is None:
        return None, None, 0, None
    try:
        from ray._private import state

        info = state.actors(actor)  # a developer API, and the GCS may not answer (a node just failed)
        restarts = int(info["NumRestarts"])
    except Exception:
        return actor, cluster_id(), None, None
    return actor, cluster_id(), restarts, _cause(info.get("DeathCause")) if restarts else None


def cluster_id() -> str | None:
    """The id of the Ray cluster this process is connected to (hex), or None."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        return ray._private.worker.global_worker.current_cluster_and_job[0].hex()
    except Exception:
        return None


def actor_state(actor: str) -> str | None:
    """What Ray's actor table says of ``actor`` (``ALIVE``, ``RESTARTING``, ``DEAD``, ...); None if it does not
    know it, or cannot be asked."""
    try:
        from ray._private import state

        return state.actors(actor).get("State") or None
    except Exception:
        return None


def leftovers(storage_dirs: list[Any]) -> list[Path]:
    """What dead buffers left on this node (``rayrb.durability.leftovers``), judged with the view of the Ray
    cluster this process is connected to (none: by the state directories' leases alone)."""
    from rayrb.durability.leftovers import state_dirs, version_files

    cluster = cluster_id()
    state = actor_state if cluster is not None else None
    found = version_files(cluster=cluster, state=state)
    for root in storage_dirs:
        found += state_dirs(root, cluster=cluster, state=state)
    return found


def _cause(cause: Any) -> str | None:
    """Why Ray says the actor's previous process died (its actor table's death cause), in one line."""
    try:
        kind = cause.WhichOneof("context")
        if kind is None:
            return None
        message = str(getattr(getattr(cause, kind), "error_message", "") or "").strip().splitlines()
        return f"{kind}: {message[0]}" if message else kind
    except Exception:
        return None
