"""The buffer's options checked once into a frozen ``BufferSettings`` (``rayrb.handle.settings``): no Ray."""
from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from rayrb.core.schedules import Constant, Linear, Schedule
from rayrb.errors import InvalidArgumentError, InvalidArgumentTypeError, RayrbError
from rayrb.handle.settings import (
    DEFAULT_MAX_BATCH_BYTES,
    DEFAULT_STORAGE,
    BufferSettings,
    checked_settings,
)


@pytest.fixture
def chunks(tmp_path):
    return tmp_path  # an existing directory: not a dataset id; nothing is read from it here


def test_defaults_are_the_buffers(chunks):
    s = checked_settings(chunks, online_capacity=10)
    assert (s.num_offline_shards, s.num_online_shards, s.online_capacity) == (1, 1, 10)
    assert s.offline_fraction == Constant(0.5) and s.batch_size is None
    assert s.samplers == {"offline": "uniform", "online": "uniform"} and s.epoch_end == "short"
    assert (s.max_restarts, s.transport, s.online_nodes, s.storage_device) == (-1, "object_store", None, "cpu")
    assert dict(s.rate_limiter)["min_size_to_sample"] == 1 and s.limited is False
    assert (s.local_reads, s.timeout, s.transform, s.prefetch, s.online_replicas) == (True, None, None, 32, 1)
    assert s.max_batch_bytes == DEFAULT_MAX_BATCH_BYTES and s.storage_dir == DEFAULT_STORAGE
    assert s.priority == {"alpha": 0.6, "beta": 0.4, "eps": 1e-8}


def test_the_owner_has_the_same_defaults():
    from rayrb.handle.owner import OfflineToOnlineReplayBuffer

    owner = inspect.signature(OfflineToOnlineReplayBuffer.__init__).parameters
    checker = inspect.signature(checked_settings).parameters
    for name, p in checker.items():
        if p.kind is p.KEYWORD_ONLY:
            assert owner[name].default == p.default, name


def test_the_settings_are_frozen(chunks):
    s = checked_settings(chunks, online_capacity=10, rate_limiter={"min_size_to_sample": 2})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.prefetch = 0
    with pytest.raises(TypeError):
        s.rate_limiter["min_size_to_sample"] = 5  # read-only
    assert dataclasses.replace(s, offline_sampler="prioritized").samplers["offline"] == "prioritized"
    assert s.offline_sampler == "uniform"


def test_each_option_is_normalized(chunks):
    s = checked_settings(chunks, online_capacity=10, offline_fraction={"kind": "linear", "start": 1.0,
                                                                       "total_steps": 4},
                         batch_size=8, num_online_shards=2, sampler="without_replacement", online_sampler="uniform",
                         drop_last=True, timeout=3, prefetch=0, storage_dir=None, local_reads=False, max_restarts=0)
    assert s.offline_fraction == Linear(1.0, 0.0, 4) and s.batch_size == 8 and s.num_online_shards == 2
    assert s.samplers == {"offline": "without_replacement", "online": "uniform"} and s.epoch_end == "drop"
    assert (s.timeout, s.prefetch, s.storage_dir, s.local_reads, s.max_restarts) == (3.0, 0, None, False, 0)
    assert isinstance(checked_settings(chunks, online_capacity=1, offline_fraction=Linear(0.5)).offline_fraction,
                      Schedule)
    assert checked_settings(str(chunks), online_capacity=1).offline_sampler == "uniform"


BAD = [  # (options, error class, message)
    ({"online_capacity": 0}, InvalidArgumentError, "online_capacity must be a positive integer, got 0"),
    ({"online_capacity": None}, InvalidArgumentError, "provide exactly one of online_capacity or online_storage"),
    ({"online_capacity": 1, "num_online_shards": 2}, InvalidArgumentError,
     "online_capacity must be at least num_online_shards (2), got 1"),
    ({"num_offline_shards": 0}, InvalidArgumentError, "num_offline_shards must be a positive integer, got 0"),
    ({"offline_fraction": 1.5}, InvalidArgumentError, "offline_fraction must be a number in [0, 1], got 1.5"),
    ({"offline_fraction": True}, InvalidArgumentError, "offline_fraction must be a number in [0, 1], got True"),
    ({"offline_fraction": "nope"}, InvalidArgumentError, "schedule kind must be one of"),
    ({"offline_fraction": [0.5]}, InvalidArgumentTypeError, "expected a fraction, a schedule kind"),
    ({"batch_size": 0}, InvalidArgumentError, "batch_size must be a positive integer, got 0"),
    ({"sampler": "random"}, InvalidArgumentError, "sampler"),
    ({"epoch_end": "later"}, InvalidArgumentError, "epoch_end must be one of"),
    ({"alpha": -1}, InvalidArgumentError, "alpha must be a finite number >= 0.0, got -1"),
    ({"eps": 0}, InvalidArgumentError, "eps must be a finite number > 0.0, got 0"),
    ({"max_restarts": -2}, InvalidArgumentError, "max_restarts must be -1 (restart without end) or a non-negative "
                                                 "integer, got -2"),
    ({"transport": "pigeon"}, InvalidArgumentError, "transport"),
    ({"storage_device": "tape"}, InvalidArgumentError, "storage_device"),
    ({"online_nodes": "node"}, InvalidArgumentTypeError, "expected online_nodes as a list of node ids"),
    ({"rate_limiter": {"min_size_to_sample": 50}}, InvalidArgumentError, "online_capacity (10)"),
    ({"local_reads": 1}, InvalidArgumentTypeError, "local_reads must be True or False, got 1"),
    ({"timeout": 0}, InvalidArgumentError, "timeout must be a finite number > 0.0, got 0"),
    ({"transform": 3}, InvalidArgumentTypeError, "transform must be callable, got int"),
    ({"max_batch_bytes": 0}, InvalidArgumentError, "max_batch_bytes must be a positive integer, got 0"),
    ({"prefetch": -1}, InvalidArgumentError, "prefetch must be a non-negative integer, got -1"),
    ({"online_replicas": 0}, InvalidArgumentError, "online_replicas must be a positive integer, got 0"),
    ({"online_replicas": 2, "storage_dir": None}, InvalidArgumentError, "expected a storage_dir with "
                                                                        "online_replicas=2"),
    # a primary that never restarts never takes its replica's rows: the replica would be kept for nothing
    ({"online_replicas": 2, "max_restarts": 0}, InvalidArgumentError,
     "expected max_restarts=-1 or at least 1 with online_replicas=2 (a replica serves only a primary that "
     "restarts and takes its rows), got max_restarts=0"),
]


