"""Many reads in flight from one thread: Linux's io_uring through its three system calls, no library.

A batch of cold rows needs many requests in flight to use the disk (``rayrb.io.gather``). Threads making one
``preadv`` each give that, but each request then pays a hand-over of the GIL on its way out and back in; with 28
KiB rows on this 2-core machine that, not the disk, bounded a gather (about 60 % of the disk's rate, with the
process's threads using a core and a half). A ring takes the batch's requests in one call and hands back their
results in another: the requests are plain memory (64 bytes each, written through a numpy view of the kernel's
shared queue), the kernel makes the reads (page-cache reads, so the cache fills as it would) and the GIL is
released once per wait, not once per read.

The kernel's layout (``include/uapi/linux/io_uring.h``): ``io_uring_setup`` fills ``io_uring_params`` with the
offsets of the submission ring (head, tail, mask, the index array) and the completion ring (head, tail, mask,
16-byte entries: ``user_data``, ``res``, ``flags``), both in one mapping (``IORING_FEAT_SINGLE_MMAP``, Linux 5.4
on), and the 64-byte submission entries in a second. A request is entry ``i``: ``opcode`` ``IORING_OP_READV``,
``fd``, ``off``, ``addr`` (an ``iovec`` array), ``len`` (its count), ``user_data`` (the request's number); the
tail moved past it submits it with ``io_uring_enter``.

``available()`` is False where the kernel is older, io_uring is switched off (``kernel.io_uring_disabled``) or a
seccomp profile refuses it (Docker's default): the gather then uses its threads. A ring belongs to the process and
thread that made it (``ring()``): after ``fork`` a child makes its own.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import weakref

import numpy as np

from rayrb.io import descriptors

SETUP, ENTER = 425, 426  # the system call numbers, the same on every architecture (added after the tables merged)
OP_READV = 1
ENTER_GETEVENTS = 1
FEAT_SINGLE_MMAP = 1
OFF_SQES = 0x10000000
REFUSED = (0, errno.ENOSYS, errno.EPERM, errno.EACCES, errno.EINVAL, None)  # io_uring is not to be had here
ENTRIES = 256  # requests in flight at most: this machine's disk queues 256 (/sys/block/vda/queue/nr_requests)

_libc = ctypes.CDLL(None, use_errno=True)  # a CDLL call releases the GIL while the kernel waits
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class _Offsets(ctypes.Structure):
    _fields_ = [("head", ctypes.c_uint32), ("tail", ctypes.c_uint32), ("ring_mask", ctypes.c_uint32),
                ("ring_entries", ctypes.c_uint32), ("flags_or_overflow", ctypes.c_uint32),
                ("dropped_or_cqes", ctypes.c_uint32), ("array_or_flags", ctypes.c_uint32),
                ("resv1", ctypes.c_uint32), ("user_addr", ctypes.c_uint64)]


class _Params(ctypes.Structure):
    _fields_ = [("sq_entries", ctypes.c_uint32), ("cq_entries", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("sq_thread_cpu", ctypes.c_uint32), ("sq_thread_idle", ctypes.c_uint32),
                ("features", ctypes.c_uint32), ("wq_fd", ctypes.c_uint32), ("resv", ctypes.c_uint32 * 3),
                ("sq_off", _Offsets), ("cq_off", _Offsets)]


SQE = np.dtype([("opcode", "u1"), ("flags", "u1"), ("ioprio", "<u2"), ("fd", "<i4"), ("off", "<u8"),
                ("addr", "<u8"), ("len", "<u4"), ("rw_flags", "<u4"), ("user_data", "<u8"), ("pad", "<u8", 3)])
CQE = np.dtype([("user_data", "<u8"), ("res", "<i4"), ("flags", "<u4")])
assert SQE.itemsize == 64 and CQE.itemsize == 16


class RingError(OSError):
    """The ring could not be made or entered (not a read's own error: those come back per request)."""


class Ring:
    """One io_uring of ``entries`` requests (see the module). ``read`` makes a list of reads and returns each
    one's result; nothing else is public."""

    def __init__(self, entries: int = ENTRIES):
        params = _Params()
        descriptors.make_room(1)
        fd = _syscall(SETUP, ctypes.c_uint(entries), ctypes.byref(params))
        if fd < 0:
            e = ctypes.get_errno()
            raise RingError(e, f"io_uring_setup: {os.strerror(e)}")
        self.fd, self.pid = int(fd), os.getpid()
        descriptors.held(1)
        self._closer = weakref.finalize(self, _close, self.fd)  # a thread's ring goes with the thread
        try:
            if not params.features & FEAT_SINGLE_MMAP:
                raise RingError(0, "io_uring without a single mapping for both rings (Linux before 5.4)")
            sq, cq = params.sq_off, params.cq_off
            size = max(sq.array_or_flags + params.sq_entries * 4, cq.dropped_or_cqes + params.cq_entries * CQE.itemsize)
            self._rings = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                    prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
            self._sqes_map = mmap.mmap(self.fd, params.sq_entries * SQE.itemsize, flags=mmap.MAP_SHARED,
                                       prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=OFF_SQES)
        except BaseException:
            self._closer()
            raise
        u32 = np.frombuffer(self._rings, np.uint32)
        self._sq_head, self._sq_tail = u32[sq.head // 4:sq.head // 4 + 1], u32[sq.tail // 4:sq.tail // 4 + 1]
        self._cq_head, self._cq_tail = u32[cq.head // 4:cq.head // 4 + 1], u32[cq.tail // 4:cq.tail // 4 + 1]
        self._sq_mask, self._cq_mask = int(u32[sq.ring_mask // 4]), int(u32[cq.ring_mask // 4])
        self.entries = int(params.sq_entries)
        self._array = u32[sq.array_or_flags // 4:sq.array_or_flags // 4 + self.entries]
        self._cqes = np.frombuffer(self._rings, CQE, count=int(params.cq_entries), offset=cq.dropped_or_cqes)
        self._sqes = np.frombuffer(self._sqes_map, SQE)

    def read(self, fds: np.ndarray, offsets: np.ndarray, iovecs: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Make request ``i``: ``readv`` on ``fds[i]`` at ``offsets[i]`` into the ``counts[i]`` ``iovec``
        entries at address ``iovecs[i]``; return each request's result (bytes read, or ``-errno``). At most
        ``entries`` are in flight; every request has completed when this returns, also when it raises (the
        kernel writes into the caller's buffers until then)."""
        n = int(fds.size)
        results = np.zeros(n, np.int64)
        start = int(self._sq_head[0])  # the kernel's count of entries taken: what was submitted, whatever happens
        queued = submitted = done = 0
        try:
            while done < n:
                room = min(n - queued, self.entries - (queued - done))
                if room:
                    self._queue(queued, room, fds, offsets, iovecs, counts)
                    queued += room
                submitted += self._enter(queued - submitted, 1 if submitted < queued or done < submitted else 0)
                done += self._reap(results)
        except BaseException:
            self._sq_tail[0] = self._sq_head[0]  # entries queued but not taken are withdrawn, never sent later
            submitted = (int(self._sq_head[0]) - start) & 0xFFFFFFFF
            while done < submitted:  # the kernel may still write into the buffers: wait for every request taken
                try:
                    self._enter(0, submitted - done)
                except RingError:
                    pass
                done += self._reap(results)
            raise
        return results

    def _queue(self, first: int, count: int, fds, offsets, iovecs, counts) -> None:
        tail = int(self._sq_tail[0])
        slots = (tail + np.arange(count, dtype=np.int64)) & self._sq_mask
        e = self._sqes
        e[slots] = np.zeros(count, SQE)
        e["opcode"][slots] = OP_READV
        e["fd"][slots] = fds[first:first + count]
        e["off"][slots] = offsets[first:first + count]
        e["addr"][slots] = iovecs[first:first + count]
        e["len"][slots] = counts[first:first + count]
        e["user_data"][slots] = np.arange(first, first + count, dtype=np.uint64)
        self._array[slots] = slots
        self._sq_tail[0] = (tail + count) & 0xFFFFFFFF  # x86 and arm64 stores are ordered enough here: the
        # kernel reads the tail only inside io_uring_enter, a full barrier

    def _enter(self, submit: int, wait: int) -> int:
        while True:
            r = _syscall(ENTER, ctypes.c_uint(self.fd), ctypes.c_uint(submit), ctypes.c_uint(wait),
                         ctypes.c_uint(ENTER_GETEVENTS), None, ctypes.c_size_t(0))
            if r >= 0:
                return int(r)
            e = ctypes.get_errno()
            if e != errno.EINTR:  # a signal came while waiting: the requests stand, wait again
                raise RingError(e, f"io_uring_enter: {os.strerror(e)}")
            submit = 0

    def _reap(self, results: np.ndarray) -> int:
        head, tail = int(self._cq_head[0]), int(self._cq_tail[0])
        k = (tail - head) & 0xFFFFFFFF
        if k:
            at = (head + np.arange(k, dtype=np.int64)) & self._cq_mask
            c = self._cqes[at]
            results[c["user_data"].astype(np.int64)] = c["res"]
            self._cq_head[0] = tail
        return k

    def close(self) -> None:
        """The ring's mappings and descriptor closed (no read may be in flight: ``read`` never returns with one)."""
        if self.fd >= 0:
            self._sqes = self._cqes = self._array = None
            self._sq_head = self._sq_tail = self._cq_head = self._cq_tail = None
            self._sqes_map.close()
            self._rings.close()
            self._closer()
            self.fd = -1


def _close(fd: int) -> None:
    os.close(fd)
    descriptors.held(-1)


def requests(at: np.ndarray, size: np.ndarray, dest: np.ndarray, bounds: np.ndarray, scratch: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Segments as ``readv`` requests: segment ``s`` is ``size[s]`` bytes at file offset ``at[s]`` into address
    ``dest[s]``; request ``q`` reads segments ``bounds[q]`` to ``bounds[q + 1]``, in offset order. Returns the
    ``iovec`` entries (``[n, 2]``: address, length; a gap between two segments of a request is read into
    ``scratch``, not kept), and by request its first entry's number, its file offset, its entries' count and the
    bytes it reads.

    >>> iov, first, off, count, want = requests(np.array([0, 8, 36]), np.array([4, 4, 4]),
    ...                                         np.array([100, 104, 108]), np.array([0, 2, 3]), scratch=7)
    >>> iov.tolist(), first.tolist(), off.tolist(), count.tolist(), want.tolist()
    ([[100, 4], [7, 4], [104, 4], [108, 4]], [0, 3], [0, 36], [3, 1], [12, 4])
    """
    gap = np.zeros(at.size, np.int64)
    gap[1:] = at[1:] - (at[:-1] + size[:-1])
    gap[bounds[:-1]] = 0  # a request's first segment starts it
    per = 1 + (gap > 0)  # entries a segment takes
    data = np.cumsum(per) - 1  # its data entry's number (its gap's, if any, just before)
    iov = np.empty((int(per.sum()), 2), np.uint64)
    iov[data, 0], iov[data, 1] = dest, size
    g = gap > 0
    iov[data[g] - 1, 0], iov[data[g] - 1, 1] = scratch, gap[g]
    if not at.size:
        return iov, np.zeros(0, np.int64), np.zeros(0, np.uint64), np.zeros(0, np.uint32), np.zeros(0, np.int64)
    return (iov, (data - per + 1)[bounds[:-1]].astype(np.int64), at[bounds[:-1]].astype(np.uint64),
            np.add.reduceat(per, bounds[:-1]).astype(np.uint32), np.add.reduceat(size + gap, bounds[:-1]))


_local = threading.local()
_state = {"ok": None}  # None: not tried yet; False: refused here (kernel, switch or seccomp)


def ring() -> Ring | None:
    """This thread's ring (made at the first call, again after ``fork``), or None where io_uring is refused."""
    if _state["ok"] is False:
        return None
    r = getattr(_local, "ring", None)
    if r is not None and r.pid == os.getpid():
        return r
    try:
        r = Ring()
    except (RingError, OSError, ValueError) as e:
        if getattr(e, "errno", 0) in REFUSED:  # this kernel or its seccomp profile: never again in this process
            _state["ok"] = False
        return None  # out of descriptors or memory now: the threads read this batch, a later one tries again
    _state["ok"] = True
    _local.ring = r
    return r


def available() -> bool:
    """Whether this process can make io_uring reads."""
    return ring() is not None
