"""The online shard actor: a circular buffer over ``OnlineStorage`` that copies rows on insert, so it never keeps
a view into an object-store buffer (pinned plasma memory, ray#8234), with the replicas it forwards its pieces to
(``rayrb.actors.replication``; what it does as one copy of several: ``rayrb.actors.shard_copies``). Reads and the
rest it shares with the offline shard (``rayrb.actors.shards``).
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rayrb.actors.inline import joined
from rayrb.actors.publishing import Publisher, Target
from rayrb.actors.replication import Replication, lookup
from rayrb.actors.shard_copies import ShardCopies
from rayrb.actors.shards import Rows, Shard
from rayrb.actors.timer import every
from rayrb.core.schema import RowSpec
from rayrb.core.validation import positive_int
from rayrb.durability.appends import Appender, WriteLock
from rayrb.durability.runs import advance, held_runs
from rayrb.durability.storage import OnlineStorage, store_rows
from rayrb.errors import InvalidArgumentError, RowsLostError

CHECK_EVERY = 2.0  # seconds between a primary's checks of its replicas when no write comes


class OnlineShard(ShardCopies, Shard):
    """A circular buffer of ``capacity`` rows; the oldest rows are overwritten first.

    Rows, generations, the write count and priorities live in
    ``OnlineStorage``, memory-mapped under ``state_dir`` when
    given: a restarted shard reopens them with every acknowledged write.
    """

    kind = "online"

    def __init__(self, spec_json: Mapping[str, Any], capacity: int, shard_id: str, sampler: str = "uniform",
                 sampler_options: Mapping[str, float] | None = None, state_dir: str | None = None,
                 device: str | None = None, replicas: Sequence[str] = (), coordinator: str | None = None):
        capacity = positive_int(f"shard {shard_id}: capacity", capacity)
        super().__init__(shard_id, sampler, capacity=capacity, sampler_options=sampler_options, device=device,
                         state_dir=state_dir)
        self._spec = RowSpec.from_json(spec_json)
        self._capacity = int(capacity)
        lock = WriteLock(state_dir)  # writers on this node append to the files too (rayrb.durability.appends)
        with lock.held():
            self._store = OnlineStorage(self._spec, self._capacity, state_dir)
            self._data, self._gen = self._store.rows, self._store.generation
            self._sampler.bind(self._data, self._gen, count=self._store.count_map)
            # writes applied beyond the write count (behind a piece still to come): first row -> end; a
            # restarted shard finds them again from the generations
            self._held: dict[int, int] = dict(held_runs(self._gen, self._store.written))
            # the pieces placed at the write count, by this actor or a writer on its node, and their journal; a
            # shard with replicas publishes its count once they hold the rows too (``append``)
            self._files = Appender(self._store, lock=lock, publish=None if replicas else self._publish)
        self._publisher = Publisher()  # where its count is published: told by the coordinator (publish_to)
        self._stream, self._fence = None, 0  # as a replica: its pieces' stream, and the fence frames must carry
        self._mirror()
        if self._store.reopened:
            self._sampler.on_write(np.arange(self.size()))
        self._sampler.attach(self._store.priority, self._store.max_priority, self._store.reopened)
        self._replication = Replication(replicas, lambda: self.state(journal=True),
                                        lambda: self._publisher.target) if replicas else None
        # Restarted without its files (its node was lost): its rows come from its replicas, or are lost
        self._lost = bool(self._lives.restarts) and not self._store.reopened
        if self._replication is not None:
            # Restarted, files found or not (they may be older than what was acknowledged): the replicas' rows
            # are taken before any call, the newer winning (``merge``); unsure: merging empty ones changes nothing
            if (self._lives.restarts or self._lives.unsure) and self._replication.take_all(self.merge, self.shard_id):
                self._lost = False
            every(CHECK_EVERY, "check_replicas")
        if self._lost and coordinator is not None:  # its count went back: the coordinator takes it again
            lookup(coordinator).resync.remote()
        if coordinator and (self._lives.restarts or self._lives.unsure):  # a restart asks where it publishes
            self._publisher = Publisher(lookup(coordinator).publish_target.remote(shard_id))
        self._lives.ready()

    def size(self) -> int:
        return self._store.size

    def written(self) -> int:
        """Rows ever written (the write count); ``size()`` is this capped at the capacity."""
        return self._store.written

    @property
    def _capacity_for_reads(self) -> int:
        return self._capacity

    def write_state(self) -> tuple[int, list[tuple[int, int]]]:
        """The write count, and the runs of rows held beyond it (written behind a piece that has not landed)."""
        with self._files.locked():
            return self._store.written, held_runs(self._gen, self._store.written)

    def extend(self, rows: Mapping[str, np.ndarray], start: int = 0, stop: int | None = None,
               first: int | None = None, forward: list | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Copy ``rows[start:stop]`` in as this shard's ``first``-th rows on; return their slots and generations.

        ``first`` is the write count the coordinator planned with, and it names the
        write: the ``w``-th row ever written goes to slot ``w mod capacity`` with
        generation ``w // capacity + 1``. So a write lands in the same place whenever
        it runs: a retry (after a restart, in whatever order Ray re-sends tasks) never
        lands twice, and never over a newer row. The write count advances over
        contiguous writes only, so a restart still finds every write that completed.
        ``forward`` holds what a shard with replicas passes on to them (``rayrb.actors.replication``): the rows'
        ref, unresolved, which each fetches itself, or the rows, sent in the call. A piece this copy fails to
        store after sending it has its replicas rebuilt from this copy.
        """
        t0 = time.perf_counter()
        first = self._store.written if first is None else int(first)
        if self._lost and first > self._store.written:
            # placed over rows this shard lost with its node (sent before the coordinator took its count again):
            # refused whole, so that the write's retry places it anew at the count there is
            raise RowsLostError(f"shard {self.shard_id}: expected a piece at its count {self._store.written} or "
                                f"below, got one at {first}: the rows before it were lost with this shard's node")
        sent: list = []
        rows = {k: v[start:stop] for k, v in rows.items()}
        n = self._spec.validate(rows, what=f"rows for shard {self.shard_id}")
        if forward and self._replication is not None:  # sent first: the replicas copy while this copy does
            sent = self._replication.send(forward[0], start, stop, first, piece=rows)
        try:
            with self._files.locked():
                pos, gen = self._store_rows(rows, first, n)
                self._advance(first, first + n)  # last: this is what makes the rows visible after a restart
        except BaseException:
            if forward and self._replication is not None:  # they were sent a piece this copy does not hold
                self._replication.redo()
            raise
        if self._replication is not None:  # acknowledged once every live replica holds the rows too
            self._replication.settle(sent, self.order())
        self._metrics.observe("extend_ms", (time.perf_counter() - t0) * 1e3)
        return pos, gen

    def extend_parts(self, how: Mapping[str, Any], *parts: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """``extend`` with its rows carried in the call, cut in ``parts`` (``rayrb.actors.inline``), its other
        arguments in ``how``, where ``forward`` says whether the rows go on to the replicas."""
        rows, how = joined(parts), dict(how)
        forward = [rows] if how.pop("forward") else None
        return self.extend(rows, **how, forward=forward)

    def append(self, rows: Mapping[str, np.ndarray], write_id: str, piece: int = 0, start: int = 0,
               digest: str | None = None, stop: int | None = None, forward: list | None = None
               ) -> tuple[np.ndarray, int, bool]:
        """A piece of a write this shard places itself (``rayrb.handle.direct``): its rows in as this shard's
        next rows, at its write count (``rayrb.durability.appends``); their slots, the write count after,
        whether the count was published in the coordinator's counts map (else the writer tells the
        coordinator), once every live replica holds the piece too. ``rows`` is the
        piece, which starts at row ``start`` of its write, or with ``stop`` the whole write, of which the piece
        is ``[start, stop)``. A piece placed before under ``(write_id, piece)`` is answered from the journal and
        written once; other rows under it are refused (``WriteIdError``). ``forward``: ``rows``' object-store ref,
        unresolved, which replicas sent the piece by call are sent instead of the rows (each fetches them itself).

        With replicas, this copy copies the piece in and counts it first, then sends it on (``_send_on``)."""
        t0 = time.perf_counter()
        bounds = (start, stop) if stop is not None else (0, None)  # the piece within what is forwarded
        if stop is not None:
            rows = {k: v[start:stop] for k, v in rows.items()}
        n = self._spec.validate(rows, what=f"rows for shard {self.shard_id}")
        if n == 0:
            raise InvalidArgumentError(f"shard {self.shard_id}: expected a piece of at least one row, got none")
        if self._publisher.take_asked():
            self.publish_to(None, taken=True)
        try:
            done = self._files.append(rows, write_id, piece, start, digest, store=self._store_rows)
        except BaseException:
            if self._table is not None:  # the files were put back: so is the device copy
                self._mirror()
            raise
        published = self._publisher.publishing
        if done.answered:
            self._metrics.count("writes_answered_again")
        if self._replication is not None:
            write = (write_id, int(piece), int(start), digest)
            published = self._send_on(rows, write, done, forward[0] if forward else None, bounds) or published
        self._metrics.observe("extend_ms", (time.perf_counter() - t0) * 1e3)
        return done.slots, done.written, published

    def append_parts(self, how: Mapping[str, Any], *parts: Mapping[str, np.ndarray]
                     ) -> tuple[np.ndarray, int, bool]:
        """``append`` with its rows carried in the call, cut in ``parts`` (``rayrb.actors.inline``), and its other
        arguments in ``how``."""
        return self.append(joined(parts), **how)

    def pieces_of(self, write_id: str) -> dict[int, tuple[int, int, int, str | None]]:
        """The pieces of ``write_id`` this shard placed: piece -> ``(first, rows, start, digest)``."""
        with self._files.locked():
            self._files.ids.sync(self._store.written)
            return {p: tuple(v) for p, v in self._files.ids.of(write_id).items()}

    def publish_to(self, target: Target | None, taken: bool = False, now: bool = True) -> bool:
        """Publish this shard's count in the coordinator's counts map ``target = (node, path, index)`` from now on,
        when it is on this node (``rayrb.actors.publishing``); whether it is. Publishes the count now, unless
        ``now`` is false (a replica, told by its primary: it publishes only the counts its primary's frames ask it
        to). A primary passes the target on to its replicas."""
        if not taken:
            self._publisher.to(target)
        if self._replication is not None:
            self._replication.publish_to()
        if now:
            with self._files.locked():
                self._publish(self._store.written)
        return self._publisher.publishing

    def _publish(self, written: int) -> None:
        self._publisher.publish(written)

    def _store_rows(self, rows: Mapping[str, np.ndarray], first: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Copy ``n`` rows in as the ``first``-th on (the count is not moved): their slots and generations."""
        w = first + np.arange(n, dtype=np.int64)
        pos, gen = w % self._capacity, w // self._capacity + 1
        fresh = (w >= first + n - self._capacity) & (self._gen[pos] < gen)  # a write larger than the shard keeps its tail
        kept = pos[fresh]
        if self._table is not None:  # the device copy serves reads: written first, as it may refuse the rows
            self._table.write(kept, {k: rows[k][fresh] for k in self._data})
        try:  # copies out of the object store, marked as being written meanwhile (store_rows)
            store_rows(self._data, self._gen, kept, rows, fresh, gen[fresh])
        except BaseException:
            if self._table is not None:  # back to what the memory maps hold
                self._table.write(kept, {k: v[kept] for k, v in self._data.items()})
            raise
        self._sampler.on_write(kept)
        self._metrics.count("rows_written", int(fresh.sum()))
        return pos, gen

    def _advance(self, first: int, end: int) -> None:
        self._store.written = advance(self._held, self._store.written, first, end)

    def _mirror(self) -> None:
        """The device copy of the storage (what a restart reopened, or zeros), when rows live on a device."""
        if self._device is not None:
            from rayrb.io.device_table import DeviceTable

            self._table = DeviceTable.from_arrays(self._data, self._device)

    def _gather(self, idx: np.ndarray) -> Rows:
        if self._table is not None:
            return self._table.numpy(idx)
        return {k: v[idx] for k, v in self._data.items()}

    def gather(self, idx: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        with self._files.locked():  # no append of a writer on this node runs during the copy
            return super().gather(idx)

    def _generation(self, idx: np.ndarray) -> np.ndarray:
        return self._gen[idx]

    def _unchanged(self, idx: np.ndarray, generation: np.ndarray) -> bool:
        # writers on this node append to the files without this actor (rayrb.durability.appends)
        return self._table is not None or bool((self._gen[idx] == generation).all())

    def stats(self) -> dict[str, Any]:
        self._metrics.gauge("write_count", self._store.written)
        self._metrics.gauge("capacity", self._capacity)
        self._metrics.gauge("torn_slots", int((self._gen < 0).sum()))  # left by a crash mid-write, until re-sent
        out = super().stats()
        if self._replication is not None:
            report = self._replication.report(self._store.written)
            self._metrics.gauge("replicas_live", self._replication.live())
            self._metrics.gauge("replica_rows_behind", max((r["behind"] or 0 for r in report), default=0))
            out = {**out, **self._metrics.snapshot(), "node": self.place()["node"], "replicas": report}
        return out

    def close(self) -> None:
        """Remove this shard's files, and its replicas' (the buffer is being shut down for good)."""
        if self._replication is not None:
            self._replication.close_all()
        if self._stream is not None:
            self._stream.close()
        super().close()
