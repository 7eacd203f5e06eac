"""Batches drawn ahead of being served, and giving them back. No Ray here.

A handle's stream (``rayrb.handle.stream``) asks for batches before its caller
does. Each draw is logged here with the planner's snapshot before it, so that the
handle can give back what it did not serve and the stream goes on as if those
draws had never been made.

* Draws are numbered per log; a handle reports the last number it has served
  (``AheadLog.served``) and those draws are never given back.
* Only the most recent caller's draws can be rewound: a draw by anyone else, or a
  change of settings (``AheadLog.forget``), makes every earlier draw stand. A
  handle that gives back draws that stand keeps them (without replacement: each row
  of an epoch is served once) or drops them (with replacement).
* Rows drawn and not yet served are counted per handle (``AheadLog.unserved_rows``),
  so that a rate limiter can judge writes against the rows actually served, as it
  would if nothing were drawn ahead.
* Without replacement, batches that stand and that their handle will never serve (it
  closed its iterator, or changed batch size) are not dropped: their rows belong to an
  epoch that must serve each once. The handle hands them back as they were planned, and
  they wait here (``AheadLog.orphan``) for the next handle that asks for batches of their
  size (``AheadLog.adopt``), which serves them before any new draw.

Examples:
    >>> log = AheadLog(limit=8)
    >>> [log.record("h", ("state", i), rows=10, online=4) for i in range(4)]
    [0, 1, 2, 3]
    >>> log.served("h", 0)
    >>> log.first_unserved(), log.unserved_rows()
    (('state', 1), 12)
    >>> log.take_back("h", 2)  # draws 2 and 3: the state before draw 2, and their rows
    Taken(snapshot=('state', 2), rows=20, online=8)
    >>> log.record("other", ("state", 9), rows=5, online=5)  # draw 1 of "h" now stands
    4
    >>> log.take_back("h", 1) is None, log.drop("h", 1), log.unserved_rows()
    (True, (10, 4), 5)
"""
from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

from rayrb.core.plans import GroupPlan, decode_group, offline_epoch, reads_by_plan

MAX_AHEAD = 512  # draws one handle may have ahead: the log keeps no more of a handle's, so no more can be given back
MAX_HANDLES = 1024  # handles tracked at once; the oldest is forgotten past this


def past_any_number() -> int:
    """A number larger than any count a coordinator that lost its saved state can have handed out: microseconds
    since the epoch. Draw numbers and the version go on from it, so handles that hold older ones see them as old."""
    return time.time_ns() // 1000


class GiveBack(enum.Enum):
    """What became of batches a handle gave back."""

    UNDONE = "undone"  # the stream is back where it was before them
    KEEP = "keep"  # they stand (another caller drew since); without replacement the handle serves them
    DROP = "drop"  # they stand; with replacement the handle drops them
    ADOPT = "adopt"  # they stand, without replacement, and the handle will not serve them: another handle will


class Taken(NamedTuple):
    """Draws taken back: the planner's snapshot before them, their rows, and how many of those were online."""

    snapshot: tuple
    rows: int
    online: int


