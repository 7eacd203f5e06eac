"""Run in a subprocess: a ray.cluster_utils.Cluster loses nodes without grace while writers retry by write id and a
sampler samples. ``argv``: a scratch directory, then the scenarios to run in one cluster, one after the other:
``2`` and ``1`` (the copies of each online shard), ``stream`` (the seeded stream), ``slices`` (slices of episodes
with two copies); none named: all four.

Each loss removes a node (``allow_graceful=False``) and, since the simulated nodes share this machine's disk, the
state directories of the actors that ran on it (that node's local disk); a fresh node joins after it, as an
autoscaler would replace it. With 2 copies: the node of online shard 0's serving copy, then the coordinator's node,
then the node shard 0 was moved to; its rows are wide (``PAD``): each write is two parts in the calls, to the
primary and on. With 1 copy: shard 0's node only. Prints one marked JSON line: what was
acknowledged, what the shards hold at the end, every batch's split, and how long the buffer took to answer again,
by scenario (a scenario that raised gives its traceback, and the next one runs).

One cluster for every scenario: a node lost in one is replaced by a fresh one before the next starts, so each
starts on three live worker nodes, as it would on a cluster of its own. The head holds the twin of ``stream``
only: every other actor asks for a ``worker`` resource, which the head has none of.
"""
import os
import shutil
import signal
import sys
import threading
import time
import traceback

import numpy as np
import ray
from cluster_util import local_cluster, report

FAST_HEALTH_CHECKS = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                      "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}
ROWS, OFFLINE_ROWS, BATCH = 16, 1000, 64
PAD = 1500  # float32 beside x in each row with two copies: a write of ROWS rows is two parts in the call (96 KiB)
WORKER_RESOURCES = {"worker": 10}
ON_A_WORKER = {"num_cpus": 0.01, "resources": {"worker": 0.01}}  # never on the head, which is not lost


def where(actor) -> tuple[str, str, int]:
    """``(node id, state directory, process id)`` of a shard or the coordinator."""
    return ray.get(actor.__ray_call__.remote(lambda self: (
        ray.get_runtime_context().get_node_id(),
        str(self._state.directory) if hasattr(self, "_writing") else self._state_dir, os.getpid())), timeout=120)


class Load:
    """Two writers retrying each write under its id until it is acknowledged, and one sampler checking each split."""

    def __init__(self, rb, pad: int = 0):
        self.rb, self.stop, self.pad = rb, threading.Event(), pad
        self.mixed = 0  # rows sampled whose pad is not their x (a row of two writes, or parts joined wrong)
        self.acked: dict[int, int] = {}  # row value -> its online index
        self.started: dict[int, float] = {}  # row value -> when its write was first sent
        self.splits: list[int] = []  # offline rows in each batch
        self.last_write = self.last_sample = time.monotonic()
        self.errors, self.messages, self.odd = [], [], []  # exception names, their texts, batches split otherwise
        self.first_ack: float | None = None
        self.threads = [threading.Thread(target=self.write, args=(w,)) for w in range(2)]
        self.threads.append(threading.Thread(target=self.sample))
        for t in self.threads:
            t.start()

    def write(self, w: int) -> None:
        seq = 0
        while not self.stop.is_set():
            x = np.arange(ROWS, dtype=np.int64) + (w * 10_000_000 + seq * ROWS)
            started = time.monotonic()
            while True:
                try:
                    idx = self.rb.extend(wide(x, self.pad), write_id=f"w{w}-{seq}")
                    break
                except Exception as e:  # a node is gone: the same write again, under its id
                    self.errors.append(type(e).__name__)
                    self.messages.append(str(e)[-1500:])
                    time.sleep(0.2)
            self.acked.update(zip(x.tolist(), idx.tolist()))
            self.first_ack = self.first_ack or time.monotonic()
            self.started.update(dict.fromkeys(x.tolist(), started))
            self.last_write = time.monotonic()
            seq += 1
            time.sleep(0.02)

    def sample(self) -> None:
        while not self.stop.is_set():
            # a batch is all offline while the online side is empty, and may be planned so as of the batch before
            online = self.first_ack is not None and time.monotonic() - self.first_ack > 1.0
            try:
                batch = self.rb.sample(BATCH)
            except Exception as e:
                self.errors.append(type(e).__name__)
                time.sleep(0.2)
                continue
            if self.pad:
                self.mixed += int((batch["pad"].numpy() != batch["x"].numpy()[:, None]).any(axis=1).sum())
            if online:
                self.splits.append(int((batch["x"] < 0).sum()))
                if self.splits[-1] != BATCH // 2:
                    self.odd.append((len(batch), self.splits[-1], time.monotonic()))
            self.last_sample = time.monotonic()

    def answered_since(self, t: float) -> bool:
        return self.last_write > t and self.last_sample > t

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)


