"""A call an actor sends itself every few seconds: work that must happen even when no caller comes, run
between the actor's other calls (a thread of its own would race them)."""
from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)


def every(seconds: float, method: str) -> threading.Thread | None:
    """Call ``method`` of the actor this runs in every ``seconds``, one call at a time; None outside an actor."""
    import ray

    try:
        me = ray.get_runtime_context().current_actor
    except RuntimeError:  # not in an actor (tests of the parts)
        return None

    def run() -> None:
        while True:
            threading.Event().wait(seconds)
            try:
                ray.get(getattr(me, method).remote())
            except Exception as e:  # the actor is going away, or the call failed: the next one tries again
                logger.debug("rayrb: %s failed: %r", method, e)

    thread = threading.Thread(target=run, name=f"rayrb-{method}", daemon=True)
    thread.start()
    return thread
