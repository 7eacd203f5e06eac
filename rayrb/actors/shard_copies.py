"""What an online shard does as one copy of several (``rayrb.actors.replication``): a replica's pieces, taking
another copy's rows (a merge at a restart, a rebuild, a restore) and the state a copy hands over. A mixin of
``OnlineShard``, apart so that the shard's write paths read on their own; it uses the shard's storage
(``_store``, ``_data``, ``_gen``, ``_held``), its journal and write lock (``_files``), its sampler, its
replicas (``_replication``), ``extend``, and as a replica its stream server and fence (``_stream``, ``_fence``:
``rayrb.actors.stream``). The rules for which copy wins live in ``rayrb.durability.copies``.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from rayrb.actors.inline import joined
from rayrb.actors.stream import Frame, StreamServer, node_address
from rayrb.durability.copies import copy_order, merged_count, take_newer
from rayrb.durability.runs import held_runs
from rayrb.errors import FencedFrameError, SavedStateError


class ShardCopies:
    """An online shard's methods as one copy among its replicas (see the module)."""

    def replicate(self, rows: Mapping[str, np.ndarray], start: int, stop: int, first: int,
                  write: tuple[str, int, int, str | None] | None = None) -> tuple[int, int]:
        """A piece its primary was given; this copy's ``order()`` after. ``write``: the piece's ``(write id, piece,
        start in its write, digest)`` where the primary placed it itself, journalled here as there (before the
        rows), so that a retry reaching this copy once it serves the shard is answered, not written again."""
        with self._files.locked():
            ids = self._files.ids
            ids.sync(self._store.written)
            new = write is not None and int(first) == self._store.written and ids.get(write[0], write[1]) is None
            if new:
                ids.add(write[0], write[1], first=int(first), rows=int(stop) - int(start), start=write[2],
                        digest=write[3])
            try:
                self.extend(rows, start, stop, first=first)
            except BaseException:
                if new:
                    ids.forget(write[:2])
                raise
        return self.order()

    def _send_on(self, rows: Mapping[str, np.ndarray], write: tuple, done: Any, ref: Any, bounds: tuple) -> bool:
        """A piece this primary placed and counted itself (``append``: ``done``), sent on to its replicas and
        awaited, where the frames and calls are owned (a writer awaiting calls through refs it borrows cost more
        CPU: ``docs/benchmarks.md``, "Rows in the call"); a retry answered from the journal checks them instead
        (this copy may have died between counting the piece and sending it). Then the count is published where
        this copy can; whether a replica published it (a frame asks one beside the coordinator to, where this
        copy cannot). ``ref``: the rows' object-store ref, which replicas sent the piece by call fetch themselves,
        the piece ``bounds`` of it."""
        if done.answered:
            self._replication.check(self.order())
            published = False
        else:
            n = len(done.slots)
            a, b = bounds if ref is not None else (0, n)
            sent = self._replication.send(rows if ref is None else ref, a, a + n if b is None else b, done.written - n,
                                          write, rows, publish=not self._publisher.publishing)
            published = self._replication.settle(sent, self.order())
        self._publish(self._store.written)
        return published

    def replicate_parts(self, how: Mapping[str, Any], *parts: Mapping[str, np.ndarray]) -> tuple[int, int]:
        """``replicate`` with its rows carried in the call, cut in ``parts`` (``rayrb.actors.inline``) and its
        other arguments in ``how``."""
        return self.replicate(joined(parts), **how)

    def stream_endpoint(self) -> tuple[str, int, str]:
        """Where this copy takes its primary's pieces over a stream (``rayrb.actors.stream``): ``(host, port,
        token)``, the server started at the first ask."""
        if self._stream is None:
            self._stream = StreamServer(self._streamed, node_address())
        return self._stream.endpoint()

    def _streamed(self, frame: Frame, waited: Callable[[], bool]) -> tuple[int, int, bool]:
        """A piece from the stream (its own thread): ``replicate``, while the frame's fence is the one the last
        rebuild gave this copy, else ``FencedFrameError`` (a frame sent before that rebuild, arriving after it);
        then the count published where the frame asks and this copy can, while its primary still ``waited``."""
        with self._files.locked():
            if int(frame.fence) != self._fence:
                raise FencedFrameError(f"shard {self.shard_id}: expected a piece fenced {self._fence} (this copy's "
                                       f"last rebuild), got one fenced {frame.fence}")
            n = len(next(iter(frame.rows.values()))) if frame.rows else 0
            written, restores = self.replicate(frame.rows, 0, n, frame.first, frame.write)
            published = bool(frame.publish and self._publisher.publishing and waited())
            if published:
                self._publish(written)
            return written, restores, published

    def order(self) -> tuple[int, int]:
        """``(write count, restore epoch)``: a replica holds its primary's rows when both are the primary's."""
        return self._store.written, self._store.restores

    def merge(self, state: Mapping[str, np.ndarray]) -> int:
        """Take, slot by slot, the newer rows of another copy of this shard (``state()`` of its primary or of a
        replica; ``rayrb.durability.copies``), a restore epoch first (``copy_order``); the write count after.
        Taking a copy twice changes nothing."""
        with self._files.locked():
            return self._merge(state)

    def _merge(self, state: Mapping[str, np.ndarray]) -> int:
        how = copy_order(self._store.restores, int(state.get("restores", 0)))
        if how != "merge":  # "keep": the other copy is rebuilt from this one
            return self.replace(state) if how == "replace" else self._store.written
        take = take_newer(self._data, self._gen, state, f"shard {self.shard_id}")
        if take.size:
            self._sampler.on_write(take)
            if "sampler/priority" in state:  # the copy's priorities for the rows taken from it
                mine = self._sampler.state_dict()
                mine["priority"][take] = np.asarray(state["sampler/priority"])[take]
                mine["max_priority"] = max(float(mine["max_priority"]), float(state["sampler/max_priority"]))
                self._sampler.load_state_dict(mine)
            self._mirror()
        count = merged_count(self._gen, self._store.written, int(state["written"]))
        self._lost = False  # it holds what the copy held
        self._held.clear()
        self._held.update(held_runs(self._gen, count))
        self._store.written = count
        self._files.ids.adopt(state.get("write_ids"), count)  # a retry of the copy's writes is answered here
        self._metrics.count("rows_merged", int(take.size))
        return count

    def replace(self, state: Mapping[str, np.ndarray], fence: int | None = None) -> int:
        """Take another copy's state whole, with its restore epoch (``copy_order``); the write count after.
        ``fence``: from the primary's rebuild, which refuses every frame sent before it (``rayrb.actors.stream``)."""
        with self._files.locked():
            super().load_state(state)
            self._files.ids.adopt(state.get("write_ids"), self._store.written)  # its journal with its rows
            self._store.restores = int(state.get("restores", 0))  # last: rows without it read as the older copy
            if fence is not None:
                self._fence = int(fence)
        self._lost = False
        return self._store.written

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        """A restore: the rows replaced whole, under a restore epoch newer than any copy's (set first, so that a
        copy from before it never wins a merge); the replicas take it too."""
        apply = self._checked(state)
        with self._files.locked():
            self._store.restores = max(self._store.restores, int(state.get("restores", 0))) + 1
            apply()
            self._publish(self._store.written)
        if self._replication is not None:
            self._replication.rebuild_all()

    def check_replicas(self) -> None:
        """Between writes: replicas that restarted empty or fell behind are rebuilt (a timer sends this)."""
        if self._replication is not None:
            self._replication.check(self.order())

    def state(self, journal: bool = False) -> dict[str, np.ndarray]:
        """This shard's rows, generations, counts and sampler state at one cut: no append runs meanwhile; with
        ``journal``, its write ids too (``write_ids``: what another copy takes with the rows)."""
        with self._files.locked():
            out = {k: np.array(v) for k, v in super().state().items()}
            if journal:
                self._files.ids.sync(self._store.written)
                out["write_ids"] = self._files.ids.to_array()
            return out

    def _state(self) -> dict[str, np.ndarray]:
        return {**{f"rows/{k}": v for k, v in self._data.items()}, "generation": self._gen,
                "written": np.int64(self._store.written), "restores": np.int64(self._store.restores)}

    def _set_state(self, state: dict[str, np.ndarray]) -> Callable[[], None]:
        rows = {k[len("rows/"):]: v for k, v in state.items() if k.startswith("rows/")}
        gen = state.get("generation")
        if set(rows) != set(self._data) or gen is None or gen.shape != self._gen.shape or "written" not in state:
            raise SavedStateError(f"shard {self.shard_id}: saved state has keys {sorted(rows)} and capacity "
                                  f"{None if gen is None else gen.shape[0]}, expected {sorted(self._data)} and "
                                  f"{self._capacity}")
        self._spec.validate(rows, what="saved rows")
        if any(v.shape[0] != self._capacity for v in rows.values()):
            raise SavedStateError(f"shard {self.shard_id}: saved rows are not {self._capacity} slots")

        def apply() -> None:
            self._gen[...] = -1  # every row is being replaced: readers on this node leave it to the shard
            for k in self._data:
                self._data[k][...] = rows[k]
            self._gen[...] = gen
            self._store.written = int(state["written"])
            self._held.clear()  # rows the saved shard held behind a hole: counted once it is filled
            self._held.update(held_runs(self._gen, self._store.written))
            self._files.ids.clear()  # rows replaced whole: no earlier write is answered from them
            self._mirror()

        return apply

    def update_priority(self, idx: np.ndarray, generation: np.ndarray, priority: np.ndarray) -> int:
        with self._files.locked():  # as a replica, its stream's thread may be writing rows (and their priorities)
            done = super().update_priority(idx, generation, priority)
        if self._replication is not None:
            self._replication.priorities(idx, generation, priority)
        return done
