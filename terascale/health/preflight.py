"""One rank of ``terascale check``: measure this rank's device, memory, disk and links.

``terascale check`` starts this module on every rank through torchrun
(``python -m terascale.health.preflight [options]``). Each rank measures, all ranks at
once: matmul throughput (fp32, bf16), memory copy bandwidth, host<->device copies over
pinned memory (CUDA only), and write/read bandwidth of the NVMe path through terascale's
own I/O engine; then the bus bandwidth of all-reduce, all-gather and reduce-scatter over
the world, and over the node-local and cross-node groups when there are several nodes.
Rank 0 gathers every rank's :class:`~terascale.health.verdict.RankReport` and prints the
table and the verdict (:func:`~terascale.health.verdict.format_report`).

[Note: a failing rank must not hang the others]
A measurement that raises is recorded as text in the rank's report and the rank goes on.
Local measurements involve no other rank. Before each collective every rank says on a
gloo control group whether its buffers are ready, and a group runs the collective only
when all its members are, so a rank that failed early never leaves its peers waiting;
the process-group timeout (``--timeout``) bounds what is left (a peer dying mid-way).
The control group is gloo even on NCCL, so the reports still reach rank 0 when a GPU or
its links are what failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from terascale.comm.collectives import all_gather_flat, reduce_scatter_flat
from terascale.comm.groups import init_distributed
from terascale.health.verdict import (
    COLLECTIVE_OPS,
    GROUP_KINDS,
    CheckOptions,
    RankReport,
    bus_factor,
    collective_metric,
    format_report,
    summary,
)
from terascale.offload.aio import AioError, AioOptions, AsyncIO, aligned_empty

__all__ = ["bus_bandwidth", "host_copy_gbps", "main", "matmul_tflops", "measure_collectives", "measure_local",
           "memory_gbps", "run_check"]

_MIB = 1 << 20
# Matrix sizes: a few tens of milliseconds per product on one CPU thread, and on a GPU
# large enough (about a TFLOP) to reach its peak.
_MATMUL_N = {"cpu": 1024, "cuda": 8192}
_DEFAULT_SIZE_MB = {"cpu": 32, "cuda": 256}


def _describe(exc: BaseException) -> str:
    # An AioError's strerror is the whole explanation (what failed, where, what to change).
    text = exc.strerror if isinstance(exc, AioError) and exc.strerror else str(exc)
    return f"{type(exc).__name__}: {text}"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` runs of ``fn`` after one warm-up.

    The best run rather than the mean: a moment's interference on a shared machine should
    not make an outlier, while a slow part is slow every time.
    """
    fn()
    _synchronize(device)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> float:
    """TFLOP/s of an ``n x n`` by ``n x n`` product of ``dtype`` tensors on ``device``."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _best_time(lambda: torch.mm(a, b, out=out), device, repeats) / 1e12


def memory_gbps(device: torch.device, nbytes: int, repeats: int) -> float:
    """GB/s of copying one ``nbytes`` tensor into another on ``device`` (bytes read + written)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best_time(lambda: dst.copy_(src), device, repeats) / 1e9


def host_copy_gbps(device: torch.device, nbytes: int, repeats: int) -> tuple[float, float]:
    """GB/s of copying ``nbytes`` from pinned host memory to ``device`` and back."""
    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = nbytes / _best_time(lambda: dev.copy_(host, non_blocking=True), device, repeats) / 1e9
    d2h = nbytes / _best_time(lambda: host.copy_(dev, non_blocking=True), device, repeats) / 1e9
    return h2d, d2h


def _attempt(report: RankReport, names: tuple[str, ...], fn: Callable[[], float | tuple[float, ...]]) -> bool:
    """Store ``fn()``'s value(s) in ``report`` under ``names``, or its exception as their
    errors; return whether it succeeded."""
    try:
        result = fn()
    except Exception as exc:
        report.errors.update(dict.fromkeys(names, _describe(exc)))
        return False
    report.values.update(zip(names, result if isinstance(result, tuple) else (result,)))
    return True


