"""What a sampled batch is made of, and how its shard parts become one batch. No Ray here.

The coordinator *draws* a ``BatchPlan``: the exact split ``n_offline +
n_online``, and for each shard that contributes, a ``Part`` ``(side, shard,
count)``. Each part is read by its shard, which returns ``(rows, info)``: flat
``{"a/b": ndarray}`` rows and per-row ``index``, ``generation`` (and ``priority``
under prioritized sampling). Parts are ordered offline first, so a batch's rows
are its offline rows, then its online rows.

Per-row provenance is rebuilt from the plan and the shards' infos:

* ``offline`` and ``shard`` repeat each part's side and shard id ``count`` times;
* ``index`` and ``generation`` are the shards' own;
* prioritized: ``weight = (p_i / min p) ** -beta``, where ``min p`` is the smallest
  ``p`` over *all* shards of the row's side. That is ``(N P(i)) ** -beta``
  normalized by its largest value, for the union of shards, as one buffer gives.

Examples:
    >>> import numpy as np
    >>> plan = BatchPlan([Part("offline", 1, 2), Part("online", 0, 1)], n_offline=2, n_online=1,
    ...                  fraction=0.5)
    >>> results = [({"x": np.array([10, 11])}, {"index": np.array([0, 1]), "generation": np.array([1, 1])}),
    ...            ({"x": np.array([99])}, {"index": np.array([4]), "generation": np.array([2])})]
    >>> rows, info = assemble(plan, results, return_info=True)
    >>> rows["x"].tolist(), info["offline"].tolist(), info["shard"].tolist(), info["generation"].tolist()
    ([10, 11, 99], [True, True, False], [1, 1, 0], [1, 1, 2])
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from rayrb.core.schema import SEP
from rayrb.errors import InvalidArgumentError, InvalidArgumentTypeError, RowIndexError

OFFLINE, ONLINE = "offline", "online"
SIDES = (OFFLINE, ONLINE)
OFFLINE_GENERATION = 1  # an offline row's generation: written once, never again (priority updates name it)

Rows = dict[str, np.ndarray]
Info = dict[str, np.ndarray]


class Epoch(NamedTuple):
    """Without replacement: epoch ``number`` is ``permutation(size)`` drawn from ``seed``; a read starts at ``start``."""

    number: int
    seed: int
    size: int
    start: int


class Part(NamedTuple):
    """``count`` rows that shard ``shard`` of side ``side`` contributes to a batch."""

    side: str
    shard: int
    count: int


@dataclass(frozen=True)
class ImportanceWeights:
    """Prioritized importance weights ``(p_i / min_p[side]) ** -beta`` over each side's union of shards."""

    beta: float
    min_p: Mapping[str, float]  # the prioritized sides only

    def __call__(self, side: str, info: Mapping[str, Any]) -> Any:
        """Each row's weight from its shard's info; 1 for the rows of a side sampled without priorities."""
        if side not in self.min_p:
            return info["index"] * 0 + 1.0
        return (info["priority"] / self.min_p[side]) ** -self.beta


@dataclass(slots=True)
class BatchPlan:
    """One batch, or one learner's slice of a batch, as the coordinator drew it."""

    parts: list[Part]
    n_offline: int
    n_online: int
    fraction: float  # the offline fraction it was drawn with: what the handle reports as the next batch's
    weights: ImportanceWeights | None = None
    last_of_epoch: bool = False  # the offline side's epoch without replacement ended with this batch

    @property
    def batch_size(self) -> int:
        return self.n_offline + self.n_online


Read = tuple[list[int], list[int], list[Any], "int | None"]  # counts, seeds, epochs, online write count


