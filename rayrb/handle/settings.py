"""The buffer's settings: every option of ``OfflineToOnlineReplayBuffer`` checked once, into a frozen object.

``checked_settings`` is the one place the owner's raw options are checked, before any actor exists; each
refusal says what was expected and what came, and raises a ``rayrb.errors`` class that is also its builtin
(``InvalidArgumentError`` a ``ValueError``, ``InvalidArgumentTypeError`` a ``TypeError``). What it returns, a
``BufferSettings``, is trusted below it: the owner passes its fields to the actors and the handle, which do not
check them again. Only what a user-supplied schedule answers at each step stays unchecked here: the planner
checks it where the schedule gives it.

Examples:
    >>> from pathlib import Path
    >>> s = checked_settings(Path("chunks"), online_capacity=100, offline_fraction=0.25)
    >>> s.online_capacity, s.offline_fraction, s.prefetch, s.samplers
    (100, Constant(value=0.25), 32, {'offline': 'uniform', 'online': 'uniform'})
    >>> checked_settings(Path("chunks"), online_capacity=0)
    Traceback (most recent call last):
    ...
    rayrb.errors.InvalidArgumentError: online_capacity must be a positive integer, got 0
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from rayrb.actors.placement import online_nodes_option
from rayrb.actors.transport import check_storage_device, check_transport
from rayrb.core.allocators import epoch_end_option
from rayrb.core.names import buffer_name
from rayrb.core.plans import OFFLINE, ONLINE
from rayrb.core.rate_limiter import make_rate_limiter
from rayrb.core.samplers import sampler_class
from rayrb.core.schedules import Schedule, make_schedule
from rayrb.core.slice_sampling import NAME_PRIORITIZED, NAME_WITHOUT_REPLACEMENT, NAMES, SliceSampler
from rayrb.core.validation import (
    ALPHA,
    BETA,
    EPS,
    boolean,
    callable_or_none,
    non_negative_int,
    positive_int,
    priority_options,
)
from rayrb.core.validation import timeout as check_timeout
from rayrb.errors import InvalidArgumentError, InvalidArgumentTypeError
from rayrb.handle.client import PREFETCH

DEFAULT_MAX_BATCH_BYTES = 8 << 30
# The options a client may set for itself (client_options), checked the one way the buffer's are
CLIENT_CHECKS: dict[str, Callable[[Any], Any]] = {
    "timeout": check_timeout, "prefetch": lambda v: non_negative_int("prefetch", v),
    "local_reads": lambda v: boolean("local_reads", v),
    "max_writes_in_flight": lambda v: positive_int("max_writes_in_flight", v)}
DEFAULT_STORAGE = os.path.join(tempfile.gettempdir(), "rayrb-state")


@dataclasses.dataclass(frozen=True)
class BufferSettings:
    """A buffer's options, checked (``checked_settings``); the owner's docstring says what each means."""

    num_offline_shards: int
    num_online_shards: int
    online_capacity: int
    offline_fraction: Schedule
    batch_size: int | None
    offline_sampler: str
    online_sampler: str
    epoch_end: str
    alpha: float
    beta: float
    eps: float
    max_restarts: int
    transport: str
    online_nodes: tuple[str | None, ...] | None
    storage_device: str
    rate_limiter: Mapping[str, Any]  # the limiter's config (read-only), which checkpoints must match
    limited: bool  # whether the limiter bounds samples per insert
    local_reads: bool
    timeout: float | None
    transform: Callable | None
    max_batch_bytes: int
    prefetch: int
    online_replicas: int
    write_path: str  # "shards" or "coordinator": who places each write (rayrb.handle.direct)
    storage_dir: str | None
    name: str  # as given: its forms for metric tags and file names are rayrb.core.names's
    seed: int | None = None
    dataset_root: str | None = None  # where in-memory offline data is written as chunks (None: a folder of its own)
    actor_options: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    slices: SliceSampler | None = None  # how slices are drawn, with sampler "slice" on both sides

    @property
    def samplers(self) -> dict[str, str]:
        """Each side's sampler kind."""
        return {OFFLINE: self.offline_sampler, ONLINE: self.online_sampler}

    @property
    def priority(self) -> dict[str, float]:
        """Prioritized sampling's ``alpha``, ``beta`` and ``eps``."""
        return {"alpha": self.alpha, "beta": self.beta, "eps": self.eps}

    @property
    def shards_place(self) -> bool:
        """Whether the online shards place every write themselves, which then goes straight to them, or is
        appended by the writer itself on their node (``write_path="shards"``, ``rayrb.handle.direct``)."""
        return self.write_path == "shards"

    def handle_options(self) -> dict[str, Any]:
        """What a ``BufferClient`` takes of them."""
        return {"local_reads": self.local_reads, "limited": self.limited, "shards_place": self.shards_place,
                "timeout": self.timeout,
                "transform": self.transform, "max_batch_bytes": self.max_batch_bytes, "prefetch": self.prefetch,
                "transport": self.transport, "storage_device": self.storage_device}