def _measure_nvme(report: RankReport, directory: str, nbytes: int, repeats: int, pin: bool) -> None:
    """Write then read one ``nbytes`` file in ``directory`` through :class:`AsyncIO` (O_DIRECT
    where the filesystem allows it), ``repeats`` times each; the file is removed afterwards."""
    path = Path(directory, f"terascale-check-{report.host}-rank{report.rank}-{os.getpid()}.bin")
    cpu = torch.device("cpu")
    try:
        with AsyncIO(AioOptions()) as aio:
            buf = aligned_empty(nbytes, torch.uint8, pin_memory=pin).fill_(0x5A)

            def write() -> None:
                aio.sync_write(buf, path)
                aio.close_file(path, fsync=True)  # on the device, not just in a cache

            if not _attempt(report, ("nvme_write",), lambda: nbytes / _best_time(write, cpu, repeats) / 1e9):
                report.skipped["nvme_read"] = "the write failed"
                return
            if str(path) not in aio.direct_paths:
                report.notes.append(f"O_DIRECT is not supported in {directory}: the NVMe numbers include the page cache")
            _attempt(report, ("nvme_read",), lambda: nbytes / _best_time(lambda: aio.sync_read(buf, path), cpu, repeats) / 1e9)
    except Exception as exc:  # the engine or its buffer could not be set up, or closing failed
        report.errors.setdefault("nvme_write" if "nvme_write" not in report.values else "nvme_read", _describe(exc))
    finally:
        try:
            path.unlink(missing_ok=True)
        except OSError:  # e.g. the "directory" is a file: nothing was created
            pass


def measure_local(report: RankReport, device: torch.device, opts: CheckOptions, nbytes: int) -> None:
    """Fill ``report`` with this rank's own measurements (no other rank is involved):
    matmul, memory copies of ``nbytes`` on ``device``, host<->device copies, NVMe I/O."""
    n = _MATMUL_N.get(device.type, _MATMUL_N["cpu"])
    _attempt(report, ("matmul_fp32",), lambda: matmul_tflops(device, torch.float32, n, opts.repeats))
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        report.skipped["matmul_bf16"] = f"{torch.cuda.get_device_name(device)} has no bf16 support"
    else:
        _attempt(report, ("matmul_bf16",), lambda: matmul_tflops(device, torch.bfloat16, n, opts.repeats))
    _attempt(report, ("memory",), lambda: memory_gbps(device, nbytes, opts.repeats))
    if device.type == "cuda":
        _attempt(report, ("h2d", "d2h"), lambda: host_copy_gbps(device, nbytes, opts.repeats))
    else:
        report.skipped["h2d"] = report.skipped["d2h"] = f"no CUDA device (the rank runs on {device.type})"
    directory = opts.nvme_path
    if directory is None:
        report.notes.append(f"no --nvme-path: the I/O test ran in the system temp dir {tempfile.gettempdir()}")
        try:
            directory = tempfile.mkdtemp(prefix="terascale-check-")
        except OSError as exc:
            report.errors["nvme_write"], report.skipped["nvme_read"] = _describe(exc), "the write failed"
            return
    try:
        _measure_nvme(report, directory, opts.io_mb * _MIB, opts.repeats, pin=device.type == "cuda")
    finally:
        if opts.nvme_path is None:
            shutil.rmtree(directory, ignore_errors=True)


# ---------------------------------------------------------------------------
# collectives


@dataclass
class _Group:
    """This rank's group of one kind (``None`` when it has no peer in that kind)."""

    kind: str
    group: ProcessGroup | None
    members: list[int]


def _build_groups(report: RankReport, control: ProcessGroup, timeout: datetime.timedelta) -> list[_Group]:
    """The world group, and with several nodes this rank's node-local and cross-node groups.

    Collective over the world: every rank learns every rank's node, then creates every
    group in the same order (``dist.new_group`` must be called identically everywhere).
    A kind that does not apply is recorded in ``report.skipped``.
    """
    def skip(kinds: tuple[str, ...], why: str) -> None:
        report.skipped.update({collective_metric(op, kind): why for kind in kinds for op in COLLECTIVE_OPS})

    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        skip(GROUP_KINDS, "one rank: nothing to communicate with")
        return []
    nodes_of: list[str | None] = [None] * world
    dist.all_gather_object(nodes_of, report.node, group=control)
    nodes: dict[str, list[int]] = {}
    for r, node in enumerate(nodes_of):
        nodes.setdefault(str(node), []).append(r)
    groups = [_Group("world", dist.group.WORLD, list(range(world)))]
    if len(nodes) == 1:
        skip(("node", "cross"), "one node: no node-local or cross-node groups")
        return groups
    by_kind = {
        "node": list(nodes.values()),
        # Cross-node: the i-th rank of every node, as a data-parallel ring between nodes would be.
        "cross": [[ranks[i] for ranks in nodes.values() if len(ranks) > i] for i in range(max(map(len, nodes.values())))],
    }
    for kind, member_lists in by_kind.items():
        mine = _Group(kind, None, [rank])
        for members in member_lists:
            created = dist.new_group(members, timeout=timeout) if len(members) > 1 else None
            if rank in members and created is not None:
                mine = _Group(kind, created, members)
        if mine.group is None:
            skip((kind,), f"no other rank in this rank's {kind} group")
        groups.append(mine)
    return groups


