"""A shard's large reads go back to the system once freed (rayrb.actors.heap), instead of staying in glibc's heap.

Each case runs in a fresh process: the heap's thresholds are per process and move with what it allocated before.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

SCRIPT = r"""
import json, pickle, sys
import rayrb.actors.shards as shards

if sys.argv[2] == "without":
    shards.return_large_frees = lambda: None

def anon_mib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) / 1024

shard = shards.OfflineShard(sys.argv[1], 0, 200_000, "t/off-0")  # written by another process
shard.sample_many([64], [1])
before = anon_mib()
for seed in range(6):  # a B=65536, prefetch=16 group over 4 shards: 16 reads of 8,192 rows, 29 MiB gathered
    rows, info = shard.sample_many([8192] * 16, list(range(seed * 16, seed * 16 + 16)))
    assert rows["x"].shape == (8192 * 16, 54)
    sent = pickle.dumps((rows, info), protocol=5)  # as Ray copies a return value out before freeing it
    del rows, info, sent
print(json.dumps({"growth_mib": anon_mib() - before}))
"""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    from rayrb import write_dataset

    root = str(tmp_path_factory.mktemp("heap") / "ds")
    n = 200_000
    write_dataset({"x": np.random.default_rng(0).random((n, 54), dtype=np.float32), "y": np.zeros(n, np.int64)},
                  root)
    return root


def growth(dataset: str, case: str) -> float:
    out = subprocess.run([sys.executable, "-c", SCRIPT, dataset, case], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["growth_mib"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status and glibc's heap")
def test_a_shards_freed_reads_do_not_stay_in_its_heap(dataset):
    kept = growth(dataset, "without")
    if kept < 16:
        pytest.skip(f"this C library returned the reads without help ({kept:.0f} MiB kept)")
    assert growth(dataset, "with") < 8, f"the shard kept its freed reads in its heap (without the fix: {kept:.0f} MiB)"
