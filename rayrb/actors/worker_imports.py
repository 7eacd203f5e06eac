"""Ray's serialization add-ons in rayrb's actor processes: registered once their libraries are imported, not all
at a worker's first deserialization.

A Ray worker builds its serialization context when it first deserializes anything (an actor's constructor
arguments), and building it imports pydantic and pyarrow to register serializers for a few of their classes
(``ray.util.serialization_addons.apply``): 0.15 CPU-s a process here, against 0.29 CPU-s for all of an actor
without arguments; most rayrb actors never use either library. A registration only puts one of the library's
classes in the pickler's global table (``CloudPickler.dispatch``), and the table is read only when an object is
pickled, which a context does in one place (``_serialize_to_pickle5``). So here each context registers, just
before it pickles, the add-ons of the libraries imported since: every object is pickled as under Ray's rule (no
object of a library's class exists before the library is imported), and a process that never imports a library
never pays for it.

``defer_serialization_addons()`` does that in a Ray worker process (a driver keeps Ray's rule), once; where Ray's
add-ons are not where this module expects them (another Ray), it leaves Ray's rule in place.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from typing import Any

# Ray 2.60's add-ons: the module each waits for, and where Ray keeps its registration (imported when it runs:
# ``pydantic_compat`` imports pydantic).
ADDONS = {
    "pydantic": ("ray._common.pydantic_compat", "register_pydantic_serializers"),
    "starlette": ("ray.util.serialization_addons", "register_starlette_serializer"),
    "pyarrow": ("ray._private.arrow_serialization", "_register_custom_datasets_serializers"),
}

_lock = threading.Lock()
_registered: set[str] = set()
_deferred = False


def register_imported(context: Any, addons: dict[str, tuple[str, str]] = ADDONS,
                      registered: set[str] = _registered) -> bool:
    """Register with ``context`` the add-ons of each library in ``addons`` imported by now and not in
    ``registered`` yet; return whether all are registered. Called before each pickling until then: a few
    ``sys.modules`` lookups, and the lock only when a library has come since the last call.

    Examples:
        >>> done = set()
        >>> register_imported("ctx", {"json": ("builtins", "print"), "no_such_module": ("builtins", "print")}, done)
        ctx
        False
        >>> register_imported("ctx", {"json": ("builtins", "print")}, done)  # once only
        True
    """
    if all(name in registered or name not in sys.modules for name in addons):
        return registered.issuperset(addons)
    with _lock:
        for name, (module, function) in addons.items():
            if name in registered:
                continue
            imported = sys.modules.get(name)
            # a module still running its own code (a first import in another thread) waits for the next pickling
            if imported is None or getattr(getattr(imported, "__spec__", None), "_initializing", False):
                continue
            getattr(importlib.import_module(module), function)(context)
            registered.add(name)
        return registered.issuperset(addons)


def installed(addons: dict[str, tuple[str, str]] = ADDONS) -> dict[str, tuple[str, str]]:
    """The add-ons whose library is installed here (found, not imported): one that is not can never be imported,
    so nothing waits for it.

    >>> sorted(installed({"json": ("m", "f"), "no_such_module": ("m", "f")}))
    ['json']
    """
    return {name: where for name, where in addons.items() if importlib.util.find_spec(name) is not None}


def ray_keeps_addons_here() -> bool:
    """Whether this Ray is the one ``ADDONS`` describes (2.60) and keeps each registration where it says (found
    without importing: ``pydantic_compat`` imports pydantic). Another Ray keeps its own rule."""
    import ray

    if not ray.__version__.startswith("2.60."):
        return False
    for module, function in ADDONS.values():
        spec = importlib.util.find_spec(module)
        source = spec.loader.get_source(module) if spec is not None and spec.loader is not None else None
        if not source or f"def {function}(serialization_context)" not in source:
            return False
    return True


def defer_serialization_addons() -> bool:
    """In a Ray worker process, make each new serialization context register Ray's add-ons as their libraries are
    imported (see the module). Returns whether this process defers them."""
    global _deferred
    with _lock:
        if _deferred:
            return True
        try:
            import ray._private.worker as worker
            import ray.util.serialization_addons as addons
        except ImportError:
            return False
        if worker.global_worker.mode != worker.WORKER_MODE or not ray_keeps_addons_here():
            return False

        waited_for = installed()

        def apply(context: Any) -> None:
            pickle5 = context._serialize_to_pickle5

            def serialize_to_pickle5(metadata: Any, value: Any) -> Any:
                if register_imported(context, waited_for):
                    context._serialize_to_pickle5 = pickle5  # all registered: Ray's method again, unwrapped
                return pickle5(metadata, value)

            context._serialize_to_pickle5 = serialize_to_pickle5

        addons.apply = apply
        _deferred = True
        return True
