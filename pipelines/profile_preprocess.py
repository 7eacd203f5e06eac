"""Where one preprocess task's time goes, phase by phase, for one chunk of the benchmark's table.

    python pipelines/profile_preprocess.py [rows_per_chunk]
"""
from __future__ import annotations

import sys
import tempfile
import time

import numpy as np

from rayrb.core.schema import RowSpec
from rayrb.io.chunks import hash_arrays, write_chunk, write_dataset
from rayrb.io.preprocess import _apply, _read_unit


def standardize(td):
    td["X"] = (td["X"] - 0.5) / 2.0
    td["norm"] = td["X"].pow(2).sum(-1)
    return td


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 72_627  # the benchmark's chunk (581,012 rows / 8)
    root = tempfile.mkdtemp()
    rng = np.random.default_rng(0)
    write_dataset({"X": rng.standard_normal((rows, 54), dtype=np.float32), "y": np.zeros(rows, np.int64)},
                  f"{root}/src")
    for rep in range(3):
        t = [time.perf_counter()]
        arrays = _read_unit("chunks", f"{root}/src", 0, rows)
        t.append(time.perf_counter())
        out = _apply(standardize, arrays, True, "chunk", 0)
        t.append(time.perf_counter())
        spec = RowSpec.from_arrays(out)
        hash_arrays(out, spec)
        t.append(time.perf_counter())
        write_chunk(out, f"{root}/out{rep}", spec)  # writes, checksumming each block as it goes
        t.append(time.perf_counter())
        names = ["map input (copy-on-write)", "fn + TensorDict round trip", "xxh3 of output alone",
                 "chunk write + xxh3"]
        print(f"rep {rep}: " + ", ".join(f"{n} {1e3 * (b - a):.1f} ms" for n, a, b in zip(names, t, t[1:])))


if __name__ == "__main__":
    main()
