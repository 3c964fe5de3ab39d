"""The kernel's asynchronous I/O queue (``io_submit``), reached through ctypes system calls.

[Note: the kernel AIO backend]
A thread blocked in ``pwritev`` keeps one request in flight; a kernel AIO context keeps
``queue_depth`` of them for one thread that only submits and reaps. That is how
DeepSpeed's op works (libaio, which wraps these same system calls). On this project's
disk, with 4-16 MiB pieces on huge-page buffers, it wrote new files 7-10% faster than
the same number of threads, tied on rewrites and reads, and ran an offloaded training
step about 10% slower (``bench/aio.py``, ``bench/offload.py``, RESULTS.md), so it is the
``backend: "kernel"`` option, not the default. No library is needed: :class:`KernelQueue`
makes the four system calls with ctypes, and completions wake the submitting thread
through an ``eventfd`` that the engine also writes when it queues new pieces, so one
blocking read waits for either. Only ``O_DIRECT`` transfers are asynchronous in the
kernel; the engine runs any other piece with a plain ``preadv``/``pwritev``.

:func:`open_queue` returns None where the calls are unavailable (another OS or CPU, a
sandbox that forbids them, ``fs.aio-max-nr`` exhausted); the engine then uses threads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform
import sys

# (io_setup, io_destroy, io_submit, io_getevents) by machine; the ABI's struct is the
# little-endian one, so only little-endian machines are listed.
_SYSCALLS = {"x86_64": (206, 207, 209, 208), "aarch64": (0, 1, 2, 4), "arm64": (0, 1, 2, 4)}
_IOCB_CMD_PREAD, _IOCB_CMD_PWRITE = 0, 1
_IOCB_FLAG_RESFD = 1


class _Iocb(ctypes.Structure):  # struct iocb (linux/aio_abi.h)
    _fields_ = [
        ("data", ctypes.c_uint64),
        ("key", ctypes.c_uint32),
        ("rw_flags", ctypes.c_int32),
        ("opcode", ctypes.c_uint16),
        ("reqprio", ctypes.c_int16),
        ("fildes", ctypes.c_uint32),
        ("buf", ctypes.c_uint64),
        ("nbytes", ctypes.c_uint64),
        ("offset", ctypes.c_int64),
        ("reserved2", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("resfd", ctypes.c_uint32),
    ]


class _Event(ctypes.Structure):  # struct io_event
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64), ("res2", ctypes.c_int64)]


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux") or sys.byteorder != "little" or not hasattr(os, "eventfd"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


class KernelQueue:
    """One AIO context of ``depth`` slots and its eventfd. Not thread-safe: one thread
    submits and reaps; any thread may :meth:`wake` it."""

    def __init__(self, libc: ctypes.CDLL, calls: tuple[int, int, int, int], depth: int) -> None:
        self._libc = libc
        self._setup, self._destroy, self._submit, self._getevents = calls
        self.depth = depth
        self._ctx = ctypes.c_ulong(0)
        if libc.syscall(self._setup, ctypes.c_uint(depth), ctypes.byref(self._ctx)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_setup: {os.strerror(err)}")
        self.efd = os.eventfd(0, os.EFD_CLOEXEC)
        self._iocbs = (_Iocb * depth)()
        self._events = (_Event * depth)()
        self._free = list(range(depth))
        self.slots: list[object] = [None] * depth  # what each busy slot carries

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def in_flight(self) -> int:
        return self.depth - len(self._free)

    def submit(self, items: list[tuple[object, bool, int, int, int, int]]) -> list[object]:
        """Start ``(tag, is_read, fd, address, nbytes, offset)`` transfers, one slot each
        (at most :attr:`free`); a completion later returns ``tag``. Returns the tags of
        those the kernel refused to start (the caller moves them itself)."""
        batch = []
        for tag, is_read, fd, addr, nbytes, offset in items:
            slot = self._free.pop()
            self._iocbs[slot] = _Iocb(
                data=slot, opcode=_IOCB_CMD_PREAD if is_read else _IOCB_CMD_PWRITE, fildes=fd, buf=addr,
                nbytes=nbytes, offset=offset, flags=_IOCB_FLAG_RESFD, resfd=self.efd,
            )  # fmt: skip
            self.slots[slot] = tag
            batch.append(slot)
        done = 0
        while done < len(batch):
            ptrs = (ctypes.POINTER(_Iocb) * (len(batch) - done))(*(ctypes.pointer(self._iocbs[s]) for s in batch[done:]))
            n = self._libc.syscall(self._submit, self._ctx, ctypes.c_long(len(batch) - done), ptrs)
            if n < 0:
                if ctypes.get_errno() in (errno.EAGAIN, errno.EINTR):
                    continue
                refused = [self.slots[slot] for slot in batch[done:]]
                for slot in batch[done:]:  # nothing of the rest started
                    self.slots[slot] = None
                    self._free.append(slot)
                return refused
            done += n
        return []

    def reap(self) -> list[tuple[object, int]]:
        """The transfers that finished: ``(tag, result)``, result the bytes moved or
        ``-errno``. Does not block."""
        timeout = (ctypes.c_long * 2)(0, 0)
        n = self._libc.syscall(self._getevents, self._ctx, ctypes.c_long(0), ctypes.c_long(self.depth), self._events, timeout)
        if n < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                return []
            raise OSError(err, f"io_getevents: {os.strerror(err)}")
        out = []
        for i in range(n):
            slot = self._events[i].data
            out.append((self.slots[slot], self._events[i].res))
            self.slots[slot] = None
            self._free.append(slot)
        return out

    def wait(self) -> None:
        """Block until a transfer finishes or :meth:`wake` is called (either may already
        have happened)."""
        os.eventfd_read(self.efd)

    def wake(self) -> None:
        os.eventfd_write(self.efd, 1)

    def close(self) -> None:
        """Destroy the context (the kernel waits for transfers still in flight)."""
        self._libc.syscall(self._destroy, self._ctx)
        os.close(self.efd)


def open_queue(depth: int) -> KernelQueue | None:
    """A kernel AIO queue of ``depth`` slots, or None where this machine cannot give one."""
    libc = _libc()
    calls = _SYSCALLS.get(platform.machine())
    if libc is None or calls is None:
        return None
    try:
        return KernelQueue(libc, calls, depth)
    except OSError:  # ENOSYS, EPERM (seccomp), EAGAIN (fs.aio-max-nr)
        return None
