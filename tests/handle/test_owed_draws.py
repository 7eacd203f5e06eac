"""The draws a buffer owes: batches an iterator drew ahead without replacement, never served and handed back when
it closed (orphans), are served by the next caller. They survive a checkpoint round trip and a coordinator
restart, and an epoch's pass does not end while it still owes them: every row of the epoch is served once."""
from __future__ import annotations

import pytest
import torch
from restart_util import kill_coordinator
from tensordict import TensorDict

pytestmark = pytest.mark.usefixtures("ray_session")

KW = {"online_capacity": 10, "num_offline_shards": 2, "num_online_shards": 1, "seed": 5, "batch_size": 4,
      "prefetch": 0, "sampler": "without_replacement", "offline_fraction": 1.0}


def rows(n: int) -> TensorDict:
    ids = torch.arange(n, dtype=torch.int64)
    return TensorDict({"obs": ids.float()[:, None], "id": ids}, [n])


def orphaned(rb, served: int = 2) -> list[int]:
    """An iterator plans ahead, serves ``served`` batches, and closes after the ``sample()`` loop drew (so its
    draws stand and it hands them back as orphans); the rows served so far."""
    it = rb.iter_batches(prefetch=4)
    got = [next(it)["id"] for _ in range(served)]
    assert it.ahead > 8, it.ahead  # drawn ahead: what it will never serve
    got.append(rb.sample()["id"])
    it.close()
    return torch.cat(got).tolist()


def rest_of_epoch(rb) -> list[int]:
    """The rows ``sample()`` serves up to the batch that ends the epoch (``for batch in rb`` would stop there)."""
    out = []
    for batch in rb:
        out += batch["id"].tolist()
        assert len(out) <= 4 * len(rb), "the epoch did not end"
    return out


def assert_one_epoch(served: list[int], n: int) -> None:
    missing, twice = n - len(set(served)), len(served) - len(set(served))
    assert missing == 0 and twice == 0, (f"the epoch ended with {missing} of its {n} rows never served and "
                                         f"{twice} served twice")
    assert sorted(served) == list(range(n))


@pytest.mark.parametrize("how", ["dumps and loads", "state_dict"])
def test_a_checkpoint_round_trip_keeps_what_a_closed_iterator_left(make_buffer, tmp_path, how):
    rb = make_buffer(rows(1024), **KW)
    served = orphaned(rb)
    if how == "dumps and loads":
        rb.dumps(tmp_path / "ckpt")
        rb.loads(tmp_path / "ckpt")
    else:
        rb.load_state_dict(rb.state_dict())
    assert_one_epoch(served + rest_of_epoch(rb), 1024)


def test_a_twin_loading_the_checkpoint_serves_what_a_closed_iterator_left(make_buffer, tmp_path):
    rb = make_buffer(rows(1024), **KW)
    served = orphaned(rb)
    rb.dumps(tmp_path / "ckpt")
    twin = make_buffer(rows(1024), **KW)
    twin.loads(tmp_path / "ckpt")
    theirs, mine = rest_of_epoch(twin), rest_of_epoch(rb)
    assert theirs == mine  # the same batches, in the same order: the saved stream goes on as the buffer's
    assert_one_epoch(served + theirs, 1024)


def test_a_restarted_coordinator_still_owes_what_a_closed_iterator_left(make_buffer):
    rb = make_buffer(rows(1024), **KW)
    served = orphaned(rb)
    kill_coordinator(rb)
    assert_one_epoch(served + rest_of_epoch(rb), 1024)


@pytest.mark.parametrize("epoch_end, loop_prefetch", [("short", 8), ("short", 0), ("drop", 8)])
def test_an_epoch_pass_serves_what_a_closed_iterator_left_before_it_ends(make_buffer, epoch_end, loop_prefetch):
    n = 256 if epoch_end == "short" else 258  # 64 batches of 4 (and, dropping, 2 rows the epoch drops)
    rb = make_buffer(rows(n), **{**KW, "prefetch": loop_prefetch, "epoch_end": epoch_end})
    it = rb.iter_batches(prefetch=4)
    served = torch.cat([next(it)["id"] for _ in range(2)]).tolist()
    assert it.ahead == 46, it.ahead  # batches 2-47 planned, the loop draws 48-63
    passed = 0
    for batch in rb:  # the loop draws the rest of the epoch, the last flagged last
        served += batch["id"].tolist()
        passed += 1
        if passed == (1 if loop_prefetch else 16):  # the loop drew the epoch's last batch (ahead, or now)
            it.close()  # the iterator's draws stand: it hands them to the next caller
    assert len(served) == len(set(served)) == 256, f"{256 - len(set(served))} rows never served, " \
                                                   f"{len(served) - len(set(served))} twice"
    assert set(served) <= set(range(n))
    assert rb.stats()["coordinator"]["batches_adopted"] == 46


def test_a_checkpoint_whose_orphans_were_edited_is_refused_and_changes_nothing(make_buffer, tmp_path):
    import json

    from rayrb.errors import SavedStateError
    from rayrb.handle.checkpoint import MANIFEST, manifest_digest

    rb = make_buffer(rows(1024), **KW)
    orphaned(rb)
    rb.dumps(tmp_path / "ckpt")
    manifest = tmp_path / "ckpt" / MANIFEST
    meta = json.loads(manifest.read_text())
    assert len(meta["coordinator"]["orphans"]) == 46
    meta["coordinator"]["orphans"][5][1] = meta["coordinator"]["orphans"][5][1].replace('["offline",1]',
                                                                                        '["offline",2]')
    meta["digest"] = manifest_digest(meta)  # edited with care: only the orphan is wrong
    manifest.write_text(json.dumps(meta))
    other = make_buffer(rows(1024), **KW)
    served = orphaned(other)  # owes orphans of its own
    with pytest.raises(SavedStateError, match=r"\['orphans'\]\[5\].*it reads offline shard 2"):
        other.loads(tmp_path / "ckpt")
    assert_one_epoch(served + rest_of_epoch(other), 1024)  # still owed, and served


def test_a_give_back_while_the_loop_holds_orphans_it_took_over_loses_none(make_buffer):
    rb = make_buffer(rows(1024), **{**KW, "prefetch": 8})
    it = rb.iter_batches(prefetch=4)
    served = torch.cat([next(it)["id"] for _ in range(2)]).tolist()
    served += rb.sample()["id"].tolist()  # the loop plans 16 batches, then 32, after the iterator's 48
    it.close()
    served += torch.cat([rb.sample()["id"] for _ in range(16)]).tolist()  # its next plan call takes them over
    assert rb.stats()["coordinator"]["batches_adopted"] > 0  # gives back what the loop holds: its own draws and,
    # after them, the orphans
    assert_one_epoch(served + rest_of_epoch(rb), 1024)
