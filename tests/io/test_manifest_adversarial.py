"""Manifests written by hand or damaged: paths out of the dataset, fields of the wrong type, dtypes rayrb cannot
store. Each is refused at open with a ``ChunkError`` naming the field; none is served."""
from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rayrb.core.schema import STORED_DTYPES, RowSpec, SchemaError
from rayrb.io.arrays import to_numpy_dict
from rayrb.io.chunks import ChunkDataset, ChunkError, write_dataset


@pytest.fixture
def two(tmp_path):
    """A dataset ``ds`` and, beside it, ``other`` with other values in the same layout."""
    write_dataset({"X": np.arange(20, dtype=np.float32).reshape(10, 2)}, tmp_path / "ds", chunk_rows=5)
    write_dataset({"X": np.arange(20, dtype=np.float32).reshape(10, 2) + 100}, tmp_path / "other", chunk_rows=5)
    return tmp_path / "ds", tmp_path / "other"


def rewrite(root, change):
    path = root / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


# chunk paths ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["../other/chunk-00000", "chunk-00000/../../other/chunk-00000", "ABS", "", "."])
def test_a_chunk_path_out_of_the_dataset_is_refused(two, path):
    ds, other = two
    path = str(other / "chunk-00000") if path == "ABS" else path
    rewrite(ds, lambda m: m["chunks"][1].update(path=path))
    with pytest.raises(ChunkError, match=r"field chunks\[1\]\.path: expected a path relative to the dataset"):
        ChunkDataset.open(ds)


def test_a_chunk_directory_linked_out_of_the_dataset_is_refused(two):
    ds, other = two
    shutil.rmtree(ds / "chunk-00001")
    os.symlink(other / "chunk-00001", ds / "chunk-00001")  # same size, same name: only where it leads differs
    with pytest.raises(ChunkError, match="chunk chunk-00001: expected its files inside the dataset"):
        ChunkDataset.open(ds)


def test_a_column_file_linked_out_of_the_dataset_is_refused(two):
    ds, other = two
    os.unlink(ds / "chunk-00000" / "X.memmap")
    os.symlink(other / "chunk-00000" / "X.memmap", ds / "chunk-00000" / "X.memmap")
    with pytest.raises(ChunkError, match="chunk chunk-00000: expected its files inside the dataset"):
        ChunkDataset.open(ds)


def test_links_inside_the_dataset_and_a_linked_root_still_open(two, tmp_path):
    ds, _ = two
    os.rename(ds / "chunk-00001", ds / "stored")
    os.symlink("stored", ds / "chunk-00001")  # a link that stays inside
    os.symlink(ds, tmp_path / "alias")
    got = ChunkDataset.open(tmp_path / "alias", verify=True).read()["X"]
    np.testing.assert_array_equal(got, np.arange(20, dtype=np.float32).reshape(10, 2))


@pytest.mark.parametrize("again", ["chunk-00000", "./chunk-00000", "chunk-00000/"])
def test_a_chunk_listed_twice_is_refused(two, again):
    ds, _ = two
    rewrite(ds, lambda m: m["chunks"][1].update(path=again, hash=m["chunks"][0]["hash"]))
    with pytest.raises(ChunkError, match=r"chunks\[1\]\.path: expected each chunk once"):
        ChunkDataset.open(ds)


def _loop(chunk):
    shutil.rmtree(chunk)
    os.symlink(chunk.name, chunk)


def _a_file(chunk):
    shutil.rmtree(chunk)
    chunk.write_text("not a chunk")


def _a_directory(chunk):
    os.unlink(chunk / "X.memmap")
    os.mkdir(chunk / "X.memmap")


@pytest.mark.parametrize("damage, words", [(_loop, "cannot be read"), (_a_file, "cannot be read"),
                                           (_a_directory, "expected a file for key 'X'")])
def test_a_chunk_that_is_no_directory_of_files_is_a_chunk_error(two, damage, words):
    ds, _ = two
    damage(ds / "chunk-00001")
    with pytest.raises(ChunkError, match=f"chunk chunk-00001: .*{words}"):
        ChunkDataset.open(ds)


# every field, wrong ----------------------------------------------------------------------------------------------
def _set(*keys, value):
    def change(m):
        for k in keys[:-1]:
            m = m[k]
        m[keys[-1]] = value
    return change


