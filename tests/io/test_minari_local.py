"""``minari:`` ids: a dataset recorded here with Minari's DataCollector loads from Minari's local datasets, with
TorchRL's Minari rows; other ids go to TorchRL's MinariExperienceReplay. No network; Ray in the last test only."""
from __future__ import annotations

import numpy as np
import pytest
import torch

minari = pytest.importorskip("minari")
gym = pytest.importorskip("gymnasium")
pytest.importorskip("jax")  # Minari's DataCollector needs it (minari[create])

import torchrl.data.datasets.minari_data as minari_data  # noqa: E402

from rayrb.errors import DatasetOptionError, UnknownDatasetError  # noqa: E402
from rayrb.io.datasets.registry import as_chunk_dataset, load_dataset, torchrl_rows  # noqa: E402

DATASET_ID = "test/cartpole/mixed-v0"


@pytest.fixture
def minari_home(tmp_path, monkeypatch):
    home = tmp_path / "minari"
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(home))
    monkeypatch.setenv("RAYRB_HOME", str(tmp_path / "rayrb"))
    return home


@pytest.fixture
def recorded(minari_home):
    """Five CartPole episodes recorded with DataCollector: what env.step returned, per episode."""
    env = minari.DataCollector(gym.make("CartPole-v1", max_episode_steps=15))
    rng = np.random.default_rng(0)
    episodes = []
    for seed in range(5):
        obs, _ = env.reset(seed=seed)
        ep = {"obs": [obs], "action": [], "reward": [], "terminated": [], "truncated": []}
        while True:
            action = 0 if seed % 2 == 0 else int(rng.integers(2))  # always left: the pole falls before step 15
            obs, reward, terminated, truncated, _ = env.step(action)
            for key, value in zip(("obs", "action", "reward", "terminated", "truncated"),
                                  (obs, action, reward, terminated, truncated)):
                ep[key].append(value)
            if terminated or truncated:
                break
        episodes.append({k: np.asarray(v) for k, v in ep.items()})
    with pytest.warns(UserWarning):  # Minari asks for an author, a description, ...
        env.create_dataset(dataset_id=DATASET_ID, algorithm_name="left-or-random")
    env.close()
    assert any(ep["terminated"][-1] for ep in episodes) and any(ep["truncated"][-1] for ep in episodes)
    return episodes


@pytest.fixture
def torchrl_not_called(monkeypatch):
    calls = []
    monkeypatch.setattr(minari_data, "MinariExperienceReplay", lambda *a, **kw: calls.append((a, kw)))
    yield
    assert calls == []


def test_a_locally_recorded_dataset_loads_by_id(recorded, torchrl_not_called):
    rb = load_dataset(f"minari:{DATASET_ID}", batch_size=4, download=False)
    rows = torchrl_rows(rb)
    assert len(rb) == len(rows) == sum(len(ep["action"]) for ep in recorded)
    assert rb.sample().batch_size == torch.Size([4])
    start = 0
    for i, ep in enumerate(recorded):  # each episode's steps, consecutive, in id order
        steps = len(ep["action"])
        got = rows[start:start + steps]
        assert got["episode"].tolist() == [i] * steps
        np.testing.assert_array_equal(got["observation"].numpy(), ep["obs"][:-1])
        np.testing.assert_array_equal(got["next", "observation"].numpy(), ep["obs"][1:])
        np.testing.assert_array_equal(got["action"].numpy(), ep["action"])
        np.testing.assert_array_equal(got["next", "reward"].squeeze(-1).numpy(), ep["reward"])
        assert got["next", "terminated"].squeeze(-1).tolist() == ep["terminated"].tolist()
        assert got["next", "truncated"].squeeze(-1).tolist() == ep["truncated"].tolist()
        assert got["next", "done"].squeeze(-1).tolist() == [False] * (steps - 1) + [True]
        start += steps
    assert start == len(rows)


def test_the_rows_have_torchrls_minari_layout(recorded, tmp_path):
    ours = torchrl_rows(load_dataset(f"minari:{DATASET_ID}", batch_size=4))
    theirs = torchrl_rows(minari_data.MinariExperienceReplay(DATASET_ID, batch_size=4, root=tmp_path / "torchrl",
                                                             load_from_local_minari=True))
    # the keys, dtypes and row shapes (TorchRL 0.14.1's processed copy is written by memmap_like, which keeps
    # shapes only, so its values are not compared)
    def layout(td):
        return {k: (td[k].dtype, tuple(td[k].shape)) for k in td.keys(include_nested=True, leaves_only=True)}

    assert layout(ours) == layout(theirs)
    assert set(layout(ours)) == {"observation", "action", "episode", ("next", "observation"), ("next", "reward"),
                                 ("next", "terminated"), ("next", "truncated"), ("next", "done")}


