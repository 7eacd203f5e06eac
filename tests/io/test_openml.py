"""The seven OpenML recipes against TorchRL 0.14.1, on the real offline scikit-learn cache."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from openml_fixtures import build_cache

from rayrb.io.datasets import openml
from rayrb.io.datasets.openml import DatasetUnavailableError, load_openml, preprocess_frame

REAL = ["adult_num", "adult_onehot", "mushroom_num", "mushroom_onehot", "shuttle", "magic"]
WIDTH = {"adult_num": 13, "adult_onehot": 106, "mushroom_num": 22, "mushroom_onehot": 117, "shuttle": 9, "magic": 10}


@pytest.fixture(scope="module")
def torchrl_data(data_home, tmp_path_factory):
    """TorchRL's own OpenMLExperienceReplay storage for each real dataset, built once."""
    from torchrl.data.datasets import OpenMLExperienceReplay

    mp = pytest.MonkeyPatch()
    mp.setenv("SCIKIT_LEARN_DATA", str(data_home))
    root = tmp_path_factory.mktemp("torchrl_openml")
    out = {}
    for name in REAL:
        rb = OpenMLExperienceReplay(name, batch_size=8, root=root)
        td = rb.storage._storage
        out[name] = (td["X"].numpy().copy(), td["y"].numpy().copy())
    mp.undo()
    return out


@pytest.mark.parametrize("name", REAL)
def test_float64_is_bit_identical_to_torchrl(name, torchrl_data, data_home, tmp_path):
    X, y = torchrl_data[name]
    ds = load_openml(name, root=tmp_path, data_home=data_home, dtype="float64")
    got = ds.read()
    assert got["X"].shape == X.shape == (len(X), WIDTH[name])
    assert got["X"].dtype == np.float64 and got["y"].dtype == np.int64
    np.testing.assert_array_equal(got["X"], X)
    np.testing.assert_array_equal(got["y"], y)


@pytest.mark.parametrize("name", REAL)
def test_float32_default_equals_torchrl_at_float32(name, torchrl_data, data_home, tmp_path):
    X, y = torchrl_data[name]
    got = load_openml(name, root=tmp_path, data_home=data_home).read()
    assert got["X"].dtype == np.float32
    np.testing.assert_array_equal(got["X"], X.astype(np.float32))
    np.testing.assert_array_equal(got["y"], y)


def synthetic_covertype_schema_not_real_data(rows=300, seed=0):
    """A table with OpenML covertype v3's schema and random values. NOT the real covertype rows."""
    rng = np.random.default_rng(seed)
    numeric = ["Elevation", "Aspect", "Slope", "Horizontal_Distance_To_Hydrology", "Vertical_Distance_To_Hydrology",
               "Horizontal_Distance_To_Roadways", "Hillshade_9am", "Hillshade_Noon", "Hillshade_3pm",
               "Horizontal_Distance_To_Fire_Points"]
    cols = {c: rng.integers(0, 4000, rows).astype(np.int64) for c in numeric}
    for c in [f"Wilderness_Area{i}" for i in range(1, 5)] + [f"Soil_Type{i}" for i in range(1, 41)]:
        cols[c] = pd.Categorical(rng.integers(0, 2, rows).astype(str), categories=["0", "1"])
    X = pd.DataFrame(cols)
    y = pd.Series(pd.Categorical(rng.integers(1, 8, rows).astype(str)), name="class")
    return X, y


def test_covertype_recipe_matches_torchrl_on_same_schema_table(monkeypatch):
    import sklearn.datasets
    from torchrl.data.datasets import OpenMLExperienceReplay

    X, y = synthetic_covertype_schema_not_real_data()
    calls = []

    def fake_fetch(name, version, return_X_y):
        calls.append((name, version))
        return X.copy(), y.copy()

    monkeypatch.setattr(sklearn.datasets, "fetch_openml", fake_fetch)
    ref = OpenMLExperienceReplay._get_data("covertype")
    assert calls == [("covertype", 3)]
    got = preprocess_frame("covertype", X.copy(), y.copy())
    assert got["X"].shape == (300, 54)
    np.testing.assert_array_equal(got["X"], ref["X"].numpy())
    np.testing.assert_array_equal(got["y"], ref["y"].numpy())


