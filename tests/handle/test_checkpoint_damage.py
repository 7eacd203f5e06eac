"""A refused loads() changes nothing: damage in any part of a checkpoint's manifest, the coordinator's section
included, is found before any actor changes, and the buffer's sizes, rows, seeded stream and rate limiter
counters are exactly as before."""
from __future__ import annotations

import json

import pytest
import torch
from tensordict import TensorDict

from rayrb import SampleToInsertRatio


def rows(start: int, n: int) -> TensorDict:
    ids = torch.arange(start, start + n, dtype=torch.int64)
    return TensorDict({"obs": ids.float()[:, None], "id": ids}, [n])


def leaves(obj, path=()):
    """Every scalar in a JSON tree, with its path."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from leaves(v, (*path, i))
    else:
        yield path, obj


def set_at(obj, path, value):
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


def fingerprint(rb):
    """What a refused loads() must leave as it was: sizes, online rows, limiter counters, then the stream."""
    import ray

    held = sorted(i for s in ray.get([sh.state.remote() for sh in rb.rpc.by_side["online"]])
                  for i in s["rows/id"][s["generation"] > 0].tolist())
    limiter = rb.stats()["coordinator"]["rate_limiter"]
    return rb.sizes(), held, {k: limiter[k] for k in ("inserts", "samples")}


@pytest.fixture
def saved(make_buffer, tmp_path):
    kw = dict(online_capacity=600, num_online_shards=2, offline_fraction=0.5, batch_size=16, seed=3, prefetch=0,
              rate_limiter=SampleToInsertRatio(samples_per_insert=1.0, min_size_to_sample=1, error_buffer=1000))
    src = make_buffer(rows(0, 200), **kw)
    src.extend(rows(1000, 300))
    for _ in range(3):
        src.sample()
    src.dumps(tmp_path / "ckpt")
    return kw, tmp_path / "ckpt"


@pytest.mark.usefixtures("ray_session")
def test_damage_anywhere_in_the_coordinator_section_is_refused_and_changes_nothing(make_buffer, saved, tmp_path):
    kw, ckpt = saved
    meta = json.loads((ckpt / "buffer.json").read_text())
    targets = [p for p, v in leaves(meta["coordinator"]) if v is not None and not isinstance(v, bool)]
    assert len(targets) >= 8, targets
    rb = make_buffer(rows(0, 200), **kw)
    rb.extend(rows(5000, 10))
    twin = make_buffer(rows(0, 200), **kw)
    twin.extend(rows(5000, 10))
    before = fingerprint(rb)
    refused = []
    for path in targets:
        damaged = json.loads(json.dumps(meta))
        set_at(damaged["coordinator"], path, "x")
        from rayrb.handle.checkpoint import manifest_digest

        damaged["digest"] = manifest_digest(damaged)  # edited with care: only the value is wrong
        (ckpt / "buffer.json").write_text(json.dumps(damaged))
        with pytest.raises((ValueError, TypeError)):
            rb.loads(ckpt)
        refused.append(path)
        assert fingerprint(rb) == before, path
    assert [rb.sample()["id"].tolist() for _ in range(5)] == [twin.sample()["id"].tolist() for _ in range(5)]


@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("damage", ["truncated", "edited"])
def test_a_torn_or_edited_manifest_is_refused_and_changes_nothing(make_buffer, saved, damage):
    kw, ckpt = saved
    text = (ckpt / "buffer.json").read_text()
    if damage == "truncated":
        (ckpt / "buffer.json").write_text(text[: len(text) // 2])
    else:  # a value changed without the digest: 300 online rows claimed as 299
        meta = json.loads(text)
        meta["sizes"]["online_written"][0] -= 1
        (ckpt / "buffer.json").write_text(json.dumps(meta))
    rb = make_buffer(rows(0, 200), **kw)
    rb.extend(rows(5000, 10))
    before = fingerprint(rb)
    with pytest.raises(ValueError, match="damaged|changed after it was written"):
        rb.loads(ckpt)
    assert fingerprint(rb) == before


@pytest.mark.usefixtures("ray_session")
def test_a_restore_that_fails_while_applying_puts_the_buffer_back(make_buffer, saved, monkeypatch):
    import rayrb.handle.checkpoint as checkpoint

    kw, ckpt = saved
    rb = make_buffer(rows(0, 200), **kw)
    rb.extend(rows(5000, 10))
    twin = make_buffer(rows(0, 200), **kw)
    twin.extend(rows(5000, 10))
    before = fingerprint(rb)
    real, calls = checkpoint._apply, []

    def fails_after_the_shards(rb, files, state):
        calls.append(files)
        if len(calls) == 1:  # the checkpoint's shards are in; then the coordinator's part fails
            rb.rpc.get([s.load.remote(f) for s, f in zip(rb.rpc.shards, files)])
            raise OSError("disk gone while restoring")
        return real(rb, files, state)

    monkeypatch.setattr(checkpoint, "_apply", fails_after_the_shards)
    with pytest.raises(OSError, match="disk gone"):
        rb.loads(ckpt)
    assert len(calls) == 2 and fingerprint(rb) == before
    assert [rb.sample()["id"].tolist() for _ in range(5)] == [twin.sample()["id"].tolist() for _ in range(5)]
    monkeypatch.setattr(checkpoint, "_apply", real)
    rb.loads(ckpt)  # the same checkpoint, undamaged, then loads
    assert sum(rb.sizes()["online"]) == 300
