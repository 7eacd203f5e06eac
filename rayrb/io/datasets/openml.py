"""The seven OpenML tables of TorchRL's ``OpenMLExperienceReplay``, as chunk datasets.

Each recipe reproduces TorchRL 0.14.1's ``OpenMLExperienceReplay._get_data``:
the same rows dropped, the same encoders fitted in the same order, the same
column order. ``X`` is stored as float32 by default (half the bytes TorchRL's
float64 moves); ``dtype="float64"`` keeps TorchRL's values bit for bit. ``y`` is
int64.

scikit-learn 1.9 with pandas 3 crashes inside ``fetch_openml``'s default (pandas)
ARFF parser on files whose nominal values look like integers (openml.org's
adult v1, shuttle and covertype), and then deletes the cached file. rayrb reads
ARFF with scikit-learn's ``liac-arff`` parser, which keeps nominal values as
strings; the recipes then see exactly the categories the pandas parser gives on
files it can read.

Examples:
    >>> ds = load_openml("shuttle", data_home="~/scikit_learn_data", root=tmp_root)  # doctest: +SKIP
    >>> ds.spec  # doctest: +SKIP
    RowSpec(X: float32[9], y: int64[])
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any
from urllib.error import URLError

import numpy as np

from rayrb.errors import (
    DatasetUnavailableError,  # noqa: F401  (re-exported)
    InvalidArgumentError,
    UnknownDatasetError,  # noqa: F401  (re-exported)
)
from rayrb.io.chunks import ChunkDataset, ChunkError, read_manifest, write_dataset
from rayrb.io.files import replace_dir

RECIPE_VERSION = 1
PARSER = "liac-arff"

# dataset name -> (OpenML name, version), as TorchRL fetches them
OPENML_SOURCES: dict[str, tuple[str, int]] = {
    "adult_num": ("adult", 1),
    "adult_onehot": ("adult", 1),
    "mushroom_num": ("mushroom", 1),
    "mushroom_onehot": ("mushroom", 1),
    "covertype": ("covertype", 3),
    "shuttle": ("shuttle", 1),
    "magic": ("MagicTelescope", 1),
}
OPENML_DATASETS: tuple[str, ...] = tuple(OPENML_SOURCES)



def default_root() -> Path:
    """Where prepared datasets go: ``$RAYRB_HOME`` or ``~/.cache/rayrb``."""
    return Path(os.environ.get("RAYRB_HOME") or Path.home() / ".cache" / "rayrb")



def check_name(name: str) -> str:
    if name not in OPENML_SOURCES:
        raise UnknownDatasetError(f"Dataset does not exist: unknown OpenML dataset {name!r}; expected one of "
                                  f"{', '.join(OPENML_DATASETS)}")
    return name


def fetch(
    openml_name: str | None,
    version: int | None = None,
    *,
    data_id: int | None = None,
    data_home: str | os.PathLike | None = None,
    n_retries: int = 3,
):
    """``fetch_openml(name, version=..., return_X_y=True)`` with a parser that survives pandas 3.

    Give a name and version, or a ``data_id``. Returns ``(X, y)`` as a pandas DataFrame and Series.
    """
    by = {"data_id": data_id} if data_id is not None else {"name": openml_name, "version": version}
    from sklearn.datasets import fetch_openml

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "version 1 is inactive" and the like
            return fetch_openml(
                **by,
                return_X_y=True,
                as_frame=True,
                data_home=None if data_home is None else str(data_home),
                parser=PARSER,
                n_retries=n_retries,
            )
    except (URLError, OSError) as exc:
        where = data_home or os.environ.get("SCIKIT_LEARN_DATA") or "~/scikit_learn_data"
        raise DatasetUnavailableError(
            f"could not fetch OpenML {by}: not in the scikit-learn cache at {where} and "
            f"openml.org is unreachable ({exc}). Offline, point data_home at a scikit-learn OpenML cache (or set "
            f"SCIKIT_LEARN_DATA): the folder that holds openml/openml.org/..., as fetch_openml writes it. Online, "
            f"the table is downloaded there on first use"
        ) from exc


def preprocess_frame(name: str, X, y) -> dict[str, np.ndarray]:
    """TorchRL's recipe for ``name`` on the raw ``fetch_openml`` frame; ``X`` float64, ``y`` int64.

    Mirrors ``torchrl.data.datasets.OpenMLExperienceReplay._get_data`` step by step;
    do not "tidy" it: the order of fits is part of the result.
    """
    from sklearn.preprocessing import LabelEncoder, OneHotEncoder, StandardScaler

    check_name(name)
    if name in ("adult_num", "adult_onehot"):
        X = X[~X.isna().any(axis=1)]
        y = X["occupation"]  # TorchRL's label is the occupation, not the income class
        X = X.drop(["occupation"], axis=1)
        cat_ix = X.select_dtypes(include=["category"]).columns
        num_ix = X.select_dtypes(include=["int64", "float64"]).columns
        encoder = LabelEncoder()
        for col in cat_ix:
            X[col] = encoder.fit_transform(X[col])
        y = encoder.fit_transform(y)
        if name == "adult_onehot":
            cat_features = OneHotEncoder(sparse_output=False).fit_transform(X[cat_ix])
            num_features = StandardScaler().fit_transform(X[num_ix])
            X = np.concatenate((num_features, cat_features), axis=1)
        else:
            X = StandardScaler().fit_transform(X)
    elif name in ("mushroom_num", "mushroom_onehot"):
        encoder = LabelEncoder()
        X = X.copy()
        for col in X.columns:
            X[col] = encoder.fit_transform(X[col])
        y = encoder.fit_transform(y)
        if name == "mushroom_onehot":
            X = OneHotEncoder(sparse_output=False).fit_transform(X)
        else:
            X = StandardScaler().fit_transform(X)
    else:  # covertype, shuttle, magic: all numeric
        X = StandardScaler().fit_transform(X)
        y = LabelEncoder().fit_transform(y)
    return {"X": np.asarray(X, dtype=np.float64), "y": np.asarray(y, dtype=np.int64)}


def recipe(name: str, dtype: str) -> dict[str, Any]:
    openml_name, version = OPENML_SOURCES[check_name(name)]
    return {
        "kind": "openml",
        "name": name,
        "openml": {"name": openml_name, "version": version, "parser": PARSER},
        "dtype": dtype,
        "recipe_version": RECIPE_VERSION,
        "parity": "torchrl==0.14.1 OpenMLExperienceReplay._get_data",
    }


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in ("float32", "float64"):
        raise InvalidArgumentError(f"dtype must be float32 or float64, got {dtype!r}")
    return name


def load_openml(
    name: str,
    *,
    root: str | os.PathLike | None = None,
    data_home: str | os.PathLike | None = None,
    dtype: Any = "float32",
    chunk_rows: int | None = None,
    pbar: bool = True,
) -> ChunkDataset:
    """Prepare (once) and open one of the seven datasets as a read-only chunk dataset.

    The dataset lives at ``root/openml/<name>-<dtype>`` (``root`` defaults to
    ``default_root``) and is reused when its manifest records the same recipe.

    Args:
        name: one of ``OPENML_DATASETS``.
        root: where prepared datasets are written (the OpenML cache itself is only read).
        data_home: scikit-learn's data home holding (or receiving) the OpenML cache.
        dtype: ``"float32"`` (default) or ``"float64"`` (bit parity with TorchRL) for ``X``.
        chunk_rows: rows per chunk (default: about 64 MiB per chunk).
        pbar: show progress while fetching, preprocessing and writing.
    """
    check_name(name)
    dtype = _dtype_name(dtype)
    want = recipe(name, dtype)
    dest = Path(root or default_root()) / "openml" / f"{name}-{dtype}"
    try:
        if read_manifest(dest).get("recipe") == want:
            return ChunkDataset.open(dest)
    except ChunkError:
        pass
    openml_name, version = OPENML_SOURCES[name]
    if pbar:
        print(f"rayrb: preparing openml:{name} (fetch_openml {openml_name!r} v{version}, TorchRL's recipe)", flush=True)
    X, y = fetch(openml_name, version, data_home=data_home)
    arrays = preprocess_frame(name, X, y)
    arrays["X"] = arrays["X"].astype(dtype, copy=False)
    replace_dir(dest, lambda d: write_dataset(arrays, d, chunk_rows=chunk_rows, source={"openml": want["openml"]},
                                              recipe=want, pbar=pbar))
    return ChunkDataset.open(dest)
