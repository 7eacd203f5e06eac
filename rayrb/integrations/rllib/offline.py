"""RLlib's offline API (BC, MARWIL, CQL, ...) reading a rayrb chunk dataset through rayrb's Ray Data source.

``config.offline_data(input_=<chunk dataset directory>, offline_data_class=ChunkOfflineData)``: the rows of
``write_episodes`` reach RLlib's ``OfflinePreLearner`` as one-step transitions in RLlib's column names, read by
``rayrb.to_ray_dataset`` (read tasks that map the chunk files; no Parquet copy).

This module imports RLlib; ``rayrb.integrations.rllib`` imports it only when ``ChunkOfflineData`` is asked for.
"""
from __future__ import annotations

from typing import Any

from ray.rllib.offline.offline_data import OfflineData
from ray.rllib.offline.offline_prelearner import OfflinePreLearner

from rayrb.errors import InvalidArgumentError
from rayrb.integrations.rllib.transitions import one_step_columns


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