def checked_settings(offline_dataset: Any, *, online_capacity: Any = None, online_storage: Any = None,
                     offline_fraction: Any = 0.5, batch_size: Any = None, transform: Any = None,
                     num_offline_shards: Any = 1, num_online_shards: Any = 1, sampler: Any = None,
                     offline_sampler: Any = None, online_sampler: Any = None, epoch_end: Any = None,
                     drop_last: Any = None, actor_options: Any = None, online_nodes: Any = None,
                     online_replicas: Any = 1, timeout: Any = None, transport: Any = "object_store",
                     alpha: Any = ALPHA, beta: Any = BETA, eps: Any = EPS,
                     max_batch_bytes: Any = DEFAULT_MAX_BATCH_BYTES, storage_dir: Any = DEFAULT_STORAGE,
                     rate_limiter: Any = None, prefetch: Any = PREFETCH, storage_device: Any = "cpu",
                     max_restarts: Any = -1, local_reads: Any = True, name: Any = None,
                     write_path: Any = None, seed: Any = None, dataset_root: Any = None,
                     **slice_keywords: Any) -> BufferSettings:
    """The buffer's options checked, each once, in ``OfflineToOnlineReplayBuffer``'s order (its defaults too);
    ``slice_keywords``: TorchRL's ``SliceSampler`` keywords, with ``sampler="slice"`` (``slices_option``)."""
    m = positive_int("num_offline_shards", num_offline_shards)
    k = positive_int("num_online_shards", num_online_shards)
    capacity = capacity_option(online_capacity, online_storage, k)
    seed = None if seed is None else non_negative_int("seed", seed)
    if dataset_root is not None and not isinstance(dataset_root, (str, os.PathLike)):
        raise InvalidArgumentTypeError(f"expected dataset_root as a path (str or os.PathLike) or None, got "
                                       f"{type(dataset_root).__name__}")
    actor_options = actor_options_option(actor_options)
    schedule = make_schedule(offline_fraction)  # a number is checked here, once (a Constant trusts it after)
    if batch_size is None and is_dataset_id(offline_dataset):  # TorchRL's rule, and its words
        raise InvalidArgumentError(
            f"batch_size must be provided when offline_dataset is a string, so the dataset can be "
            f"constructed. Got batch_size=None for {offline_dataset!r}")
    batch_size = None if batch_size is None else positive_int("batch_size", batch_size)
    slices = slices_option(offline_dataset, sampler, offline_sampler, **slice_keywords)
    kinds = sampler_kinds(offline_dataset, None if slices else sampler, offline_sampler, online_sampler, slices)
    if drop_last is None and epoch_end is None:  # a TorchRL buffer's SamplerWithoutReplacement(drop_last=...)
        drop_last = getattr(getattr(offline_dataset, "_sampler", None), "drop_last", None)
    epoch_end = epoch_end_option(epoch_end, drop_last)
    prio = priority_options(alpha, beta, eps)
    max_restarts = restarts_option(max_restarts)
    transport = check_transport(transport)
    nodes = online_nodes_option(online_nodes, k, actor_options)
    storage_device = check_storage_device(storage_device)
    limiter = make_rate_limiter(rate_limiter)
    limiter.validate(online_capacity=capacity)  # a configuration that can deadlock is refused here
    local_reads, timeout = CLIENT_CHECKS["local_reads"](local_reads), CLIENT_CHECKS["timeout"](timeout)
    transform = callable_or_none("transform", transform)
    max_batch_bytes = positive_int("max_batch_bytes", max_batch_bytes)
    prefetch = CLIENT_CHECKS["prefetch"](prefetch)
    replicas = replicas_option(online_replicas, storage_dir, nodes, actor_options, max_restarts)
    write_path = write_path_option(write_path, limiter.samples_per_insert is not None, slices, rate_limiter)
    return BufferSettings(
        num_offline_shards=m, num_online_shards=k, online_capacity=capacity, offline_fraction=schedule,
        batch_size=batch_size, offline_sampler=kinds[OFFLINE], online_sampler=kinds[ONLINE], epoch_end=epoch_end,
        max_restarts=max_restarts, transport=transport, online_nodes=None if nodes is None else tuple(nodes),
        storage_device=storage_device, rate_limiter=MappingProxyType(limiter.config()),
        limited=limiter.samples_per_insert is not None, local_reads=local_reads, timeout=timeout,
        transform=transform, max_batch_bytes=max_batch_bytes, prefetch=prefetch, online_replicas=replicas,
        write_path=write_path, storage_dir=None if storage_dir is None else str(storage_dir), name=buffer_name(name),
        seed=seed, dataset_root=None if dataset_root is None else os.fspath(dataset_root),
        actor_options=MappingProxyType(actor_options), slices=slices, **prio)


