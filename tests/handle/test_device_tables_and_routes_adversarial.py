"""Hostile use of shards whose rows live in a DeviceTable, and of route planning.

The device tests build shards without Ray (the CPU device runs the GPU shards' code
path) and compare them row for row with host shards. The route tests check invariants
of ``plan_routes`` over many made-up layouts.
"""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from rayrb import write_dataset
from rayrb.actors.online_shard import OnlineShard
from rayrb.actors.shards import OfflineShard
from rayrb.actors.transport import Place, choose, plan_routes, receive, refuse_shared_gpus, shared_gpu
from rayrb.core.plans import BatchPlan, Epoch, ImportanceWeights, Part, assemble

# -- device tables against host memory -------------------------------------------------------------------------


def odd_table(n, start=0):
    """Columns of every awkward kind: bool, int8, float16, float64, scalars, multi-dim, nested keys."""
    ids = np.arange(start, start + n)
    return {
        "id": ids.astype(np.int64),
        "flag": (ids % 3 == 0),
        "small": (ids % 100 - 50).astype(np.int8)[:, None].repeat(2, 1),
        "half": (ids / 7).astype(np.float16)[:, None, None].repeat(2, 1).repeat(3, 2),
        "wide": (ids * 1.5).astype(np.float64),
        "img": (ids % 256).astype(np.uint8)[:, None, None, None].repeat(2, 1).repeat(2, 2).repeat(1, 3),
        "next/reward": (ids % 2).astype(np.float32),
        "next/done/now": (ids % 5 == 0)[:, None],
    }


@pytest.fixture
def odd_dataset(tmp_path):
    return str(write_dataset(odd_table(500), tmp_path / "ds", chunk_rows=70).root)


def same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def same_reads(host, dev, counts, seeds, epochs=None):
    (rh, ih), (rd, idev) = (s.sample_many(counts, seeds, epochs) for s in (host, dev))
    same(rh, rd)
    same(ih, idev)
    t = dev.sample_many_tensors(counts, seeds, epochs)
    for k in rh:
        np.testing.assert_array_equal(t[f"rows/{k}"].numpy(), rh[k], err_msg=k)
    return rh


@pytest.mark.parametrize("sampler", ["uniform", "without_replacement", "prioritized"])
def test_offline_device_shard_matches_host_through_restarts_priorities_and_epochs(odd_dataset, tmp_path, sampler):
    # Catches a device table that drops a dtype, a scalar or nested column, or a shape; loses its priorities
    # when the process restarts or a state is loaded; or starts a restarted shard at the wrong epoch place.
    def shard(kind, state=True):
        return OfflineShard(odd_dataset, 130, 470, f"t/off-{kind}", sampler, device=None if kind == "host" else "cpu",
                            state_dir=str(tmp_path / kind) if state else None)

    host, dev = shard("host"), shard("dev")
    rng = np.random.default_rng(0)
    if sampler == "prioritized":
        idx, prio = rng.integers(0, 340, 120), rng.uniform(0, 9, 120).round(1)  # repeated rows, zeros
        for s in (host, dev):
            s.update_priority(idx, np.ones(120, np.int64), prio)
    epochs = [Epoch(1, 5, 340, 0), Epoch(1, 5, 340, 100), Epoch(1, 5, 340, 101)] \
        if sampler == "without_replacement" else None
    first = same_reads(host, dev, [100, 1, 0], [1, 2, 3], epochs)
    dev = shard("dev")  # the device shard's process died: a new one over the same state directory
    epochs2 = [Epoch(1, 5, 340, 101), Epoch(2, 6, 340, 0)] if sampler == "without_replacement" else None
    second = same_reads(host, dev, [239, 7], [4, 5], epochs2)
    if sampler == "without_replacement":  # one epoch: every row once
        assert sorted(np.concatenate([first["id"], second["id"][:239]]).tolist()) == list(range(130, 470))
    fresh = shard("dev2", state=False)
    fresh.load_state(host.state())
    same_reads(host, fresh, [50], [9], [Epoch(2, 6, 340, 7)] if sampler == "without_replacement" else None)
    idx = np.array([0, 339, 339, 5])
    same(host.gather(idx)[0], dev.gather(idx)[0])


