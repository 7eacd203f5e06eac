"""Arrow tables in (Parquet files, Ray Data blocks): every column comes back as its rows, or is refused naming
it; nothing arrives as other rows (a null list dropped shifts the rows after it, an integer column with a null
turns float64 with NaN, lists of other lengths re-cut, two columns for one key lose one)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayrb.errors import InvalidArgumentError, InvalidArgumentTypeError
from rayrb.io.arrow import arrow_to_arrays
from rayrb.io.chunks import write_dataset
from rayrb.io.parquet import export_parquet


@pytest.mark.parametrize("column, message", [
    (pa.array([[1, 2], None, None, [3, 4]], pa.list_(pa.int64())), "expected no missing values, got 2 null"),
    (pa.array([[1, 2], None, [3, 4]], pa.list_(pa.int64(), 2)), "expected no missing values, got 1 null"),
    (pa.array([[1, None], [3, 4]], pa.list_(pa.int64())), "expected no missing values, got 1 null\\(s\\) in its lists at depth 1"),
    (pa.array([1, None, 3], pa.int64()), "expected no missing values, got 1 null"),
    (pa.array([True, None], pa.bool_()), "expected no missing values, got 1 null"),
    (pa.array([[[1, 2], [3]], [[5], [6, 7]]], pa.list_(pa.list_(pa.int64()))),
     "expected lists of one length per row at depth 1, got lengths from 1 to 2"),
    (pa.array([[1, 2], [3]], pa.list_(pa.int64())), "expected lists of one length per row, got lengths from 1 to 2"),
])
def test_missing_values_and_ragged_lists_are_refused_naming_the_column(column, message):
    with pytest.raises(InvalidArgumentTypeError, match=f"column 'x': {message}"):
        arrow_to_arrays(pa.table({"x": column}))


def test_lists_of_lists_of_one_length_come_back_as_their_rows():
    t = pa.table({"x": pa.array([[[1, 2], [3, 4]], [[5, 6], [7, 8]]], pa.list_(pa.list_(pa.int64()))),
                  "y": pa.array([[1.5, 2.5], [3.5, 4.5]], pa.list_(pa.float32(), 2)),
                  "s": pa.array([{"a": 1}, {"a": 2}])})
    out = arrow_to_arrays(t)
    assert out["x"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]] and out["y"].dtype == np.float32
    assert out["s/a"].tolist() == [1, 2]


def test_a_struct_field_and_a_dotted_column_naming_one_key_are_refused():
    t = pa.table({"a.b": pa.array([1, 2]), "a": pa.array([{"b": 10}, {"b": 20}])})
    with pytest.raises(InvalidArgumentTypeError, match="expected one column per key, got both as key 'a/b'"):
        arrow_to_arrays(t)


def test_keys_with_a_dot_round_trip_through_parquet_and_keys_naming_one_column_are_refused(tmp_path):
    ds = write_dataset({"obs.pos": np.arange(12, dtype=np.float32).reshape(3, 2, 2),
                        "next": {"obs": np.arange(3, dtype=np.int16)}}, tmp_path / "ds")
    back = arrow_to_arrays(pq.read_table(export_parquet(ds, tmp_path / "pq")[0]))
    assert sorted(back) == ["next/obs", "obs.pos"] and back["obs.pos"].shape == (3, 2, 2)
    assert back["next/obs"].dtype == np.int16
    both = write_dataset({"a.b": np.arange(3), "a/b": np.arange(3) * 10}, tmp_path / "both")
    with pytest.raises(InvalidArgumentError, match="keys 'a.b' and 'a/b': .* got both as column 'a.b'"):
        export_parquet(both, tmp_path / "pq2")
    assert not (tmp_path / "pq2").exists()