WRONG = [  # (what changes, the field the error must name)
    (_set("spec", "X", "dtype", value="float99"), "spec: key 'X': expected a dtype"),
    (_set("spec", "X", "dtype", value="bfloat16"), "spec: key 'X': expected a dtype"),
    (_set("spec", "X", "dtype", value="object"), "spec: key 'X': expected a dtype"),  # pointers, mapped from a file
    (_set("spec", "X", "dtype", value=">f4"), "spec: key 'X': expected a dtype"),
    (_set("spec", "X", "dtype", value=7), "spec: key 'X': expected a dtype"),
    (_set("spec", "X", "shape", value="2"), "spec: key 'X': expected a shape"),
    (_set("spec", "X", "shape", value=[2.0]), "spec: key 'X': expected a shape"),
    (_set("spec", "X", "shape", value=[-2]), "spec: key 'X': expected a shape"),
    (_set("spec", "X", "shape", value=[True, 2]), "spec: key 'X': expected a shape"),
    (_set("spec", "X", value=[2]), "spec: key 'X': expected a mapping with 'shape' and 'dtype'"),
    (_set("spec", "X", value={"shape": [2]}), "spec: key 'X': expected a mapping with 'shape' and 'dtype'"),
    (_set("spec", value=[{"shape": [2], "dtype": "float32"}]), "spec: expected a row spec as a mapping"),
    (_set("spec", value="X"), "spec: expected a row spec as a mapping"),
    (_set("spec", value={}), "spec: a row spec needs at least one key"),
    (_set("spec", value={"../../X": {"shape": [2], "dtype": "float32"}}), "spec: key '../../X': expected a key"),
    (_set("spec", value={"a//X": {"shape": [2], "dtype": "float32"}}), "spec: key 'a//X': expected a key"),
    (_set("rows", value="one hundred"), "field rows: expected an integer in"),
    (_set("rows", value=10.0), "field rows: expected an integer in"),
    (_set("rows", value=True), "field rows: expected an integer in"),
    (_set("rows", value=None), "field rows: expected an integer in"),
    (_set("chunks", value={"0": {}}), "field chunks: expected a list"),
    (_set("chunks", value=None), "field chunks: expected a list"),
    (_set("chunks", 0, value="chunk-00000"), r"field chunks\[0\]: expected an entry"),
    (_set("chunks", 0, "surprise", value=1), r"field chunks\[0\]: expected an entry"),
    (lambda m: m["chunks"][0].pop("hash"), r"field chunks\[0\]: expected an entry"),
    (_set("chunks", 0, "path", value=5), r"field chunks\[0\]\.path: expected a string"),
    (_set("chunks", 0, "path", value=["chunk-00000"]), r"field chunks\[0\]\.path: expected a string"),
    (_set("chunks", 0, "rows", value="five"), r"field chunks\[0\]\.rows: expected an integer in"),
    (_set("chunks", 0, "rows", value=-5), r"field chunks\[0\]\.rows: expected an integer in"),
    (_set("chunks", 0, "rows", value=5.0), r"field chunks\[0\]\.rows: expected an integer in"),
    (_set("chunks", 0, "rows", value=2**70), r"field chunks\[0\]\.rows: expected an integer in"),
    (_set("spec", "X", "shape", value=[2**62, 2**62]), "spec: key 'X': expected at most 2\\*\\*40 values in a row"),
    (_set("spec", "X", "shape", value=[2**20, 2**19]), r"chunk chunk-00000: key 'X' expected \d{13,} bytes"),
    (_set("chunks", 0, "hash", value=3), r"field chunks\[0\]\.hash: expected a string"),
    (_set("chunks", 0, "node", value=3), r"field chunks\[0\]\.node: expected a node id or null"),
    (_set("chunks", 0, "extra", value=[]), r"field chunks\[0\]\.extra: expected a mapping"),
]


@pytest.mark.parametrize("change, field", WRONG, ids=[f"{i}-" + re.sub(r"\W+", "_", w[1].split(":")[0]).strip("_") for i, w in enumerate(WRONG)])
def test_each_malformed_field_is_a_chunk_error_naming_it(two, change, field):
    ds, _ = two
    before = {p: p.read_bytes() for p in ds.rglob("*") if p.is_file() and p.name != "manifest.json"}
    rewrite(ds, change)
    with pytest.raises(ChunkError, match=field):
        ChunkDataset.open(ds)
    assert {p: p.read_bytes() for p in before} == before  # refused, nothing touched


ODD = [None, True, 0, -1, 1.5, 2**70, float("nan"), "", "x", "../x", [], [1], ["x"], {}, {"a": 1}]