@pytest.mark.parametrize("options,error,message", BAD, ids=[str(sorted(o)) for o, _, _ in BAD])
def test_bad_options_are_refused_with_their_class_and_words(chunks, options, error, message):
    options = {"online_capacity": 10, **options}
    with pytest.raises(error, match=re.escape(message)) as caught:
        checked_settings(chunks, **options)
    assert isinstance(caught.value, RayrbError)
    assert isinstance(caught.value, ValueError if error is InvalidArgumentError else TypeError)


def test_a_dataset_id_needs_a_batch_size():
    with pytest.raises(InvalidArgumentError, match="batch_size must be provided when offline_dataset is a string"):
        checked_settings("openml:not-a-directory", online_capacity=10)
    s = checked_settings("openml:not-a-directory", online_capacity=10, batch_size=4)
    assert s.offline_sampler == "without_replacement"  # TorchRL's OpenML default


def test_the_class_lists_its_fields_once():
    names = [f.name for f in dataclasses.fields(BufferSettings)]
    assert len(names) == len(set(names))
    assert set(names) - {"offline_sampler", "online_sampler", "limited", "slices"} <= set(
        inspect.signature(checked_settings).parameters) | {"online_capacity"}


def test_a_clients_own_options_are_checked_as_the_buffers():
    from rayrb.handle.settings import client_options

    assert client_options() == {}
    assert client_options(timeout=2, prefetch=0, local_reads=False) == {"timeout": 2.0, "prefetch": 0,
                                                                        "local_reads": False}
    with pytest.raises(InvalidArgumentError, match="prefetch must be a non-negative integer, got -1"):
        client_options(prefetch=-1)
    with pytest.raises(InvalidArgumentTypeError, match="local_reads must be True or False, got 'yes'"):
        client_options(local_reads="yes")
    with pytest.raises(InvalidArgumentError, match="timeout must be a finite number > 0.0, got 0"):
        client_options(timeout=0)


def test_the_name_is_any_string_and_checked_with_the_options(chunks):
    assert checked_settings(chunks, online_capacity=10, name="回放 ü").name == "回放 ü"
    assert checked_settings(chunks, online_capacity=10).name.startswith("rayrb-")  # a unique one
    with pytest.raises(InvalidArgumentTypeError, match="name must be a string .* got int 7"):
        checked_settings(chunks, online_capacity=10, name=7)


@pytest.mark.parametrize("option, value, error, match", [
    ("seed", -1, InvalidArgumentError, "seed"),
    ("seed", "7", InvalidArgumentError, "seed must be a non-negative integer"),
    ("seed", 1.5, InvalidArgumentError, "seed must be a non-negative integer"),
    ("dataset_root", 3, InvalidArgumentTypeError, "dataset_root as a path"),
    ("actor_options", ["num_cpus"], InvalidArgumentTypeError, "actor_options as a dict"),
    ("actor_options", {1: 2}, InvalidArgumentTypeError, "actor_options as a dict"),
])
def test_seed_dataset_root_and_actor_options_are_checked_with_the_rest(chunks, option, value, error, match):
    with pytest.raises(error, match=match):
        checked_settings(chunks, online_capacity=10, **{option: value})


def test_seed_dataset_root_and_actor_options_are_kept_checked_and_read_only(chunks, tmp_path):
    import numpy as np

    s = checked_settings(chunks, online_capacity=10, seed=np.int64(3), dataset_root=tmp_path / "ds",
                         actor_options={"num_cpus": 0.5})
    assert s.seed == 3 and type(s.seed) is int and s.dataset_root == str(tmp_path / "ds")
    assert dict(s.actor_options) == {"num_cpus": 0.5}
    with pytest.raises(TypeError):
        s.actor_options["num_cpus"] = 1  # frozen: the layers below take it as it is
