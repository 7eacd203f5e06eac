"""Dataset ids: ``load_dataset("openml:adult_num")``, ``register_dataset(prefix, factory)``.

An id is ``"<prefix>:<name>"``; a path to a chunk-dataset directory is accepted
too. ``openml`` is rayrb's own loader (TorchRL's recipes, written as chunks); it
accepts ``batch_size`` and ignores it, since TorchRL's loaders take it. TorchRL's
other prefixes (``d4rl``, ``minari``, ``atari``, ...) route to TorchRL's dataset
classes, imported when used, as TorchRL's registry does; a buffer copies the rows
such a dataset holds into chunks. A ``minari`` id Minari holds locally is read by Minari
first (``rayrb.io.datasets.minari_local``), in the same rows. A factory may be a callable or a
``"module:attribute"`` string resolved when the prefix is used.

Examples:
    >>> def toy(name, root, **options):  # options: what the caller passes, batch_size included
    ...     import numpy as np
    ...     from rayrb.io.chunks import write_dataset
    ...     return write_dataset({"x": np.arange(int(name), dtype="int64")}, root)
    >>> register_dataset("toy", toy)
    >>> len(load_dataset("toy:5", root=tmp_path / "toy"))  # doctest: +SKIP
    5
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rayrb.errors import (
    DatasetOptionError,  # noqa: F401  (re-exported)
    InvalidArgumentError,
    InvalidArgumentTypeError,
    UnknownDatasetError,
)
from rayrb.io.chunks import MANIFEST, ChunkDataset

Factory = Callable[..., Any]
_REGISTRY: dict[str, Factory | str] = {}
_DATASET_REGISTRY = _REGISTRY  # TorchRL's name for it



def register_dataset(prefix: str, factory: Factory | str, *, overwrite: bool = False,
                     replace: bool = False) -> None:
    """Make ``load_dataset("<prefix>:<name>", **kw)`` call ``factory(name, **kw)``.

    ``factory`` is a callable, or a ``"module:attribute"`` string imported when the
    prefix is first used (so a module patched later is the one called).
    ``replace`` is TorchRL's name for ``overwrite``.
    """
    overwrite = overwrite or replace
    if not prefix or ":" in prefix or not prefix.isidentifier():
        raise InvalidArgumentError(f"expected a prefix like 'openml' (an identifier, no ':'), got {prefix!r}")
    if isinstance(factory, str):
        module, _, attribute = factory.partition(":")
        if not module or not attribute:
            raise InvalidArgumentError(f"expected a factory string 'module:attribute', got {factory!r}")
    elif not callable(factory):
        raise InvalidArgumentTypeError(f"expected a callable factory(name, **kwargs) or a 'module:attribute' string, "
                                       f"got {type(factory).__name__}")
    if prefix in _REGISTRY and not overwrite:
        raise InvalidArgumentError(
            f"dataset prefix {prefix!r} is already registered; pass overwrite=True to replace it")
    _REGISTRY[prefix] = factory


def registered_prefixes() -> list[str]:
    return sorted(_REGISTRY)


def load_dataset(dataset_id: str | os.PathLike, **kwargs: Any) -> Any:
    """Open a dataset by id (``"openml:shuttle"``, a registered prefix) or by chunk-dataset path.

    Options go to the prefix's factory, as TorchRL forwards them; rayrb's own OpenML
    factory ignores ``batch_size`` (a buffer's batch size is the buffer's). Returns
    what the factory returns: a ``ChunkDataset`` for ``openml`` and paths, a
    TorchRL dataset for TorchRL's prefixes (see ``as_chunk_dataset``).
    """
    path = Path(dataset_id)
    if (path / MANIFEST).is_file():
        kwargs.pop("batch_size", None)
        if kwargs:
            raise DatasetOptionError(f"a chunk-dataset path takes no options, got {sorted(kwargs)}")
        return ChunkDataset.open(path)
    dataset_id = str(dataset_id)
    prefix, sep, name = dataset_id.partition(":")
    if sep and prefix in _REGISTRY:
        return _factory(prefix)(name, **kwargs)
    if not sep:
        raise InvalidArgumentError(
            f"dataset_id must be prefixed with a source identifier ('<prefix>:<name>', prefix in "
            f"{registered_prefixes()}) or be a chunk-dataset directory holding {MANIFEST}; "
            f"got {dataset_id!r}")
    raise UnknownDatasetError(f"Unknown dataset source {prefix!r} in {dataset_id!r}: expected a dataset id "
                              f"'<prefix>:<name>' with prefix in {registered_prefixes()}, or a chunk-dataset directory "
                              f"holding {MANIFEST}")


def _openml(name: str, **kwargs: Any) -> ChunkDataset:
    from rayrb.io.datasets.openml import load_openml

    kwargs.pop("batch_size", None)
    return load_openml(name, **kwargs)


def _factory(prefix: str) -> Factory:
    factory = _REGISTRY[prefix]
    if not isinstance(factory, str):
        return factory
    module, _, attribute = factory.partition(":")
    try:
        found = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as e:  # a missing attribute is an ImportError, as `from m import a` says
        raise ImportError(f"dataset prefix {prefix!r} loads through {factory}, which could not be imported ({e}); "
                          "TorchRL's loaders need `pip install torchrl` and their own extras") from e
    if not callable(found):
        raise InvalidArgumentTypeError(
            f"dataset prefix {prefix!r} loads through {factory}: expected a callable factory(name, "
            f"**kwargs) there, got {type(found).__name__}")
    return found


register_dataset("openml", _openml)
for _prefix, _factory_name in {  # TorchRL's other loaders, as its registry names them
    "atari": "torchrl.data.datasets.atari_dqn:AtariDQNExperienceReplay",
    "atari_dqn": "torchrl.data.datasets.atari_dqn:AtariDQNExperienceReplay",
    "d4rl": "torchrl.data.datasets.d4rl:D4RLExperienceReplay",
    "gen_dgrl": "torchrl.data.datasets.gen_dgrl:GenDGRLExperienceReplay",
    "lerobot": "torchrl.data.datasets.lerobot:LeRobotExperienceReplay",
    "minari": "rayrb.io.datasets.minari_local:load_minari",  # Minari's local datasets first
    "openx": "torchrl.data.datasets.openx:OpenXExperienceReplay",
    "roboset": "torchrl.data.datasets.roboset:RobosetExperienceReplay",
    "vd4rl": "torchrl.data.datasets.vd4rl:VD4RLExperienceReplay",
}.items():
    register_dataset(_prefix, _factory_name)


def torchrl_rows(obj: Any):
    """Rows held by a TorchRL replay buffer or storage, as a TensorDict (duck-typed: torchrl is optional).

    A buffer's own transforms (a TorchRL dataset's ``DoubleToFloat``, say) are applied
    once, here, as its ``sample()`` applies them to every batch.
    """
    import torch

    storage = obj.storage if hasattr(obj, "storage") and hasattr(obj, "sample") else obj
    n = len(storage)
    if n == 0:
        raise InvalidArgumentError(f"expected a non-empty offline dataset, got an empty {type(obj).__name__}")
    rows = storage.get(torch.arange(n))
    transform = getattr(obj, "_transform", None) if storage is not obj else None
    if transform is not None and len(transform):
        with rows.unlock_() if hasattr(rows, "unlock_") else contextlib.nullcontext():
            rows = transform(rows)
        if rows.shape[:1] != (n,):
            raise InvalidArgumentError(f"expected the buffer's transforms to keep one row per stored row ({n}), "
                                       f"got a batch of shape {tuple(rows.shape)}")
    return rows


def _is_ray_dataset(obj: Any) -> bool:
    data = sys.modules.get("ray.data")  # a Dataset exists only once ray.data was imported
    return data is not None and isinstance(obj, data.Dataset)


def as_chunk_dataset(source: Any, *, root: str | os.PathLike | None = None, **kwargs: Any) -> tuple[ChunkDataset, bool]:
    """Resolve any offline source to a chunk dataset; return it and whether it was written here.

    ``source`` may be a dataset id or chunk-dataset path (see ``load_dataset``), a
    ``ChunkDataset``, a TensorDict or dict of arrays, a ``ray.data.Dataset`` (written by
    Ray tasks, see ``rayrb.io.raydata.write_ray_dataset``), or a TorchRL replay buffer or
    storage. Other sources are written once to ``root`` (a fresh temporary directory by
    default) and mapped from there.
    """
    from tensordict import TensorDictBase

    from rayrb.io.chunks import write_dataset

    if isinstance(source, (str, os.PathLike)):  # root= is the dataset's own option here: where it is prepared
        loaded = load_dataset(source, **({"root": root} if root is not None else {}), **kwargs)
        if isinstance(loaded, ChunkDataset):
            return loaded, False
        if isinstance(loaded, (str, os.PathLike)):  # taken as an id again, it could name itself without end
            raise InvalidArgumentTypeError(f"expected the loader of {str(source)!r} to return a dataset, got the "
                                           f"{type(loaded).__name__} {str(loaded)!r}")
        return as_chunk_dataset(loaded)  # a TorchRL dataset's rows, copied into chunks
    if callable(getattr(source, "offline_source", None)):  # rayrb's OpenMLExperienceReplay: its chunks (or rows)
        return as_chunk_dataset(source.offline_source(), root=root, **kwargs)
    if kwargs:
        raise DatasetOptionError(f"dataset options {sorted(kwargs)} apply only to dataset ids (dataset_kwargs are "
                                 f"only forwarded when offline_dataset is a string), got a {type(source).__name__}")
    if isinstance(source, ChunkDataset):
        return source, False
    if _is_ray_dataset(source):
        from rayrb.io.raydata import write_ray_dataset

        def write(dest: Path) -> ChunkDataset:
            return write_ray_dataset(source, dest)
    else:
        if isinstance(source, (TensorDictBase, dict)):
            rows = source
        elif hasattr(source, "storage") or (hasattr(source, "get") and hasattr(source, "__len__")):
            rows = torchrl_rows(source)
        else:
            raise InvalidArgumentTypeError(
                "expected an offline dataset as a dataset id, a chunk-dataset path, a ChunkDataset, a TensorDict, "
                f"a dict of arrays, a ray.data.Dataset or a TorchRL replay buffer/storage, got {type(source).__name__}"
            )
        if isinstance(rows, TensorDictBase):
            rows = rows.exclude("index") if "index" in rows.keys() else rows  # TorchRL bookkeeping
            if rows.batch_dims != 1:
                rows = rows.reshape(-1)

        def write(dest: Path) -> ChunkDataset:
            return write_dataset(rows, dest, source={"kind": type(source).__name__})
    if root is None:
        return _write_in_temporary(write), True
    return write(Path(root)), True


def _write_in_temporary(write: Callable[[Path], ChunkDataset]) -> ChunkDataset:
    """``write(directory)`` for a directory in a fresh temporary folder under the datasets' root; a ``write``
    that raises leaves nothing there."""
    import tempfile

    from rayrb.io.datasets.openml import default_root

    base = Path(default_root()) / "tmp"
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="offline-", dir=base))
    try:
        return write(tmp / "ds")
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
