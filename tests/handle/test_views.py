"""``offline_buffer`` / ``online_buffer`` views, and TorchRL's class around a rayrb buffer."""
from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

pytestmark = pytest.mark.usefixtures("ray_session")


def rows(start, n):
    ids = torch.arange(start, start + n, dtype=torch.int64)
    return TensorDict({"obs": ids.float()[:, None].expand(n, 2).contiguous(), "id": ids}, [n])


@pytest.fixture
def make_buffer(make_buffer):
    """conftest's make_buffer over this file's offline rows and defaults."""

    def make(**kwargs):
        return make_buffer(rows(0, 100), **{"online_capacity": 50, "num_offline_shards": 2, "num_online_shards": 2,
                                            "seed": 0, **kwargs})

    return make


def test_side_views_count_and_sample_without_touching_the_stream(make_buffer):
    a, b = make_buffer(), make_buffer()
    for rb in (a, b):
        rb.extend(rows(1000, 30))
    assert len(a.offline_buffer) == 100 and len(a.online_buffer) == 30 and len(a) == 130
    assert a.online_buffer.storage.max_size == 50 and a.online_buffer.storage.device == "cpu"
    off = a.offline_buffer.sample(500)
    on, info = a.online_buffer.sample(200, return_info=True)
    assert bool((off["id"] < 100).all()) and set(off["id"].tolist()) <= set(range(100))
    assert bool((on["id"] >= 1000).all()) and not bool(info["offline"].any())
    assert torch.equal(a.sample(64)["id"], b.sample(64)["id"])  # the buffer's own stream did not move
    from rayrb.io.chunks import ReadOnlyError

    with pytest.raises(ReadOnlyError):
        a.offline_buffer.extend(rows(0, 1))


def test_online_state_dict_moves_the_online_rows_between_buffers(make_buffer):
    a, b = make_buffer(), make_buffer()
    a.extend(rows(1000, 70))  # wraps around
    state = a.online_buffer.state_dict()
    b.online_buffer.load_state_dict(state)
    assert b.sizes()["online"] == a.sizes()["online"] and b.write_count == 70
    b.offline_fraction = 0.0
    assert set(b.sample(2000)["id"].tolist()) == set(range(1020, 1070))
    with pytest.raises(ValueError, match="of the online side, got one of .offline."):
        b.online_buffer.load_state_dict({**state, "side": "offline"})


def test_torchrl_sees_its_own_class(make_buffer):
    from torchrl.data import OfflineToOnlineReplayBuffer as TorchRLO2O
    from torchrl.trainers.algorithms.offline_to_online import OfflineToOnlineReplayBufferHook

    from rayrb.integrations.torchrl import as_torchrl

    # a transform of the buffer's batches (here one renaming a key) runs on rb.sample, not on a side's own rows,
    # as TorchRL's side buffers give them: the hook aligns collected rows to the offline keys by them
    rb = make_buffer(offline_fraction=0.8, batch_size=10, transform=lambda td: td.rename_key_("obs", "observation"))
    assert set(rb.offline_buffer.sample(3).keys()) == {"obs", "id"} and "observation" in rb.sample().keys()
    view = as_torchrl(rb)
    assert isinstance(view, TorchRLO2O) and len(view) == 100
    hook = OfflineToOnlineReplayBufferHook(view, batch_size=10)
    hook.extend(rows(2000, 5))  # aligned to the offline keys through offline_buffer.sample(1)
    assert rb.write_count == 5 and hook.sample(None).batch_size[0] == 10
    assert set(rb.online_buffer.sample(3).keys()) == {"obs", "id"}
    view.anneal(5, 10)
    assert rb.offline_fraction == pytest.approx(0.4)
    state = hook.state_dict()
    assert state["offline_fraction"] == pytest.approx(0.4) and state["base_offline_fraction"] == pytest.approx(0.8)
    hook.load_state_dict(state)
    assert rb.offline_fraction == pytest.approx(0.4)


def test_a_torchrl_checkpoint_keeps_the_online_rows_and_the_annealing_base(make_buffer, tmp_path):
    """TorchRL's Checkpoint (what OfflineToOnlineTrainer's save_trainer_file and checkpoint= use) picks the view's
    dump/load: rayrb's checkpoint, online rows included, and the fraction ``anneal`` decays from, which TorchRL's
    replay-buffer hook saves as base_offline_fraction when the buffer itself is not saved."""
    from torchrl.checkpoint import Checkpoint

    from rayrb.integrations.torchrl import as_torchrl

    a = make_buffer(offline_fraction=0.8)
    b = make_buffer(offline_fraction=0.3)  # started elsewhere: only the checkpoint knows the base was 0.8
    a.extend(rows(1000, 30))
    view = as_torchrl(a)
    view.anneal(5, 10)
    Checkpoint(replay_buffer=view).save(tmp_path / "ckpt")
    restored = as_torchrl(b)
    assert Checkpoint(replay_buffer=restored).load(tmp_path / "ckpt").loaded == {"replay_buffer"}
    assert b.write_count == 30 and b.offline_fraction == pytest.approx(0.4)
    b.offline_fraction = 0.0
    assert set(b.sample(500)["id"].tolist()) == set(range(1000, 1030))
    restored.anneal(8, 10)  # from the saved base, 0.8, not from b's 0.3
    assert b.offline_fraction == pytest.approx(0.16)


