"""``minari:<dataset_id>`` ids: Minari's local datasets first, TorchRL's ``MinariExperienceReplay`` otherwise.

A dataset recorded on this machine with Minari's ``DataCollector`` (or downloaded by Minari) is listed by
``minari.list_local_datasets()`` under ``$MINARI_DATASETS_PATH`` (``~/.minari/datasets`` by default); such an id
is read with ``minari.load_dataset(id)``, no network and no TorchRL cache. Any other id goes to TorchRL's
``MinariExperienceReplay(id, **options)`` unchanged (it downloads from Minari's remote hub, or with
``download=False`` reads TorchRL's own processed copy); ``download="force"`` always does.

Both routes give TorchRL's Minari rows, one per step: ``observation``, ``action``, ``episode`` (the Minari
episode id), and under ``next``: ``observation``, ``reward``, ``terminated``, ``truncated`` and ``done``
(``terminated | truncated``), the last four of shape ``[..., 1]``; ``info`` and ``("next", "info")`` where the
episodes record infos. Episodes come in increasing id order, each one's steps consecutive.

Examples:
    >>> rb = load_minari("cartpole/random-v0", batch_size=32)  # doctest: +SKIP
    >>> rb.storage[0]["next", "done"]  # doctest: +SKIP
    tensor([False])
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rayrb.errors import DatasetOptionError, SchemaError, UnknownDatasetError

# TorchRL's MinariExperienceReplay options and what the local route does with them
_BUFFER_OPTIONS = ("sampler", "writer", "collate_fn", "pin_memory", "prefetch", "transform")  # the buffer's
_UNUSED_OPTIONS = ("root", "download", "load_from_local_minari")  # nothing is downloaded or prepared


def minari_datasets_path() -> Path:
    """Where Minari keeps its local datasets: ``$MINARI_DATASETS_PATH`` or ``~/.minari/datasets``."""
    return Path(os.environ.get("MINARI_DATASETS_PATH") or Path.home() / ".minari" / "datasets")


def local_minari_dataset(dataset_id: str) -> Any | None:
    """Minari's local ``MinariDataset`` for ``dataset_id``, or None (not local, or minari not installed)."""
    try:
        import minari
    except ImportError:
        return None
    if not minari_datasets_path().is_dir():  # minari would create the folder just to list it
        return None
    if dataset_id not in minari.list_local_datasets():
        return None
    return minari.load_dataset(dataset_id)


def load_minari(dataset_id: str, **options: Any) -> Any:
    """The ``minari:`` factory: a TorchRL replay buffer over the id's rows (see the module docstring)."""
    local = None if options.get("download") == "force" else local_minari_dataset(dataset_id)
    if local is not None:
        return _local_buffer(local, **options)
    from torchrl.data.datasets import minari_data  # looked up when called, so a patched class is the one used

    try:
        return minari_data.MinariExperienceReplay(dataset_id, **options)
    except FileNotFoundError as e:
        raise UnknownDatasetError(
            f"Minari dataset {dataset_id!r} not found: it is not among Minari's local datasets at "
            f"{minari_datasets_path()} and TorchRL's MinariExperienceReplay could not load it ({e})") from e
    except ImportError as e:  # e.g. huggingface_hub, which Minari's remote hub needs
        e.add_note(f"Minari dataset {dataset_id!r} is not among Minari's local datasets at {minari_datasets_path()}, "
                   "so TorchRL's MinariExperienceReplay was asked to download it")
        raise


def minari_rows(dataset: Any):
    """The rows of a ``MinariDataset`` as one TensorDict, in TorchRL's Minari layout (episodes by id)."""
    import torch
    from tensordict import TensorDict, cat

    parts = []
    for episode in dataset.iterate_episodes(sorted(int(i) for i in dataset.episode_indices)):
        steps = len(episode)
        observations = _tree(episode.observations, "observations", steps + 1)
        terminated = torch.as_tensor(episode.terminations, dtype=torch.bool).reshape(steps, 1)
        truncated = torch.as_tensor(episode.truncations, dtype=torch.bool).reshape(steps, 1)
        row = {
            "observation": observations[:-1],
            "action": _tree(episode.actions, "actions", steps),
            "episode": torch.full((steps,), int(episode.id), dtype=torch.int64),
            "next": {"observation": observations[1:], "reward": torch.as_tensor(episode.rewards).reshape(steps, 1),
                     "terminated": terminated, "truncated": truncated, "done": terminated | truncated},
        }
        infos = _infos(episode.infos, steps)
        if infos is not None:
            row["info"], row["next"]["info"] = infos[:-1], infos[1:]
        parts.append(TensorDict(row, batch_size=[steps]))
    if not parts:
        raise SchemaError(f"Minari dataset {dataset.id!r} holds no episodes")
    return cat(parts, 0)


def _local_buffer(dataset: Any, batch_size: int | None = None, *, split_trajs: bool = False, **options: Any):
    from torchrl.data import TensorDictReplayBuffer
    from torchrl.data.replay_buffers.storages import TensorStorage
    from torchrl.data.replay_buffers.writers import ImmutableDatasetWriter

    unknown = sorted(set(options) - set(_BUFFER_OPTIONS) - set(_UNUSED_OPTIONS))
    if unknown:
        raise DatasetOptionError(f"unexpected options {unknown} for the local Minari dataset {dataset.id!r}; "
                                 f"expected {sorted(('batch_size', 'split_trajs') + _BUFFER_OPTIONS + _UNUSED_OPTIONS)}")
    rows = minari_rows(dataset)
    if split_trajs:  # as TorchRL's: one row per episode, padded to the longest
        from torchrl.collectors.utils import split_trajectories

        rows = split_trajectories(rows, trajectory_key="episode")
    kwargs = {k: options[k] for k in _BUFFER_OPTIONS if k in options}
    kwargs.setdefault("writer", ImmutableDatasetWriter())
    buffer = TensorDictReplayBuffer(storage=TensorStorage(rows), batch_size=batch_size, **kwargs)
    buffer.dataset_id = dataset.id
    return buffer


def _tree(value: Any, name: str, steps: int):
    """An episode's array (or dict of arrays, as a Dict space records) as tensors of ``steps`` rows."""
    import numpy as np
    import torch

    if isinstance(value, dict):
        from tensordict import TensorDict

        return TensorDict({k: _tree(v, f"{name}.{k}", steps) for k, v in value.items()}, batch_size=[steps])
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "biuf":
        raise SchemaError(f"Minari {name}: expected numeric arrays (a Box, Discrete or Dict space), got "
                          f"{type(value).__name__}{'' if not isinstance(value, np.ndarray) else ' ' + str(value.dtype)}")
    if len(value) != steps:
        raise SchemaError(f"Minari {name}: expected {steps} rows, got {len(value)}")
    return torch.as_tensor(value)


def _infos(infos: Any, steps: int):
    """An episode's numeric infos (one row per observation, as Minari records them), or None; others are
    left out, as TorchRL leaves them out."""
    import numpy as np

    if not isinstance(infos, dict):
        return None
    kept = {}
    for key, value in infos.items():
        if isinstance(value, dict):
            value = _infos(value, steps)
        elif isinstance(value, np.ndarray) and value.dtype.kind in "biuf" and len(value) == steps + 1:
            value = _tree(value, f"infos.{key}", steps + 1)
        else:
            value = None
        if value is not None:
            kept[key] = value
    if not kept:
        return None
    from tensordict import TensorDict

    return TensorDict(kept, batch_size=[steps + 1])
