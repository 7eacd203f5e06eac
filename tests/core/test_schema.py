import numpy as np
import pytest

from rayrb.core.schema import BOOKKEEPING_KEYS, FieldSpec, RowSpec, SchemaError, strip_bookkeeping


def arrays(rows=4, x_dim=3, x_dtype="float32"):
    return {"X": np.zeros((rows, x_dim), x_dtype), "n/y": np.zeros(rows, "int64")}


def test_spec_from_arrays_and_json_round_trip():
    spec = RowSpec.from_arrays(arrays())
    assert spec["X"] == FieldSpec((3,), "float32")
    assert spec[("n", "y")] == FieldSpec((), "int64")
    assert RowSpec.from_json(spec.to_json()) == spec
    assert spec.row_bytes == 3 * 4 + 8


@pytest.mark.parametrize(
    "bad, needle",
    [
        (arrays(x_dim=4), "key 'X': expected trailing shape (3,), got (4,)"),
        (arrays(x_dtype="float64"), "key 'X': expected dtype float32, got float64"),
        ({"X": np.zeros((4, 3), "float32")}, "missing ['n/y']"),
        ({**arrays(), "extra": np.zeros(4)}, "unexpected ['extra']"),
        ({"X": np.zeros((4, 3), "float32"), "n/y": np.zeros(5, "int64")}, "expected 4 rows"),
    ],
)
def test_validate_names_the_key_that_differs(bad, needle):
    spec = RowSpec.from_arrays(arrays())
    with pytest.raises(SchemaError) as e:
        spec.validate(bad)
    assert needle in str(e.value)


def test_strip_bookkeeping_keeps_keys_that_are_real_data():
    data = {**arrays(), "index": np.arange(4)}
    assert "index" in BOOKKEEPING_KEYS
    assert "index" not in strip_bookkeeping(data)
    assert "index" in strip_bookkeeping(data, keep=["index"])
