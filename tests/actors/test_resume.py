"""Attacks on resumed writes, re-answered sample calls and dataset loaders: restarts at awkward moments, retries
that do not match the write they name, call ids reused, loaders and factories that return or raise the wrong thing."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from restart_util import coordinator_places, kill_coordinator, online_ids, rows
from tensordict import TensorDict
from write_model import ModelShard

from rayrb.core.allocation import cut_write
from rayrb.durability.writelog import WriteLog
from rayrb.io.datasets import registry


# ------------------------------------------------------------------ writes cut short, restarts (no Ray)
class _Coordinator:
    """What the coordinator does with a WriteLog and its journal, and what a restart leaves of it."""

    def __init__(self, capacities):
        self.capacities, self.shards, self.journal = capacities, [ModelShard() for _ in capacities], []
        self.log = WriteLog(capacities)

    def send(self, write_id, pieces, skip=()):
        for i, w in enumerate(pieces):
            if i not in skip:
                self.shards[w.shard].extend(w.first, [(write_id, r) for r in range(w.start, w.stop)])

    def plan(self, write_id, rows, pieces=None):
        plan = self.log.plan(pieces or cut_write(rows, self.log.capacity))
        self.journal.append((write_id, [[w.shard, w.start, w.stop, w.first] for w in plan]))
        self.log.commit(plan, write_id)
        return plan

    def resume(self, write_id):
        whole, send = self.log.resume(write_id)
        if send:
            self.journal.append((write_id, [[w.shard, w.start, w.stop, w.first] for w in whole]))
        self.send(write_id, send)
        return self.log.indices(whole)

    def restart(self):
        self.log = WriteLog(self.capacities)
        self.log.reset([s.written for s in self.shards])
        self.log.recall(self.journal)

    def held(self, index):
        """The row at a global online index."""
        shard = int(np.searchsorted(self.log.offsets, index, side="right")) - 1
        s = self.shards[shard]
        pos = [p for p in s.rows if p < s.written and p % self.capacities[shard] == index - self.log.offsets[shard]]
        return s.rows[max(pos)]


def test_a_piece_whose_rows_another_write_took_is_still_missing_after_a_second_restart():
    """Write a's second piece never reached shard 1; after a restart write b took shard 1's rows there, and the
    coordinator restarted again. Shard 1's count is past a's piece now, with b's rows: a's retry must send it."""
    c = _Coordinator([100, 100])
    a = c.plan("a", 20, pieces=[10, 10])
    c.send("a", a[:1])  # died before the second piece
    c.restart()
    b = c.plan("b", 30, pieces=[30])
    assert [(w.shard, w.first) for w in b] == [(1, 0)]  # over the rows a's piece was planned at
    c.send("b", b)
    c.restart()
    indices = c.resume("a")
    assert [c.held(int(i)) for i in indices] == [("a", r) for r in range(20)]
    assert [c.held(100 + i) for i in range(30)] == [("b", r) for r in range(30)]


def test_writes_cut_short_through_repeated_restarts_land_every_row_exactly_once():
    """The randomized model of cut-short writes, with restarts that rebuild the log from the shards' counts and the
    journal (resumed writes journalled again), any number of them between a write and its retry."""
    rng = np.random.default_rng(1)
    for trial in range(60):
        k = int(rng.integers(2, 4))
        c, rows, pending, answers = _Coordinator([10 ** 6] * k), {}, [], {}
        for w in range(int(rng.integers(5, 25))):
            if pending and rng.random() < 0.3:
                v = pending.pop(int(rng.integers(len(pending))))
                answers[v] = c.resume(v)
            if rng.random() < 0.2:
                c.restart()
            rows[w] = int(rng.integers(1, 40))
            parts = min(k, rows[w], int(rng.integers(1, k + 1)))
            plan = c.plan(w, rows[w], pieces=[len(x) for x in np.array_split(np.arange(rows[w]), parts)])
            event = rng.random()
            if event < 0.3:  # the coordinator dies after sending some of the pieces
                c.send(w, plan[:int(rng.integers(len(plan)))])
                c.restart()
            elif event < 0.45:  # one shard fails its piece; the writer's client resyncs at once
                c.send(w, plan, skip={int(rng.integers(len(plan)))})
                c.log.reset([s.written for s in c.shards])
            else:
                c.send(w, plan)
                answers[w] = c.log.indices(plan)
                continue
            pending.append(w)
        for v in pending:
            if rng.random() < 0.5:
                c.restart()
            answers[v] = c.resume(v)
        held = sorted(r for s in c.shards for pos, r in s.rows.items() if pos < s.written)
        assert held == sorted((w, r) for w, n in rows.items() for r in range(n)), trial  # all, and once
        for w, indices in answers.items():  # and each answer points at its own rows
            assert [c.held(int(i)) for i in indices] == [(w, r) for r in range(rows[w])], (trial, w)


# ------------------------------------------------------------------ sample call ids (no Ray: submit=False)
def test_a_call_id_reused_with_other_arguments_is_refused():
    from rayrb.actors.coordinator import Coordinator

    c = Coordinator([object()], [100], [], [], seed=0)
    first = c.plan(16, 1, call="learner/7")
    with pytest.raises(ValueError, match=r"learner/7.*\(16, 1, None, 1\).*\(32, 1, None, 1\)"):
        c.plan(32, 1, call="learner/7")  # answering it would give 16 rows for 32
    again = c.plan(16, 1, call="learner/7")  # the same call re-sent: the same batch
    assert [p.batch_size for p in again.plans] == [16] and again.args == first.args
    fresh = c.plan(32, 1, call="learner/8")
    assert [p.batch_size for p in fresh.plans] == [32]


# ------------------------------------------------------------------ loaders and factories (no Ray)
@pytest.fixture
def prefix():
    yield "adversarial_source"
    registry._REGISTRY.pop("adversarial_source", None)


def test_a_factory_string_whose_attribute_is_missing_names_the_prefix(prefix):
    registry.register_dataset(prefix, "os:no_such_loader")
    with pytest.raises(ImportError, match=f"{prefix}.*os:no_such_loader.*no attribute"):
        registry.load_dataset(f"{prefix}:x", batch_size=4)


def test_a_factory_string_naming_something_not_callable_says_so(prefix):
    registry.register_dataset(prefix, "os:sep")
    with pytest.raises(TypeError, match=f"{prefix}.*os:sep.*callable.*got str"):
        registry.load_dataset(f"{prefix}:x")


def test_a_loader_that_returns_an_id_instead_of_a_dataset_is_refused(prefix):
    registry.register_dataset(prefix, lambda name, **kw: f"{prefix}:{name}")  # would load itself without end
    with pytest.raises(TypeError, match="return a dataset, got the str"):
        registry.as_chunk_dataset(f"{prefix}:x", batch_size=4)


def test_register_dataset_refuses_to_overwrite_and_keeps_the_old_factory(prefix):
    old = lambda name, **kw: "old"  # noqa: E731
    registry.register_dataset(prefix, old)
    with pytest.raises(ValueError, match="already registered"):
        registry.register_dataset(prefix, lambda name, **kw: "new")
    with pytest.raises(ValueError, match="module:attribute"):
        registry.register_dataset(prefix, "broken", overwrite=True)
    assert registry.load_dataset(f"{prefix}:x") == "old"
    registry.register_dataset(prefix, lambda name, **kw: "new", replace=True)
    assert registry.load_dataset(f"{prefix}:x") == "new"


def test_a_transform_that_changes_the_row_count_is_refused_and_writes_nothing(tmp_path, monkeypatch):
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    monkeypatch.setenv("RAYRB_HOME", str(tmp_path / "home"))
    source = ReplayBuffer(storage=LazyTensorStorage(10))
    source.extend(TensorDict({"x": torch.arange(10)}, [10]))
    source.append_transform(lambda td: td[:-2])
    with pytest.raises(ValueError, match=r"one row per stored row \(10\).*\(8,\)"):
        registry.as_chunk_dataset(source)
    assert not (tmp_path / "home" / "tmp").exists() or not any((tmp_path / "home" / "tmp").iterdir())


# ------------------------------------------------------------------ through Ray
KW = {"online_capacity": 1000, "num_offline_shards": 1, "num_online_shards": 2, "seed": 3, "batch_size": 8,
      "prefetch": 0}


def _half_sent(rb, tmp_path, write_id, data):
    """A coordinator that died between the pieces of a journalled write: shard 0 got its half, shard 1 nothing."""
    import ray

    pass
    from rayrb.durability.coordinator_state import CoordinatorState

    n = len(data)
    ray.get(rb.rpc.by_side["online"][0].extend.remote(ray.put(rb._writer.rows(data, "rows")), 0, n // 2, first=0))
    CoordinatorState(next((tmp_path / "state").rglob("coordinator"))).journal(
        write_id, [(0, 0, n // 2, 0), (1, n // 2, n, 0)])
    kill_coordinator(rb)


@pytest.mark.usefixtures("ray_session")
def test_a_retry_with_another_row_count_is_refused_and_changes_nothing(make_buffer, tmp_path):
    rb = make_buffer(rows(0, 50), **KW, **coordinator_places())  # its journal is the coordinator's
    _half_sent(rb, tmp_path, "half", rows(2000, 150))  # 75 rows on shard 0, shard 1's 75 never sent
    done = rb.extend(rows(1000, 30), write_id="done")
    with pytest.raises(ValueError, match=r"'done'.*30 rows.*retry of 20"):
        rb.extend(rows(1000, 20), write_id="done")  # answering it would give 30 indices for 20 rows
    before = (rb.write_count, online_ids(rb))
    with pytest.raises(ValueError, match=r"'half'.*150 rows.*retry of 100"):
        rb.extend(rows(2000, 100), write_id="half")  # its missing piece would be cut from rows it lacks
    assert (rb.write_count, online_ids(rb)) == before
    indices = rb.extend(rows(2000, 150), write_id="half")  # the true retry still finishes it, once
    assert len(set(indices.tolist()) | set(done.tolist())) == 180
    assert online_ids(rb) == list(range(1000, 1030)) + list(range(2000, 2150))
    after = rb.extend(rows(3000, 10))  # and later writes go after every row
    assert set(after.tolist()).isdisjoint(indices.tolist()) and rb.write_count == 190


@pytest.mark.usefixtures("ray_session")
def test_a_half_sent_write_whose_place_was_taken_survives_a_second_restart(make_buffer, tmp_path):
    rb = make_buffer(rows(0, 50), **KW, **coordinator_places())  # its journal is the coordinator's
    _half_sent(rb, tmp_path, "w", rows(1000, 150))
    other = rb.extend(rows(5000, 90), write_id="other")  # takes shard 1's rows 0-89, past w's piece there
    kill_coordinator(rb)  # the journal still says w's piece is at shard 1's rows 0-74
    indices = rb.extend(rows(1000, 150), write_id="w")
    assert set(indices.tolist()).isdisjoint(other.tolist()) and len(set(indices.tolist())) == 150
    assert online_ids(rb) == list(range(1000, 1150)) + list(range(5000, 5090))
    rb.offline_fraction = 0.0
    got = {}
    for _ in range(30):
        batch, info = rb.sample(64, return_info=True)
        got.update(zip((info["shard"] * 500 + info["index"]).tolist(), batch["id"].tolist()))
    for i, row in zip(indices.tolist(), range(1000, 1150)):  # each answered index holds its own row
        assert got.get(i, row) == row


@pytest.mark.usefixtures("ray_session")
def test_two_writers_under_one_write_id_with_the_same_row_count_are_told_apart_by_their_rows(make_buffer):
    """A write_id names one writer's write: the same rows again are a retry (answered, not written), other rows
    under it are refused, never dropped while their writer is told they landed; also after the coordinator
    restarted, from its journal."""
    from rayrb.errors import WriteIdError

    rb = make_buffer(rows(0, 50), **KW)
    first = rb.extend(rows(1000, 40), write_id="collector-0/step-7")
    version = rb.rpc.version()
    with pytest.raises(WriteIdError, match=r"'collector-0/step-7'.*other rows"):
        rb.extend(rows(2000, 40), write_id="collector-0/step-7")  # another writer, the same id and row count
    assert rb.rpc.version() == version  # refused: nothing changed, not even the version other handles follow
    assert torch.equal(rb.extend(rows(1000, 40), write_id="collector-0/step-7"), first)  # the retry
    assert online_ids(rb) == list(range(1000, 1040)) and rb.write_count == 40
    kill_coordinator(rb)
    with pytest.raises(WriteIdError, match="other rows"):
        rb.extend(rows(2000, 40), write_id="collector-0/step-7")
    assert torch.equal(rb.extend(rows(1000, 40), write_id="collector-0/step-7"), first)
    assert online_ids(rb) == list(range(1000, 1040)) and rb.write_count == 40


@pytest.mark.usefixtures("ray_session")
def test_an_extend_whose_coordinator_died_with_the_call_asks_again_under_its_id(make_buffer, monkeypatch):
    """Ray re-sends a call a bounded number of times; when the coordinator died with it that often, the write may
    have landed. The handle asks again under the same write id (answered from the journal: landed once), and
    where it must give up, its error names the write id for a retry."""
    from ray.exceptions import RayActorError

    from rayrb.errors import BufferUnavailableError

    rb = make_buffer(rows(0, 50), **KW, **coordinator_places())  # its journal is the coordinator's
    real, failures = rb.rpc.call, []

    def dies_after_applying(method, *args, **kwargs):
        out = real(method, *args, **kwargs)
        if method.startswith("extend") and len(failures) < 2:  # applied (rows in the call or not), no answer, twice
            failures.append(method)
            raise BufferUnavailableError("an actor of this buffer is dead") from RayActorError()
        return out

    monkeypatch.setattr(rb.rpc, "call", dies_after_applying)
    indices = rb.extend(rows(1000, 30), write_id="w")
    assert len(failures) == 2 and rb.write_count == 30 and online_ids(rb) == list(range(1000, 1030))
    assert torch.equal(rb.extend(rows(1000, 30), write_id="w"), indices)

    def always_dies(method, *args, **kwargs):
        raise BufferUnavailableError("an actor of this buffer is dead") from RayActorError()

    monkeypatch.setattr(rb.rpc, "call", always_dies)
    monkeypatch.setattr("rayrb.handle.writes.MAX_ASKS", 3)
    with pytest.raises(BufferUnavailableError, match="write_id='w2'") as caught:
        rb.extend(rows(2000, 5), write_id="w2")
    assert caught.value.write_id == "w2"