def test_online_device_shard_matches_host_through_wraps_out_of_order_writes_and_restarts(odd_dataset, tmp_path):
    # Catches a device copy that misses a write (out of order, larger than the shard, wrapping), that keeps
    # stale rows after a restart or load_state, or that reads back a dtype or shape differently.
    from rayrb.io.chunks import ChunkDataset

    spec = ChunkDataset.open(odd_dataset).spec.to_json()
    cap = 37

    def shard(kind, sampler="prioritized", state=True):
        return OnlineShard(spec, cap, f"t/on-{kind}", sampler, state_dir=str(tmp_path / kind) if state else None,
                           device=None if kind.startswith("host") else "cpu")

    host, dev = shard("host"), shard("dev")
    data = odd_table(400, start=1000)
    rng = np.random.default_rng(1)
    bounds = np.unique(np.concatenate([[0, 400], rng.integers(1, 400, 14)]))
    writes = list(itertools.pairwise(bounds))
    order = list(range(len(writes)))
    for j in range(0, len(order) - 1, 3):  # every third pair of writes lands out of order
        order[j], order[j + 1] = order[j + 1], order[j]
    for step, j in enumerate(order):
        a, b = writes[j]
        for s in (host, dev):
            s.extend(data, int(a), int(b), first=int(a))
        assert host.written() == dev.written()
        same(host.gather(np.arange(host.size()))[0], dev.gather(np.arange(dev.size()))[0])
        if step % 4 == 3:
            n = min(10, host.size())
            _, info = host.gather(np.arange(n))
            prio = rng.uniform(0.1, 4, n)
            gen = info["generation"].copy()
            gen[::2] -= 1  # stale generations: those updates are dropped on both
            assert host.update_priority(np.arange(n), gen, prio) == dev.update_priority(np.arange(n), gen, prio)
            same_reads(host, dev, [25, 3], [step, step + 1])
    big = odd_table(2 * cap + 3, start=5000)  # one write larger than the shard keeps its tail
    for s in (host, dev):
        s.extend(big, 0, len(big["id"]), first=400)
    same_reads(host, dev, [60], [7])
    dev = shard("dev")  # restart
    assert dev.written() == host.written() == 400 + 2 * cap + 3
    same_reads(host, dev, [60], [8])
    for kind in ("host-fresh", "dev-fresh"):  # a loaded state replaces whatever the shard held
        fresh = shard(kind, state=False)
        fresh.extend(odd_table(5, start=-5), 0, 5, first=0)
        fresh.load_state(host.state())
        same_reads(host, fresh, [40], [9])
    wor_host, wor_dev = shard("host-w", "without_replacement"), shard("dev-w", "without_replacement")
    for s in (wor_host, wor_dev):
        s.extend(data, 0, 30, first=0)
    ep = [Epoch(3, 4, 30, 0), Epoch(3, 4, 30, 17)]
    got = same_reads(wor_host, wor_dev, [17, 13], [0, 0], ep)
    assert sorted(got["id"].tolist()) == list(range(1000, 1030))


def test_device_shards_refuse_bad_writes_and_states_without_changing_anything(odd_dataset, tmp_path):
    # Catches a device shard that half-applies a refused write or state: every refusal is checked
    # before the memory maps or the device copy change.
    from rayrb.io.chunks import ChunkDataset

    spec = ChunkDataset.open(odd_dataset).spec.to_json()
    dev = OnlineShard(spec, 20, "t/on-dev", "uniform", state_dir=str(tmp_path / "d"), device="cpu")
    dev.extend(odd_table(20), 0, 20, first=0)
    before = dev.gather(np.arange(20))[0]
    wrong = odd_table(5, start=100)
    wrong["half"] = wrong["half"].astype(np.float32)  # the spec says float16
    with pytest.raises(ValueError, match="half"):
        dev.extend(wrong, 0, 5, first=20)
    short = odd_table(5, start=100)
    short["small"] = short["small"][:, :1]
    with pytest.raises(ValueError, match="small"):
        dev.extend(short, 0, 5, first=20)
    bad_state = dev.state()
    bad_state["rows/img"] = bad_state["rows/img"][:10]
    with pytest.raises(ValueError):
        dev.load_state(bad_state)
    assert dev.written() == 20
    same(dev.gather(np.arange(20))[0], before)
    same(OnlineShard(spec, 20, "t/on-dev", "uniform", state_dir=str(tmp_path / "d"),
                     device="cpu").gather(np.arange(20))[0], before)


