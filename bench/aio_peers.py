"""The I/O paths the benches measure terascale's engine against, each returning
``{"write": GB/s, "read": GB/s}`` over one file (written, then read back), and
:func:`disk_speed`, the raw disk's figure the other benches divide by:

* ``fio_rw``: the raw device through fio (libaio, O_DIRECT), ``jobs`` x ``iodepth``;
* ``DEEPSPEED_WORKER``: DeepSpeed's ``async_io`` op (libaio in C++ threads), run by
  ``deepspeed_rw`` in the peers' Python with a list of points, one JSON line per point.

io_uring was a candidate too: the maintained binding that installs as a wheel
(``liburing`` 2026.3.30, abi3) takes only ``bytes``/``bytearray`` objects and reads their
start address, so it cannot do I/O into a tensor or an aligned view (O_DIRECT), and was
left out; see RESULTS.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

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


def engine_rw(path: Path, nbytes: int, state: str = "fresh", options: object = None,
              buf: torch.Tensor | None = None) -> dict[str, float]:
    """terascale's engine (its defaults unless ``options``) writing ``nbytes`` from ``buf``
    (default: a fresh huge-page buffer) and reading them back; ``state`` as for
    :func:`fio_rw`."""
    import time

    from terascale.offload import AioOptions, AsyncIO, aligned_empty

    buf = aligned_empty(nbytes, torch.uint8).fill_(7) if buf is None else buf[:nbytes]
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
