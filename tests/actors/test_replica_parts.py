"""Writes carried inside the calls, in parts (rayrb.actors.inline), to a primary and its replica: the primary sends
the replica the piece and answers once the replica holds it. A replica killed with its files mid-stream, a
primary that dies (its files with it) while it copies a piece in, and one whose own copy fails there: every
acknowledged row is in both copies once, in its write's order, a retry of the write is answered, not applied
again, and no row of a failed write stays in either copy."""
from __future__ import annotations

import uuid

import numpy as np
import pytest
from test_replicas import die_while_storing, level, writes_through_a_replica_loss

from rayrb.actors.inline import cut
from rayrb.actors.lifecycle import actor_class
from rayrb.actors.online_shard import OnlineShard
from rayrb.core.schema import RowSpec

WIDTH, ROWS, CAPACITY = 64, 1000, 64_000  # 264 bytes a row: a write of 1,000 rows is three parts
SPEC = RowSpec.from_arrays({"x": np.zeros(1, np.int64), "obs": np.zeros((1, WIDTH), np.float32)}).to_json()
pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture
def pair(ray_session, tmp_path):
    tag, cls = uuid.uuid4().hex[:8], actor_class(OnlineShard)
    opts = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": 10}
    dirs = [str(tmp_path / f"{tag}-on-0"), str(tmp_path / f"{tag}-on-0.r1")]
    replica = cls.options(name=f"{tag}/on-0.r1", **opts).remote(SPEC, CAPACITY, f"{tag}/on-0.r1", state_dir=dirs[1])
    primary = cls.options(name=f"{tag}/on-0", **opts).remote(SPEC, CAPACITY, f"{tag}/on-0", state_dir=dirs[0],
                                                             replicas=[f"{tag}/on-0.r1"])
    ray_session.get([replica.ping.remote(), primary.ping.remote()])
    yield primary, replica, dirs
    for actor in (primary, replica):
        ray_session.kill(actor, no_restart=True)


def rows_from(first: int) -> dict[str, np.ndarray]:
    x = np.arange(first, first + ROWS, dtype=np.int64)
    return {"x": x, "obs": np.repeat(x[:, None].astype(np.float32), WIDTH, axis=1)}  # each row names itself


def write(ray, primary, first: int) -> tuple[list[int], int]:
    parts = cut(rows_from(first))
    assert parts is not None and len(parts) == 3
    slots, written, _ = ray.get(primary.append_parts.remote({"write_id": f"w{first}", "digest": f"d{first}"}, *parts))
    return np.asarray(slots).tolist(), int(written)


def held(ray, actor) -> tuple[int, np.ndarray, np.ndarray]:
    state = ray.get(actor.state.remote())
    kept = state["generation"] > 0
    return int(state["written"]), state["rows/x"][kept], state["rows/obs"][kept]


def assert_each_row_once(ray, actor, written: int) -> None:
    count, x, obs = held(ray, actor)
    assert count == written
    assert x.tolist() == list(range(written))  # slot order is write order: no slot filled twice or out of turn
    assert np.array_equal(obs, np.repeat(x[:, None].astype(np.float32), WIDTH, axis=1))  # parts joined in order


def test_a_replica_killed_with_its_files_while_parts_stream_in_is_rebuilt_and_holds_every_row(ray_session, pair):
    ray = ray_session
    primary, replica, dirs = pair

    def write_at(w):
        assert write(ray, primary, w) == (list(range(w, w + ROWS)), w + ROWS)

    done = writes_through_a_replica_loss(write_at, ray, replica, dirs[1], ROWS, CAPACITY - ROWS + 1, 5, 20)
    assert level(ray, primary)["rebuilds"] >= 1
    for actor in (primary, replica):
        assert_each_row_once(ray, actor, len(done) * ROWS)


def test_a_primary_dying_while_it_copies_the_parts_in_lands_the_retry_once(ray_session, pair):
    ray = ray_session
    primary, replica, dirs = pair
    for w in range(0, 3 * ROWS, ROWS):
        write(ray, primary, w)

    die_while_storing(ray, primary, dirs[0])
    assert write(ray, primary, 3 * ROWS) == (list(range(3 * ROWS, 4 * ROWS)), 4 * ROWS)  # Ray sent it again
    assert write(ray, primary, 3 * ROWS) == (list(range(3 * ROWS, 4 * ROWS)), 4 * ROWS)  # the writer's retry
    assert ray.get(primary.stats.remote())["restarts"] == 1
    level(ray, primary)
    for actor in (primary, replica):
        assert_each_row_once(ray, actor, 4 * ROWS)


@pytest.mark.parametrize("placed_by", ["primary", "coordinator"])
def test_a_piece_the_primary_fails_to_store_leaves_no_trace_in_the_replica(ray_session, pair,
                                                                                          placed_by):
    """When the primary's own copy fails (the disk, a device copy that refuses the rows), the write fails and no
    replica keeps the piece: placed by the primary (``append``), it copies the piece in before it sends it, so
    nothing was sent; placed by the coordinator (``extend``), it sent it first, and the replica is rebuilt from the
    primary. A later write of the same length at that count then holds its own rows in both copies."""
    ray = ray_session
    primary, replica, dirs = pair
    write(ray, primary, 0)

    def fail_once(shard):
        real = shard._store_rows

        def store_rows(*args):
            shard._store_rows = real
            raise OSError("no space left on device")
        shard._store_rows = store_rows

    ray.get(primary.__ray_call__.remote(fail_once))
    failed = {k: v + 10**6 for k, v in rows_from(ROWS).items()}  # rows that were never acknowledged
    with pytest.raises(Exception, match="no space left"):
        if placed_by == "primary":
            ray.get(primary.append_parts.remote({"write_id": "failed", "digest": "f"}, *cut(failed)))
        else:
            how = {"start": 0, "stop": ROWS, "first": ROWS, "forward": True}
            ray.get(primary.extend_parts.remote(how, *cut(failed)))
    if placed_by == "primary":
        assert write(ray, primary, ROWS) == (list(range(ROWS, 2 * ROWS)), 2 * ROWS)
    else:
        how = {"start": 0, "stop": ROWS, "first": ROWS, "forward": True}
        slots, _ = ray.get(primary.extend_parts.remote(how, *cut(rows_from(ROWS))))
        assert np.asarray(slots).tolist() == list(range(ROWS, 2 * ROWS))
    level(ray, primary)
    for actor in (primary, replica):
        assert_each_row_once(ray, actor, 2 * ROWS)