# -- routes ------------------------------------------------------------------------------------------------------


def random_places(rng, kind, n):
    out = []
    for i in range(n):
        node = f"node-{rng.randrange(3)}"
        gpus = tuple(sorted(rng.sample(["0", "1", "2", "3"], rng.choice([0, 0, 1, 1, 1, 2, 3]))))
        out.append(Place(f"{kind} {i}", node, gpus))
    return out


def shares(a, b):
    """Whether learner ``b`` was given the GPU that holds shard ``a``'s rows (its first) on the same node."""
    return a.node == b.node and bool(a.gpus) and a.gpus[0] in b.gpus


def test_auto_routes_keep_their_invariants_over_many_layouts():
    # Catches an NCCL group whose members share a GPU, CUDA IPC between actors that share none, a GPU-less
    # end outside the object store, members listed that carry no NCCL pair, and needless fallbacks.
    rng = random.Random(0)
    for _ in range(400):
        shards = random_places(rng, "shard", rng.randrange(0, 6))
        learners = random_places(rng, "learner", rng.randrange(0, 5))
        routes, s_ids, l_ids = plan_routes("auto", shards, learners)
        assert set(routes) == {(i, j) for i in range(len(shards)) for j in range(len(learners))}
        members = [shards[i] for i in s_ids] + [learners[j] for j in l_ids]
        assert shared_gpu(members) is None
        assert s_ids == sorted({i for (i, _), t in routes.items() if t == "nccl"})
        assert l_ids == sorted({j for (_, j), t in routes.items() if t == "nccl"})
        for (i, j), t in routes.items():
            s, d = shards[i], learners[j]
            if not s.gpus or not d.gpus:
                assert t == "object_store"
            elif shares(s, d):
                assert t == "cuda_ipc"
            elif t == "object_store":  # NCCL refused: only because the group could not take both ends
                assert shared_gpu(list({*members, s, d})) is not None
            else:
                assert t == "nccl"
        assert plan_routes("auto", shards, learners) == (routes, s_ids, l_ids)  # deterministic


def test_explicit_transports_refuse_exactly_the_layouts_that_cannot_work():
    # Catches an NCCL refusal that misses a shared GPU (or invents one across nodes) and a CUDA IPC
    # check that passes a pair without a common GPU.
    rng = random.Random(1)
    for _ in range(300):
        shards = random_places(rng, "shard", rng.randrange(0, 5))
        learners = random_places(rng, "learner", rng.randrange(0, 4))
        everyone = [*shards, *learners]
        hit = shared_gpu(everyone)
        gpuless = next((p for p in everyone if not p.gpus), None) if shards and learners else None
        if gpuless is not None and hit is None:
            with pytest.raises(ValueError, match=f"Ray gave {gpuless.name} .* none"):
                plan_routes("nccl", shards, learners)
        elif gpuless is not None:
            with pytest.raises(ValueError):
                plan_routes("nccl", shards, learners)
        elif hit is None:
            routes, s_ids, l_ids = plan_routes("nccl", shards, learners)
            assert set(routes.values()) <= {"nccl"}
            assert (s_ids, l_ids) == ((list(range(len(shards))), list(range(len(learners))))
                                      if shards and learners else ([], []))
            refuse_shared_gpus(everyone)
        else:
            a, b, g = hit
            assert a.node == b.node and g in a.gpus and g in b.gpus and a is not b
            with pytest.raises(ValueError, match=f"{a.name} and {b.name}: both run on GPU {g}"):
                plan_routes("nccl", shards, learners)
        ok = all(shares(s, d) for s in shards for d in learners)
        if ok:
            routes, s_ids, l_ids = plan_routes("cuda_ipc", shards, learners)
            assert set(routes.values()) <= {"cuda_ipc"} and s_ids == l_ids == []
        else:
            with pytest.raises(ValueError, match="transport='cuda_ipc' carries rows only"):
                plan_routes("cuda_ipc", shards, learners)
        for t in ("object_store", "gloo"):
            routes, s_ids, l_ids = plan_routes(t, shards, learners)
            assert set(routes.values()) <= {t} and len(routes) == len(shards) * len(learners)
            if t == "object_store" or not routes:
                assert s_ids == l_ids == []
    with pytest.raises(ValueError, match="transport must be one of"):
        plan_routes("rdma", [], [])


