"""rayrb's actor processes register Ray's serialization add-ons as their libraries are imported: a shard or the
coordinator never imports pydantic or pyarrow for them, and once a process imports one, its objects are pickled
as under Ray's own rule."""
from __future__ import annotations

import inspect
import re
import sys

import pytest
from restart_util import rows

from rayrb.actors.worker_imports import ADDONS, defer_serialization_addons, ray_keeps_addons_here, register_imported


def test_the_add_ons_deferred_are_every_one_this_ray_registers():
    """An upgrade that adds, moves or renames an add-on fails here, not in a user's actor."""
    import ray.util.serialization_addons as addons

    assert ray_keeps_addons_here()
    # Ray's own ``apply`` (the module's attribute is replaced only in a worker process, never in this one)
    called = set(re.findall(r"(\w+)\(serialization_context\)", inspect.getsource(addons.apply))) - {"apply"}
    assert called == {function for _, function in ADDONS.values()}


def test_another_ray_or_a_moved_registration_keeps_rays_rule(monkeypatch):
    import ray

    from rayrb.actors import worker_imports

    monkeypatch.setattr(ray, "__version__", "2.61.0")
    assert not ray_keeps_addons_here()
    monkeypatch.setattr(ray, "__version__", "2.60.0")
    assert ray_keeps_addons_here()
    moved = {**ADDONS, "pyarrow": ("ray._private.arrow_serialization", "register_arrow_serializers")}
    monkeypatch.setattr(worker_imports, "ADDONS", moved)
    assert not ray_keeps_addons_here()
    monkeypatch.setattr(worker_imports, "ADDONS", {**ADDONS, "pydantic": ("ray._common.no_such_module", "f")})
    assert not ray_keeps_addons_here()


def test_a_driver_keeps_rays_rule():
    import ray.util.serialization_addons as addons

    assert defer_serialization_addons() is False
    assert addons.apply.__module__ == "ray.util.serialization_addons"


def test_each_library_registers_once_it_is_imported_and_then_never_again():
    calls = []
    done: set[str] = set()
    fake_register = {"json": (__name__, "record"), "a_module_not_imported": (__name__, "record")}
    record.calls = calls
    assert register_imported("ctx", fake_register, done) is False and calls == ["ctx"]
    sys.modules["a_module_not_imported"] = sys.modules["json"]  # as if imported since
    try:
        assert register_imported("ctx2", fake_register, done) is True and calls == ["ctx", "ctx2"]
        assert register_imported("ctx3", fake_register, done) is True and calls == ["ctx", "ctx2"]
    finally:
        del sys.modules["a_module_not_imported"]
    assert set(fake_register) == done


def record(context):
    record.calls.append(context)


def in_process(actor, fn):
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: fn()))


@pytest.mark.usefixtures("ray_session")
def test_a_shards_process_imports_neither_library_and_pickles_as_ray_once_it_does(make_buffer):
    # defined here, not at the module's top level, so that they are sent by value: an actor's process importing
    # this module would import what it imports
    def imported_libraries():
        import sys

        return sorted(name for name in ("pydantic", "pyarrow") if name in sys.modules)

    def deferred():
        from rayrb.actors import worker_imports

        return worker_imports._deferred

    def serialized_slice_bytes():
        """A 10-row slice of a 1 M-row Arrow table as this process's Ray serializes it: Ray's reducer sends the
        slice (hundreds of bytes); pyarrow's own pickling sends the whole 8 MB buffer."""
        import pyarrow as pa
        import ray

        table = pa.table({"x": pa.array(range(1_000_000), pa.int64())})
        context = ray._private.worker.global_worker.get_serialization_context()
        return context.serialize(table.slice(0, 10)).total_bytes

    def pydantic_model_field_registered():
        import ray
        from pydantic.v1.fields import ModelField
        from ray import cloudpickle
        from ray._private.serialization import SerializationContext

        serialized = serialized_slice_bytes()  # a pickling: registers what was imported since the last one
        context = ray._private.worker.global_worker.get_serialization_context()
        # every installed library registered (starlette is not installed here): Ray's own method again
        unwrapped = getattr(context._serialize_to_pickle5, "__func__", None) is SerializationContext._serialize_to_pickle5
        return serialized, ModelField in cloudpickle.CloudPickler.dispatch, unwrapped

    rb = make_buffer(rows(0, 50), online_capacity=100, num_offline_shards=1, seed=0, batch_size=8)
    rb.extend(rows(1000, 20))
    rb.sample()
    coordinator, offline, online = rb.rpc.coord, rb.rpc.by_side["offline"][0], rb.rpc.by_side["online"][0]
    for actor in (coordinator, offline, online):
        assert in_process(actor, imported_libraries) == []
        assert in_process(actor, deferred) is True
    assert in_process(online, serialized_slice_bytes) < 10_000  # Ray's reducer, registered at the first pickling
    size, registered, unwrapped = in_process(offline, pydantic_model_field_registered)
    assert size < 10_000 and registered and unwrapped
    assert in_process(coordinator, imported_libraries) == []
    rb.extend(rows(2000, 20))  # the shards still take writes and serve reads
    assert len(rb.sample()["id"]) == 8
