"""A primary's pieces to a live replica over a TCP stream of its own, one frame a piece, each answered before the
primary answers its writer. No Ray here.

A Ray call costs both ends more CPU than the piece they copy: with the pieces of a second copy sent as calls, the
shards' processes spent 0.61-0.64 CPU s on 200 writes of 1,000 rows, over a stream 0.35-0.37 s
(``docs/benchmarks.md``, "A second copy over a stream"). So a primary sends its live replicas their pieces over a
connection each, and keeps Ray calls for everything else (a rebuild, a count check, priorities, where to publish),
which it sends only while no frame is unanswered.

**Order.** One primary has one connection to a replica, and awaits each frame's answer before its next write, so
frames arrive in the order they were sent. A frame carries the replica's *fence*, a token its primary gives it with
every rebuild (``OnlineShard.replace``); a replica applies a frame only while the fence it holds is the frame's. A
frame left unanswered (the replica late, the connection broken) is followed by a rebuild, with a new fence, so that
frame, arriving late, is refused and never lands over the copy the rebuild made.

**Trust.** The replica's listening port takes a connection only once it sends the token the replica handed its
primary through Ray (``endpoint``); anything else is closed before a byte of it is read as rows.

**Counts.** Where the replica runs beside the coordinator and its primary does not, the frame asks it to publish
its count in the coordinator's counts map once it holds the piece (``rayrb.actors.publishing``), and its answer
says it did: the writer then need not tell the coordinator. The primary copies a piece in before it sends it, so a
replica never publishes a row its primary lacks; and a replica publishes only while its connection is open, which
the primary closes as soon as it stops waiting for an answer, before it sends that replica anything else. (Left
open: a replica's thread stalled between that check and the publish for longer than a restore waits for its
replicas, 30 s, would publish a count from before the restore; the coordinator keeps the highest count it sees.)

Frame, primary to replica: 4-byte little-endian length of a JSON header ``{fence, first, write, publish, arrays:
[[key, dtype, trailing shape], ...], rows}``, then each array's bytes, C order. Answer: four little-endian int64,
``(status, write count, restore epoch, published)``; status ``APPLIED``, ``FENCED`` or ``FAILED``.

Examples:
    >>> import numpy as np
    >>> got = []
    >>> server = StreamServer(lambda frame, waited: got.append(frame) or (7, 0, frame.publish and waited()))
    >>> client = StreamClient.connect(server.endpoint(), timeout=5)
    >>> client.send(3, 4, ("w", 0, 0, None), {"x": np.arange(6, dtype=np.int64).reshape(3, 2)}, publish=True)
    >>> client.answer(timeout=5)
    (0, 7, 0, 1)
    >>> got[0].fence, got[0].first, got[0].write, got[0].rows["x"].tolist()
    (3, 4, ('w', 0, 0, None), [[0, 1], [2, 3], [4, 5]])
    >>> client.close(); server.close()
"""
from __future__ import annotations

import hmac
import json
import logging
import secrets
import select
import socket
import struct
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from rayrb.errors import FencedFrameError, StreamError

logger = logging.getLogger(__name__)
APPLIED, FENCED, FAILED = 0, 1, 2
TOKEN_BYTES = 16
HEADER_BYTES = 1 << 20  # a header larger than this is not a frame: the connection is closed
FRAME_BYTES = 1 << 34  # nor rows larger than this (16 GiB)
ANSWER = struct.Struct("<4q")
LENGTH = struct.Struct("<I")


class Frame(NamedTuple):
    fence: int
    first: int  # the primary's write count the piece was placed at
    write: tuple | None  # (write id, piece, start in its write, digest), where the primary placed it itself
    rows: dict[str, np.ndarray]
    publish: bool  # publish the count once the piece is held (while the primary still waits for the answer)


Apply = Callable[[Frame, Callable[[], bool]], tuple[int, int, bool]]


def node_address() -> str:
    """This node's address as Ray knows it (other nodes reach its processes there)."""
    import ray

    return ray.util.get_node_ip_address()


def _exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    _into(sock, memoryview(buf))
    return buf


def _into(sock: socket.socket, view: memoryview) -> None:
    view = view.cast("B")
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise StreamError(f"expected {len(view)} bytes, the connection closed after {got}")
        got += k


