"""An asynchronous file I/O engine for the NVMe tier, in pure Python over the OS.

[Note: asynchronous I/O without a compiled op]
``os.preadv`` / ``os.pwritev`` release the GIL for the whole system call, so a pool of
Python threads keeps as many requests in flight as it has threads, which is what a
libaio queue does for one submitting thread. A request (one tensor to or from one file
range) is cut into ``block_size`` pieces; the engine has ``thread_count x queue_depth``
worker threads, so that many pieces are in flight at once. The workers take pieces from
one priority queue: pieces someone is waiting for first, then reads, then writes, each
in submission order. Reads are what a step waits for (a parameter shard, an optimizer
run); writes are write-behind that only frees buffers, and a write someone waits for is
promoted with the rest. Requests are independent: the engine does not order a read after
an earlier write to the same bytes, so callers wait for such a write first (the swap
tiers do). Files are opened with ``O_DIRECT`` where the filesystem allows it, bypassing
the page cache: a swap file is written once per step and read once per step, so caching
it only evicts memory the model needs and doubles the copies. ``O_DIRECT`` needs the
buffer address, file offset and length to be multiples of the device's block size;
:func:`aligned_empty` makes such buffers, and a piece that is not aligned goes through an
ordinary descriptor of the same file instead (Linux keeps the two coherent), so any
tensor can be read or written, aligned ones fast.

Measured against this design (``bench/aio.py``, RESULTS.md): the kernel's AIO queue
(``io_submit``/``io_getevents`` through ctypes, one submitting thread; ``backend:
"kernel"``) gave no more bandwidth than threads on rewrites and reads at any block size or
depth, 7-10% more on writes into new files, and a slower offloaded training step, so it is
an option rather than the default; io_uring's binding that installs as a
wheel (``liburing``) takes only ``bytes``/``bytearray`` objects, so it cannot move a
tensor's (or any aligned) memory. What did matter was the buffers' pages (see [Note:
huge-page I/O buffers]) and the block size.

A handle's ``wait()`` raises :class:`AioError` naming the file, offset and length of the
first failed piece (missing or read-only directory, no space left, short read); a write
whose handle raised must be treated as not written.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import itertools
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

import torch

from terascale.comm.ops import named_range
from terascale.offload.host_buffers import ALIGNMENT, aligned_empty
from terascale.offload.kernel_aio import KernelQueue, open_queue

__all__ = ["ALIGNMENT", "AioError", "AioOptions", "AsyncIO", "IoActivity", "IoHandle", "aligned_empty", "io_traffic"]

_O_DIRECT = getattr(os, "O_DIRECT", 0)

# Defaults measured on this project's disk (bench/aio.py, RESULTS.md): 16 MiB pieces on
# huge-page buffers, 16 in flight, were as fast as any setting or faster, for one 1 GiB
# transfer and for forty 24 MiB ones alike. The config's defaults are these.
DEFAULT_BLOCK_SIZE = 16 << 20
DEFAULT_QUEUE_DEPTH = 16
DEFAULT_THREAD_COUNT = 1

# Queue priorities: lower runs first.
_WAITED, _READ, _WRITE = 0, 1, 2
_NO_RANGE = contextlib.nullcontext()


class AioError(OSError):
    """A read or write of the I/O engine failed; the message names the file and range."""


@dataclass(frozen=True)
class AioOptions:
    """The ``aio`` config section as the engine uses it.

    ``block_size``: bytes per piece; ``queue_depth``: pieces in flight per I/O thread;
    ``thread_count``: I/O threads (DeepSpeed's ``intra_op_parallelism``); the engine runs
    ``thread_count x queue_depth`` workers. ``single_submit``: a request's pieces go one
    after another on one worker rather than to all at once; ``overlap_events``: let a
    new request start while earlier ones are in flight (False finishes each request
    before the next is submitted).
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    queue_depth: int = DEFAULT_QUEUE_DEPTH
    thread_count: int = DEFAULT_THREAD_COUNT
    single_submit: bool = False
    overlap_events: bool = True
    # "threads": thread_count x queue_depth threads in preadv/pwritev; "kernel":
    # thread_count threads each keeping queue_depth pieces in the kernel's AIO queue
    # ([Note: the kernel AIO backend]).
    backend: Literal["threads", "kernel"] = "threads"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % ALIGNMENT:
            raise ValueError(f"aio.block_size must be a positive multiple of {ALIGNMENT}, got {self.block_size}")
        if self.queue_depth <= 0 or self.thread_count <= 0:
            raise ValueError("aio.queue_depth and aio.thread_count must be positive")
        if self.backend not in ("threads", "kernel"):
            raise ValueError(f"aio backend must be 'threads' or 'kernel', got {self.backend!r}")

    @property
    def workers(self) -> int:
        """Pieces in flight at once."""
        return self.thread_count * self.queue_depth


def _byte_view(tensor: torch.Tensor) -> memoryview:
    if tensor.device.type != "cpu":
        raise ValueError(f"the I/O engine reads and writes host tensors, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("the I/O engine needs a contiguous tensor")
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


class IoActivity:
    """When the engine's workers were busy: seconds with at least one read (write) piece
    in flight, and, while :attr:`recording`, those spans themselves and the spans the
    owner thread spent waiting, as ``(start, end, kind)`` on ``time.perf_counter``'s clock
    (``kind`` "read", "write" or "wait"; the newest ``max_spans`` are kept)."""

    def __init__(self, max_spans: int = 1 << 16) -> None:
        self.busy_s = {"read": 0.0, "write": 0.0, "any": 0.0}
        self.spans: deque[tuple[float, float, str]] = deque(maxlen=max_spans)
        self.recording = False
        self._in_flight = {"read": 0, "write": 0, "any": 0}
        self._since = {"read": 0.0, "write": 0.0, "any": 0.0}

    def begin(self, op: str, now: float) -> None:  # called under the engine's lock
        for kind in (op, "any"):
            if self._in_flight[kind] == 0:
                self._since[kind] = now
            self._in_flight[kind] += 1

    def end(self, op: str, now: float) -> None:  # called under the engine's lock
        for kind in (op, "any"):
            self._in_flight[kind] -= 1
            if self._in_flight[kind] == 0:
                self.busy_s[kind] += now - self._since[kind]
                if self.recording and kind != "any":
                    self.spans.append((self._since[kind], now, kind))

    def busy(self, now: float | None = None) -> dict[str, float]:
        """``busy_s`` including spans still open at ``now``."""
        now = time.perf_counter() if now is None else now
        return {k: v + (now - self._since[k] if self._in_flight[k] else 0.0) for k, v in self.busy_s.items()}


class _Request:
    """One submitted read or write: its pieces, how many are unfinished, its first error."""

    __slots__ = ("op", "fds", "view", "addr", "offset", "path", "block", "pieces", "pending", "error", "error_at",
                 "finished")

    def __init__(self, op: str, fds: tuple[int, int | None], view: memoryview, addr: int, offset: int, path: Path,
                 block: int) -> None:
        self.op, self.fds, self.view, self.addr, self.offset, self.path = op, fds, view, addr, offset, path
        self.block = block  # bytes per system call
        self.pieces: list[list] = []  # [request, lo, hi, claimed]
        self.pending = 0
        self.error: BaseException | None = None
        self.error_at = 0  # the failed piece's first byte
        self.finished = threading.Event()


class _Workers:
    """The worker threads and their priority queue. Kept apart from :class:`AsyncIO` so
    that a finaliser can stop the threads of an engine nobody closed (at exit, or when it
    is collected) after finishing what was queued.

    With kernel queues, each of their threads submits and reaps up to its queue's depth
    of pieces ([Note: the kernel AIO backend]); otherwise each of ``count`` threads moves
    one piece at a time."""

    def __init__(self, count: int, queues: list[KernelQueue], trace_name: str | None, activity: IoActivity) -> None:
        self.count = count
        self.queues = queues
        self.trace_name = trace_name
        self.activity = activity
        self.cv = threading.Condition()
        self.heap: list[tuple[int, int, list]] = []
        self.seq = itertools.count()
        self.threads: list[threading.Thread] = []
        self.closed = False

    def push(self, pieces: list[list], priority: int) -> None:
        with self.cv:
            assert not self.closed, "the I/O engine is closed"
            if not self.threads:
                targets = [partial(self._run_kernel, q) for q in self.queues] or [self._run] * self.count
                self.threads = [threading.Thread(target=t, name=f"terascale-aio-{i}", daemon=True)
                                for i, t in enumerate(targets)]  # fmt: skip
                for t in self.threads:
                    t.start()
            for piece in pieces:
                heapq.heappush(self.heap, (priority, next(self.seq), piece))
            self.cv.notify(len(pieces))
        for q in self.queues:
            q.wake()

    def promote(self, request: _Request) -> None:
        """Move ``request``'s pieces that no worker took yet to the front of the queue."""
        with self.cv:
            waiting = [p for p in request.pieces if not p[3]]
            for piece in waiting:  # the old entries are skipped once these are claimed
                heapq.heappush(self.heap, (_WAITED, next(self.seq), piece))

    def _take(self, limit: int) -> list[list]:
        """Claim up to ``limit`` pieces, most urgent first (under the lock)."""
        taken = []
        while self.heap and len(taken) < limit:
            piece = heapq.heappop(self.heap)[2]
            if piece[3]:
                continue
            piece[3] = True
            self.activity.begin(piece[0].op, time.perf_counter())
            taken.append(piece)
        return taken

    def _run(self) -> None:
        cv = self.cv
        while True:
            with cv:
                while not self.heap and not self.closed:
                    cv.wait()
                taken = self._take(1)
                if not taken and self.closed and not self.heap:
                    return
            for piece in taken:
                self._finish(piece, self._move(piece, piece[1], piece[2]))

    def _run_kernel(self, q: KernelQueue) -> None:
        while True:
            for (piece, rng), res in q.reap():
                rng.__exit__(None, None, None)
                self._finish(piece, self._completed(piece, res))
            with self.cv:
                taken = self._take(q.free)
                idle = not self.heap
                if not taken and idle and q.in_flight == 0 and self.closed:
                    break
            batch = []
            for piece in taken:
                request, lo, hi = piece[0], piece[1], piece[2]
                fd = _direct_fd(request, lo, hi)
                if fd is None or request.error is not None:  # not a kernel AIO transfer
                    self._finish(piece, self._move(piece, lo, hi))
                    continue
                rng = self._range(request.op)
                rng.__enter__()
                batch.append(((piece, rng), request.op == "read", fd, request.addr + lo, hi - lo, request.offset + lo))
            for piece, rng in q.submit(batch) if batch else ():  # refused by the kernel: move them here
                rng.__exit__(None, None, None)
                self._finish(piece, self._move(piece, piece[1], piece[2]))
            if q.in_flight or idle:
                q.wait()  # a completion, or new pieces queued
        q.close()

    def _range(self, op: str) -> contextlib.AbstractContextManager:
        return _NO_RANGE if self.trace_name is None else named_range(self.trace_name, op)

    def _move(self, piece: list, lo: int, hi: int) -> BaseException | None:
        """Move bytes ``[lo, hi)`` of ``piece``'s request on this thread; the error if any."""
        request = piece[0]
        if request.error is not None:
            return None
        try:
            with self._range(request.op):
                _transfer(request, lo, hi)
        except BaseException as exc:  # noqa: BLE001  (handed to whoever waits)
            return exc
        return None

    def _completed(self, piece: list, res: int) -> BaseException | None:
        """The outcome of a kernel transfer of ``piece`` that returned ``res``."""
        request, lo, hi = piece[0], piece[1], piece[2]
        if res < 0:
            err = OSError(-res, os.strerror(-res))
            return AioError(-res, _explain(err, request.op, request.path, request.offset + lo, hi - lo), str(request.path))
        if res < hi - lo:  # a short transfer (the end of the file): finish it here, or say why not
            return self._move(piece, lo + res, hi)
        return None

    def _finish(self, piece: list, error: BaseException | None) -> None:
        request = piece[0]
        with self.cv:
            # The error of the first failed piece in the file, whichever failed first.
            if error is not None and (request.error is None or piece[1] < request.error_at):
                request.error, request.error_at = error, piece[1]
            self.activity.end(request.op, time.perf_counter())
            request.pending -= 1
            if request.pending == 0:
                # Let go of the caller's memory now, not when the garbage collector finds
                # the request <-> pieces cycle: buffers are often gigabytes.
                request.view = None
                request.pieces = []
                request.finished.set()

    def shutdown(self) -> None:
        """Finish the queued pieces, then stop the threads."""
        with self.cv:
            self.closed = True
            self.cv.notify_all()
            threads = self.threads
        for q in self.queues:
            q.wake()
        for t in threads:
            if t is not threading.current_thread():
                t.join()
        if not threads:
            for q in self.queues:
                q.close()


class IoHandle:
    """One submitted read or write; :meth:`wait` blocks until every piece is done."""

    def __init__(self, description: str, request: _Request, nbytes: int, engine: AsyncIO | None = None) -> None:
        self.description = description
        self.nbytes = nbytes
        self.waited = False  # a handle's error is raised to whoever waits first, once
        self._request = request
        self._engine = engine

    def done(self) -> bool:
        return self._request.finished.is_set()

    def unreported_error(self) -> bool:
        """Whether the finished request failed and nobody has waited for it yet."""
        return not self.waited and self.done() and self._request.error is not None

    def wait(self) -> int:
        """Block until the request completes; return its bytes or raise :class:`AioError`."""
        self.waited = True
        request = self._request
        if not request.finished.is_set():
            engine = self._engine
            if engine is not None:
                engine._workers.promote(request)
            started = time.perf_counter()
            request.finished.wait()
            if engine is not None and threading.get_ident() == engine.owner_thread:
                now = time.perf_counter()
                engine.blocked_s += now - started
                if engine.activity.recording:
                    engine.activity.spans.append((started, now, "wait"))
        if request.error is not None:
            raise request.error
        return self.nbytes


class AsyncIO:
    """Reads and writes tensors from and to files on a pool of I/O threads.

    ``read`` and ``write`` return an :class:`IoHandle` at once; ``synchronize()`` waits for
    everything submitted so far. ``direct=False`` never uses ``O_DIRECT``; with True it is
    used wherever the filesystem accepts it (tmpfs, for one, does not: see
    :attr:`direct_paths`). Use as a context manager or call :meth:`close`; an engine left
    open finishes its queued requests when collected or at exit. With ``trace_name``,
    each piece shows in a torch profiler trace as a range ``"<trace_name> read"`` or
    ``"<trace_name> write"`` on its I/O thread. :attr:`activity` says when the workers
    were busy (see :class:`IoActivity`).
    """

    def __init__(self, options: AioOptions | None = None, *, direct: bool = True, trace_name: str | None = None) -> None:
        self.options = options or AioOptions()
        self._direct = direct and _O_DIRECT != 0
        self.trace_name = trace_name
        self.activity = IoActivity()
        self._workers = _Workers(self.options.workers, self._kernel_queues(), trace_name, self.activity)
        self._finalizer = weakref.finalize(self, _Workers.shutdown, self._workers)
        self._lock = threading.Lock()
        self._fds: dict[tuple[str, bool], int | None] = {}
        self._outstanding: list[IoHandle] = []
        self.direct_paths: set[str] = set()  # files opened with O_DIRECT
        self.bytes_read = 0  # submitted so far (for reports: traffic per step)
        self.bytes_written = 0
        # Time the creating (training) thread spent waiting for requests: the step's I/O
        # stalls. Background threads' waits (checkpoint writes, prefetch) are not stalls.
        self.owner_thread = threading.get_ident()
        self.blocked_s = 0.0

    def _kernel_queues(self) -> list[KernelQueue]:
        """``thread_count`` kernel AIO queues of ``queue_depth`` slots for the "kernel"
        backend (none: threads). Raises ValueError where the machine has none to give."""
        opts = self.options
        if opts.backend == "threads" or not self._direct:
            return []
        queues = [open_queue(opts.queue_depth) for _ in range(opts.thread_count)]
        if all(q is not None for q in queues):
            return queues
        for q in queues:
            if q is not None:
                q.close()
        raise ValueError("aio backend 'kernel': this machine has no kernel AIO queue to give (io_setup failed)")

    @property
    def backend(self) -> str:
        """"kernel" or "threads": what this engine runs on."""
        return "kernel" if self._workers.queues else "threads"

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
        if not self.options.overlap_events:
            self.synchronize()
        addr = tensor.data_ptr()
        request = _Request(op, fds, view, addr, offset, path, self.options.block_size)
        if self.options.single_submit:
            cuts = [0, nbytes] if nbytes else [0]
        else:
            cuts = _cuts(addr, offset, nbytes, self.options.block_size)
        request.pieces = [[request, lo, hi, False] for lo, hi in zip(cuts, cuts[1:])]
        request.pending = len(request.pieces)
        if op == "read":
            self.bytes_read += nbytes
        else:
            self.bytes_written += nbytes
        handle = IoHandle(f"{op} of {nbytes} bytes at offset {offset} of '{path}'", request, nbytes, self)
        with self._lock:
            # Finished requests are forgotten unless their error still awaits a waiter.
            self._outstanding = [h for h in self._outstanding if not h.done() or h.unreported_error()] + [handle]
        if request.pieces:
            self._workers.push(request.pieces, _READ if op == "read" else _WRITE)
        else:
            request.finished.set()
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
            self._finalizer()
            with self._lock:
                for fd in self._fds.values():
                    if fd is not None:
                        os.close(fd)
                self._fds.clear()

    def __enter__(self) -> AsyncIO:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def io_traffic(aio: AsyncIO | None) -> dict[str, float]:
    """``aio``'s traffic so far: bytes ``read`` and ``written``, and seconds it had reads,
    writes or either in flight (``read_busy_s``, ``write_busy_s``, ``busy_s``); zeros
    without an engine."""
    if aio is None:
        return {"read": 0, "written": 0, "read_busy_s": 0.0, "write_busy_s": 0.0, "busy_s": 0.0}
    busy = aio.activity.busy()
    return {"read": aio.bytes_read, "written": aio.bytes_written, "read_busy_s": busy["read"],
            "write_busy_s": busy["write"], "busy_s": busy["any"]}  # fmt: skip


def _cuts(addr: int, offset: int, nbytes: int, block: int) -> list[int]:
    """Where a request of ``nbytes`` from memory ``addr`` to file ``offset`` is cut into
    pieces of at most ``block`` bytes: when the memory and the file are misaligned alike,
    an unaligned head and tail (under 4 KiB each) are cut off so that every piece between
    them can go O_DIRECT; otherwise every ``block`` bytes."""
    if nbytes == 0:
        return [0]
    if (addr - offset) % ALIGNMENT:
        return [*range(0, nbytes, block), nbytes]
    head = min((-offset) % ALIGNMENT, nbytes)
    end = head + (nbytes - head) // ALIGNMENT * ALIGNMENT
    cuts = [0] if head == 0 else [0, head]
    cuts += range(head + block, end, block)
    if end > cuts[-1]:
        cuts.append(end)
    if nbytes > cuts[-1]:
        cuts.append(nbytes)
    return cuts


def _transfer(request: _Request, lo: int, hi: int) -> None:
    """Move bytes ``[lo, hi)`` of ``request``, one system call per ``block_size`` (a piece of
    a ``single_submit`` request spans the whole request)."""
    for a in range(lo, hi, request.block):
        _transfer_block(request, a, min(a + request.block, hi))


def _direct_fd(request: _Request, lo: int, hi: int) -> int | None:
    """The O_DIRECT descriptor for bytes ``[lo, hi)`` of ``request``, if they may use it."""
    direct = request.fds[1]
    if direct is None or (request.addr + lo) % ALIGNMENT or (request.offset + lo) % ALIGNMENT or (hi - lo) % ALIGNMENT:
        return None
    return direct


def _transfer_block(request: _Request, lo: int, hi: int) -> None:
    op, view, offset, path = request.op, request.view, request.offset, request.path
    fd = _direct_fd(request, lo, hi)
    fd = request.fds[0] if fd is None else fd
    call = os.preadv if op == "read" else os.pwritev
    piece, done, want = view[lo:hi], 0, hi - lo
    while done < want:
        try:
            moved = call(fd, [piece[done:]], offset + lo + done)
        except OSError as exc:
            raise AioError(exc.errno, _explain(exc, op, path, offset + lo, want), str(path)) from exc
        if moved == 0:  # only a read returns 0: the end of the file
            raise AioError(
                errno.EIO,
                f"short read of '{path}': wanted bytes [{offset + lo}, {offset + hi}) but the "
                f"file ends at {os.fstat(fd).st_size}; it was not fully written or is another file",
                str(path),
            )
        done += moved


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