def lose(cluster, nodes: dict, node_id: str, dirs: list[str], pids: list[int] = ()) -> None:
    """Remove ``node_id`` without grace, the processes on it (``pids``: a worker may outlive its raylet by a
    moment here, and answer a call from files already gone) and its local disk (``dirs``); a fresh node joins."""
    gone = nodes.pop(node_id)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    cluster.remove_node(gone, allow_graceful=False)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    fresh = cluster.add_node(num_cpus=1, resources=WORKER_RESOURCES)
    nodes[fresh.node_id] = fresh


def recover(load: Load, t0: float, limit: float = 180.0) -> float:
    """Seconds from ``t0`` until a write was acknowledged and a batch sampled after it."""
    while not load.answered_since(t0):
        if time.monotonic() - t0 > limit:
            raise RuntimeError(f"the buffer did not answer within {limit} s; errors: {load.errors[-5:]}")
        time.sleep(0.05)
    return max(load.last_write, load.last_sample) - t0


def replicated(rb, limit: float = 120.0) -> float:
    """Seconds until every online shard's copies are live and level again."""
    t0 = time.monotonic()
    while True:
        shards = [s for s in rb.stats()["shards"] if "replicas" in s]
        if all(r["status"] == "live" and r["behind"] == 0 for s in shards for r in s["replicas"]):
            return time.monotonic() - t0
        if time.monotonic() - t0 > limit:
            raise RuntimeError(f"copies not rebuilt within {limit} s: {[s['replicas'] for s in shards]}")
        time.sleep(0.5)


def held(rb, num_offline: int) -> tuple[list[int], int]:
    """Every row value the online shards' serving copies hold, and how many of them are held beyond a gap (written
    behind rows that never landed: counted once later writes fill the gap)."""
    out, beyond = [], 0
    for shard in rb.rpc.shards[num_offline:]:
        state = ray.get(shard.state.remote())
        out += state["rows/x"][state["generation"] > 0].tolist()
        beyond += int((state["generation"] > 0).sum()) - ray.get(shard.size.remote())
    return out, beyond