def test_prepared_dataset_is_reused_and_deletable(data_home, tmp_path, monkeypatch):
    ds = load_openml("magic", root=tmp_path, data_home=data_home)
    assert ds.recipe["name"] == "magic" and ds.recipe["dtype"] == "float32"

    def no_fetch(*a, **k):
        raise AssertionError("a matching prepared dataset must be reused, not rebuilt")

    monkeypatch.setattr(openml, "fetch", no_fetch)
    again = load_openml("magic", root=tmp_path, data_home=data_home)
    assert again.root == ds.root and len(again) == 19020
    again.delete()
    assert not ds.root.exists()
    with pytest.raises(AssertionError, match="reused"):
        load_openml("magic", root=tmp_path, data_home=data_home)


def test_unknown_name_lists_the_seven():
    with pytest.raises(ValueError) as e:
        load_openml("iris")
    for name in openml.OPENML_DATASETS:
        assert name in str(e.value)
    assert len(openml.OPENML_DATASETS) == 7


def test_no_network_and_no_cache_says_how_to_point_data_home(tmp_path, monkeypatch):
    import socket

    def refuse(*a, **k):
        raise OSError("network is unreachable in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    with pytest.raises(DatasetUnavailableError, match="point data_home at a scikit-learn OpenML cache"):
        openml.fetch("shuttle", 1, data_home=tmp_path / "empty_home", n_retries=1)


@pytest.mark.parametrize("data_id, by_name", [(2, True), (40945, False)])
def test_integer_like_nominals_load_despite_pandas3_parser_crash(data_id, by_name, tmp_path):
    """Regression: sklearn 1.9 + pandas 3's ARFF parser crashes on these files and deletes the cache."""
    desc = build_cache(data_id, tmp_path)
    arff = next((tmp_path / "openml").rglob("*.arff.gz"))
    by = {"openml_name": desc["name"], "version": int(desc["version"])} if by_name else {"openml_name": None, "data_id": data_id}
    X, y = openml.fetch(**by, data_home=tmp_path, n_retries=1)
    assert len(X) > 0 and len(y) == len(X)
    assert arff.exists(), "the cached ARFF must survive loading"
    # values are those of the reference ARFF reader
    from sklearn.datasets import fetch_openml

    X2, y2 = fetch_openml(data_id=data_id, data_home=tmp_path, parser="liac-arff",
                          return_X_y=True, as_frame=True, n_retries=1)
    pd.testing.assert_frame_equal(X, X2)


def test_the_pandas3_trap_is_real(tmp_path, monkeypatch):
    """Documents why rayrb does not use the default parser: with pandas 3 it crashes on these files."""
    if int(pd.__version__.split(".")[0]) < 3:
        pytest.skip("the crash needs pandas >= 3")
    import socket

    from sklearn.datasets import fetch_openml
    from sklearn.datasets._openml import _retry_with_clean_cache  # noqa: F401  (the cache-deleting retry)

    def refuse(*a, **k):
        raise OSError("network is unreachable in this test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    build_cache(40945, tmp_path)
    arff = next((tmp_path / "openml").rglob("*.arff.gz"))
    with pytest.raises(Exception):  # TypeError from the parser, then URLError from the re-download
        fetch_openml(data_id=40945, data_home=tmp_path, parser="pandas", return_X_y=True, n_retries=1)
    assert not arff.exists(), "scikit-learn deletes the cached file after the parser crash"


def test_a_prepared_dataset_with_a_broken_manifest_is_prepared_again(data_home, tmp_path):
    from rayrb import load_dataset

    first = load_dataset("openml:mushroom_num", data_home=data_home, root=tmp_path, pbar=False)
    manifest = first.root / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])  # truncated
    again = load_dataset("openml:mushroom_num", data_home=data_home, root=tmp_path, pbar=False)
    assert len(again) == len(first) == 8124
    assert again.read()["y"].tolist() == first.read()["y"].tolist()
