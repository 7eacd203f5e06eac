"""Dataset ids: rayrb's registry, factory strings, and TorchRL's prefixes routed to TorchRL's loaders."""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, RandomSampler, ReplayBuffer, SamplerWithoutReplacement

from rayrb import OfflineToOnlineReplayBuffer, load_dataset, prefill_replay_buffer, register_dataset
from rayrb.io.chunks import ChunkDataset
from rayrb.io.datasets import registry


@pytest.fixture
def prefix():
    """A scratch prefix, removed afterwards."""
    name = "scratch_source"
    yield name
    registry._REGISTRY.pop(name, None)


@pytest.fixture(autouse=True)
def rayrb_home(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYRB_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _torchrl_dataset(n: int = 64, sampler=None) -> ReplayBuffer:
    rb = ReplayBuffer(storage=LazyTensorStorage(n), sampler=sampler or RandomSampler())
    rb.extend(TensorDict({"observation": torch.arange(n * 3, dtype=torch.float32).reshape(n, 3),
                          "action": torch.arange(n)}, [n]))
    return rb


def _fake_module(monkeypatch, name: str, **attrs) -> None:
    module = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(module, k, v)
    monkeypatch.setitem(sys.modules, name, module)


def test_torchrl_prefixes_are_registered_as_torchrl_does():
    assert set(registry.registered_prefixes()) >= {"openml", "d4rl", "minari", "atari", "atari_dqn", "gen_dgrl",
                                                   "lerobot", "openx", "roboset", "vd4rl"}
    assert registry._DATASET_REGISTRY is registry._REGISTRY
    assert registry._REGISTRY["d4rl"] == "torchrl.data.datasets.d4rl:D4RLExperienceReplay"


def test_a_factory_string_is_imported_when_the_prefix_is_used(prefix, monkeypatch):
    register_dataset(prefix, "rayrb_scratch_loaders:make")  # the module does not exist yet: nothing is imported
    calls = []
    _fake_module(monkeypatch, "rayrb_scratch_loaders", make=lambda name, **kw: calls.append((name, kw)) or "made")
    assert load_dataset(f"{prefix}:thing", batch_size=3, split_trajs=True) == "made"
    assert calls == [("thing", {"batch_size": 3, "split_trajs": True})]


@pytest.mark.parametrize("bad", ["no_colon", ":attr", "module:", ""])
def test_a_malformed_factory_string_is_refused(prefix, bad):
    with pytest.raises(ValueError, match="module:attribute"):
        register_dataset(prefix, bad)
    assert prefix not in registry.registered_prefixes()


def test_a_loader_that_cannot_be_imported_names_its_prefix(prefix):
    register_dataset(prefix, "rayrb_no_such_module_anywhere:Loader")
    with pytest.raises(ImportError, match=f"{prefix}.*rayrb_no_such_module_anywhere:Loader"):
        load_dataset(f"{prefix}:x", batch_size=4)


def test_load_dataset_returns_what_the_factory_returns_and_as_chunk_dataset_copies_it(prefix, tmp_path):
    source = _torchrl_dataset(10)
    register_dataset(prefix, lambda name, **kw: source)
    assert load_dataset(f"{prefix}:x") is source
    ds, owned = registry.as_chunk_dataset(f"{prefix}:x")
    try:
        assert isinstance(ds, ChunkDataset) and owned and len(ds) == 10
        np.testing.assert_array_equal(ds.gather(np.arange(10))["action"], np.arange(10))
    finally:
        import shutil

        shutil.rmtree(ds.root.parent)


@pytest.mark.usefixtures("ray_session")
class TestThroughTheBuffer:
    def test_a_d4rl_id_is_loaded_by_torchrl_with_the_buffers_batch_size(self, monkeypatch, make_buffer):
        import torchrl.data.datasets.d4rl as d4rl_mod

        source, seen = _torchrl_dataset(64, SamplerWithoutReplacement()), []
        monkeypatch.setattr(d4rl_mod, "D4RLExperienceReplay", lambda name, **kw: seen.append((name, kw)) or source)
        rb = make_buffer("d4rl:halfcheetah-medium-v2", online_capacity=32, batch_size=16, seed=0)
        assert seen == [("halfcheetah-medium-v2", {"batch_size": 16})]
        assert len(rb) == 64
        # the dataset's own sampler is the offline default, as for a TorchRL buffer passed in: one epoch, each row once
        actions = torch.cat([rb.sample()["action"] for _ in range(4)])
        assert sorted(actions.tolist()) == list(range(64))

    def test_dataset_kwargs_reach_the_torchrl_loader(self, monkeypatch, make_buffer):
        import torchrl.data.datasets.minari_data as minari_mod

        seen = []
        monkeypatch.setattr(minari_mod, "MinariExperienceReplay",
                            lambda name, **kw: seen.append((name, kw)) or _torchrl_dataset(8))
        rb = make_buffer("minari:mujoco/hopper/expert-v0", online_capacity=8, batch_size=4, download=False)
        assert seen == [("mujoco/hopper/expert-v0", {"batch_size": 4, "download": False})]
        assert rb.sample().batch_size == torch.Size([4])

    def test_the_rows_copied_from_a_loader_are_removed_at_shutdown(self, prefix, rayrb_home):
        register_dataset(prefix, lambda name, **kw: _torchrl_dataset(16))
        rb = OfflineToOnlineReplayBuffer(f"{prefix}:x", online_capacity=8, batch_size=4, storage_dir=None)
        try:
            assert any((rayrb_home / "tmp").iterdir())
        finally:
            rb.shutdown()
        assert not any((rayrb_home / "tmp").iterdir())

    def test_a_loader_that_fails_leaves_nothing(self, prefix, rayrb_home):
        import ray

        def broken(name, **kw):
            raise RuntimeError("the download failed")

        register_dataset(prefix, broken)
        before = len(ray.util.list_named_actors(all_namespaces=True))
        with pytest.raises(RuntimeError, match="the download failed"):
            OfflineToOnlineReplayBuffer(f"{prefix}:x", online_capacity=8, batch_size=4)
        assert len(ray.util.list_named_actors(all_namespaces=True)) == before
        assert not (rayrb_home / "tmp").exists() or not any((rayrb_home / "tmp").iterdir())

    def test_an_empty_torchrl_dataset_is_refused_and_leaves_nothing(self, prefix, rayrb_home):
        register_dataset(prefix, lambda name, **kw: ReplayBuffer(storage=LazyTensorStorage(4)))
        with pytest.raises(ValueError, match="non-empty offline dataset"):
            OfflineToOnlineReplayBuffer(f"{prefix}:x", online_capacity=8, batch_size=4)
        assert not (rayrb_home / "tmp").exists() or not any((rayrb_home / "tmp").iterdir())

    def test_prefill_builds_a_torchrl_id_with_chunk_size_as_its_batch_size(self, prefix):
        seen = []
        register_dataset(prefix, lambda name, **kw: seen.append(kw) or _torchrl_dataset(30))
        target = ReplayBuffer(storage=LazyTensorStorage(100))
        prefill_replay_buffer(target, f"{prefix}:x", n_samples=12, chunk_size=5, seed=0)
        assert seen == [{"batch_size": 5}] and len(target) == 12
        assert len(set(target[:]["action"].tolist())) == 12  # distinct rows


@pytest.mark.usefixtures("ray_session")
def test_a_torchrl_buffers_transforms_are_applied_to_the_rows_copied(make_buffer):
    """TorchRL's SAC fine-tuning script does ``offline.append_transform(DoubleToFloat())``: the offline rows
    must come out as that buffer's ``sample()`` gives them, or float32 online rows would not match them."""
    from torchrl.envs import DoubleToFloat

    offline = ReplayBuffer(storage=LazyTensorStorage(40))
    offline.extend(TensorDict({"observation": torch.randn(40, 3, dtype=torch.float64),
                               "id": torch.arange(40)}, [40]))
    offline.append_transform(DoubleToFloat(in_keys=["observation"]))
    rb = make_buffer(offline, online_capacity=16, batch_size=8, seed=0)
    batch = rb.sample()
    assert batch["observation"].dtype == torch.float32
    want = offline.storage.get(batch["id"])["observation"].float()
    assert torch.equal(batch["observation"], want)
    rb.extend(TensorDict({"observation": torch.randn(4, 3), "id": torch.arange(100, 104)}, [4]))  # float32 fits
    assert len(rb) == 44
