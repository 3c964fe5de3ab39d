"""An asynchronous file I/O engine for the NVMe tier, in pure Python over the OS.

[Note: asynchronous I/O without a compiled op]
``os.preadv`` / ``os.pwritev`` release the GIL for the whole system call, so a pool of
Python threads keeps as many requests in flight as it has threads, which is what a
libaio queue does for one submitting thread. A request (one tensor to or from one file
range) is cut into ``block_size`` pieces; the pool has ``thread_count x queue_depth``
threads, so that many pieces are in flight at once. Files are opened with ``O_DIRECT``
where the filesystem allows it, bypassing the page cache: a swap file is written once
per step and read once per step, so caching it only evicts memory the model needs and
doubles the copies. ``O_DIRECT`` needs the buffer address, file offset and length to be
multiples of the device's block size; :func:`aligned_empty` makes such buffers, and a
piece that is not aligned goes through an ordinary descriptor of the same file instead
(Linux keeps the two coherent), so any tensor can be read or written, aligned ones fast.

A handle's ``wait()`` raises :class:`AioError` naming the file, offset and length of the
first failed piece (missing or read-only directory, no space left, short read); a write
whose handle raised must be treated as not written.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from terascale.comm.ops import named_range

ALIGNMENT = 4096  # bytes; a multiple of every logical block size O_DIRECT may need
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class AioError(OSError):
    """A read or write of the I/O engine failed; the message names the file and range."""


@dataclass(frozen=True)
class AioOptions:
    """The ``aio`` config section as the engine uses it.

    ``block_size``: bytes per piece; ``queue_depth``: pieces in flight per I/O thread;
    ``thread_count``: I/O threads (DeepSpeed's ``intra_op_parallelism``);
    ``single_submit``: issue a request's pieces one after another rather than all at once;
    ``overlap_events``: let a new request start while earlier ones are in flight (False
    finishes each request before the next is submitted).
    """

    block_size: int = 1 << 20
    queue_depth: int = 8
    thread_count: int = 1
    single_submit: bool = False
    overlap_events: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % ALIGNMENT:
            raise ValueError(f"aio.block_size must be a positive multiple of {ALIGNMENT}, got {self.block_size}")
        if self.queue_depth <= 0 or self.thread_count <= 0:
            raise ValueError("aio.queue_depth and aio.thread_count must be positive")

    @classmethod
    def from_config(cls, aio: object) -> AioOptions:
        """From a :class:`terascale.config.schema.AioConfig` (or anything with its fields)."""
        return cls(
            block_size=aio.block_size,
            queue_depth=aio.queue_depth,
            thread_count=aio.thread_count,
            single_submit=aio.single_submit,
            overlap_events=aio.overlap_events,
        )


def aligned_empty(numel: int, dtype: torch.dtype, *, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised 1-D host tensor whose data starts on an ``ALIGNMENT`` boundary and
    whose storage extends to a whole number of ``ALIGNMENT`` blocks past it, so that it
    can be read or written with ``O_DIRECT`` (``pin_memory`` where a GPU is present)."""
    nbytes = _round_up(max(numel, 1) * dtype.itemsize, ALIGNMENT)
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=pin_memory)
    shift = (-raw.data_ptr()) % ALIGNMENT
    return raw[shift : shift + nbytes].view(dtype)[:numel]


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _byte_view(tensor: torch.Tensor) -> memoryview:
    if tensor.device.type != "cpu":
        raise ValueError(f"the I/O engine reads and writes host tensors, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("the I/O engine needs a contiguous tensor")
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


class IoHandle:
    """One submitted read or write; :meth:`wait` blocks until every piece is done."""

    def __init__(self, description: str, futures: list[Future], nbytes: int, engine: AsyncIO | None = None) -> None:
        self.description = description
        self.nbytes = nbytes
        self.waited = False  # a handle's error is raised to whoever waits first, once
        self._futures = futures
        self._engine = engine

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def unreported_error(self) -> bool:
        """Whether the finished request failed and nobody has waited for it yet."""
        return not self.waited and any(f.exception() is not None for f in self._futures)

    def wait(self) -> int:
        """Block until the request completes; return its bytes or raise :class:`AioError`."""
        self.waited = True
        error = None
        started = time.perf_counter()
        for f in self._futures:  # wait for all, so no piece still runs after an error
            exc = f.exception()
            if exc is not None and error is None:
                error = exc
        if self._engine is not None and threading.get_ident() == self._engine.owner_thread:
            self._engine.blocked_s += time.perf_counter() - started
        if error is not None:
            raise error
        return self.nbytes


class AsyncIO:
    """Reads and writes tensors from and to files on a pool of I/O threads.

    ``read`` and ``write`` return an :class:`IoHandle` at once; ``synchronize()`` waits for
    everything submitted so far. ``direct=False`` never uses ``O_DIRECT``; with True it is
    used wherever the filesystem accepts it (tmpfs, for one, does not: see
    :attr:`direct_paths`). Use as a context manager or call :meth:`close`. With
    ``trace_name``, each transfer shows in a torch profiler trace as a range
    ``"<trace_name> read"`` or ``"<trace_name> write"`` on its I/O thread.
    """

    def __init__(self, options: AioOptions | None = None, *, direct: bool = True, trace_name: str | None = None) -> None:
        self.options = options or AioOptions()
        self._direct = direct and _O_DIRECT != 0
        self.trace_name = trace_name
        self._pool = ThreadPoolExecutor(
            max_workers=self.options.thread_count * self.options.queue_depth, thread_name_prefix="terascale-aio"
        )
        self._lock = threading.Lock()
        self._fds: dict[tuple[str, bool], int] = {}
        self._outstanding: list[IoHandle] = []
        self.direct_paths: set[str] = set()  # files opened with O_DIRECT
        self.bytes_read = 0  # submitted so far (for reports: traffic per step)
        self.bytes_written = 0
        # Time the creating (training) thread spent waiting for requests: the step's I/O
        # stalls. Background threads' waits (checkpoint writes, prefetch) are not stalls.
        self.owner_thread = threading.get_ident()
        self.blocked_s = 0.0

    # -- submission --------------------------------------------------------------------------

    def read(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> IoHandle:
        """Start filling ``tensor`` with the bytes of ``path`` from ``offset``; the file
        must hold all of them (a short read is an error)."""
        return self._submit("read", tensor, Path(path), offset)

    def write(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> IoHandle:
        """Start writing ``tensor``'s bytes into ``path`` at ``offset`` (the file is created
        if missing and never truncated)."""
        return self._submit("write", tensor, Path(path), offset)

    def sync_read(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> int:
        return self.read(tensor, path, offset).wait()

    def sync_write(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> int:
        return self.write(tensor, path, offset).wait()

    def wait(self, handle: IoHandle) -> int:
        return handle.wait()

    def synchronize(self) -> int:
        """Wait for every request submitted so far; return how many there were.

        Raises the first error (of a request nobody waited for yet) after all have finished.
        """
        with self._lock:
            handles, self._outstanding = self._outstanding, []
        error = None
        for h in handles:
            if h.waited:
                continue
            try:
                h.wait()
            except AioError as exc:
                error = error or exc
        if error is not None:
            raise error
        return len(handles)

    def _submit(self, op: str, tensor: torch.Tensor, path: Path, offset: int) -> IoHandle:
        if offset < 0:
            raise ValueError(f"negative file offset {offset} for '{path}'")
        view = _byte_view(tensor)
        nbytes = len(view)
        fds = self._open(path, op)
        step = self.options.block_size
        pieces = [(lo, min(lo + step, nbytes)) for lo in range(0, nbytes, step)]
        if not self.options.overlap_events:
            self.synchronize()
        addr = tensor.data_ptr()
        if self.options.single_submit:
            futures = [self._pool.submit(self._run, self._transfer_all, op, fds, view, addr, offset, pieces, path)]
        else:
            futures = [self._pool.submit(self._run, self._transfer, op, fds, view, addr, offset, lo, hi, path) for lo, hi in pieces]
        desc = f"{op} of {nbytes} bytes at offset {offset} of '{path}'"
        if op == "read":
            self.bytes_read += nbytes
        else:
            self.bytes_written += nbytes
        handle = IoHandle(desc, futures, nbytes, self)
        with self._lock:
            # Finished requests are forgotten unless their error still awaits a waiter.
            self._outstanding = [h for h in self._outstanding if not h.done() or h.unreported_error()] + [handle]
        return handle

    # -- files -------------------------------------------------------------------------------

    def _open(self, path: Path, op: str) -> tuple[int, int | None]:
        """(buffered fd, O_DIRECT fd or None) of ``path``, opened once and kept."""
        key = str(path)
        with self._lock:
            plain = self._fds.get((key, False))
            if plain is None:
                flags = os.O_RDWR | (os.O_CREAT if op == "write" else 0)
                try:
                    plain = os.open(key, flags, 0o644)
                except OSError as exc:
                    if exc.errno == errno.ENOENT and op == "read" and path.parent.is_dir():
                        raise AioError(exc.errno, f"read of '{path}' failed: no such file", key) from exc
                    raise AioError(exc.errno, _explain(exc, op, path), key) from exc
                self._fds[(key, False)] = plain
            direct = self._fds.get((key, True))
            if self._direct and (key, True) not in self._fds:
                try:
                    direct = os.open(key, os.O_RDWR | _O_DIRECT)
                    self.direct_paths.add(key)
                except OSError:  # the filesystem does not support O_DIRECT (tmpfs, ...)
                    direct = None
                self._fds[(key, True)] = direct
            return plain, direct

    def close_file(self, path: str | os.PathLike, *, fsync: bool = False) -> None:
        """Close ``path``'s descriptors (after its requests finished), first flushing the
        file to the device with ``fsync``: a file written once, like a checkpoint shard,
        holds no descriptor afterwards."""
        key = str(path)
        with self._lock:
            fds = [self._fds.pop((key, direct), None) for direct in (False, True)]
        try:
            if fsync and fds[0] is not None:
                try:
                    os.fsync(fds[0])
                except OSError as exc:
                    raise AioError(exc.errno, _explain(exc, "fsync", Path(path)), key) from exc
        finally:
            for fd in fds:
                if fd is not None:
                    os.close(fd)

    def close(self) -> None:
        """Finish outstanding requests, stop the threads and close every file."""
        try:
            self.synchronize()
        finally:
            self._pool.shutdown(wait=True)
            with self._lock:
                for fd in self._fds.values():
                    if fd is not None:
                        os.close(fd)
                self._fds.clear()

    def __enter__(self) -> AsyncIO:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- pieces (run on the I/O threads) -----------------------------------------------------

    def _run(self, transfer: Callable[..., None], op: str, *args: object) -> None:
        """``transfer(op, *args)`` on an I/O thread, inside a trace range if this engine names one."""
        if self.trace_name is None:
            transfer(op, *args)
            return
        with named_range(self.trace_name, op):
            transfer(op, *args)

    def _transfer(self, op: str, fds: tuple[int, int | None], view: memoryview, addr: int, offset: int,
                  lo: int, hi: int, path: Path) -> None:
        plain, direct = fds
        aligned = not ((addr + lo) % ALIGNMENT or (offset + lo) % ALIGNMENT or (hi - lo) % ALIGNMENT)
        fd = direct if direct is not None and aligned else plain
        piece, done, want = view[lo:hi], 0, hi - lo
        call = os.preadv if op == "read" else os.pwritev
        while done < want:
            try:
                moved = call(fd, [piece[done:]], offset + lo + done)
            except OSError as exc:
                raise AioError(exc.errno, _explain(exc, op, path, offset + lo, want), str(path)) from exc
            if moved == 0:  # only a read returns 0: the end of the file
                raise AioError(
                    errno.EIO,
                    f"short read of '{path}': wanted bytes [{offset + lo}, {offset + hi}) but the "
                    f"file ends at {offset + lo + done}; it was not fully written or is another file",
                    str(path),
                )
            done += moved

    def _transfer_all(self, op: str, fds: tuple[int, int | None], view: memoryview, addr: int, offset: int,
                      pieces: list[tuple[int, int]], path: Path) -> None:
        for lo, hi in pieces:
            self._transfer(op, fds, view, addr, offset, lo, hi, path)


def _explain(exc: OSError, op: str, path: Path, offset: int | None = None, nbytes: int | None = None) -> str:
    """A message for a failed open, read or write that says what to change."""
    where = f"'{path}'" if offset is None else f"bytes [{offset}, {offset + nbytes}) of '{path}'"
    hint = {
        errno.ENOENT: f"the directory '{path.parent}' does not exist; create it or choose another directory",
        errno.EACCES: f"no permission to {op} in '{path.parent}'; choose another directory",
        errno.EROFS: f"'{path.parent}' is on a read-only filesystem; choose another directory",
        errno.ENOSPC: f"no space left on the device holding '{path.parent}'; free space or choose another directory",
        errno.EDQUOT: f"disk quota exceeded on '{path.parent}'",
    }.get(exc.errno, exc.strerror or "")
    return f"{op} of {where} failed: {hint}"
