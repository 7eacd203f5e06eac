"""Feeding RLlib learners (new API stack) from a rayrb buffer. Extra: ``pip install rayrb[rllib]``.

Each learner's slice is built as a ``MultiAgentBatch`` by a small task next to
the shards' data, and reaches ``LearnerGroup.update(batch_refs=...)`` as a ref,
so rows go shard -> learner without the driver. Per-row TD errors come back
aligned with the rows' provenance, ready to be routed back as priorities.

Examples:
    >>> from rayrb.integrations.rllib import update  # doctest: +SKIP
    >>> out = update(learner_group, rb, batch_size=256, num_learners=1)  # doctest: +SKIP
    >>> out.td_errors.shape, out.info["shard"].shape  # doctest: +SKIP
    ((256,), (256,))
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from rayrb.errors import MissingKeyError, ShapeMismatchError

# RLlib column -> rayrb key, for data stored in TorchRL's TED layout.
DQN_COLUMNS: dict[str, str] = {
    "obs": "observation",
    "actions": "action",
    "rewards": "next/reward",
    "new_obs": "next/observation",
    "terminateds": "next/terminated",
    "truncateds": "next/truncated",
}


def to_multi_agent_batch(rows: Mapping[str, np.ndarray], info: Mapping[str, np.ndarray] | None = None,
                         columns: Mapping[str, str] = DQN_COLUMNS, module_id: str | None = None, n_step: int = 1):
    """A ``MultiAgentBatch`` for one module from flat rayrb rows.

    Trailing singleton dimensions (TED's ``[B, 1]`` rewards and flags) are squeezed.
    The DQN loss also needs ``n_step`` and ``weights``: unless ``columns`` maps them,
    ``n_step`` is 1 and ``weights`` are the importance weights of a prioritized buffer
    (``info["weight"]``), else 1.0.
    """
    from ray.rllib.core import DEFAULT_MODULE_ID
    from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

    missing = sorted(v for v in columns.values() if v not in rows)
    if missing:
        raise MissingKeyError(f"columns map to keys {missing} that the rows do not have; rows have {sorted(rows)}")
    cols = {}
    for col, key in columns.items():
        a = np.asarray(rows[key])
        cols[col] = a.reshape(a.shape[0]) if a.ndim == 2 and a.shape[1] == 1 else a
    b = next(iter(cols.values())).shape[0]
    cols.setdefault("n_step", np.full(b, n_step, dtype=np.int64))
    if info is not None and "weight" in info:
        cols.setdefault("weights", np.asarray(info["weight"], dtype=np.float32))
    cols.setdefault("weights", np.ones(b, dtype=np.float32))
    return MultiAgentBatch({module_id or DEFAULT_MODULE_ID: SampleBatch(cols)}, env_steps=b)


def batch_refs(rb: Any, num_learners: int = 1, batch_size: int | None = None,
               columns: Mapping[str, str] = DQN_COLUMNS, module_id: str | None = None, n_step: int = 1):
    """One global batch as ``num_learners`` MultiAgentBatch refs, plus a provenance ref per slice."""
    from rayrb.core.validation import positive_int

    post = partial(to_multi_agent_batch, columns=dict(columns), module_id=module_id, n_step=n_step)
    pairs = rb.sample_slices(positive_int("num_learners", num_learners), batch_size, postprocess=post,
                             split_info=True)
    return [p[0] for p in pairs], [p[1] for p in pairs]


def td_errors(results: Any, module_id: str | None = None) -> np.ndarray:
    """Per-row TD errors from ``LearnerGroup.update`` results, in batch order."""
    from ray.rllib.core import DEFAULT_MODULE_ID
    from ray.rllib.utils.metrics import TD_ERROR_KEY

    results = results if isinstance(results, list) else [results]
    series = []
    for r in results:
        stat = r[module_id or DEFAULT_MODULE_ID][TD_ERROR_KEY]
        value = stat.peek() if hasattr(stat, "peek") else stat
        series.extend(value if isinstance(value, list) else [value])
    return np.concatenate([np.asarray(getattr(v, "detach", lambda: v)()).reshape(-1) for v in series])


@dataclass
class UpdateResult:
    results: Any
    td_errors: np.ndarray  # one per row, in the order of ``info``
    info: dict[str, np.ndarray]  # offline, shard, index, generation: where to route priorities


def update(learner_group: Any, rb: Any, batch_size: int | None = None, *, num_learners: int = 1,
           columns: Mapping[str, str] = DQN_COLUMNS, timesteps: dict | None = None,
           module_id: str | None = None) -> UpdateResult:
    """Sample, update the learner group from refs, and return TD errors with provenance."""
    import ray

    refs, info_refs = batch_refs(rb, num_learners, batch_size, columns, module_id)
    results = learner_group.update(batch_refs=refs, timesteps=timesteps or {})
    infos = ray.get(info_refs)
    info = {k: np.concatenate([i[k] for i in infos]) for k in infos[0]}
    errors = td_errors(results, module_id)
    if errors.shape[0] != info["index"].shape[0]:
        raise ShapeMismatchError(f"expected one TD error per row ({info['index'].shape[0]}), got {errors.shape[0]}")
    return UpdateResult(results, errors, info)
