"""The io_uring reads (rayrb.io.uring): every request's bytes where they were asked for, more requests than the
ring holds, a read's error or end of file as its own result, a ring per thread and per process, and a kernel that
refuses io_uring leaves gathers to the threads."""
from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest

from rayrb.io import gather, uring

pytestmark = pytest.mark.skipif(not uring.available(), reason="io_uring is refused here")


def requests(fd: int, offsets: list[int], out: np.ndarray, size: int) -> tuple:
    """Request ``i`` reads ``size`` bytes at ``offsets[i]`` into ``out[i]`` (one ``iovec`` each)."""
    n = len(offsets)
    iov = np.empty((n, 2), np.uint64)
    iov[:, 0] = out.ctypes.data + np.arange(n, dtype=np.uint64) * out.strides[0]
    iov[:, 1] = size
    return iov, (np.full(n, fd, np.int32), np.asarray(offsets, np.uint64),
                 (iov.ctypes.data + 16 * np.arange(n)).astype(np.uint64), np.ones(n, np.uint32))


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    path = tmp_path / "data"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    yield fd, data
    os.close(fd)


def test_more_requests_than_the_ring_holds_each_land_where_asked(data_file):
    fd, data = data_file
    ring = uring.Ring(entries=8)
    try:
        offsets = np.random.default_rng(1).integers(0, data.size - 100, 300).tolist()
        out = np.zeros((300, 100), np.uint8)
        iov, args = requests(fd, offsets, out, 100)
        got = ring.read(*args)
        assert got.tolist() == [100] * 300
        for i, at in enumerate(offsets):
            np.testing.assert_array_equal(out[i], data[at:at + 100])
        assert ring.read(*requests(fd, [], out, 100)[1]).size == 0  # nothing asked: nothing made
    finally:
        ring.close()


def test_a_read_past_the_end_and_a_bad_descriptor_are_that_requests_result(data_file):
    fd, data = data_file
    ring = uring.ring()
    out = np.zeros((3, 64), np.uint8)
    iov, (fds, offsets, addrs, counts) = requests(fd, [0, data.size - 10, data.size + 5], out, 64)
    fds[0] = 1 << 20  # no such descriptor
    got = ring.read(fds, offsets, addrs, counts)
    assert got.tolist() == [-errno.EBADF, 10, 0]
    np.testing.assert_array_equal(out[1, :10], data[-10:])
    iov, args = requests(fd, [5], out, 64)  # the ring goes on after failed requests
    assert ring.read(*args).tolist() == [64]
    np.testing.assert_array_equal(out[0], data[5:69])


def test_each_thread_and_each_process_has_its_own_ring(data_file):
    fd, data = data_file
    mine, theirs = uring.ring(), []
    t = threading.Thread(target=lambda: theirs.append(uring.ring()))
    t.start()
    t.join()
    assert mine is uring.ring() and theirs[0] is not mine
    pid = os.fork()
    if pid == 0:  # the child's ring is its own, and reads
        code = 1
        try:
            ring = uring.ring()
            out = np.zeros((1, 32), np.uint8)
            iov, args = requests(fd, [100], out, 32)
            code = 0 if ring is not mine and ring.read(*args).tolist() == [32] and (out[0] == data[100:132]).all() else 2
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0


def test_where_the_kernel_refuses_io_uring_the_threads_read(tmp_path, monkeypatch):
    from rayrb.io.chunks import write_dataset

    monkeypatch.setattr(uring, "_syscall", lambda *args: -1)  # io_uring_setup refused (ENOSYS, EPERM...)
    monkeypatch.setattr(uring, "_local", threading.local())
    monkeypatch.setattr(uring, "_state", {"ok": None})
    assert not uring.available() and uring.ring() is None
    rows = np.random.default_rng(2).standard_normal((500, 9)).astype(np.float32)
    ds = write_dataset({"obs": rows}, tmp_path / "ds", chunk_rows=64)
    ds.reads = "read"
    used = []
    real = gather.ColdReads._thread_reads
    monkeypatch.setattr(gather.ColdReads, "_thread_reads", lambda self, work: (used.append(1), real(self, work))[1])
    idx = np.random.default_rng(3).integers(0, 500, 200)
    np.testing.assert_array_equal(ds.gather(idx)["obs"], rows[idx])
    assert used == [1]