def _ready_ranks(ok: bool, control: ProcessGroup) -> set[int]:
    """The ranks that said ``ok`` (a gloo all-reduce of one flag per rank)."""
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int32)
    flags[dist.get_rank()] = int(ok)
    dist.all_reduce(flags, group=control)
    return {r for r, f in enumerate(flags.tolist()) if f}


def _buffers(op: str, device: torch.device, nbytes: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(full, shard) fp32 buffers for ``op`` over ``n`` ranks: the full one about ``nbytes``.
    Zeros, so that repeated in-place sums stay finite."""
    numel = max(nbytes // 4 // n, 1) * n
    full = torch.zeros(numel, device=device)
    shard = full if op == "all_reduce" else torch.zeros(numel // n, device=device)
    return full, shard


def bus_bandwidth(op: str, group: ProcessGroup, full: torch.Tensor, shard: torch.Tensor,
                  device: torch.device, repeats: int) -> float:
    """Bus bandwidth (GB/s, nccl-tests conventions) of ``op`` on ``full``/``shard`` over ``group``.

    All-reduce sums ``full`` in place, busbw = algbw x 2(n-1)/n; all-gather fills ``full``
    from every rank's ``shard``, reduce-scatter sums ``full`` into ``shard``, both with
    busbw = algbw x (n-1)/n, where algbw = bytes of ``full`` / time. Collective over ``group``.
    """
    if op == "all_reduce":
        fn = lambda: dist.all_reduce(full, group=group)  # noqa: E731
    elif op == "all_gather":
        fn = lambda: all_gather_flat(full, shard, group)  # noqa: E731
    else:
        fn = lambda: reduce_scatter_flat(shard, full, group)  # noqa: E731
    seconds = _best_time(fn, device, repeats)
    return full.numel() * full.element_size() / seconds / 1e9 * bus_factor(op, dist.get_world_size(group))


def measure_collectives(report: RankReport, groups: list[_Group], control: ProcessGroup,
                        device: torch.device, nbytes: int, repeats: int) -> None:
    """Bus bandwidth of each collective over each of this rank's groups, into ``report``.

    Collective over the world (every rank calls it with its own groups of the same kinds,
    in the same order): before each measurement the ranks agree over ``control`` who is
    ready, and a group whose members are not all ready skips it instead of hanging.
    """
    for g in groups:
        for op in COLLECTIVE_OPS:
            name = collective_metric(op, g.kind)
            buffers, ok = None, g.group is not None  # None first: the last op's buffers are freed
            if ok:
                try:
                    buffers = _buffers(op, device, nbytes, len(g.members))
                except Exception as exc:
                    report.errors[name], ok = _describe(exc), False
            try:
                ready = _ready_ranks(ok, control)
            except Exception as exc:
                report.errors[name] = f"could not reach the other ranks: {_describe(exc)}"
                continue
            if g.group is None or buffers is None:
                continue
            missing = [r for r in g.members if r not in ready]
            if missing:
                report.skipped[name] = f"rank(s) {', '.join(map(str, missing))} could not take part"
                continue
            _attempt(report, (name,), lambda: bus_bandwidth(op, g.group, *buffers, device=device, repeats=repeats))


# ---------------------------------------------------------------------------
# the whole check


def _agreed_bytes(opts: CheckOptions, device: torch.device, control: ProcessGroup) -> int:
    """Buffer bytes for memory and collectives: ``--size-mb`` or the device's default, the
    smallest over all ranks (collectives need the same size everywhere)."""
    mb = opts.size_mb if opts.size_mb is not None else _DEFAULT_SIZE_MB.get(device.type, 32)
    size = torch.tensor([max(int(mb * _MIB) // 4 * 4, 4)], dtype=torch.int64)
    if dist.get_world_size(control) > 1:
        dist.all_reduce(size, op=dist.ReduceOp.MIN, group=control)
    return int(size.item())


def _print_verdict(reports: list[RankReport], opts: CheckOptions, world_size: int) -> int:
    """Rank 0: print the table and verdict, write the JSON; return the verdict's exit code."""
    text, code = format_report(reports, opts.tolerance)
    if len(reports) < world_size:  # the gather failed: only rank 0's own numbers are here
        text += f"\nterascale check: FAILED: only {len(reports)} of {world_size} ranks reported; see the errors above"
        code = 1
    print(text, flush=True)
    if opts.json_path is not None:
        with open(opts.json_path, "w") as f:
            json.dump(summary(reports, opts.tolerance), f, indent=2)
    return code


def _share_verdict(code: int, control: ProcessGroup) -> int:
    """Rank 0's verdict on every rank (the largest code any rank holds); 1 if unreachable."""
    t = torch.tensor([code], dtype=torch.int32)
    try:
        if dist.get_world_size(control) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control)
    except Exception:
        return 1
    return int(t.item())