def test_a_buffer_copies_the_local_rows_into_chunks(recorded, torchrl_not_called):
    ds, written = as_chunk_dataset(f"minari:{DATASET_ID}", batch_size=8)
    rows = torchrl_rows(load_dataset(f"minari:{DATASET_ID}", batch_size=8))
    chunks = ds.to_tensordict()
    assert written and len(ds) == len(rows)
    assert torch.equal(chunks["episode"], rows["episode"])
    assert torch.equal(chunks["next", "observation"], rows["next", "observation"])
    assert torch.equal(chunks["next", "terminated"], rows["next", "terminated"])


def test_split_trajs_gives_one_row_per_episode(recorded, torchrl_not_called):
    rows = load_dataset(f"minari:{DATASET_ID}", batch_size=2, split_trajs=True).storage[:]
    lengths = [len(ep["action"]) for ep in recorded]
    assert tuple(rows.batch_size) == (len(recorded), max(lengths))
    assert rows["mask"].sum(-1).tolist() == lengths


def test_an_unknown_option_is_refused_with_the_id(recorded, torchrl_not_called):
    with pytest.raises(DatasetOptionError, match="shuffle.*test/cartpole/mixed-v0"):
        load_dataset(f"minari:{DATASET_ID}", batch_size=2, shuffle=True)


def test_an_id_not_found_locally_goes_to_torchrl(minari_home, recorded, monkeypatch):
    calls = []
    monkeypatch.setattr(minari_data, "MinariExperienceReplay", lambda *a, **kw: calls.append((a, kw)) or "torchrl's")
    assert load_dataset("minari:D4RL/door/human-v2", batch_size=4, download=False) == "torchrl's"
    assert load_dataset(f"minari:{DATASET_ID}", batch_size=4, download="force") == "torchrl's"  # force: remote
    assert calls == [(("D4RL/door/human-v2",), {"batch_size": 4, "download": False}),
                     ((DATASET_ID,), {"batch_size": 4, "download": "force"})]


def test_no_local_datasets_folder_goes_to_torchrl_and_creates_none(minari_home, monkeypatch):
    calls = []
    monkeypatch.setattr(minari_data, "MinariExperienceReplay", lambda *a, **kw: calls.append(a) or "torchrl's")
    assert load_dataset(f"minari:{DATASET_ID}", batch_size=4) == "torchrl's"
    assert calls == [(DATASET_ID,)] and not minari_home.exists()


def test_an_id_neither_has_names_the_id(minari_home, recorded, tmp_path):
    with pytest.raises(UnknownDatasetError, match="'test/cartpole/other-v0' not found.*local datasets") as e:
        load_dataset("minari:test/cartpole/other-v0", batch_size=4, root=tmp_path / "torchrl", download=False)
    assert isinstance(e.value.__cause__, FileNotFoundError)  # TorchRL's: no processed copy under root


def test_a_download_that_cannot_start_says_the_id_was_not_local(minari_home, recorded, monkeypatch):
    def no_hub(*a, **kw):
        raise ImportError("huggingface_hub is not installed")

    monkeypatch.setattr(minari_data, "MinariExperienceReplay", no_hub)
    with pytest.raises(ImportError, match="huggingface_hub") as e:
        load_dataset("minari:D4RL/door/human-v2", batch_size=4)
    assert any("'D4RL/door/human-v2' is not among Minari's local datasets" in n for n in e.value.__notes__)


def test_slices_of_a_local_minari_dataset_stay_in_its_episodes(recorded, torchrl_not_called, ray_session, tmp_path):
    """``SliceSampler()`` with TorchRL's default keys finds a Minari dataset's episodes (its ``("next", "done")``
    flags) through a buffer built from the id: every slice is consecutive steps of one episode, and the slices
    drawn are every valid slice of the recorded episodes, none other."""
    from rayrb import OfflineToOnlineReplayBuffer, SliceSampler

    slice_len = 4
    rb = OfflineToOnlineReplayBuffer(f"minari:{DATASET_ID}", online_capacity=64, offline_fraction=1.0, batch_size=16,
                                     sampler=SliceSampler(slice_len=slice_len), seed=0,
                                     dataset_root=tmp_path / "ds", storage_dir=tmp_path / "state")
    try:
        firsts, valid, at = set(), set(), 0
        for ep in recorded:  # the steps of each episode, in id order: starts of the slices it holds
            steps = len(ep["action"])
            valid |= set(range(at, at + steps - slice_len + 1))
            at += steps
        for _ in range(200):
            batch, info = rb.sample(return_info=True)
            steps, index = batch.reshape(-1, slice_len), info["index"].reshape(-1, slice_len)
            assert (steps["episode"] == steps["episode"][:, :1]).all()  # one episode a slice
            assert torch.equal(index - index[:, :1], torch.arange(slice_len).expand_as(index))  # consecutive steps
            assert torch.equal(steps["next", "observation"][:, :-1], steps["observation"][:, 1:])
            assert not steps["next", "done"][:, :-1].any()  # an episode's end only at a slice's last step
            firsts |= set(index[:, 0].tolist())
        assert firsts == valid
    finally:
        rb.shutdown()
