"""A replicated online shard that samples slices by priority (rayrb.core.prioritized_slices): its priorities
reach the replica, and a primary lost with its files draws by the same masses once it came back from it."""
from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
from test_replicas import level, lose, restarted

from rayrb.actors.lifecycle import actor_class
from rayrb.actors.online_shard import OnlineShard
from rayrb.core.schema import RowSpec

pytestmark = pytest.mark.usefixtures("ray_session")


def test_slices_by_priority_keep_their_priorities_in_the_replica_through_the_primarys_loss(ray_session, tmp_path):
    """A shard sampling slices by priority, with a replica: priority updates reach the replica, and a primary lost
    with its files comes back from it drawing by the same masses (the starts' tree built again over the copy's
    priorities, not over fresh ones)."""
    ray, tag, steps = ray_session, uuid.uuid4().hex[:8], 16
    spec = RowSpec.from_arrays({"x": np.zeros(1, np.int64), "episode": np.zeros(1, np.int64)}).to_json()
    cls, opts = actor_class(OnlineShard), {"num_cpus": 0, "max_restarts": -1, "max_task_retries": 10}
    kw = {"sampler": "prioritized_slice", "sampler_options": {"slice_len": 4, "slice_key": "episode"}}
    dirs = [str(tmp_path / f"{tag}-on-0"), str(tmp_path / f"{tag}-on-0.r1")]
    replica = cls.options(name=f"{tag}/on-0.r1", **opts).remote(spec, 256, f"{tag}/on-0.r1", state_dir=dirs[1], **kw)
    primary = cls.options(name=f"{tag}/on-0", **opts).remote(spec, 256, f"{tag}/on-0", state_dir=dirs[0],
                                                             replicas=[f"{tag}/on-0.r1"], **kw)
    try:
        for e in range(4):  # four episodes of 16 steps, an episode a write
            rows = {"x": np.arange(e * steps, (e + 1) * steps), "episode": np.full(steps, e, np.int64)}
            ray.get(primary.append.remote(rows, f"w{e}", 0, 0, f"d{e}"))
        level(ray, primary)
        gen = ray.get(primary.state.remote())["generation"]
        hot = np.arange(2 * steps, 3 * steps)  # episode 2's steps
        assert ray.get(primary.update_priority.remote(hot, gen[hot], np.full(steps, 1000.0))) == steps
        before = ray.get(primary.mass_stats.remote())

        def priorities(actor):
            return ray.get(actor.state.remote())["sampler/priority"][:4 * steps]

        t0 = time.monotonic()
        while not np.array_equal(priorities(replica), priorities(primary)):  # sent after the update, not awaited
            assert time.monotonic() - t0 < 30
            time.sleep(0.1)
        lose(ray, primary, dirs[0])
        restarted(ray, primary)
        assert ray.get(primary.written.remote()) == 4 * steps
        assert np.array_equal(priorities(primary), priorities(replica))
        assert ray.get(primary.mass_stats.remote()) == pytest.approx(before)
        rows, _ = ray.get(primary.sample_many.remote([800], [7]))  # 200 slices of 4 steps
        episodes = rows["episode"].reshape(-1, 4)
        assert (episodes == episodes[:, :1]).all()  # whole slices, each in one episode
        # episode 2 holds 13 of the 52 valid starts, each at p = 1000^0.6 = 63 against 1: 95.5 % of the mass
        assert (episodes[:, 0] == 2).mean() > 0.85, np.bincount(episodes[:, 0], minlength=4)
    finally:
        for actor in (primary, replica):
            ray.kill(actor, no_restart=True)