def _exit_code(code: int, verdict_file: str | None, local_rank: int) -> int:
    """This process's exit code for verdict ``code``.

    Where the launcher's ``verdict_file`` is reachable (its own machine's ranks) the verdict
    travels in that file and the rank exits 0, so that torchrun does not print a
    failed-worker report after the verdict's last line; elsewhere (ranks on remote hosts,
    or a node started by hand) the process exits with the verdict itself.
    """
    if verdict_file is None or not os.path.isdir(os.path.dirname(verdict_file)):
        return code
    if local_rank == 0:  # one writer per machine
        Path(verdict_file).write_text(str(code))
    return 0


def run_check(opts: CheckOptions, verdict_file: str | None = None) -> int:
    """Measure this rank, gather every rank's report on rank 0 and print the verdict there.

    Collective over the world started by torchrun (joins it with gloo on CPU, NCCL on
    CUDA). Every rank learns the verdict (0 healthy, 1 not) and returns its exit code
    (see :func:`_exit_code`).
    """
    timeout = datetime.timedelta(seconds=opts.timeout_s)
    ctx = init_distributed(timeout=timeout)
    try:
        control = dist.group.WORLD if ctx.backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        host = socket.gethostname()
        # torchrun's GROUP_RANK names the agent; two agents on one host are two nodes to it.
        node = os.environ.get("GROUP_RANK", host)
        report = RankReport(rank=ctx.rank, host=host, device=str(ctx.device), node=node)
        nbytes = _agreed_bytes(opts, ctx.device, control)
        groups = _build_groups(report, control, timeout)
        if ctx.rank == 0:
            print(f"terascale check: {ctx.world_size} rank(s) on {ctx.device.type}, buffers {nbytes / _MIB:g} MiB, "
                  f"I/O {opts.io_mb} MiB, best of {opts.repeats}", file=sys.stderr, flush=True)
        measure_local(report, ctx.device, opts, nbytes)
        measure_collectives(report, groups, control, ctx.device, nbytes, opts.repeats)
        gathered: list[dict | None] | None = [None] * ctx.world_size if ctx.rank == 0 else None
        code = 0
        try:
            dist.gather_object(report.to_dict(), gathered, dst=0, group=control)
        except Exception as exc:
            print(f"terascale check: rank {ctx.rank} could not gather the reports: {_describe(exc)}",
                  file=sys.stderr, flush=True)
            gathered, code = [report.to_dict()], 1
        if ctx.rank == 0:
            try:
                code = _print_verdict([RankReport.from_dict(d) for d in gathered if d is not None], opts, ctx.world_size)
            except Exception as exc:  # e.g. an unwritable --json; the others wait for the verdict
                print(f"terascale check: FAILED: could not report: {_describe(exc)}", flush=True)
                code = 1
        return _exit_code(_share_verdict(code, control), verdict_file, ctx.local_rank)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Parse the options (as ``terascale check`` passes them) and run this rank's check."""
    parser = argparse.ArgumentParser(prog="python -m terascale.health.preflight",
                                     description="One rank of `terascale check`; start it with torchrun.")
    CheckOptions.add_arguments(parser)
    parser.add_argument("--verdict-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        opts = CheckOptions.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))  # exits 2
    return run_check(opts, verdict_file=args.verdict_file)


if __name__ == "__main__":
    raise SystemExit(main())
