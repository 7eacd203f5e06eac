"""Fixtures shared by the handle's tests."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def reference(request, tmp_path_factory, ray_session):
    """``reference(n, **kw)``: the first ``n`` batches' ids of a twin that only calls ``sample()``, built from the
    test module's ``KW`` and ``rows(200)``. One twin per setting for the module (a buffer start each), drawn further
    as tests ask for more: the stream is the same."""
    from rayrb import OfflineToOnlineReplayBuffer

    base, rows = request.module.KW, request.module.rows
    twins, streams = {}, {}

    def stream(n, **kw):
        key = tuple(sorted(kw.items()))
        if key not in twins:
            root = tmp_path_factory.mktemp("reference")
            twins[key] = OfflineToOnlineReplayBuffer(rows(200), **{**base, **kw}, dataset_root=root / "ds",
                                                     storage_dir=root / "state")
            streams[key] = []
        while len(streams[key]) < n:
            streams[key].append(twins[key].sample()["id"])
        return streams[key][:n]

    yield stream
    for rb in twins.values():
        rb.shutdown()
