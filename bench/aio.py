"""Read and write bandwidth of terascale's async I/O engine against the raw disk and DeepSpeed's aio op.

Every system moves the same bytes (``--size-gib`` in one file, O_DIRECT, one 4 KiB-aligned
host buffer) in the same directory; systems are interleaved and repeated, and the
median GB/s of each is reported with its ratio to the raw disk. The raw disk is fio
(libaio, O_DIRECT, ``--fio-jobs`` jobs (default 4) x queue depth ``--fio-qd``) when fio is installed,
else ``dd oflag/iflag=direct`` (one request at a time, a lower bound). DeepSpeed's aio op
runs in ``--peers-python`` (it needs ``libaio-dev`` to build; see ../shared/BENCHMARKING.md).

    python bench/aio.py --size-gib 1 --repeats 3 --peers-python /tmp/peers/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from terascale.offload import AioOptions, AsyncIO, aligned_empty  # noqa: E402


def terascale_rw(path: Path, nbytes: int, options: AioOptions) -> dict[str, float]:
    buf = aligned_empty(nbytes, torch.uint8)
    buf.fill_(7)
    with AsyncIO(options) as aio:
        t = time.perf_counter()
        aio.sync_write(buf, path)  # O_DIRECT: on the device when it returns, as fio's and dd's
        write = nbytes / (time.perf_counter() - t) / 1e9
        _drop_cache(path)
        t = time.perf_counter()
        aio.sync_read(buf, path)
        read = nbytes / (time.perf_counter() - t) / 1e9
    return {"write": write, "read": read}


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fio_rw(path: Path, nbytes: int, jobs: int, qd: int, block: int) -> dict[str, float]:
    out = {}
    for rw, key in (("write", "write"), ("read", "read")):
        cmd = [
            "fio", "--name=raw", f"--filename={path}", f"--size={nbytes}", f"--bs={block}",
            f"--rw={rw}", "--direct=1", "--ioengine=libaio", f"--iodepth={qd}", f"--numjobs={jobs}",
            "--offset_increment=" + str(nbytes // jobs), f"--io_size={nbytes // jobs}",
            "--group_reporting", "--output-format=json",
        ]  # fmt: skip
        res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        out[key] = res["jobs"][0][key]["bw_bytes"] / 1e9
    return out


def dd_rw(path: Path, nbytes: int, block: int) -> dict[str, float]:
    count = nbytes // block
    t = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", f"bs={block}", f"count={count}", "oflag=direct", "conv=notrunc"],
        check=True, capture_output=True,
    )  # fmt: skip
    write = nbytes / (time.perf_counter() - t) / 1e9
    t = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={block}", "iflag=direct"], check=True, capture_output=True)
    read = nbytes / (time.perf_counter() - t) / 1e9
    return {"write": write, "read": read}


_DEEPSPEED_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time, torch
    from deepspeed.ops.op_builder import AsyncIOBuilder
    path, nbytes, block, qd, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    aio = AsyncIOBuilder().load(verbose=False)
    h = aio.aio_handle(block, qd, False, True, threads)
    buf = h.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    buf.fill_(7)
    t = time.perf_counter(); h.sync_pwrite(buf, path); write = nbytes / (time.perf_counter() - t) / 1e9
    fd = os.open(path, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
    t = time.perf_counter(); h.sync_pread(buf, path); read = nbytes / (time.perf_counter() - t) / 1e9
    print(json.dumps({"write": write, "read": read}))
    """
)


def deepspeed_rw(python: str, path: Path, nbytes: int, block: int, qd: int, threads: int) -> dict[str, float]:
    env = dict(os.environ, DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", "/tmp/peers-ext"))
    res = subprocess.run(
        [python, "-c", _DEEPSPEED_SCRIPT, str(path), str(nbytes), str(block), str(qd), str(threads)],
        capture_output=True, text=True, env=env, timeout=3600,
    )  # fmt: skip
    lines = [ln for ln in res.stdout.strip().splitlines() if ln.startswith("{")]
    if lines:  # measured; its I/O threads may still abort the process at exit
        return json.loads(lines[-1])
    raise RuntimeError(res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "failed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=str(ROOT / "runs" / "bench" / "aio"))
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=1 << 20)
    ap.add_argument("--queue-depth", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="aio.thread_count")
    ap.add_argument("--fio-jobs", type=int, default=4)
    ap.add_argument("--fio-qd", type=int, default=32)
    ap.add_argument("--peers-python", default=None, help="python with DeepSpeed (and libaio-dev) for its aio op")
    ap.add_argument("--json", default=str(ROOT / "runs" / "bench" / "aio.json"))
    args = ap.parse_args()

    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    nbytes = int(args.size_gib * (1 << 30)) // (1 << 20) * (1 << 20)
    free = shutil.disk_usage(directory).free
    if free < 3 * nbytes:
        raise SystemExit(f"{directory} has {free / 2**30:.1f} GiB free; need {3 * nbytes / 2**30:.1f}")
    options = AioOptions(block_size=args.block_size, queue_depth=args.queue_depth, thread_count=args.threads)
    raw_name = "fio" if shutil.which("fio") else "dd"
    systems = {
        "raw-" + raw_name: (
            (lambda p: fio_rw(p, nbytes, args.fio_jobs, args.fio_qd, args.block_size))
            if raw_name == "fio"
            else (lambda p: dd_rw(p, nbytes, args.block_size))
        ),
        "terascale": lambda p: terascale_rw(p, nbytes, options),
    }
    if args.peers_python:
        systems["deepspeed-aio"] = lambda p: deepspeed_rw(
            args.peers_python, p, nbytes, args.block_size, args.queue_depth, args.threads
        )
    results: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
    failed: dict[str, str] = {}
    try:
        for r in range(args.repeats):
            names = list(systems)
            names = names[r % len(names) :] + names[: r % len(names)]  # rotate the order
            for name in names:
                if name in failed:
                    continue
                path = directory / f"{name}.bin"
                try:
                    res = systems[name](path)
                except (RuntimeError, subprocess.CalledProcessError) as exc:
                    failed[name] = str(exc)
                    print(f"{name}: failed: {exc}", flush=True)
                    continue
                finally:
                    path.unlink(missing_ok=True)
                results[name].append(res)
                print(f"repeat {r} {name:14s} write {res['write']:.2f} GB/s  read {res['read']:.2f} GB/s", flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    raw = "raw-" + raw_name
    med = {n: {k: statistics.median(x[k] for x in v) for k in ("write", "read")} for n, v in results.items() if v}
    print(
        f"\n{nbytes / 2**30:.2f} GiB file, O_DIRECT, block {args.block_size >> 10} KiB, queue depth "
        f"{args.queue_depth}, {args.threads} thread(s); {args.repeats} interleaved repeats, medians\n"
    )
    print("| system | write GB/s | read GB/s | write vs raw | read vs raw | per-repeat write | per-repeat read |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, m in med.items():
        ws = [x["write"] for x in results[name]]
        rs = [x["read"] for x in results[name]]
        vs = med.get(raw)
        ratio = (lambda k: f"{m[k] / vs[k]:.2f}") if vs else (lambda k: "-")
        print(
            f"| {name} | {m['write']:.2f} | {m['read']:.2f} | {ratio('write')} | {ratio('read')} | "
            f"{min(ws):.2f}–{max(ws):.2f} | {min(rs):.2f}–{max(rs):.2f} |"
        )
    for name, why in failed.items():
        print(f"\n{name} did not run: {why}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"bytes": nbytes, "results": results, "failed": failed}, indent=1))


if __name__ == "__main__":
    main()