class AheadLog:
    """Draws handles made ahead of serving them (see the module)."""

    def __init__(self, limit: int = MAX_AHEAD):
        self.limit = limit
        self.latest: str | None = None  # the handle whose draws are the most recent, rewindable
        # per handle: [number, snapshot before it (None once it stands), rows, online rows], oldest first
        self._entries: OrderedDict[str, list[list[Any]]] = OrderedDict()
        self._next = 0
        self.orphans: list[list[Any]] = []  # [batch size, the batch as planned (plain data), rows, online rows]

    def record(self, handle: str, snapshot: tuple, rows: int, online: int = 0) -> int:
        """Log a draw made for ``handle``; returns its number. Another handle's draws stand from now on."""
        if handle != self.latest:
            self.forget()
            self.latest = handle
        number, self._next = self._next, self._next + 1
        entries = self._entries.setdefault(handle, [])
        self._entries.move_to_end(handle)
        entries.append([number, snapshot, int(rows), int(online)])
        del entries[:-self.limit]
        while len(self._entries) > MAX_HANDLES:
            self._entries.popitem(last=False)
        return number

    @property
    def next_number(self) -> int:
        """The number the next draw gets."""
        return self._next

    def forget(self) -> None:
        """Every draw so far stands (another caller drew, or a setting changed); their rows stay counted."""
        for entries in self._entries.values():
            for e in entries:
                e[1] = None
        self.latest = None

    def served(self, handle: str, number: int) -> None:
        """``handle`` has served its draws up to ``number``: those are never given back."""
        entries = self._entries.get(handle)
        if entries:
            entries[:] = [e for e in entries if e[0] > number]
            if not entries:
                del self._entries[handle]

    def take_back(self, handle: str, count: int) -> Taken | None:
        """Remove ``handle``'s last ``count`` draws if they can be rewound: the snapshot before them and their
        rows; else None and nothing changes (another caller drew since, or they were served, or one of them stands:
        an orphan taken over, which cannot be rewound with them)."""
        entries = self._entries.get(handle, [])
        if handle != self.latest or not 0 < count <= len(entries) or any(e[1] is None for e in entries[-count:]):
            return None
        taken = entries[-count:]
        del entries[-count:]
        return Taken(taken[0][1], sum(e[2] for e in taken), sum(e[3] for e in taken))

    def drop(self, handle: str, count: int | None = None) -> tuple[int, int]:
        """Remove ``handle``'s last ``count`` draws (all with None) that it will never serve; their rows and
        online rows."""
        entries = self._entries.get(handle, [])
        count = len(entries) if count is None else min(int(count), len(entries))
        dropped = entries[len(entries) - count:]
        del entries[len(entries) - count:]
        if not entries:
            self._entries.pop(handle, None)
        return sum(e[2] for e in dropped), sum(e[3] for e in dropped)

    def unserved(self, handle: str) -> int:
        """How many of ``handle``'s draws are logged and not served.

        >>> log = AheadLog(limit=8)
        >>> [log.record("it", ("state", i), rows=5) for i in range(3)]
        [0, 1, 2]
        >>> log.served("it", 0)
        >>> log.unserved("it"), log.take_back("it", log.unserved("it")).rows, log.unserved("other")
        (2, 10, 0)
        """
        return len(self._entries.get(handle, ()))

    def unserved_rows(self) -> int:
        """Online rows drawn by any handle and not (yet) served (what a rate limiter counts), orphans included."""
        return sum(e[3] for entries in self._entries.values() for e in entries) + sum(o[3] for o in self.orphans)

    def orphan(self, handle: str, batches: list[tuple[int, Any, int, int]]) -> None:
        """``handle`` will never serve its draws, which stand: drop them from its log and keep ``batches``
        (``(batch size, the batch as planned, rows, online rows)``, its unserved draws as it holds them) for
        another handle to serve. Their rows stay counted as drawn and not served.

        >>> log = AheadLog(); [log.record("it", None, rows=8, online=2) for _ in range(3)]
        [0, 1, 2]
        >>> log.orphan("it", [(8, "batch 1", 8, 2), (8, "batch 2", 8, 2)]); log.unserved("it"), log.unserved_rows()
        (0, 4)
        >>> len(log.orphans)  # the next caller of their size serves them (``adopt``)
        2
        """
        self.drop(handle)
        self.orphans += [[int(b), batch, int(r), int(o)] for b, batch, r, o in batches]

    def adopt(self, handle: str | None, batch_size: int, k: int, *, owing: int | None = None,
              ended: Callable[[int], bool] = lambda epoch: False) -> GroupPlan | None:
        """Up to ``k`` orphans of ``batch_size`` rows (with ``owing``, only those of offline epochs up to that one),
        oldest first, now drawn for ``handle`` as one group (numbered, standing; a caller that draws nothing ahead,
        None, serves them at once: number -1), as far as they share each shard's planned write count (a group
        carries one per shard); None if there are none. The last orphan of an offline epoch that has ``ended`` (its
        last batch was drawn, by another handle) ends the epoch in its place: a pass over it serves that one too.

        >>> from rayrb.core.plans import BatchPlan, Epoch, Part
        >>> def batch(epoch, start):
        ...     return GroupPlan([BatchPlan([Part("offline", 0, 4)], 4, 0, 1.0)], [("offline", 0)],
        ...                      [([4], [1], [Epoch(epoch, 7, 12, start)], None)]).encoded()
        >>> log = AheadLog(); log.orphan("it", [(4, batch(1, 0), 4, 0), (4, batch(1, 4), 4, 0), (4, batch(2, 0), 4, 0)])
        >>> g = log.adopt("h", 4, 8, owing=1, ended=lambda epoch: epoch == 1)
        >>> g.first, [p.last_of_epoch for p in g.plans], len(log.orphans)
        (0, [False, True], 1)
        >>> log.adopt("h", 4, 8, owing=1), log.adopt(None, 4, 8).first, log.orphans
        (None, -1, [])
        """
        found = []
        for o in self.orphans:
            if o[0] == batch_size:
                group = decode_group(o[1])
                epoch = offline_epoch(reads_by_plan(group)[0])
                if owing is None or (epoch is not None and epoch <= owing):
                    found.append((o, group, epoch))
        plans, by_shard, taken = [], {}, []
        for o, g, _ in found[:k]:
            if any(by_shard.get(key, args)[3] != args[3] for key, args in zip(g.reads, g.args)):
                break  # planned at another write count: the next call takes it
            plans += g.plans
            taken.append(o)
            for key, (counts, seeds, epochs, w) in zip(g.reads, g.args):
                into = by_shard.setdefault(key, ([], [], [], w))
                into[0].extend(counts), into[1].extend(seeds), into[2].extend(epochs)
        epochs = [e for _, _, e in found]
        for j, plan in enumerate(plans):  # one plan per orphan, found[j]'s
            if epochs[j] is not None and epochs[j] not in epochs[j + 1:]:
                plan.last_of_epoch = plan.last_of_epoch or ended(epochs[j])
        numbers = []
        for o in taken:
            self.orphans.remove(o)
            numbers.append(-1 if handle is None else self.record(handle, None, o[2], o[3]))
        return GroupPlan(plans, list(by_shard), list(by_shard.values()), first=numbers[0]) if taken else None

    def drop_orphans(self) -> int:
        """Forget the orphans (the settings or the sampling state changed under them); their online rows."""
        online, self.orphans = sum(o[3] for o in self.orphans), []
        return online

    def state_dict(self) -> dict[str, Any]:
        """What a restarted coordinator needs: the next number and each handle's unserved draws (number, rows,
        online rows). Snapshots are left out: after a restart every draw stands.

        >>> log = AheadLog(); [log.record("h", ("state", i), rows=10, online=4) for i in range(3)]
        [0, 1, 2]
        >>> again = AheadLog(); again.load_state_dict(log.state_dict())
        >>> again.record("h", ("state", 3), rows=10), again.take_back("h", 2), again.drop("h", 2)
        (3, None, (20, 4))
        """
        return {"next": self._next, "orphans": self.orphans,
                "entries": [[h, [[e[0], e[2], e[3]] for e in entries]] for h, entries in self._entries.items()]}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Take ``state_dict``'s log: draws are numbered on from it, and each of them stands. Without one (the log
        was lost, or saved by a release that did not keep it) draws are numbered from ``past_any_number()``."""
        if state is None:
            self._next, self._entries, self.orphans = past_any_number(), OrderedDict(), []
        else:
            self._next = int(state["next"])
            self._entries = OrderedDict((h, [[int(n), None, int(r), int(o)] for n, r, o in entries])
                                        for h, entries in state["entries"])
            self.orphans = [list(o) for o in state.get("orphans", [])]
        self.latest = None

    def first_unserved(self) -> tuple | None:
        """The snapshot before the most recent handle's oldest draw that can be rewound and is not known to be
        served, or None. Draws of its that stand (orphans it took over) come before those and stay drawn.

        >>> from rayrb.core.plans import BatchPlan, Part
        >>> batch = GroupPlan([BatchPlan([Part("offline", 0, 8)], 8, 0, 1.0)], [("offline", 0)],
        ...                   [([8], [1], [None], None)]).encoded()
        >>> log = AheadLog(); log.orphan("it", [(8, batch, 8, 0)]); log.adopt("h", 8, 1).first
        0
        >>> log.first_unserved(), log.record("h", ("state", 1), rows=8), log.first_unserved()
        (None, 1, ('state', 1))
        """
        entries = self._entries.get(self.latest, ()) if self.latest is not None else ()
        return next((e[1] for e in entries if e[1] is not None), None)
