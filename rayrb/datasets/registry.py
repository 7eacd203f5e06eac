"""Dataset ids: ``load_dataset("openml:adult_num")``, ``register_dataset(prefix, factory)``.

An id is ``"<prefix>:<name>"``; a path to a chunk-dataset directory is accepted
too. ``batch_size`` is accepted and ignored, since TorchRL's loaders take it and
code that calls them ports over unchanged.

Examples:
    >>> def toy(name, root):
    ...     import numpy as np
    ...     from rayrb.chunks import write_dataset
    ...     return write_dataset({"x": np.arange(int(name), dtype="int64")}, root)
    >>> register_dataset("toy", toy)
    >>> len(load_dataset("toy:5", root=tmp_path / "toy"))  # doctest: +SKIP
    5
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from rayrb.chunks import MANIFEST, ChunkDataset

Factory = Callable[..., ChunkDataset]
_REGISTRY: dict[str, Factory] = {}


def register_dataset(prefix: str, factory: Factory, *, overwrite: bool = False) -> None:
    """Make ``load_dataset("<prefix>:<name>", **kw)`` call ``factory(name, **kw)``."""
    if not prefix or ":" in prefix or not prefix.isidentifier():
        raise ValueError(f"expected a prefix like 'openml' (an identifier, no ':'), got {prefix!r}")
    if not callable(factory):
        raise TypeError(f"expected a callable factory(name, **kwargs), got {type(factory).__name__}")
    if prefix in _REGISTRY and not overwrite:
        raise ValueError(f"dataset prefix {prefix!r} is already registered; pass overwrite=True to replace it")
    _REGISTRY[prefix] = factory


def registered_prefixes() -> list[str]:
    return sorted(_REGISTRY)


def load_dataset(dataset_id: str | os.PathLike, **kwargs: Any) -> ChunkDataset:
    """Open a dataset by id (``"openml:shuttle"``, a registered prefix) or by chunk-dataset path."""
    kwargs.pop("batch_size", None)
    path = Path(dataset_id)
    if (path / MANIFEST).is_file():
        if kwargs:
            raise TypeError(f"a chunk-dataset path takes no options, got {sorted(kwargs)}")
        return ChunkDataset.open(path)
    dataset_id = str(dataset_id)
    prefix, sep, name = dataset_id.partition(":")
    if sep and prefix in _REGISTRY:
        return _REGISTRY[prefix](name, **kwargs)
    raise ValueError(
        f"expected a dataset id '<prefix>:<name>' with prefix in {registered_prefixes()} "
        f"or a chunk-dataset directory holding {MANIFEST}, got {dataset_id!r}"
    )


def _openml(name: str, **kwargs: Any) -> ChunkDataset:
    from rayrb.datasets.openml import load_openml

    return load_openml(name, **kwargs)


register_dataset("openml", _openml)