def test_multi_gpu_nodes_and_actors_holding_several_gpus():
    # Catches GPU ids compared across nodes, and a shared id missed when an actor holds several GPUs.
    a = Place("shard a", "n1", ("0", "1"))  # its rows are on its first GPU, "0"
    assert choose(a, Place("learner", "n1", ("1", "0"))) == "cuda_ipc"
    assert choose(a, Place("learner", "n1", ("1", "2"))) == "nccl"  # shares GPU 1, not the rows' GPU
    assert choose(a, Place("learner", "n1", ("2", "3"))) == "nccl"
    assert choose(a, Place("learner", "n2", ("0", "1"))) == "nccl"  # the same ids on another node
    assert shared_gpu([a, Place("b", "n2", ("0",)), Place("c", "n1", ("2",))]) is None
    assert shared_gpu([a, Place("b", "n1", ("3", "1"))])[2] == "1"
    many = [Place(f"s{i}", f"n{i // 4}", (str(i % 4),)) for i in range(16)]  # 4 nodes of 4 GPUs, one each
    learners = [Place(f"l{j}", f"n{j}", ("0", "1")) for j in range(4)]
    routes, s_ids, l_ids = plan_routes("auto", many, learners)
    for (i, j), t in routes.items():  # learner j shares GPUs 0 and 1 of node j with two shards
        assert (t == "cuda_ipc") == (i // 4 == j and i % 4 < 2) and t in ("cuda_ipc", "nccl", "object_store")
    assert shared_gpu([*(many[i] for i in s_ids), *(learners[j] for j in l_ids)]) is None
    assert plan_routes("auto", [], learners) == ({}, [], [])
    assert plan_routes("nccl", many, []) == ({}, [], [])


def test_receive_rebuilds_what_assemble_gives_from_any_mix_of_parts():
    # Catches parts joined out of order, provenance or importance weights misaligned with rows, dtypes
    # changed on the way (bool, int8, float16), and a wrong number of parts accepted.
    rng = np.random.default_rng(0)
    for trial in range(40):
        parts = [Part("offline", i, int(rng.integers(1, 5))) for i in range(int(rng.integers(0, 3)))]
        parts += [Part("online", i, int(rng.integers(1, 5))) for i in range(int(rng.integers(1, 3)))]
        n_off = sum(p.count for p in parts if p.side == "offline")
        weights = ImportanceWeights(0.4, {"offline": 0.5, "online": 0.25}) if trial % 2 else None
        plan = BatchPlan(parts, n_off, sum(p.count for p in parts) - n_off, fraction=0.5,
                         weights=weights)
        results = []
        for p in parts:
            table = odd_table(p.count, start=int(rng.integers(0, 1000)))
            info = {"index": rng.integers(0, 100, p.count), "generation": rng.integers(1, 4, p.count)}
            if weights is not None:
                info["priority"] = rng.uniform(0.5, 2.0, p.count)
            results.append((table, info))
        want_rows, want_info = assemble(plan, results, return_info=True)
        as_sent = [r if rng.random() < 0.5 else
                   {**{f"rows/{k}": torch.from_numpy(v) for k, v in r[0].items()},
                    **{f"info/{k}": torch.from_numpy(v) for k, v in r[1].items()}} for r in results]
        td, info = receive(plan, *as_sent)
        got = {k: v.numpy() for k, v in td.flatten_keys("/").items()}
        same(got, want_rows)
        assert info.keys() == want_info.keys()
        for k, v in want_info.items():
            assert info[k].numpy().dtype == v.dtype, k
            np.testing.assert_array_equal(info[k].numpy(), v, err_msg=k)
        with pytest.raises(ValueError, match="shard parts"):
            receive(plan, *as_sent[:-1])
