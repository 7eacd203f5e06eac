"""An actor's start: counted, and held back when starts keep crashing (``rayrb.durability.restarts``)."""
from __future__ import annotations

import functools
import logging
import time
from typing import Any

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
    """Record this start of actor ``what`` in ``directory``; wait first if the starts before it kept crashing.

    Call ``RestartLog.ready`` once the actor is up.
    """
    log = RestartLog(directory)
    restarted = reconstructed()
    wait = log.started(restarted, last_death_cause() if restarted else None)
    if wait:
        logger.warning("rayrb: %s crashed before it finished starting %d time(s) in a row (last cause: %s); "
                       "waiting %.1f s before starting again", what, log.failed_starts, log.last_cause, wait)
        time.sleep(wait)
    return log


def reconstructed() -> bool:
    """Whether Ray restarted the actor this runs in (False outside an actor, as in tests of the parts)."""
    try:
        import ray

        if not ray.is_initialized():
            return False
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except (AssertionError, AttributeError, ImportError):
        return False


def last_death_cause() -> str | None:
    """Why Ray says this actor's previous process died, where it says (its actor table), in one line."""
    try:
        import ray
        from ray._private import state

        cause: Any = state.actors(ray.get_runtime_context().get_actor_id()).get("DeathCause")
        kind = cause.WhichOneof("context")
        if kind is None:
            return None
        message = str(getattr(getattr(cause, kind), "error_message", "") or "").strip().splitlines()
        return f"{kind}: {message[0]}" if message else kind
    except Exception:  # a developer API: the count does not depend on it
        return None