def _places(value, at=()):
    """Every place in a manifest (a key path), the whole manifest's fields and each one's insides."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield (*at, k)
            yield from _places(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield (*at, i)
            yield from _places(v, (*at, i))


def test_any_odd_value_anywhere_in_a_manifest_opens_or_is_a_chunk_error(two):
    ds, _ = two
    original = json.loads((ds / "manifest.json").read_text())
    tried = 0
    for place in _places(original):
        if place[0] in ("format", "version", "source", "recipe"):  # the format's own check; free-form fields
            continue
        for odd in ODD:
            manifest = json.loads(json.dumps(original))
            target = manifest
            for k in place[:-1]:
                target = target[k]
            target[place[-1]] = odd
            (ds / "manifest.json").write_text(json.dumps(manifest))
            try:
                ChunkDataset.open(ds, verify=True).read()
            except ChunkError:
                pass  # anything else (TypeError, ValueError, OSError, a crash) fails the test
            tried += 1
    assert tried == 19 * len(ODD)  # every place of a two-chunk manifest tried


def test_the_rows_must_add_up_and_a_well_formed_manifest_still_opens(two):
    ds, _ = two
    assert len(ChunkDataset.open(ds, verify=True)) == 10
    rewrite(ds, _set("rows", value=11))
    with pytest.raises(ChunkError, match="says 11 rows, but its chunks hold 10"):
        ChunkDataset.open(ds)


# dtypes ---------------------------------------------------------------------------------------------------------
def test_bfloat16_rows_are_refused_naming_the_key_and_the_dtype(tmp_path):
    td = TensorDict({"obs": {"pixels": torch.zeros(4, 2, dtype=torch.bfloat16)}, "y": torch.zeros(4)}, [4])
    with pytest.raises(SchemaError, match=r"key 'obs/pixels': expected a dtype rayrb stores .* got torch\.bfloat16"):
        write_dataset(td, tmp_path / "ds")
    assert not (tmp_path / "ds").exists()  # refused before anything was written
    with pytest.raises(SchemaError, match="key 'obs/pixels'.*bfloat16"):  # what extend() flattens rows with
        to_numpy_dict(td)
    assert to_numpy_dict(td.float())["obs/pixels"].dtype == np.float32  # the cast the message suggests


@pytest.mark.parametrize("array", [np.array(["a", "b"]), np.zeros(2, object), np.zeros(2, np.longdouble),
                                   np.zeros(2, "datetime64[s]")], ids=["str", "object", "longdouble", "datetime"])
def test_dtypes_no_chunk_can_hold_are_refused_before_writing(tmp_path, array):
    with pytest.raises(SchemaError, match=f"key 'bad': expected a dtype rayrb stores .* got '{re.escape(array.dtype.name)}'"):
        write_dataset({"bad": array, "ok": np.zeros(2)}, tmp_path / "ds")
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("dtype", STORED_DTYPES)
def test_every_stored_dtype_round_trips_through_a_chunk(tmp_path, dtype):
    data = {"x": (np.arange(6) % 2).astype(dtype).reshape(3, 2)}
    ds = write_dataset(data, tmp_path / "ds")
    assert ChunkDataset.open(tmp_path / "ds", verify=True).spec == RowSpec.from_arrays(data)
    back = ds[np.array([2, 0])]["x"]
    assert back.numpy().dtype.name == dtype
    np.testing.assert_array_equal(back.numpy(), data["x"][[2, 0]])


# a chunk cut short under its readers ----------------------------------------------------------------------------
VICTIM = """
import os, sys
import numpy as np
from rayrb.handle.local import OfflineReader
from rayrb.io.chunks import ChunkDataset, ChunkError

root, how = sys.argv[1], sys.argv[2]
if how == "local":  # a handle's own read from an offline shard's chunks (rayrb.handle.local)
    reader = OfflineReader(root, 0, 4096, "uniform")
    out = {"X": np.empty((64, 512), np.float32)}
    gather = lambda: reader.read([64], [7], None, None, out)
else:
    ds = ChunkDataset.open(root)
    gather = lambda: ds.gather(np.arange(4096 - 64, 4096) if how == "tail" else np.array([1, 4095]))
gather()  # mapped, pages read
os.truncate(os.path.join(root, "chunk-00000", "X.memmap"), 4096)  # another process cuts the file
try:
    gather()
except ChunkError as e:
    print("refused:", e)
    sys.exit(0)
print("served")
"""


@pytest.mark.parametrize("how", ["local", "tail", "two_chunks"])
def test_a_chunk_cut_short_under_a_reader_is_refused_naming_it_not_a_sigbus(tmp_path, how):
    import subprocess
    import sys

    chunk_rows = 4096 if how != "two_chunks" else 2048
    write_dataset({"X": np.ones((4096, 512), np.float32)}, tmp_path / "ds", chunk_rows=chunk_rows)
    done = subprocess.run([sys.executable, "-c", VICTIM, str(tmp_path / "ds"), how], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"the reader died (signal {-done.returncode}): {done.stderr[-2000:]}"
    assert "refused: chunk chunk-00000: key 'X' expected" in done.stdout and "holds 4096" in done.stdout