class StreamServer:
    """A replica's side: a listening socket on this node and a thread per connection, each frame handed to
    ``apply(frame, waited) -> (write count, restore epoch, published)``, which raises ``FencedFrameError`` to refuse
    it and anything else to fail it (the primary then rebuilds this copy); ``waited()``: whether the primary still
    waits for the answer (it closes the connection when it stops), asked just before publishing."""

    def __init__(self, apply: Apply, host: str = "127.0.0.1"):
        self._apply, self._token = apply, secrets.token_bytes(TOKEN_BYTES)
        self._listener = socket.create_server((host, 0))
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="rayrb-replica-stream").start()

    def endpoint(self) -> tuple[str, int, str]:
        """``(host, port, token)``: what the primary connects with (handed over through Ray only)."""
        host, port = self._listener.getsockname()[:2]
        return host, int(port), self._token.hex()

    def close(self) -> None:
        self._closed = True
        try:  # shut down first: a close alone leaves the thread blocked in accept() taking connections
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="rayrb-replica-frames").start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(10.0)
                if not hmac.compare_digest(bytes(_exact(conn, TOKEN_BYTES)), self._token):
                    return
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while not self._closed:
                    frame = read_frame(conn)
                    conn.sendall(ANSWER.pack(*self._answer(frame, lambda: not select.select([conn], [], [], 0)[0])))
            except OSError as e:  # the primary went, or sent what is not a frame (StreamError)
                logger.debug("rayrb: replica stream closed: %r", e)

    def _answer(self, frame: Frame, waited: Callable[[], bool]) -> tuple[int, int, int, int]:
        """``waited``: nothing to read on the connection before this answer is sent means it is still open (the
        primary sends its next frame only after this answer)."""
        try:
            written, restores, published = self._apply(frame, waited)
            return APPLIED, int(written), int(restores), int(bool(published))
        except FencedFrameError:
            return FENCED, -1, -1, 0
        except Exception as e:  # refused rows, a full disk: the primary rebuilds this copy
            logger.warning("rayrb: a replica could not apply a piece from its primary: %r", e)
            return FAILED, -1, -1, 0


def read_frame(conn: socket.socket) -> Frame:
    """One frame (see the module); ``StreamError`` for what is not one."""
    (size,) = LENGTH.unpack(_exact(conn, LENGTH.size))
    if size > HEADER_BYTES:
        raise StreamError(f"expected a frame header of at most {HEADER_BYTES} bytes, got {size}")
    try:
        head = json.loads(bytes(_exact(conn, size)))
        n, arrays = int(head["rows"]), [(str(k), np.dtype(d), tuple(int(s) for s in t)) for k, d, t in head["arrays"]]
        fence, first, write, publish = int(head["fence"]), int(head["first"]), head["write"], bool(head["publish"])
    except (KeyError, TypeError, ValueError) as e:
        raise StreamError(f"expected a frame header of JSON with fence, first, write, publish, rows and arrays: "
                          f"{e!r}") from e
    total = sum(n * d.itemsize * int(np.prod(t, dtype=np.int64)) for _, d, t in arrays)
    if n < 0 or total > FRAME_BYTES or any(d.hasobject for _, d, _ in arrays):
        raise StreamError(f"expected at most {FRAME_BYTES} bytes of plain rows, got {n} rows of {total} bytes")
    rows = {}
    for key, dtype, tail in arrays:
        a = np.empty((n, *tail), dtype)
        _into(conn, memoryview(a).cast("B") if a.nbytes else memoryview(b""))
        rows[key] = a
    return Frame(fence, first, tuple(write) if write is not None else None, rows, publish)


class StreamClient:
    """A primary's side: one connection to one replica's ``StreamServer``."""

    def __init__(self, sock: socket.socket):
        self._sock = sock

    @classmethod
    def connect(cls, endpoint: tuple[str, int, str], timeout: float) -> StreamClient:
        host, port, token = endpoint
        sock = socket.create_connection((host, int(port)), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(bytes.fromhex(token))
        except OSError:
            sock.close()
            raise
        return cls(sock)

    def send(self, fence: int, first: int, write: Any, rows: Mapping[str, np.ndarray], publish: bool = False,
             timeout: float = 30.0) -> None:
        """Send one piece (``OSError`` if the connection cannot take it within ``timeout`` s); ``publish``: the
        replica publishes the count once it holds the piece, where it can."""
        arrays = {k: np.ascontiguousarray(v) for k, v in rows.items()}
        n = len(next(iter(arrays.values()))) if arrays else 0
        head = json.dumps({"fence": int(fence), "first": int(first), "write": None if write is None else list(write),
                           "publish": bool(publish), "rows": n, "arrays": [[k, v.dtype.str, list(v.shape[1:])] for k, v in arrays.items()]},
                          separators=(",", ":")).encode()
        self._sock.settimeout(timeout)
        self._sock.sendall(LENGTH.pack(len(head)) + head)
        for v in arrays.values():
            if v.nbytes:
                self._sock.sendall(memoryview(v).cast("B"))

    def answer(self, timeout: float) -> tuple[int, int, int, int]:
        """The answer to the frame sent last: ``(status, write count, restore epoch, published)``; a timeout when
        none came within ``timeout`` s, ``OSError`` (``StreamError``) when the connection broke."""
        self._sock.settimeout(max(timeout, 1e-3))
        return ANSWER.unpack(_exact(self._sock, ANSWER.size))

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
