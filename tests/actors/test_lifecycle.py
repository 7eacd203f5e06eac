"""Starting actors: each actor class is made once per process, so Ray exports it once, not once per buffer."""
import pytest
import torch
from tensordict import TensorDict

from rayrb.actors import lifecycle
from rayrb.actors.coordinator import Coordinator
from rayrb.actors.online_shard import OnlineShard
from rayrb.actors.shards import OfflineShard


def test_an_actor_class_is_made_once_for_each_class_and_options():
    shard = lifecycle.actor_class(OfflineShard, num_cpus=0)
    assert lifecycle.actor_class(OfflineShard, num_cpus=0) is shard
    assert lifecycle.actor_class(OnlineShard, num_cpus=0) is not shard
    assert lifecycle.actor_class(OfflineShard, enable_tensor_transport=True) is not shard
    assert lifecycle.actor_class(Coordinator) is lifecycle.actor_class(Coordinator)


@pytest.mark.usefixtures("ray_session")
def test_a_second_buffer_starts_its_actors_from_the_classes_the_first_made(make_buffer):
    td = TensorDict({"x": torch.arange(12.0)[:, None]}, [12])
    make_buffer(td, online_capacity=4, num_offline_shards=2)
    before = lifecycle._actor_class.cache_info()
    make_buffer(td, online_capacity=4, num_offline_shards=2)
    after = lifecycle._actor_class.cache_info()
    assert after.misses == before.misses and after.hits - before.hits == 4  # 2 offline, 1 online, the coordinator
