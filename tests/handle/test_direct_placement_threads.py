"""A handle's writes from several threads at once (two collectors' threads sharing one handle): the first writes
learn where the online shards run while another thread places its write. No Ray: a stand-in for the calls."""
from __future__ import annotations

import threading
import time

import numpy as np

from rayrb.handle.direct import DirectWrites


class SlowNodes:
    """The calls ``DirectWrites`` makes to learn the shards' nodes, each answered after a pause."""

    by_side = {"offline": [object()]}

    def node_of(self, shard: int) -> str:
        time.sleep(0.05)
        return f"node-{shard % 2}"

    def counts_map(self):
        return None


def test_threads_placing_their_first_writes_at_once_see_the_shards_nodes_whole():
    writes = DirectWrites(SlowNodes(), spec=None)
    writes._capacity = np.full(4, 100)
    seen, errors = [], []

    def place():
        try:
            seen.append(writes._local_shards())
        except Exception as e:  # before: "'DirectWrites' object has no attribute '_node'", or a half-built list
            errors.append(repr(e))

    threads = [threading.Thread(target=place) for _ in range(4)]
    for i, t in enumerate(threads):
        t.start()
        time.sleep(0.02 * (i > 0))  # the others come while the first is still asking
    for t in threads:
        t.join()
    assert errors == [] and len(seen) == 4
    assert all(s == seen[0] for s in seen)  # each thread saw every shard's node, the same answer
    assert len(writes._nodes) == 4

