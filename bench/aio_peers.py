"""The I/O paths the benches measure terascale's engine against, each returning
``{"write": GB/s, "read": GB/s}`` over one file (written, then read back), and
:func:`disk_speed`, the raw disk's figure the other benches divide by:

* ``fio_rw``: the raw device through fio (libaio, O_DIRECT), ``jobs`` x ``iodepth``;
* ``kernel_aio_rw``: the kernel's AIO queue (``io_submit``/``io_getevents``) driven from
  Python through ctypes system calls, one submitting thread: the candidate the engine's
  threads were measured against (no library; ``libaio`` only wraps these calls);
* ``DEEPSPEED_WORKER``: DeepSpeed's ``async_io`` op (libaio in C++ threads), run by
  ``deepspeed_rw`` in the peers' Python with a list of points, one JSON line per point.

io_uring was a candidate too: the maintained binding that installs as a wheel
(``liburing`` 2026.3.30, abi3) takes only ``bytes``/``bytearray`` objects and reads their
start address, so it cannot do I/O into a tensor or an aligned view (O_DIRECT), and was
left out; see RESULTS.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

_SYS_IO_SETUP, _SYS_IO_DESTROY, _SYS_IO_GETEVENTS, _SYS_IO_SUBMIT = 206, 207, 208, 209  # x86_64


def fio_rw(path: Path, nbytes: int, block: int, iodepth: int, jobs: int = 1, state: str = "fresh") -> dict[str, float]:
    """fio's sequential O_DIRECT write then read of ``nbytes`` (``jobs`` cover equal parts).
    ``state`` "fresh" writes a new file (no preallocation, as the other systems do),
    "preallocated" a new file laid out with ``posix_fallocate`` first, "overwrite" one
    written before."""
    out = {}
    path.unlink(missing_ok=True)
    fallocate = "native" if state == "preallocated" else "none"
    for rw in ("write", "write", "read") if state == "overwrite" else ("write", "read"):
        cmd = [
            "fio", "--name=raw", f"--filename={path}", f"--size={nbytes}", f"--bs={block}",
            f"--rw={rw}", "--direct=1", "--ioengine=libaio", f"--iodepth={iodepth}", f"--numjobs={jobs}",
            "--offset_increment=" + str(nbytes // jobs), f"--io_size={nbytes // jobs}", f"--fallocate={fallocate}",
            "--group_reporting", "--output-format=json",
        ]  # fmt: skip
        res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        out[rw] = res["jobs"][0][rw]["bw_bytes"] / 1e9
    return out


def engine_rw(path: Path, nbytes: int, state: str = "fresh", options: object = None) -> dict[str, float]:
    """terascale's engine (its defaults unless ``options``) writing ``nbytes`` from one
    huge-page buffer and reading them back; ``state`` as for :func:`fio_rw`."""
    import time

    from terascale.offload import AioOptions, AsyncIO, aligned_empty

    buf = aligned_empty(nbytes, torch.uint8).fill_(7)
    path.unlink(missing_ok=True)
    with AsyncIO(options or AioOptions()) as aio:
        aio.sync_write(buf[:4096], path.with_suffix(".warm"))  # start the workers
        if state == "overwrite":
            aio.sync_write(buf, path)
        elif state == "preallocated":
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
        start = time.perf_counter()
        aio.sync_write(buf, path)  # O_DIRECT: on the device when it returns
        write = nbytes / (time.perf_counter() - start) / 1e9
        start = time.perf_counter()
        aio.sync_read(buf, path)
        read = nbytes / (time.perf_counter() - start) / 1e9
    path.with_suffix(".warm").unlink(missing_ok=True)
    path.unlink(missing_ok=True)
    return {"write": write, "read": read}


def disk_speed(path: Path, nbytes: int, state: str) -> dict[str, dict[str, float]]:
    """The raw disk's GB/s for ``nbytes`` in ``state`` (see :func:`fio_rw`), by the best of
    fio (4 jobs x queue depth 32, 1 MiB, libaio) and terascale's engine at its defaults:
    fio's buffers are on 4 KiB pages, which this virtio disk splits, so on reads the
    engine is often the faster raw figure ([Note: huge-page I/O buffers])."""
    out = {"engine": engine_rw(path, nbytes, state)}
    if shutil.which("fio"):
        out["fio"] = fio_rw(path, nbytes, 1 << 20, 32, 4, state)
        path.unlink(missing_ok=True)
    out["best"] = {k: max(v[k] for v in out.values()) for k in ("write", "read")}
    return out


class _Iocb(ctypes.Structure):  # struct iocb (linux/aio_abi.h, little-endian)
    _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32), ("rw_flags", ctypes.c_int32),
                ("opcode", ctypes.c_uint16), ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64), ("offset", ctypes.c_int64),
                ("reserved2", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]  # fmt: skip


class _Event(ctypes.Structure):  # struct io_event
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64), ("res2", ctypes.c_int64)]


def kernel_aio_rw(path: Path, buf: torch.Tensor, block: int, iodepth: int, state: str = "fresh") -> dict[str, float]:
    """Write ``buf`` to ``path`` (new, or written before with ``state`` "overwrite") and read
    it back through the kernel's AIO queue, ``iodepth`` ``block``-byte requests in flight
    (O_DIRECT; ``buf`` must be 4 KiB-aligned)."""
    import time

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    out = {}
    path.unlink(missing_ok=True)
    for op in ("write", "write", "read") if state == "overwrite" else ("write", "read"):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
        ctx = ctypes.c_ulong(0)
        if libc.syscall(_SYS_IO_SETUP, ctypes.c_uint(iodepth), ctypes.byref(ctx)) != 0:
            raise RuntimeError(f"io_setup failed: errno {ctypes.get_errno()}")
        try:
            start = time.perf_counter()
            _kernel_aio(libc, ctx, fd, buf.data_ptr(), buf.numel(), block, iodepth, 1 if op == "write" else 0)
            out[op] = buf.numel() / (time.perf_counter() - start) / 1e9
        finally:
            libc.syscall(_SYS_IO_DESTROY, ctx)
            os.close(fd)
    return out


def _kernel_aio(libc, ctx, fd: int, base: int, nbytes: int, block: int, depth: int, opcode: int) -> None:
    iocbs, events = (_Iocb * depth)(), (_Event * depth)()
    free, offsets, nxt, in_flight = list(range(depth)), list(range(0, nbytes, block)), 0, 0
    while nxt < len(offsets) or in_flight:
        batch = []
        while free and nxt < len(offsets):
            slot, at = free.pop(), offsets[nxt]
            nxt += 1
            iocbs[slot] = _Iocb(data=slot, opcode=opcode, fildes=fd, buf=base + at,
                                nbytes=min(block, nbytes - at), offset=at)  # fmt: skip
            batch.append(slot)
        if batch:
            ptrs = (ctypes.POINTER(_Iocb) * len(batch))(*[ctypes.pointer(iocbs[s]) for s in batch])
            if libc.syscall(_SYS_IO_SUBMIT, ctx, ctypes.c_long(len(batch)), ptrs) != len(batch):
                raise RuntimeError(f"io_submit failed: errno {ctypes.get_errno()}")
            in_flight += len(batch)
        done = libc.syscall(_SYS_IO_GETEVENTS, ctx, ctypes.c_long(1), ctypes.c_long(depth), events, None)
        for i in range(done):
            if events[i].res != iocbs[events[i].data].nbytes:
                raise RuntimeError(f"kernel AIO request returned {events[i].res}")
            free.append(events[i].data)
        in_flight -= done


# Runs in the peers' Python: argv = file, bytes, JSON list of points; one JSON line each.
DEEPSPEED_WORKER = textwrap.dedent(
    """
    import json, os, sys, time, torch
    from deepspeed.ops.op_builder import AsyncIOBuilder
    path, nbytes, points = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    aio = AsyncIOBuilder().load(verbose=False)
    locked = None
    for p in points:
        h = aio.aio_handle(p["block"], p["qd"], False, True, p["threads"])
        if p.get("aligned", True):  # DeepSpeed's own page-locked buffer, as its swapper uses
            if locked is None:
                locked = h.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
            buf = locked
        else:  # an ordinary tensor, not page-aligned: DeepSpeed copies through a bounce buffer
            buf = torch.empty(nbytes + 64, dtype=torch.uint8)[64:]
        buf.fill_(7)
        if os.path.exists(path):
            os.unlink(path)
        if p.get("state") == "overwrite":  # the file exists, written: a swap file's steady state
            h.sync_pwrite(buf, path)
        t = time.perf_counter(); h.sync_pwrite(buf, path); write = nbytes / (time.perf_counter() - t) / 1e9
        t = time.perf_counter(); h.sync_pread(buf, path); read = nbytes / (time.perf_counter() - t) / 1e9
        os.unlink(path)
        print(json.dumps({"write": write, "read": read}), flush=True)
    os._exit(0)  # DeepSpeed's I/O threads can abort an orderly exit
    """
)


def deepspeed_rw(python: str, path: Path, nbytes: int, points: list[dict]) -> list[dict[str, float]]:
    """DeepSpeed's aio op at each of ``points`` ({"block", "qd", "threads", "aligned", "state"})."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", "/tmp/peers-ext"))
    res = subprocess.run(
        [python, "-c", DEEPSPEED_WORKER, str(path), str(nbytes), json.dumps(points)],
        capture_output=True, text=True, env=env, timeout=3600,
    )  # fmt: skip
    lines = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    if len(lines) != len(points):
        tail = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "no output"
        raise RuntimeError(f"DeepSpeed's aio op measured {len(lines)} of {len(points)} points: {tail}")
    return lines


if __name__ == "__main__":
    sys.exit("a library of bench/aio.py; run that")