def actor_options_option(value: Any) -> dict[str, Any]:
    """``actor_options=``: None or a dict of Ray's ``.options()`` keywords (names as str) for every actor.

    >>> actor_options_option(None), actor_options_option({"num_cpus": 0.5})
    ({}, {'num_cpus': 0.5})
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise InvalidArgumentTypeError(f"expected actor_options as a dict of Ray actor options (str keys) or None, "
                                       f"got {value!r}")
    return dict(value)


def client_options(timeout: Any = "same", prefetch: Any = "same", local_reads: Any = "same",
                   max_writes_in_flight: Any = "same") -> dict[str, Any]:
    """A client's own ``timeout``, ``prefetch``, ``local_reads`` and ``max_writes_in_flight``, checked as
    ``checked_settings`` checks the buffer's; those left ``"same"`` (the buffer's) are left out."""
    given = {"timeout": timeout, "prefetch": prefetch, "local_reads": local_reads,
             "max_writes_in_flight": max_writes_in_flight}
    return {key: CLIENT_CHECKS[key](value) for key, value in given.items()
            if not (isinstance(value, str) and value == "same")}


def capacity_option(online_capacity: Any, online_storage: Any, num_online_shards: int) -> int:
    """The online capacity: ``online_capacity``, or a TorchRL ``online_storage``'s ``max_size`` (one of them)."""
    if (online_capacity is None) == (online_storage is None):
        how = "not both" if online_capacity is not None else "one of them is needed"
        raise InvalidArgumentError(
            f"provide exactly one of online_capacity or online_storage ({how}): Provide "
            f"{'online_storage OR online_capacity, not both' if online_capacity is not None else 'one of online_storage or online_capacity'}; "
            f"got online_capacity={online_capacity!r}, online_storage={type(online_storage).__name__}")
    if online_storage is not None:
        online_capacity = getattr(online_storage, "max_size", None)
    online_capacity = positive_int("online_capacity", online_capacity)
    if online_capacity < num_online_shards:
        raise InvalidArgumentError(f"online_capacity must be at least num_online_shards ({num_online_shards}), "
                                   f"got {online_capacity}")
    return online_capacity


def replicas_option(value: Any, storage_dir: Any, online_nodes: Any, actor_options: dict, max_restarts: int = -1
                    ) -> int:
    """``online_replicas=``: a positive integer; more than one needs a ``storage_dir``, Ray's placement and actors
    that restart (``max_restarts``, checked already)."""
    replicas = positive_int("online_replicas", value)
    if replicas > 1 and max_restarts == 0:  # the replica's rows reach the buffer only through a restarted primary
        raise InvalidArgumentError(
            f"expected max_restarts=-1 or at least 1 with online_replicas={replicas} (a replica serves only a "
            f"primary that restarts and takes its rows), got max_restarts=0")
    if replicas > 1 and storage_dir is None:
        raise InvalidArgumentError(
            f"expected a storage_dir with online_replicas={replicas} (replicated shards restart, and "
            "a restarted shard reopens its files), got storage_dir=None")
    if replicas > 1 and (online_nodes is not None or "scheduling_strategy" in actor_options):
        raise InvalidArgumentError(
            f"online_replicas={replicas} places each copy of an online shard on another node itself: "
            "give neither online_nodes nor actor_options['scheduling_strategy'] with it")
    return replicas


