"""Answers to the last few plan calls, by call id, saved beside the coordinator's state. No Ray here.

Ray re-sends an actor call whose reply was lost when the actor died; the restarted
coordinator must answer it with the same batches, not the next ones. A call id
names one call: the same id with other arguments is refused. The answers a restart
finds are kept longer than the rest (``KEPT_AFTER_RESTART``): the calls whose
replies the crash lost come back mixed with new calls from every other handle.

>>> cache = ReplyCache(kept=2)  # answers here are strings; plans are GroupPlans
>>> cache.put("a", (16, 1), "plan-a"); cache.put("b", (16, 1), "plan-b"); cache.put("c", (16, 1), "plan-c")
>>> cache.get("a", (16, 1)) is None, cache.get("c", (16, 1))
(True, 'plan-c')
>>> cache.get("c", (32, 1))
Traceback (most recent call last):
rayrb.errors.InvalidArgumentError: call 'c' was answered for (16, 1), got (32, 1): a call id names one call; ...
"""
from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from rayrb.errors import InvalidArgumentError

# Calls whose reply one crash can lose: a handle asks for its next plan at most once before the last is answered,
# so it has at most two plan calls in flight, and this covers four handles caught mid-call at once.
REPLIES_KEPT = 8
# The answers a restarted coordinator finds stay through this many new answers: Ray re-sends the calls whose
# replies were lost in any order among the calls other handles queued meanwhile, and a re-sent call answered anew
# would skip its batches (rows of an epoch never served).
KEPT_AFTER_RESTART = 64


class ReplyCache:
    """The last ``kept`` answers by call id, with the request each answered."""

    def __init__(self, kept: int = REPLIES_KEPT):
        self.kept = int(kept)
        # call -> (request, encoded answer, the entry of items() as JSON text)
        self._answers: OrderedDict[str, tuple[Hashable, str, str]] = OrderedDict()
        self._restored: set[str] = set()  # answers found at a restart, kept for KEPT_AFTER_RESTART new ones
        self._puts_since_load = 0
        self._new: list[str] = []  # answers put, and calls whose answer went, since the last take_changes()
        self._gone: list[str] = []

    def get(self, call: str | None, request: Hashable) -> Any:
        """The answer given to ``call``, or None; raises if ``call`` was answered for another request."""
        if call is None or call not in self._answers:
            return None
        asked, answer, _ = self._answers[call]
        if asked != request:
            raise InvalidArgumentError(
                f"call {call!r} was answered for {asked}, got {request}: a call id names one call; "
                "use a new id for a new call")
        return self._decode(answer)

    def put(self, call: str | None, request: Hashable, answer: Any) -> None:
        if call is None:
            return
        # kept encoded: a save of the cache (after every call) then copies strings instead of encoding plans again
        self._answers[call] = self._entry(call, request, self._encode(answer))
        self._new.append(call)
        if self._restored:
            self._puts_since_load += 1
            if self._puts_since_load >= KEPT_AFTER_RESTART:
                self._restored.clear()
        excess = len(self._answers) - self.kept - len(self._restored)
        for old in [c for c in self._answers if c not in self._restored][:max(0, excess)]:  # oldest first
            del self._answers[old]
            self._gone.append(old)

    def calls(self) -> list[str]:
        """The calls answered, oldest first (what the saved state lists; each answer is saved on its own)."""
        return list(self._answers)

    def take_changes(self) -> tuple[list[tuple[str, str]], list[str]]:
        """``([(call, entry text)], [call])``: the answers put and the calls dropped since the last time, so that
        a save writes each answer once (``rayrb.durability.coordinator_state.CoordinatorState.save_reply``).

        >>> cache = ReplyCache(kept=1); cache.put("a", (16, 1), "plan-a"); cache.put("b", (16, 1), "plan-b")
        >>> [c for c, _ in cache.take_changes()[0]], cache.take_changes()
        (['b'], ([], []))
        """
        new = [(c, self._answers[c][2]) for c in dict.fromkeys(self._new) if c in self._answers]
        gone = [c for c in dict.fromkeys(self._gone) if c not in self._answers]
        self._new, self._gone = [], []
        return new, gone

    def save_changes(self, save: Callable[[str, str], None], drop: Callable[[str], None]) -> None:
        """Write the answers new since the last save (``save(call, text)``; each once, before the state that
        lists it) and ``drop(call)`` those forgotten since."""
        new, gone = self.take_changes()
        for call, text in new:
            save(call, text)
        for call in gone:
            drop(call)

    def items(self) -> list[list[Any]]:
        """``[call, request, encoded answer]`` per answer, oldest first: plain data, for the saved state."""
        return [[call, list(request), answer] for call, (request, answer, _) in self._answers.items()]

    def items_json(self) -> str:
        """``items()`` as JSON text, each entry encoded once when it was put: the state is saved after every
        plan call, and escaping every kept answer again each time cost more than the rest of the save.

        >>> import json
        >>> cache = ReplyCache(); cache.put("a", (16, 1), "plan-a")
        >>> json.loads(cache.items_json()) == cache.items()
        True
        """
        return "[" + ",".join(text for _, _, text in self._answers.values()) + "]"

    def load(self, items: Any) -> None:
        """Take the answers a saved state holds (a restart): each is kept through ``KEPT_AFTER_RESTART`` new
        answers, since its reply may be the one the crash lost."""
        self._answers = OrderedDict((call, self._entry(call, tuple(request), answer))
                                    for call, request, answer in items or ())
        self._restored, self._puts_since_load = set(self._answers), 0
        self._new, self._gone = [], []

    @staticmethod
    def _entry(call: str, request: Hashable, encoded: str) -> tuple[Hashable, str, str]:
        return request, encoded, json.dumps([call, list(request), encoded], separators=(",", ":"))

    @staticmethod
    def _encode(answer: Any) -> str:
        if hasattr(answer, "encoded"):  # a GroupPlan: its text is also what the caller is sent
            return answer.encoded()
        return json.dumps(answer)

    @staticmethod
    def _decode(answer: str) -> Any:
        from rayrb.core.plans import GroupPlan

        data = json.loads(answer)
        return GroupPlan.from_json(data) if isinstance(data, dict) and "plans" in data else data


def saved_answers(listed: list, load: Callable[[str], str | None]) -> list:
    """The saved answers of the calls a coordinator's state lists, each read by ``load(call)`` from its file
    (None: missing or torn, and that call is planned anew if it comes again); states saved before the answers had
    files of their own list them whole, as ``[call, request, answer]``.

    >>> saved_answers([["a", [16, 1], "x"], "b", "c"], {"b": '["b", [16, 1], "y"]'}.get)
    [['a', [16, 1], 'x'], ['b', [16, 1], 'y']]
    """
    out = []
    for item in listed:
        if isinstance(item, list):
            out.append(item)
            continue
        text = load(item)
        if text is not None:
            out.append(json.loads(text))
    return out