def tally(rb, load: Load, lost: int, first_loss: float) -> dict:
    """What the online shards hold against what was acknowledged (``lost``: the shard whose node went first)."""
    values, beyond = held(rb, 1)
    counts = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    acked = load.acked
    missing = [v for v in acked if v not in counts]
    per_shard = rb.stats()["coordinator"]["online_capacity"]
    shard_of = {v: int(np.searchsorted(np.cumsum(per_shard), i, side="right")) for v, i in acked.items()}
    return {"acked": len(acked), "held": len(values), "held_beyond_a_gap": beyond, "lost": len(missing),
            # rows on the lost shard whose write was sent before the loss (some were in flight)
            "on_lost_shard_before": sum(shard_of[v] == lost and load.started[v] < first_loss for v in acked),
            "lost_written_after_first_loss": sum(load.started[v] >= first_loss for v in missing),
            "lost_elsewhere": sum(shard_of[v] != lost for v in missing), "in_flight_max": 2 * ROWS,
            "doubled": sum(c > 1 for c in counts.values()), "unacked_held": sum(v not in acked for v in counts),
            "batches": len(load.splits), "inexact": sum(s != BATCH // 2 for s in load.splits),
            "errors": sorted(set(load.errors)), "messages": load.messages[:3],
            "odd": [(n, k, t - first_loss) for n, k, t in load.odd][:10], "mixed": load.mixed}


def wide(x: np.ndarray, pad: int) -> dict[str, np.ndarray]:  # with pad: a row's x again in each pad column
    return {"x": x, "pad": np.repeat(x[:, None].astype(np.float32), pad, axis=1)} if pad else {"x": x}


def losses(cluster, nodes: dict, tmp: str, replicas: int) -> dict:
    """Writers and a sampler through the losses of the scenario with ``replicas`` copies (the module's docstring)."""
    from rayrb import OfflineToOnlineReplayBuffer

    # one copy: each online shard on a node of its own, so that one can be lost without the coordinator
    placed = {"online_replicas": 2} if replicas > 1 else {"online_nodes": list(nodes)[:2]}
    pad = PAD if replicas > 1 else 0  # two copies: writes of two parts each, each part sent on to the replicas
    rb = OfflineToOnlineReplayBuffer(wide(-1 - np.arange(OFFLINE_ROWS, dtype=np.int64), pad), num_online_shards=2,
                                     online_capacity=60_000 if pad else 100_000, offline_fraction=0.5,
                                     seed=0, timeout=120, **placed,
                                     storage_dir=os.path.join(tmp, "state"), dataset_root=os.path.join(tmp, "ds"),
                                     actor_options=ON_A_WORKER)
    load = Load(rb, pad)
    time.sleep(3)
    online = rb.rpc.shards[1:]
    coordinator_node = where(rb.rpc.coord)[0]
    lost = next((i for i, s in enumerate(online) if where(s)[0] != coordinator_node), 0)
    copies = [ray.get_actor(f"{rb._name}/on-{i}.r{r}") for i in range(2) for r in range(1, replicas)]
    plan = [("shard", lambda: where(online[lost])[0])]
    if replicas > 1:
        plan += [("coordinator", lambda: where(rb.rpc.coord)[0]),
                   ("shard again", lambda: where(online[lost])[0])]
    result = {"replicas": replicas, "losses": []}
    for what, node_of in plan:
        node = node_of()
        actors = [rb.rpc.coord, *rb.rpc.shards, *copies]
        here = [(d, pid) for n, d, pid in (where(a) for a in actors) if n == node]
        acked_before = len(load.acked)
        t0 = time.monotonic()
        if not result["losses"]:
            first_loss = t0
        lose(cluster, nodes, node, [d for d, _ in here if d], [pid for _, pid in here])
        entry = {"what": what, "node": node, "dirs": len(here), "acked_before": acked_before,
                 "recovery_s": recover(load, t0)}
        if replicas > 1:
            entry["rebuilt_s"] = replicated(rb)
        result["losses"].append(entry)
        time.sleep(2)
    load.close()
    result.update(tally(rb, load, lost, first_loss))
    result["coordinator_lost"] = coordinator_node == result["losses"][0]["node"]
    rb.shutdown()
    return result


def stream(cluster, nodes: dict, tmp: str) -> dict:
    """The seeded stream through the loss of the coordinator's node: a buffer with two copies (on worker nodes) and a
    twin with one (on the head, never lost), the same rows written to both, sample the same batches before and after
    the node of the first one's coordinator is removed with its files."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rayrb import OfflineToOnlineReplayBuffer

    head = ray.get_runtime_context().get_node_id()
    # prefetch=0: draws a handle holds ahead are dropped at any restart (docs/durability.md), here as in place
    common = dict(online_capacity=10_000, num_online_shards=2, offline_fraction=0.5, seed=7, timeout=120,
                  prefetch=0)
    offline = {"x": -1 - np.arange(OFFLINE_ROWS, dtype=np.int64)}
    rb = OfflineToOnlineReplayBuffer(offline, **common, online_replicas=2, storage_dir=os.path.join(tmp, "a"),
                                     dataset_root=os.path.join(tmp, "ds-a"),
                                     actor_options=ON_A_WORKER)
    twin = OfflineToOnlineReplayBuffer(offline, **common, storage_dir=os.path.join(tmp, "b"),
                                       dataset_root=os.path.join(tmp, "ds-b"), actor_options={
                                           "scheduling_strategy": NodeAffinitySchedulingStrategy(head, False)})
    for k in range(20):
        for b in (rb, twin):
            b.extend({"x": np.arange(k * ROWS, (k + 1) * ROWS, dtype=np.int64)})
    before = [[b.sample(BATCH)["x"].tolist() for _ in range(30)] for b in (rb, twin)]
    node, directory, pid = where(rb.rpc.coord)
    t0 = time.monotonic()
    lose(cluster, nodes, node, [directory], [pid])
    rb.sample(BATCH)  # waits out the restart
    recovery = time.monotonic() - t0
    twin.sample(BATCH)
    after = [[b.sample(BATCH)["x"].tolist() for _ in range(30)] for b in (rb, twin)]
    moved = where(rb.rpc.coord)[0] != node
    replica_reads = read_beside_a_replica(rb, twin)
    rb.shutdown()
    twin.shutdown()
    first_diff = next((i for i, (a, b) in enumerate(zip(*after)) if a != b), None)
    return {"same_before": before[0] == before[1], "same_after": after[0] == after[1], "moved": moved,
            "recovery_s": recovery, "first_different_batch": first_diff, **replica_reads}


class EpisodeLoad(Load):
    """``Load`` writing episodes: two writers writing episodes of three calls of ``per_write`` steps (each call
    retried under its id), and a sampler checking that every batch is whole slices of ``steps`` (offline values
    count down, online ones up) and, once the first write is a second old, split exactly."""

    def __init__(self, rb, steps: int, per_write: int):
        # batches not whole slices (set before Load starts the threads that fill it)
        self.steps, self.per_write, self.bad = steps, per_write, []
        super().__init__(rb)

    def write(self, w: int) -> None:
        e = 0
        while not self.stop.is_set():
            for part in range(3):
                x = np.arange(self.per_write, dtype=np.int64) + (w * 10_000_000 + e * 100 + part * self.per_write)
                rows = {"x": x, "ep": np.full(self.per_write, w * 1_000_000 + e, np.int64)}
                while True:
                    try:
                        idx = self.rb.extend(rows, write_id=f"w{w}-{e}-{part}")
                        break
                    except Exception as err:  # a node is gone: the same write again, under its id
                        self.errors.append(f"{type(err).__name__}: {str(err)[-300:]}")
                        time.sleep(0.2)
                self.acked.update(zip(x.tolist(), idx.tolist()))
                self.first_ack = self.first_ack or time.monotonic()
            e += 1
            time.sleep(0.02)

    def sample(self) -> None:
        n = self.steps
        while not self.stop.is_set():
            t = time.monotonic()
            try:
                batch = self.rb.sample(16 * n)
            except Exception as err:
                self.errors.append(f"{type(err).__name__}: {str(err)[-300:]}")
                time.sleep(0.2)
                continue
            x, ep = batch["x"].numpy().reshape(-1, n), batch["ep"].numpy().reshape(-1, n)
            if not ((np.diff(x, axis=1) == np.where(x[:, :1] < 0, -1, 1)).all() and (ep == ep[:, :1]).all()):
                self.bad.append(x.tolist())
            if self.first_ack is not None and t - self.first_ack > 1.0:  # all offline until a slice is whole
                self.splits.append(int((x[:, 0] < 0).sum()))


def slices(cluster, nodes: dict, tmp: str) -> dict:
    """Slices with two copies of each online shard (``EpisodeLoad``), through the loss of the node of online shard
    0's serving copy (with its files); what was acknowledged is held once."""
    from rayrb import OfflineToOnlineReplayBuffer, SliceSampler

    steps = 4
    offline = {"x": -1 - np.arange(OFFLINE_ROWS, dtype=np.int64), "ep": -1 - np.arange(OFFLINE_ROWS) // 10}
    rb = OfflineToOnlineReplayBuffer(offline, online_capacity=100_000, num_online_shards=2, offline_fraction=0.5,
                                     seed=0, timeout=120, online_replicas=2,
                                     sampler=SliceSampler(slice_len=steps, traj_key="ep"),
                                     storage_dir=os.path.join(tmp, "state"), dataset_root=os.path.join(tmp, "ds"),
                                     actor_options=ON_A_WORKER)
    load = EpisodeLoad(rb, steps, per_write=4)
    time.sleep(4)
    node = where(rb.rpc.shards[1])[0]
    copies = [ray.get_actor(f"{rb._name}/on-{i}.r1") for i in range(2)]
    here = [(d, pid) for n, d, pid in (where(a) for a in [rb.rpc.coord, *rb.rpc.shards, *copies]) if n == node]
    batches_before = len(load.splits)
    lose(cluster, nodes, node, [d for d, _ in here if d], [pid for _, pid in here])
    rebuilt = replicated(rb)
    time.sleep(3)
    load.close()
    values, _ = held(rb, 1)
    counts = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    after = [rb.sample(16 * steps)["x"].numpy().reshape(-1, steps) for _ in range(20)]
    rb.shutdown()
    acked = load.acked
    return {"acked": len(acked), "lost": sum(v not in counts for v in acked), "dirs": len(here),
            "doubled": sum(c > 1 for c in counts.values()), "unacked_held": sum(v not in acked for v in counts),
            "batches_before": batches_before, "batches": len(load.splits), "torn": len(load.bad),
            "torn_first": load.bad[:1], "inexact": sum(k != 8 for k in load.splits), "rebuilt_s": rebuilt,
            "whole_after": all((np.abs(np.diff(x, axis=1)) == 1).all() for x in after),
            "errors": sorted(set(load.errors))[:5]}


@ray.remote(num_cpus=0)
class Reader:
    """A handle in a process of its own: the batches it samples, and the directories of the online shards it read
    itself."""

    def run(self, handle, batches: int) -> tuple[list, list[str]]:
        out = [handle.sample(BATCH)["x"].tolist() for _ in range(batches)]
        local = handle.local_reads
        dirs = [] if local is None else [r._dir for r in local._readers.values() if hasattr(r, "_dir")]
        return out, dirs


def read_beside_a_replica(rb, twin) -> dict:
    """A handle on a node holding a replica of an online shard, and not the shard: it reads the replica's files
    itself, and samples what the twin's handle samples."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    primaries = {where(s)[0] for s in rb.rpc.shards[1:]}
    copies = [ray.get_actor(f"{rb._name}/on-{i}.r1") for i in range(2)]
    node = next((n for n, _, _ in map(where, copies) if n not in primaries), None)
    if node is None:  # every replica shares its node with a primary: nothing to show
        return {"replica_node": False}
    got = {}
    for name, buffer in (("rb", rb), ("twin", twin)):
        reader = Reader.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, False)).remote()
        got[name] = ray.get(reader.run.remote(buffer.client(), 20))
        ray.kill(reader)
    return {"replica_node": True, "same_beside_replica": got["rb"][0] == got["twin"][0],
            "replica_dirs_read": sum(d.rstrip("/").endswith(".r1") for d in got["rb"][1])}


def main(tmp: str, scenarios: list[str]) -> None:
    with local_cluster(workers=3, system_config=FAST_HEALTH_CHECKS, head_cpus=1,
                       worker_resources=WORKER_RESOURCES) as (cluster, workers):
        nodes = {w.node_id: w for w in workers}
        result = {}
        for name in scenarios:
            scratch = os.path.join(tmp, name)
            try:
                if name == "stream":
                    result[name] = stream(cluster, nodes, scratch)
                elif name == "slices":
                    result[name] = slices(cluster, nodes, scratch)
                else:
                    result[name] = losses(cluster, nodes, scratch, int(name))
            except Exception:
                result[name] = {"error": traceback.format_exc()[-3000:]}
        report(result)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["2", "1", "stream", "slices"])
