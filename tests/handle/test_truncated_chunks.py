"""A chunk file cut short under a live buffer: the user's process, reading the offline shard's rows itself from
the same files (rayrb.handle.local), gets a ChunkError naming the chunk, not a SIGBUS that kills it."""
from __future__ import annotations

import subprocess
import sys

import numpy as np

USER = """
import os, sys
import numpy as np
import ray
from rayrb import OfflineToOnlineReplayBuffer
from rayrb.io.chunks import ChunkError

address, root, state = sys.argv[1:4]
ray.init(address=address, log_to_driver=False)
rb = OfflineToOnlineReplayBuffer(root, online_capacity=16, batch_size=64, seed=0, storage_dir=state, prefetch=0)
try:
    rb.sample()  # the chunk is mapped here, on the shard's node
    assert rb.stats()["handle"]["local_reads"] > 0, rb.stats()["handle"]  # read here, not by the shard
    os.truncate(os.path.join(root, "chunk-00000", "X.memmap"), 4096)  # another process cuts the file
    try:
        rb.sample()
    except ChunkError as e:
        print("refused:", e)
    else:
        print("served")
finally:
    rb.shutdown()
"""


def test_a_chunk_cut_short_under_a_live_buffer_is_a_chunk_error_in_the_users_process(ray_session, tmp_path):
    from rayrb.io.chunks import write_dataset

    write_dataset({"X": np.ones((4096, 512), np.float32)}, tmp_path / "ds")
    address = ray_session.get_runtime_context().gcs_address
    done = subprocess.run([sys.executable, "-c", USER, address, str(tmp_path / "ds"), str(tmp_path / "state")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the user's process died (signal {-done.returncode}): {done.stderr[-3000:]}"
    assert "refused: chunk chunk-00000: key 'X' expected" in done.stdout, done.stdout + done.stderr[-3000:]
