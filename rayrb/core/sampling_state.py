"""A saved sampling state, checked whole before a planner takes any of it (``Planner.load_state_dict``,
``check_state_dict``): every key, with what was expected and what came. No Ray here.

>>> step, schedule, base, rng, alloc, limiter = checked_state(
...     {"step": 3, "schedule": 0.25, "rng": np.random.default_rng(0).bit_generator.state},
...     sampler="uniform", num_shards={"offline": 1, "online": 1}, alloc_options={}, limiter=None,
...     online_capacity=None)
>>> step, schedule.config(), base, limiter
(3, {'kind': 'constant', 'value': 0.25}, None, None)
>>> checked_state({"step": 3}, sampler="uniform", num_shards={}, alloc_options={}, limiter=None,
...               online_capacity=None)
Traceback (most recent call last):
rayrb.errors.SavedStateError: sampling state is missing 'schedule'; it has ['step']

A state also holds the draws the buffer owes (``checked_orphans``): batches a handle drew and will never serve, which
the next caller of their size serves before any new draw.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from rayrb.core.allocators import make_allocator
from rayrb.core.plans import SIDES, decode_group
from rayrb.core.rate_limiter import make_rate_limiter
from rayrb.core.schedules import make_schedule
from rayrb.core.validation import non_negative_int
from rayrb.errors import SavedStateError


def checked_state(state: Any, *, sampler: Any, num_shards: Mapping[str, int], alloc_options: dict, limiter: Any,
                  online_capacity: int | None) -> tuple:
    """``(step, schedule, base fraction, rng, allocator, rate limiter)`` from ``state``, each checked; the
    allocator is a new one of ``sampler`` over ``num_shards`` with the state loaded, and ``limiter`` stays unless the
    state holds one (checked against ``online_capacity``). Raises ``SavedStateError`` naming the key."""
    def bad(key: str, value: Any, expected: str, error: Exception | None = None) -> SavedStateError:
        why = f" ({type(error).__name__}: {error})" if error is not None else ""
        return SavedStateError(f"sampling state[{key}] = {value!r:.200}: expected {expected}{why}")

    if not isinstance(state, Mapping):
        raise SavedStateError(f"expected a sampling state dict, got {type(state).__name__}")
    for key in ("step", "schedule", "rng"):
        if key not in state:
            raise SavedStateError(f"sampling state is missing {key!r}; it has {sorted(state)}")
    if state.get("sampler", sampler) != sampler:
        raise SavedStateError(f"state was saved by a buffer sampling {state['sampler']!r}, this one samples "
                              f"{sampler!r}")
    step = non_negative_int("sampling state['step']", state["step"])
    try:
        schedule = make_schedule(state["schedule"])
    except (TypeError, ValueError, KeyError) as e:
        raise bad("'schedule'", state["schedule"], "a schedule config", e) from None
    base = state.get("base_fraction")
    if base is not None:
        from rayrb.core.validation import fraction

        base = fraction("sampling state['base_fraction']", base)
    rng = np.random.default_rng()
    try:
        rng.bit_generator.state = state["rng"]
    except (TypeError, ValueError, KeyError) as e:
        raise bad("'rng'", state["rng"], "a numpy bit generator state", e) from None
    alloc = make_allocator(sampler, num_shards, **alloc_options)
    if "allocator" in state:
        try:
            alloc.load_state_dict(state["allocator"])
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise bad("'allocator'", state["allocator"], f"the {sampler!r} allocator's state", e) from None
    if "rate_limiter" in state:
        saved = state["rate_limiter"]
        if not isinstance(saved, Mapping) or not isinstance(saved.get("config"), Mapping):  # None would be no limit
            raise bad("'rate_limiter'", saved, "a rate limiter config (a mapping) and its counters")
        try:
            limiter = make_rate_limiter(saved["config"])
            limiter.validate(online_capacity=online_capacity)
            limiter.load_state_dict(saved["state"])
        except (TypeError, ValueError, KeyError) as e:
            raise bad("'rate_limiter'", saved, "a rate limiter config and its counters", e) from None
    return step, schedule, base, rng, alloc, limiter


def checked_orphans(state: Any, num_shards: Mapping[str, int]) -> list[list[Any]]:
    """The orphans a sampling state owes (``rayrb.core.ahead.AheadLog.orphan``: ``[batch size, the batch as
    planned, rows, online rows]`` each), checked against the shard layout; none in a state saved before states held
    them, or one without its allocator's epochs (another shard layout: the epochs begin afresh, and the orphans,
    planned in the old ones, go with them). Raises ``SavedStateError`` naming the orphan.

    >>> from rayrb.core.plans import BatchPlan, GroupPlan, Part
    >>> batch = GroupPlan([BatchPlan([Part("offline", 1, 4)], 4, 0, 1.0)], [("offline", 1)], [([4], [3], [None], None)])
    >>> layout = {"offline": 2, "online": 1}
    >>> len(checked_orphans({"allocator": {}, "orphans": [[4, batch.encoded(), 4, 0]]}, layout))
    1
    >>> checked_orphans({"orphans": [[4, batch.encoded(), 4, 0]]}, layout), checked_orphans({"allocator": {}}, layout)
    ([], [])
    >>> checked_orphans({"allocator": {}, "orphans": [[4, batch.encoded(), 4, 0]]}, {"offline": 1, "online": 1})
    Traceback (most recent call last):
    rayrb.errors.SavedStateError: sampling state['orphans'][0] = [4, ...]: ... (ValueError: it reads offline shard 1)
    """
    saved = state.get("orphans") if "allocator" in state else None
    if saved is None:
        return []
    if not isinstance(saved, list):
        raise SavedStateError(f"sampling state['orphans'] = {saved!r:.200}: expected a list of orphaned batches")
    out = []
    for j, orphan in enumerate(saved):
        why = _orphan_fault(orphan, num_shards)
        if why is not None:
            raise SavedStateError(f"sampling state['orphans'][{j}] = {orphan!r:.120}: expected [batch size, that "
                                  f"batch as planned over this buffer's shards {dict(num_shards)}, its rows, its "
                                  f"online rows] ({why})")
        out.append([int(orphan[0]), orphan[1], int(orphan[2]), int(orphan[3])])
    return out


def _orphan_fault(orphan: Any, num_shards: Mapping[str, int]) -> str | None:
    """What is wrong with one saved orphan, or None."""
    try:
        size, text, rows, online = orphan
        group = decode_group(text)
        if len(group.plans) != 1:
            return f"it holds {len(group.plans)} batches"
        for side, shard in group.reads:
            if side not in SIDES or not isinstance(shard, int) or not 0 <= shard < num_shards[side]:
                return f"it reads {side} shard {shard!r}"
        plan = group.plans[0]
        if not (isinstance(size, int) and size == rows == plan.batch_size > 0 and online == plan.n_online):
            return f"{size!r} rows, {rows!r} drawn and {online!r} online; its plan has {plan.batch_size} and " \
                   f"{plan.n_online}"
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"
    return None