def restarts_option(value: Any) -> int:
    """``max_restarts=``: -1 (without end) or a non-negative integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise InvalidArgumentError(
            f"max_restarts must be -1 (restart without end) or a non-negative integer, got {value!r}")
    return int(value)


def write_path_option(write_path: Any, admitted: bool, slices: SliceSampler | None, rate_limiter: Any) -> str:
    """Who places each write: ``"coordinator"`` where a rate limiter admits each write (``admitted``), else
    ``"shards"``; slices need the shards to (an episode's writes go to one shard)."""
    if write_path not in (None, "coordinator", "shards"):
        raise InvalidArgumentError(f"expected write_path None, 'coordinator' or 'shards', got {write_path!r}")
    if write_path is None:
        write_path = "coordinator" if admitted else "shards"
    if write_path == "coordinator" and slices is not None:
        raise InvalidArgumentError(f"expected slices where the shards place writes (an episode's writes go to one "
                                   f"shard), got write_path='coordinator' (rate_limiter={rate_limiter!r})")
    if write_path == "shards" and admitted:
        raise InvalidArgumentError(f"write_path='shards' takes no rate limiter that bounds samples per insert (the "
                                   f"coordinator admits each write), got rate_limiter={rate_limiter!r}")
    return write_path


def is_dataset_id(dataset: Any) -> bool:
    """A string that names a dataset (``"openml:magic"``) rather than a chunk dataset's directory."""
    return isinstance(dataset, str) and not Path(dataset).exists()


def sampler_kinds(dataset: Any, sampler: str | None, offline: str | None, online: str | None,
                  slices: SliceSampler | None = None) -> dict[str, str]:
    """Each side's sampler: its own option, else ``sampler``, else TorchRL's default for that side. Slices are
    drawn on both sides or neither (the split counts slices), and only with their settings."""
    if slices is not None and offline is None and online is None:
        return slices.kinds()
    kinds = {OFFLINE: offline or sampler or default_offline_kind(dataset), ONLINE: online or sampler or "uniform"}
    for kind in kinds.values():
        sampler_class(kind)
    if slices is not None or set(NAMES) & set(kinds.values()):
        raise InvalidArgumentError(f"expected sampler=rayrb.SliceSampler(slice_len=...) for slices, on both sides, "
                                   f"got sampler={sampler!r}, offline_sampler={offline!r}, online_sampler={online!r}")
    return kinds


SLICE_KEYWORDS = {"slice_len": None, "num_slices": None, "traj_key": None, "end_key": None, "strict_length": True}


def slices_option(dataset: Any, sampler: Any, offline: Any, **keywords: Any) -> SliceSampler | None:
    """How slices are drawn, if they are: ``sampler=SliceSampler(...)``; ``sampler="slice"`` (or
    ``"slice_without_replacement"``, ``"prioritized_slice"``) with TorchRL's ``SliceSampler`` keywords; or a TorchRL
    dataset's own (prioritized) ``SliceSampler`` when no sampler is asked for. Keywords given without slices, or
    twice, are refused."""
    unknown = set(keywords) - set(SLICE_KEYWORDS)
    if unknown:
        raise InvalidArgumentError(f"expected options of {sorted(SLICE_KEYWORDS)} for slices, got {sorted(unknown)}")
    given = {k: v for k, v in keywords.items() if v != SLICE_KEYWORDS[k]}
    if sampler in NAMES:
        return SliceSampler(**{**SLICE_KEYWORDS, **given}, replacement=sampler != NAME_WITHOUT_REPLACEMENT,
                            prioritized=sampler == NAME_PRIORITIZED)
    if given:
        raise InvalidArgumentError(f"expected sampler='slice' (or 'slice_without_replacement', 'prioritized_slice') with "
                                   f"{sorted(given)}, got sampler={sampler!r}: a SliceSampler takes them itself")
    return sampler if isinstance(sampler, SliceSampler) else torchrl_slices(dataset, sampler, offline)


def torchrl_slices(dataset: Any, sampler: Any, offline: Any) -> SliceSampler | None:
    """A TorchRL offline buffer's ``SliceSampler`` as rayrb's (its slice settings kept), unless a sampler is given."""
    own = getattr(dataset, "_sampler", None)
    kind = type(own).__name__
    if sampler is not None or offline is not None or kind not in ("SliceSampler", "SliceSamplerWithoutReplacement",
                                                                  "PrioritizedSliceSampler"):
        return None
    return SliceSampler(slice_len=own.slice_len, num_slices=own.num_slices, traj_key=own.traj_key,
                        end_key=None if own.traj_key is not None else own.end_key, strict_length=own.strict_length,
                        replacement=kind != "SliceSamplerWithoutReplacement",
                        prioritized=kind == "PrioritizedSliceSampler")


def default_offline_kind(dataset: Any) -> str:
    """TorchRL's: OpenMLExperienceReplay samples without replacement; a ReplayBuffer samples with its own sampler."""
    if isinstance(dataset, str) and dataset.startswith("openml:"):
        return "without_replacement"
    own = type(getattr(dataset, "_sampler", None)).__name__  # a TorchRL ReplayBuffer's sampler, duck-typed
    return {"SamplerWithoutReplacement": "without_replacement", "PrioritizedSampler": "prioritized"}.get(own, "uniform")
