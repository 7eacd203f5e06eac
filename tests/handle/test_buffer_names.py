"""A buffer named as a user types it (non-ASCII letters, 250 characters) starts, serves and shuts down; its actors
carry the name as given, its metric tags and state directories the ASCII form (rayrb.core.names)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from rayrb.core.names import directory_name
from rayrb.errors import InvalidArgumentTypeError


@pytest.fixture
def dataset(tmp_path):
    from rayrb.io.chunks import write_dataset

    return write_dataset({"x": np.arange(20, dtype=np.float32).reshape(10, 2)}, tmp_path / "ds")


@pytest.mark.parametrize("name", ["puffer ü 1", "回放", "n" * 250, "team/replay 1"])
@pytest.mark.parametrize("durable", [True, False], ids=["storage_dir", "in_memory"])
def test_a_buffer_of_any_name_starts_and_serves(ray_session, make_buffer, dataset, tmp_path, name, durable):
    storage = tmp_path / "state" if durable else None
    rb = make_buffer(dataset, online_capacity=8, batch_size=4, name=name, storage_dir=storage, timeout=120)
    rb.extend({"x": np.full((3, 2), 7, np.float32)})
    batch = rb.sample()
    assert batch.batch_size == (4,) and rb.stats()  # the actors exported their metrics and live
    assert ray_session.get_actor(name) is not None and ray_session.get_actor(f"{name}/on-0") is not None
    if durable:
        (instance,) = os.listdir(storage)  # one directory, named by the ASCII form (a plain name's own)
        assert instance.startswith(directory_name(name) + "-") and len(instance.encode()) <= 255
        assert instance.isascii() and sorted(os.listdir(storage / instance)) == ["coordinator", "off-0", "on-0"]
    rb.shutdown()


def test_a_name_that_is_not_a_string_is_refused_before_any_actor(ray_session, make_buffer, dataset):
    before = {a["name"] for a in ray_session.util.list_named_actors(all_namespaces=True)}
    with pytest.raises(InvalidArgumentTypeError, match="name must be a string .* got int 7"):
        make_buffer(dataset, online_capacity=8, batch_size=4, name=7)
    assert {a["name"] for a in ray_session.util.list_named_actors(all_namespaces=True)} == before


def test_a_unicode_named_buffer_feeds_learners_over_a_gloo_group(ray_session, make_buffer, dataset):
    ray = ray_session

    @ray.remote(num_cpus=0, enable_tensor_transport=True)
    class Learner:
        def update(self, meta, *parts):
            from rayrb.actors.transport import receive

            td, _ = receive(meta, *parts)
            return td["x"].shape[0]

    learners = [Learner.remote() for _ in range(2)]
    try:  # the group is named after the buffer
        rb = make_buffer(dataset, online_capacity=8, batch_size=4, name="回放 ü", transport="gloo", timeout=120)
        rb.extend({"x": np.full((3, 2), 7, np.float32)})
        rb.connect_learners(learners)
        assert sum(rb.feed("update")) == 4
        rb.shutdown()
    finally:
        for learner in learners:
            ray.kill(learner)
