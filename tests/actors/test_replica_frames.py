"""A replica's stream of pieces from its primary (rayrb.actors.stream): frames arrive whole and in order with their
dtypes and shapes; a connection without the token, a header that is not one, rows of objects, or a frame cut
short never reach the shard; a refused (fenced) or failed piece is answered as such; an answer that does not come
is a timeout. No Ray."""
from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest

from rayrb.actors.stream import APPLIED, FAILED, FENCED, LENGTH, TOKEN_BYTES, StreamClient, StreamServer
from rayrb.errors import FencedFrameError


class Shard:
    """What a replica does with a frame, recorded; ``fail`` set: raise it instead."""

    def __init__(self):
        self.got, self.fail, self.delay = [], None, 0.0

    def __call__(self, frame, waited):
        time.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        published = frame.publish and waited()
        self.got.append((frame, published))
        return frame.first + len(next(iter(frame.rows.values()))), 4, published


@pytest.fixture
def served():
    shard = Shard()
    server = StreamServer(shard)
    yield shard, server
    server.close()


def rows_of(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"obs": rng.standard_normal((n, 5, 3), dtype=np.float32), "label": np.arange(n, dtype=np.int64),
            "done": rng.random(n) < 0.5, "pixels": rng.integers(0, 255, (n, 2, 2, 3), dtype=np.uint8),
            "next/obs": rng.standard_normal((n, 5, 3)).astype(">f8")}


def test_frames_arrive_whole_in_order_with_their_dtypes_and_shapes(served):
    shard, server = served
    client = StreamClient.connect(server.endpoint(), timeout=5)
    sent, first = [], 0
    for i, n in enumerate([1, 7, 0, 1000, 3]):
        rows = rows_of(n, seed=i)
        write = None if i == 2 else (f"w{i}", i % 2, 10 * i, None if i % 2 else f"d{i}")
        client.send(11, first, write, rows, publish=i % 2 == 1)
        assert client.answer(timeout=5) == (APPLIED, first + n, 4, i % 2)
        sent.append((11, first, write, rows, i % 2 == 1))
        first += n
    client.close()
    assert len(shard.got) == len(sent)
    for (fence, first, write, rows, publish), (got, _) in zip(sent, shard.got):
        assert (got.fence, got.first, got.write, got.publish) == (fence, first, write, publish)
        assert set(got.rows) == set(rows)
        for k, v in rows.items():
            assert got.rows[k].dtype == v.dtype and got.rows[k].shape == v.shape and np.array_equal(got.rows[k], v)


def test_a_sliced_piece_is_sent_as_its_own_rows(served):
    shard, server = served
    client = StreamClient.connect(server.endpoint(), timeout=5)
    whole = rows_of(20)
    client.send(1, 5, None, {k: v[5:9] for k, v in whole.items()})
    assert client.answer(timeout=5)[0] == APPLIED
    client.close()
    assert np.array_equal(shard.got[0][0].rows["label"], np.arange(5, 9))


def test_a_refused_or_failed_piece_is_answered_so_and_the_stream_goes_on(served):
    shard, server = served
    client = StreamClient.connect(server.endpoint(), timeout=5)
    shard.fail = FencedFrameError("fenced")
    client.send(1, 0, None, rows_of(2))
    assert client.answer(timeout=5) == (FENCED, -1, -1, 0)
    shard.fail = OSError("disk full")
    client.send(1, 0, None, rows_of(2))
    assert client.answer(timeout=5) == (FAILED, -1, -1, 0)
    shard.fail = None
    client.send(1, 0, None, rows_of(2))
    assert client.answer(timeout=5) == (APPLIED, 2, 4, 0)
    client.close()


def test_an_answer_that_does_not_come_in_time_is_a_timeout(served):
    shard, server = served
    shard.delay = 1.0
    client = StreamClient.connect(server.endpoint(), timeout=5)
    client.send(1, 0, None, rows_of(2))
    with pytest.raises(TimeoutError):
        client.answer(timeout=0.1)
    client.close()


def test_a_frame_whose_primary_stopped_waiting_is_not_published(served):
    shard, server = served
    shard.delay = 0.5
    client = StreamClient.connect(server.endpoint(), timeout=5)
    client.send(1, 0, None, {"x": np.arange(2, dtype=np.int64)}, publish=True)
    with pytest.raises(TimeoutError):
        client.answer(timeout=0.05)
    client.close()  # as the primary does when it stops waiting: the replica must not publish that count
    deadline = time.monotonic() + 5
    while not shard.got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(shard.got) == 1 and shard.got[0][0].publish and shard.got[0][1] is False


def raw(server: StreamServer, token: bytes | None = None) -> socket.socket:
    host, port, hex_token = server.endpoint()
    sock = socket.create_connection((host, port), timeout=5)
    sock.sendall(bytes.fromhex(hex_token) if token is None else token)
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def frame(header: dict | bytes, body: bytes = b"") -> bytes:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return LENGTH.pack(len(head)) + head + body


GOOD = {"fence": 1, "first": 0, "write": None, "publish": False, "rows": 2, "arrays": [["x", "<i8", []]]}


@pytest.mark.parametrize("what, data", [
    ("another token", None),
    ("a header over the limit", LENGTH.pack(2 << 20)),
    ("a header that is not JSON", frame(b"{not json")),
    ("a header without its fields", frame({"fence": 1})),
    ("rows of objects", frame({**GOOD, "arrays": [["x", "|O", []]]}, bytes(16))),
    ("more rows than a frame takes", frame({**GOOD, "rows": 1 << 40})),
    ("a frame cut short", frame(GOOD, bytes(9))),
])
def test_what_is_not_a_frame_from_its_primary_never_reaches_the_shard(served, what, data):
    shard, server = served
    if data is None:
        sock = raw(server, token=bytes(TOKEN_BYTES))
        sock.sendall(frame(GOOD, bytes(16)))
    else:
        sock = raw(server)
        sock.sendall(data)
        if what == "a frame cut short":
            sock.shutdown(socket.SHUT_WR)
    assert closed_by_peer(sock), what
    sock.close()
    assert shard.got == []
    # and the server still takes its primary's frames
    client = StreamClient.connect(server.endpoint(), timeout=5)
    client.send(1, 0, None, {"x": np.arange(2, dtype=np.int64)})
    assert client.answer(timeout=5) == (APPLIED, 2, 4, 0)
    client.close()


def test_frames_from_two_connections_each_reach_the_shard(served):
    shard, server = served
    done = []

    def one(i):
        client = StreamClient.connect(server.endpoint(), timeout=5)
        for _ in range(20):
            client.send(i, 0, None, {"x": np.full(3, i, np.int64)})
            done.append(client.answer(timeout=5)[0])
        client.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert done == [APPLIED] * 40 and len(shard.got) == 40


def test_a_closed_server_takes_no_more_connections():
    server = StreamServer(Shard())
    endpoint = server.endpoint()
    server.close()
    with pytest.raises(OSError):  # refused (or, were the port taken again since, closed for the wrong token)
        client = StreamClient.connect(endpoint, timeout=2)
        client.send(1, 0, None, {"x": np.zeros(1)})
        client.answer(timeout=2)
