"""A handle's own reads of slices from an online shard's files (rayrb.handle.local), against the shard's: no
step a reader serves is one the shard would not (contract 11). No Ray: the shard runs in this process."""
from __future__ import annotations

import numpy as np

from rayrb.actors.online_shard import OnlineShard
from rayrb.core.schema import RowSpec
from rayrb.handle.local import OnlineReader

SPEC = RowSpec.from_arrays({"x": np.zeros((1, 4), np.int64), "id": np.zeros(1, np.int64)})


def rows(first: int, n: int) -> dict[str, np.ndarray]:
    """Rows of one episode whose ``x`` is each row's number in the shard's write stream."""
    w = np.arange(first, first + n, dtype=np.int64)
    return {"x": np.repeat(w[:, None], 4, 1), "id": np.zeros(n, np.int64)}


def out_for(n: int) -> dict[str, np.ndarray]:
    return {"x": np.empty((n, 4), np.int64), "id": np.empty(n, np.int64)}


def test_a_reader_of_slices_never_serves_a_row_stored_ahead_of_the_write_count(tmp_path):
    """A piece applied ahead of the one before it (its rows held past the write count, not acknowledged) lands over
    older rows the reader's episodes still hold, with the count unmoved: the reader never serves those slots, the
    shard reads them (leaving them out), and once the reader found its episodes again it reads here again, agreeing
    with the shard. Before the count reached the capacity, such a piece wrapping over slot 0 is caught too."""
    options = {"slice_len": 2, "slice_key": "id", "slice_ends": False}
    for capacity, first, ahead in ((8, 10, 12), (6, 3, 4)):
        d = tmp_path / f"on-{capacity}"
        s = OnlineShard(SPEC.to_json(), capacity, "t/on-0", "slice", sampler_options=options, state_dir=str(d))
        reader = OnlineReader(str(d), SPEC, capacity, "slice", options)

        s.extend(rows(0, first), first=0)
        assert reader.read([8], [1], [None], first, out_for(8)) is not None  # its episodes found at this count
        s.extend(rows(ahead, 3), first=ahead)  # rows ahead..ahead+2, past rows first..ahead-1 still to come
        assert s.written() == first
        served = deferred = 0
        for seed in range(40):
            out = out_for(8)
            info = reader.read([8], [seed], [None], first, out)
            theirs = s.sample_many([8], [seed], None, first)
            assert (theirs[0]["x"][:, 0] < first).all()  # the shard leaves the rows ahead out
            if info is None:
                deferred += 1
                continue
            served += 1
            assert (out["x"][:, 0] < first).all(), f"served rows {sorted(set(out['x'][:, 0].tolist()))} of {first}"
            np.testing.assert_array_equal(out["x"], theirs[0]["x"])
            np.testing.assert_array_equal(info["index"], theirs[1]["index"])
        assert served >= 35 and deferred <= 5, (served, deferred)  # found again after a read that met them