@dataclass
class GroupPlan:
    """Consecutive batches (or one batch's slices) as the coordinator planned them: what the caller reads.

    ``reads[j]`` is a shard ``(side, index)`` and ``args[j]`` its one read for all of
    the group's batches, in batch order: ``(counts, seeds, epochs, written)``, where
    ``written`` is the online write count the batches were planned with (None
    offline), so that a read that reaches the shard later still draws over those rows.
    """

    plans: list[BatchPlan]
    reads: list[tuple[str, int]] = field(default_factory=list)
    args: list[Read] = field(default_factory=list)
    version: int = -1  # the coordinator's version (writes, updates, settings) the group was planned at
    first: int = -1  # drawn ahead for a stream: the number of its first batch (rayrb.core.ahead.AheadLog)
    _text: str | None = field(default=None, init=False, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        return group_to_json(self)

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> GroupPlan:
        return group_from_json(data)

    def encoded(self) -> str:
        """``to_json`` as compact JSON text, encoded once: the coordinator keeps it for a call asked again, and
        the same text is what travels to the caller (a plan is final once the coordinator answers it)."""
        if self._text is None:
            self._text = json.dumps(group_to_json(self), separators=(",", ":"), default=_plain)
        return self._text

    def __reduce__(self) -> tuple[Callable[[str], GroupPlan], tuple[str]]:
        # Pickled as its JSON text: Ray sends a str in a fraction of the time cloudpickle takes over the objects.
        return decode_group, (self.encoded(),)


def decode_group(text: str) -> GroupPlan:
    """The plan ``GroupPlan.encoded`` wrote.

    >>> g = GroupPlan([BatchPlan([Part("offline", 0, 4)], 4, 0, fraction=1.0)], [("offline", 0)],
    ...               [([4], [11], [None], None)], version=1, first=0)
    >>> import pickle
    >>> pickle.loads(pickle.dumps(g)) == g == decode_group(g.encoded())
    True
    """
    return group_from_json(json.loads(text))


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python number JSON takes (``json.dumps``'s ``default``: only for other types)."""
    if isinstance(value, np.generic):
        return value.item()
    raise InvalidArgumentTypeError(f"a plan holds ints, floats, strings and lists, got {type(value).__name__}")


def group_to_json(group: GroupPlan) -> dict[str, Any]:
    """A plan as JSON data, each batch a positional list: ``[parts, n_offline, n_online, fraction,
    last_of_epoch, weights]``, parts and epochs as lists (named tuples are tuples). Positional, not keyed: the
    coordinator encodes every group it plans, and keys cost more to write than the numbers (about 40 % of the
    text and of the time).

    >>> g = GroupPlan([BatchPlan([Part("offline", 0, 4)], 4, 0, fraction=1.0)], [("offline", 0)],
    ...               [([4], [11], [None], None)], version=1, first=0)
    >>> json.dumps(group_to_json(g), separators=(",", ":"))
    '{"plans":[[[["offline",0,4]],4,0,1.0,false,null]],"reads":[["offline",0]],"args":[[[4],[11],[null],null]],"version":1,"first":0}'
    """
    plans = [[b.parts, b.n_offline, b.n_online, b.fraction, b.last_of_epoch,
              None if b.weights is None else [b.weights.beta, dict(b.weights.min_p)]] for b in group.plans]
    return {"plans": plans, "reads": group.reads, "args": group.args, "version": group.version, "first": group.first}


def group_from_json(data: Mapping[str, Any]) -> GroupPlan:
    """The inverse of ``group_to_json`` (after a JSON round trip).

    >>> g = GroupPlan([BatchPlan([Part("online", 1, 3)], 0, 3, fraction=0.0)], reads=[("online", 1)],
    ...               args=[([3], [42], [Epoch(0, 5, 10, 2)], 40)], version=2, first=9)
    >>> group_from_json(json.loads(json.dumps(group_to_json(g)))) == g
    True
    """
    plans = [BatchPlan([Part(*p) for p in parts], n_off, n_on, fraction,
                       None if weights is None else ImportanceWeights(weights[0], weights[1]), last)
             for parts, n_off, n_on, fraction, *_, last, weights in data["plans"]]  # (files of older versions: a step)
    args = [(list(c), list(s), [None if e is None else Epoch(*e) for e in (ep or [])], w)
            for c, s, ep, w in data["args"]]
    return GroupPlan(plans, [tuple(r) for r in data["reads"]], args, data["version"], data["first"])


def reads_by_plan(group: GroupPlan) -> list[list[tuple[str, int, Read]]]:
    """The group's reads cut per plan, one per part: ``(side, shard, ([count], [seed], [epoch], written))``.

    >>> plan = BatchPlan([Part("offline", 0, 2), Part("online", 1, 1)], 2, 1, fraction=0.5)
    >>> g = GroupPlan([plan, plan], reads=[("offline", 0), ("online", 1)],
    ...               args=[([2, 2], [7, 8], [None, None], None), ([1, 1], [5, 6], [None, None], 40)])
    >>> [[(s, i, a[1]) for s, i, a in parts] for parts in reads_by_plan(g)]
    [[('offline', 0, [7]), ('online', 1, [5])], [('offline', 0, [8]), ('online', 1, [6])]]
    """
    by_shard = dict(zip(group.reads, group.args))
    cursor = dict.fromkeys(by_shard, 0)
    out = []
    for plan in group.plans:
        parts = []
        for side, shard, _ in plan.parts:
            counts, seeds, epochs, written = by_shard[(side, shard)]
            j = cursor[(side, shard)]
            parts.append((side, shard, ([counts[j]], [seeds[j]], [epochs[j] if epochs else None], written)))
            cursor[(side, shard)] = j + 1
        out.append(parts)
    return out


def offline_epoch(reads: Sequence[tuple[str, int, Read]]) -> int | None:
    """The offline epoch without replacement (its number) one batch's reads draw from (``reads_by_plan``'s, a
    read per part), or None: no offline rows, or sampled with replacement.

    >>> offline_epoch([("online", 0, ([2], [5], [None], 40)), ("offline", 1, ([3], [7], [Epoch(4, 9, 10, 0)], None))])
    4
    >>> offline_epoch([("offline", 0, ([3], [7], [None], None))])
    """
    return next((a[2][0].number for side, _, a in reads if side == OFFLINE and a[2] and a[2][0] is not None), None)


def concat(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Concatenate flat batches key by key (numpy or torch); a single non-empty part is returned as is."""
    parts = [p for p in parts if p and len(next(iter(p.values()))) > 0] or list(parts[:1])
    if len(parts) == 1:
        return dict(parts[0])
    first = next(iter(parts[0].values()))
    if isinstance(first, np.ndarray):
        return {k: np.concatenate([p[k] for p in parts], axis=0) for k in parts[0]}
    import torch

    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a/b": x}`` -> ``{"a": {"b": x}}``.

    >>> nest({"a/b": 1, "a/c": 2, "d": 3})
    {'a': {'b': 1, 'c': 2}, 'd': 3}
    """
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        *path, leaf = key.split(SEP)
        d = nested
        for p in path:
            d = d.setdefault(p, {})
        d[leaf] = value
    return nested


def provenance(plan: BatchPlan, infos: Sequence[Mapping[str, Any]], cat: Callable = np.concatenate,
               as_array: Callable = np.asarray) -> dict[str, Any]:
    """Per-row provenance of ``plan`` from its parts' shard infos (numpy; torch through ``cat``/``as_array``)."""
    counts = [p.count for p in plan.parts]
    info = {
        "offline": as_array(np.repeat([p.side == OFFLINE for p in plan.parts], counts).astype(bool)),
        "shard": as_array(np.repeat([p.shard for p in plan.parts], counts).astype(np.int64)),
        "index": cat([i["index"] for i in infos]),
        "generation": cat([i["generation"] for i in infos]),
    }
    if infos and all("episode_start" in i for i in infos):  # slices: where each step's episode starts in its shard
        info["episode_start"] = cat([i["episode_start"] for i in infos])
    if plan.weights is not None:
        info["weight"] = cat([plan.weights(p.side, i) for p, i in zip(plan.parts, infos)])
    return info


def assemble(plan: BatchPlan, results: Sequence[tuple[Rows, Info]], return_info: bool = False):
    """Concatenate the parts' rows into one flat batch, with provenance if asked."""
    if len(results) != len(plan.parts):
        raise InvalidArgumentError(f"expected {len(plan.parts)} shard parts for this batch, got {len(results)}")
    rows = concat([r[0] for r in results])
    if not return_info:
        return rows
    info = provenance(plan, [r[1] for r in results])
    if "weight" in info:
        info["weight"] = info["weight"].astype(np.float32)
    return rows, info


def split_group(group: GroupPlan, results: Sequence[tuple[Rows, Info]]) -> list[tuple[BatchPlan, list]]:
    """Cut a group's per-shard results back into each batch's ``(plan, parts)``."""
    data = dict(zip(group.reads, results))
    cursor = dict.fromkeys(data, 0)
    out = []
    for plan in group.plans:
        parts = []
        for side, shard, count in plan.parts:
            rows, info = data[(side, shard)]
            a = cursor[(side, shard)]
            parts.append(({k: v[a:a + count] for k, v in rows.items()}, {k: v[a:a + count] for k, v in info.items()}))
            cursor[(side, shard)] = a + count
        out.append((plan, parts))
    return out


def assemble_slice(plan: BatchPlan, return_info: bool, postprocess: Callable | None, *results: tuple[Rows, Info]):
    """``assemble``, then ``postprocess(rows)`` (``postprocess(rows, info)`` with info), as a task runs it."""
    out = assemble(plan, results, return_info)
    if postprocess is not None:
        out = (postprocess(out[0], out[1]), out[1]) if return_info else postprocess(out)
    return out


def route_priorities(offline: Any, shard: Any, index: Any, generation: Any, priority: Any,
                     sizes: Mapping[str, np.ndarray]) -> list[tuple[str, int, tuple[np.ndarray, ...]]]:
    """``(side, shard, (index, generation, priority))`` for each shard a priority update touches.

    The whole update is checked first (same lengths, finite priorities, existing
    shards, indices within each shard's rows), so a refused one reaches no shard.

    >>> sizes = {"offline": np.array([4, 4]), "online": np.array([3])}
    >>> [(side, i, a[0].tolist()) for side, i, a in route_priorities(
    ...     [True, False, True], [1, 0, 1], [3, 2, 0], [1, 1, 1], [5.0, 6.0, 7.0], sizes)]
    [('offline', 1, [3, 0]), ('online', 0, [2])]
    """
    offline = _flags("offline", offline)
    shard, index, generation = checked_integers("shard", shard), checked_integers("index", index), checked_integers("generation", generation)
    priority = _reals("priority", priority)
    lengths = [len(offline), len(shard), len(index), len(generation), len(priority)]
    if len(set(lengths)) != 1:
        raise InvalidArgumentError(
            f"expected offline, shard, index, generation and priority of the same length, got {lengths}")
    if not np.all(np.isfinite(priority)):
        raise InvalidArgumentError(
            f"priorities must be finite numbers, got {priority[~np.isfinite(priority)][:3].tolist()}")
    routes = []
    for side, on_side in ((OFFLINE, offline), (ONLINE, ~offline)):
        for i in np.unique(shard[on_side]):
            if not 0 <= i < len(sizes[side]):
                raise InvalidArgumentError(f"no {side} shard {i}: the buffer has {len(sizes[side])}")
            sel = on_side & (shard == i)
            bad = index[sel][(index[sel] < 0) | (index[sel] >= sizes[side][i])]
            if bad.size:
                raise RowIndexError(f"{side} shard {i} holds {int(sizes[side][i])} rows, got index {int(bad[0])}")
            routes.append((side, int(i), (index[sel], generation[sel], priority[sel])))
    return routes


def checked_integers(name: str, values: Any) -> np.ndarray:
    """``values`` as int64, refused where one is not a whole number (an index of 45.5 is not row 45).

    >>> checked_integers("index", [3.0, 45.5])
    Traceback (most recent call last):
    rayrb.errors.InvalidArgumentError: index must hold integers, got 45.5 (float64)
    >>> checked_integers("index", np.array([2**64 - 4], np.uint64))
    Traceback (most recent call last):
    rayrb.errors.InvalidArgumentError: index must hold int64 integers, got 18446744073709551612
    >>> checked_integers("index", np.array([3, "a"], object))
    Traceback (most recent call last):
    rayrb.errors.InvalidArgumentError: index must hold integers, got 3 (object)
    """
    a = np.asarray(values).reshape(-1)
    if a.dtype.kind == "f":
        bad = a[~np.isfinite(a) | (a != np.round(a))]
    else:
        bad = a[:0] if a.dtype.kind in "iu" else a  # bools, strings, objects: none is an index
    if bad.size:
        raise InvalidArgumentError(f"{name} must hold integers, got {_show(bad[0])} ({a.dtype})")
    if a.size:
        low, high = a.min().item(), a.max().item()  # Python numbers: compared exactly
        if not -(2**63) <= low <= high < 2**63:  # int64 would wrap them around
            raise InvalidArgumentError(f"{name} must hold int64 integers, got {high if high >= 2**63 else low!r}")
    return a.astype(np.int64)


def _reals(name: str, values: Any) -> np.ndarray:
    """``values`` as float64, refused where one is not a real number (a string, or a complex number whose
    imaginary part a cast would drop).

    >>> _reals("priority", [1.5, "a"])
    Traceback (most recent call last):
    rayrb.errors.InvalidArgumentError: priority must hold real numbers, got '1.5' (<U32)
    >>> _reals("priority", np.array([1 + 2j]))
    Traceback (most recent call last):
    rayrb.errors.InvalidArgumentError: priority must hold real numbers, got (1+2j) (complex128)
    """
    a = np.asarray(values).reshape(-1)
    if a.dtype.kind not in "biuf" and a.size:
        raise InvalidArgumentError(f"{name} must hold real numbers, got {_show(a[0])} ({a.dtype})")
    return a.astype(np.float64)


def _flags(name: str, values: Any) -> np.ndarray:
    """``values`` as bool: booleans, or numbers that are 0 or 1.

    >>> _flags("offline", [1, 0, 3])
    Traceback (most recent call last):
    rayrb.errors.InvalidArgumentError: offline must hold booleans (or 0 and 1), got 3 (int64)
    """
    a = np.asarray(values).reshape(-1)
    if a.dtype.kind != "b":
        bad = a[(a != 0) & (a != 1)] if a.dtype.kind in "iuf" else a
        if bad.size:
            raise InvalidArgumentError(f"{name} must hold booleans (or 0 and 1), got {_show(bad[0])} ({a.dtype})")
    return a.astype(bool)



def _show(value: Any) -> str:
    """One bad element, as plain Python shows it (an object array's elements have no ``item``)."""
    return repr(value.item() if isinstance(value, np.generic) else value)[:100]
