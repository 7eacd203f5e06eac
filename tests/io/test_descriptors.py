"""A dataset of many chunks read at random keeps two descriptors a chunk file open: the process's soft limit of
open files is raised as they are opened (rayrb.io.descriptors), and where the hard limit runs out the error says
so, and what to do, instead of a bare EMFILE."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from rayrb.io.chunks import write_dataset

resource = pytest.importorskip("resource")

GATHER_ALL = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    soft, hard = int(sys.argv[2]), int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    from rayrb.errors import ChunkError
    from rayrb.io.chunks import ChunkDataset
    ds = ChunkDataset.open(sys.argv[1])
    try:
        got = ds.gather(np.random.default_rng(0).permutation(len(ds)))
        out = {"ok": bool((np.sort(got["x"]) == np.arange(len(ds))).all())}
    except ChunkError as e:
        out = {"error": str(e)}
    out["soft"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    print(json.dumps(out))
""")


def gather_all(root, soft: int, hard: int) -> dict:
    done = subprocess.run([sys.executable, "-c", GATHER_ALL, str(root), str(soft), str(hard)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def many_chunks(tmp_path_factory):
    """300 chunks of two keys: 600 files, 1,200 descriptors once every chunk was read."""
    root = tmp_path_factory.mktemp("many") / "ds"
    write_dataset({"x": np.arange(3000, dtype=np.int64), "y": np.zeros((3000, 2), np.float32)}, root, chunk_rows=10)
    return root


def test_a_soft_limit_under_what_the_chunks_need_is_raised_towards_the_hard_one(many_chunks):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2000:
        pytest.skip(f"this process's hard limit of open files ({hard}) is below what the test needs")
    out = gather_all(many_chunks, 512, 4000)
    assert out.get("ok") is True, out
    assert 1200 < out["soft"] <= 4000


def test_a_hard_limit_too_low_is_a_chunk_error_that_says_what_to_do(many_chunks):
    out = gather_all(many_chunks, 512, 512)
    assert "error" in out and out["soft"] == 512, out
    assert "no descriptor left" in out["error"] and "ulimit -Hn" in out["error"] and "chunk_rows" in out["error"]
    assert "chunk-" in out["error"]  # names the chunk and key it could not open
