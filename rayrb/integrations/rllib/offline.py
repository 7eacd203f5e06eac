"""RLlib's offline API (BC, MARWIL, CQL, ...) reading a rayrb chunk dataset through rayrb's Ray Data source.

``config.offline_data(input_=<chunk dataset directory>, offline_data_class=ChunkOfflineData)``: the rows of
``write_episodes`` reach RLlib's ``OfflinePreLearner`` as one-step transitions in RLlib's column names, read by
``rayrb.to_ray_dataset`` (read tasks that map the chunk files; no Parquet copy).

This module imports RLlib; ``rayrb.integrations.rllib`` imports it only when ``ChunkOfflineData`` is asked for.

RLlib keeps a Ray Data iteration open between training steps (its learner resumes it) and never closes it, so it
used to end when the interpreter collected it, after Ray had shut down: its end reports the iteration's stats to
Ray Data's stats actor (a remote call since ray-project/ray#57971), which then failed and printed "Ray is not
initialized" with a traceback at every exit. The iterations this module hands out are closed at exit while Ray is
still up (``close_iterations``, run before Ray's own exit hook); one that still ends after Ray shut down (a script
that called ``ray.shutdown()`` and dropped its algorithm) ends without its stats, which have nowhere to go.
"""
from __future__ import annotations

import atexit
import logging
import types
import weakref
from typing import Any

import ray
from ray.rllib.offline.offline_data import OfflineData
from ray.rllib.offline.offline_prelearner import OfflinePreLearner

from rayrb.errors import InvalidArgumentError
from rayrb.integrations.rllib.transitions import one_step_columns

_OPEN: weakref.WeakSet = weakref.WeakSet()  # the Ray Data iterations handed out (guarded), not yet collected
_STATS_LOG = "ray.data._internal.stats"  # where Ray Data reports a stats call that failed


def close_iterations() -> int:
    """End every Ray Data iteration ``ChunkOfflineData`` handed out in this process and left open; how many.

    Each one's end reports its stats to Ray Data's stats actor and stops its executor, so this runs while Ray is
    up: at exit, before Ray's own exit hook (registered after it, so run first).
    """
    its = list(_OPEN)
    _OPEN.clear()
    for it in its:
        it.close()
    return len(its)


atexit.register(close_iterations)


def _guarded(it: Any) -> Any:
    """``it`` (a Ray Data iteration) behind a generator of rayrb's, tracked for ``close_iterations``."""
    g = _guard(it)
    _OPEN.add(g)
    return g


def _guard(it: Any) -> Any:
    try:
        for item in it:  # noqa: UP028 (``yield from`` would close ``it`` before ``_end`` guards it)
            yield item
    finally:
        _end(it)


def _end(it: Any) -> None:
    """End a Ray Data iteration: its stats go to Ray Data's stats actor while Ray is up; after Ray shut down they
    have nowhere to go, and Ray Data's report of that failed call (a warning with a traceback) is left out."""
    try:
        up = ray.is_initialized()
    except Exception:  # the interpreter tearing down modules
        up = False
    log = logging.getLogger(_STATS_LOG)
    was = log.disabled
    log.disabled = was or not up
    try:
        it.close()
    finally:
        log.disabled = was


class _Tracked:
    """A Ray Data iterable whose iterations are guarded and tracked (``_guarded``)."""

    def __init__(self, iterable: Any):
        self._iterable = iterable

    def __iter__(self) -> Any:
        it = iter(self._iterable)
        return _guarded(it) if isinstance(it, types.GeneratorType) else it


class _TrackedIterator:
    """A ``ray.data.DataIterator`` as RLlib's learners use it, whose batch iterations are tracked (``_Tracked``)."""

    def __init__(self, inner: Any):
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "_inner":  # while unpickling, before __init__'s attributes are back
            raise AttributeError(name)
        return getattr(self._inner, name)

    def iter_batches(self, **kwargs: Any) -> _Tracked:
        return _Tracked(self._inner.iter_batches(**kwargs))

    def iter_torch_batches(self, **kwargs: Any) -> _Tracked:
        return _Tracked(self._inner.iter_torch_batches(**kwargs))


class ChunkOfflineData(OfflineData):
    """RLlib's ``OfflineData`` over a rayrb chunk dataset (``config.input_``, one directory) of ``write_episodes`` rows.

    RLlib's own constructor opens ``input_`` with a ``ray.data.read_*`` function; this one sets the same
    attributes and opens it with rayrb's source instead, so the rest of ``OfflineData`` (mapping through the
    ``OfflinePreLearner``, iterating, splitting over learners) is RLlib's.
    """

    def __init__(self, config: Any):
        from rayrb.integrations.rllib.transitions import row_n_step
        from rayrb.io.chunks import ChunkDataset
        from rayrb.io.raydata import to_ray_dataset

        root = config.input_
        if isinstance(root, (list, tuple)) and len(root) == 1:
            root = root[0]
        if not isinstance(root, str) and not hasattr(root, "__fspath__"):
            raise InvalidArgumentError(
                f"expected config.input_ to be one chunk-dataset directory, got {config.input_!r}")
        dataset = ChunkDataset.open(root)
        row_n_step(dataset.spec)  # the rows write_episodes writes, refused otherwise
        self.config = config
        self.is_multi_agent = config.is_multi_agent
        if self.is_multi_agent:
            raise InvalidArgumentError("expected a single-agent config, got a multi-agent one")
        self.path = root
        self.data_read_method, self.data_read_method_kwargs = "rayrb.to_ray_dataset", {}
        self.data_read_batch_size = config.input_read_batch_size
        self.materialize_data, self.materialize_mapped_data = config.materialize_data, config.materialize_mapped_data
        self.data_is_mapped = False
        self.filesystem, self.filesystem_kwargs, self.filesystem_object = None, {}, None
        self.data = to_ray_dataset(dataset).map_batches(one_step_columns, batch_format="numpy")
        if self.materialize_data:
            self.data = self.data.materialize()
        self.batch_iterators = None
        self.map_batches_kwargs = self.default_map_batches_kwargs | config.map_batches_kwargs
        self.iter_batches_kwargs = self.default_iter_batches_kwargs | config.iter_batches_kwargs
        self.returned_streaming_split = False
        self.prelearner_class = config.prelearner_class or OfflinePreLearner
        self.locality_hints = None
        self.learner_handles = None
        self.module_spec = None

    def sample(self, num_samples: int, return_iterator: bool = False, num_shards: int = 1,
               module_state: dict[str, Any] | None = None) -> Any:
        """RLlib's ``sample``, with the Ray Data iterations it starts tracked, so that they end while Ray is up."""
        out = super().sample(num_samples=num_samples, return_iterator=return_iterator, num_shards=num_shards,
                             module_state=module_state)
        its = self.batch_iterators
        if isinstance(its, types.GeneratorType) and its not in _OPEN:  # batches: RLlib's own iteration, kept here
            self.batch_iterators = _guarded(its)
        elif return_iterator:  # iterators: a learner iterates them, and keeps its iteration between updates
            self.batch_iterators = [i if isinstance(i, _TrackedIterator) else _TrackedIterator(i) for i in out]
            out = list(self.batch_iterators)
        return out
