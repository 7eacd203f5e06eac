"""A handle's streams (``rayrb.handle.stream``): its ``sample()`` loop, made at the first ``sample()``, and its
iterators (``iter_batches``), with the shard reads this process makes itself, which they share."""
from __future__ import annotations

import sys
import weakref
from typing import Any

from rayrb.core.ahead import MAX_AHEAD
from rayrb.core.layout import ShardLayout
from rayrb.errors import BufferUnavailableError
from rayrb.handle.policies import Ahead, Loop
from rayrb.handle.rpc import node_id
from rayrb.handle.stream import Stream

# Every open stream of this process, of any handle: the one place a save finds what each has handed over, which
# only the process that served it knows.
_LIVE: "weakref.WeakSet[Stream]" = weakref.WeakSet()


class Sampling:
    """The streams of one handle. ``prefetch``: the loop's depth; ``layout``: where each shard's files are
    (``rayrb.handle.local``), read here unless ``local_reads`` is off; ``limited``: the buffer has a rate
    limiter."""

    def __init__(self, rpc: Any, spec: Any, *, prefetch: int, layout: ShardLayout | None, local_reads: bool,
                 limited: bool, storage_device: str):
        self.rpc, self.spec, self.prefetch, self.layout = rpc, spec, prefetch, layout
        self.local_enabled, self.limited, self.storage_device = local_reads, limited, storage_device
        self._local: Any = None  # the LocalReads, made at first use (never pickled)
        self.stream: Stream | None = None  # the sample() loop's

    @property
    def local(self) -> Any:
        """The shard reads this process makes itself (``LocalReads``), or None when turned off or unknown."""
        if self._local is None and self.local_enabled and self.layout and self.storage_device == "cpu":
            from rayrb.handle.local import LocalReads

            rpc = self.rpc
            self._local = LocalReads(self.layout, self.spec, node_id(), rpc.node_of)
        return self._local

    def close_reads(self) -> None:
        """Close the readers of the shards' files this process made (a closed handle's)."""
        local, self._local = self._local, None
        if local is not None:
            local.close()

    def loop(self, batch_size: int) -> Stream:
        """The ``sample()`` loop's stream."""
        if self.stream is None:
            self.stream = Stream(self.rpc, batch_size, depth=self.prefetch, spec=self.spec,
                                 policy=Loop(self.spec.row_bytes, limited=self.limited), local=self.local)
            _LIVE.add(self.stream)
        return self.stream

    def iterator(self, output: Any, batch_size: int, *, prefetch: int, device: Any, return_info: bool,
                 num_batches: int | None, direct: dict | None) -> "BatchIterator":
        """A new iterator's stream, wrapped (``BatchIterator``)."""
        # No deeper than the coordinator can give back on close: past that, rows drawn ahead would be lost.
        depth = prefetch if direct is not None else min(prefetch, MAX_AHEAD)
        stream = Stream(self.rpc, batch_size, depth=depth, spec=self.spec, policy=Ahead(), direct=direct,
                        limit=num_batches, local=self.local)
        _LIVE.add(stream)
        return BatchIterator(stream, output, device=device, return_info=return_info)

    def give_back(self, pace: bool = True) -> None:
        """Return what the ``sample()`` loop drew ahead and did not serve (``pace=False``: a read that must see
        the stream where the caller left it, not a pause in the caller's run of samples)."""
        if self.stream is not None and not self.rpc.closed:
            self.stream.give_back(pace)

    def report_served(self) -> None:
        """Tell the coordinator what every stream of this buffer in this process handed over, before a save
        counts it: a save by one handle must not rewind what another handle here served."""
        for stream in list(_LIVE):
            if stream.rpc.name == self.rpc.name and not stream.closed:
                stream.report()

    def ends_epoch(self, held: Any) -> bool:
        """Whether the loop's batch ``held`` ends its offline epoch for a pass over it (``for batch in rb``): it is
        the epoch's last batch drawn, and the epoch owes no orphans the loop serves next (``Stream.owes``)."""
        return held.last and not (held.epoch is not None and self.stream.owes(held.epoch))

    def next_fraction(self) -> float | None:
        """The offline fraction of the loop's next batch, if it is planned (``Stream.next_fraction``)."""
        return self.stream.next_fraction() if self.stream is not None else None

    def stats(self) -> dict[str, Any] | None:
        """The loop's drawing ahead and the local reads, once there are any."""
        if self.stream is None and self._local is None:
            return None
        return {**(self.stream.stats if self.stream is not None else {}),
                **({f"{k}_reads": v for k, v in self._local.stats.items()} if self._local else {})}


class BatchIterator:
    """``iter_batches()``: batches in order, planned ahead, with up to ``prefetch`` read ahead.

    Closing it (``close``, leaving a ``with`` block, or dropping the last reference,
    as ``break`` out of a ``for`` loop does) gives back the batches it drew and did not
    hand over. Once the buffer's handle is closed, no further batch is handed over.
    """

    def __init__(self, stream: Stream, output: Any, *, device: Any = None, return_info: bool = False):
        self._stream, self._output, self._device, self._return_info = stream, output, device, return_info

    @property
    def max_in_flight(self) -> int:
        return self._stream.max_in_flight

    @property
    def in_flight(self) -> int:
        return self._stream.in_flight

    @property
    def ahead(self) -> int:
        return self._stream.ahead

    def __iter__(self) -> "BatchIterator":
        return self

    def __enter__(self) -> "BatchIterator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_stream", None) or self._stream.closed or sys.is_finalizing():
            return
        try:
            self.close()
        except Exception:  # the buffer or Ray may be gone already: nothing to give back to
            pass

    def close(self) -> None:
        """Give back what was drawn and not handed over; the iterator then stops."""
        self._stream.close()

    def report(self) -> None:
        self._stream.report()

    def __next__(self):
        s = self._stream
        if s.closed or s.exhausted:
            raise StopIteration
        if s.rpc.closed:  # no batch drawn before the buffer was shut down is handed out
            s.close()
            raise BufferUnavailableError(f"buffer {s.rpc.name!r} was shut down")
        held = s.next()
        if s.direct is not None:  # already a TensorDict on this actor's GPU
            return self._output.finish_tensors(held.batch, self._return_info)
        return self._output.finish_held(held, self._return_info, self._device)