def test_a_torchrl_checkpoint_with_a_damaged_view_file_restores_nothing(make_buffer, tmp_path):
    """The view's load checks its own file before rayrb's restore begins: failed means unchanged."""
    from rayrb.integrations.torchrl import as_torchrl

    a, b = make_buffer(offline_fraction=0.8), make_buffer(offline_fraction=0.3)
    a.extend(rows(1000, 30))
    as_torchrl(a).dump(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "torchrl_view.json").write_text('{"base_offline_fraction": 7')  # torn
    restored = as_torchrl(b)
    with pytest.raises(ValueError, match="base_offline_fraction"):
        restored.load(tmp_path / "ckpt")
    assert b.write_count == 0 and b.offline_fraction == pytest.approx(0.3)
    assert restored._base_offline_fraction == pytest.approx(0.3)


def test_a_refused_online_state_changes_no_shard(make_buffer):
    a, b = make_buffer(), make_buffer()
    a.extend(rows(1000, 40))
    b.extend(rows(2000, 30))
    state = a.online_buffer.state_dict()
    state["shards"][1] = {**state["shards"][1], "generation": state["shards"][1]["generation"][:3]}  # damaged
    before = b.sizes()
    with pytest.raises(ValueError, match="capacity"):
        b.online_buffer.load_state_dict(state)
    assert b.sizes() == before and b.write_count == 30
    b.offline_fraction = 0.0
    assert set(b.sample(2000)["id"].tolist()) == set(range(2000, 2030))  # shard 0 did not take a's rows either


def test_the_torchrl_view_keeps_no_state_of_its_own(make_buffer, tmp_path):
    """The base fraction has one owner, the buffer: the view reads and sets it there, anneals there, saves and
    restores the buffer's state, and writes no file of its own (an older checkpoint's is still read)."""
    from rayrb.integrations.torchrl import as_torchrl

    rb = make_buffer(offline_fraction=0.8)
    view = as_torchrl(rb)
    view._offline_fraction = 0.6  # TorchRL's private attribute: the base stays
    assert rb.offline_fraction == pytest.approx(0.6) and rb._base_offline_fraction == pytest.approx(0.8)
    view._base_offline_fraction = 0.5
    assert rb._base_offline_fraction == pytest.approx(0.5) and view._base_offline_fraction == pytest.approx(0.5)
    rb.anneal(2, 10)
    assert view.offline_fraction == pytest.approx(0.4)
    view.offline_fraction = 0.9  # TorchRL's public name sets the base too
    assert rb._base_offline_fraction == pytest.approx(0.9)
    assert view.state_dict()["base_fraction"] == pytest.approx(0.9)
    view.dump(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / "torchrl_view.json").exists()
    (tmp_path / "ckpt" / "torchrl_view.json").write_text('{"base_offline_fraction": 0.7}')  # an older view's
    other = make_buffer(offline_fraction=0.1)
    as_torchrl(other).load(tmp_path / "ckpt")
    assert other.offline_fraction == pytest.approx(0.9) and other._base_offline_fraction == pytest.approx(0.7)


def test_an_older_view_state_loads_whole_with_its_base_or_not_at_all(make_buffer):
    """A view's ``state_dict`` from before the base fraction was the buffer's, ``{"rayrb": ..., "base_offline_
    fraction": ...}``, loads in one checked call: its base wins; a bad base refuses the whole state."""
    from rayrb.integrations.torchrl import as_torchrl

    a, b = make_buffer(offline_fraction=0.8), make_buffer(offline_fraction=0.3)
    old = {"rayrb": {k: v for k, v in a.state_dict().items() if k != "base_fraction"}, "base_offline_fraction": 0.6}
    view = as_torchrl(b)
    with pytest.raises(ValueError, match="base_fraction"):
        view.load_state_dict({**old, "base_offline_fraction": 7.0})
    assert b.offline_fraction == pytest.approx(0.3) and b._base_offline_fraction == pytest.approx(0.3)
    view.load_state_dict(old)
    assert b.offline_fraction == pytest.approx(0.8) and b._base_offline_fraction == pytest.approx(0.6)
