"""rayrb's Ray actors: the coordinator, the shards and what they share. Imported in each actor's process before
the actor's arguments are deserialized, so that the process defers Ray's serialization add-ons
(``rayrb.actors.worker_imports``)."""
import sys

if "ray" in sys.modules:  # a Ray worker has imported Ray by now; a process without Ray (tests/core) imports none
    from rayrb.actors.worker_imports import defer_serialization_addons

    defer_serialization_addons()
