"""The comms logger (``comms_logger``): what terascale's collectives moved, and how fast.

[Note: comms logger]
While ``with logger.active():`` is open, every collective terascale issues through
:mod:`terascale.comm.ops` (all of its own) is recorded per collective and message size:
how many, how many bytes, how long, and at what algorithmic and bus bandwidth, as
DeepSpeed's comms logger does. Collectives that user code issues with
``torch.distributed`` directly are not seen, as DeepSpeed sees only ``deepspeed.comm``
calls (see [Note: collective wrappers, not a dispatch mode] in :mod:`terascale.comm.ops`).

*Message size* is DeepSpeed's: the bytes of the tensor this rank passes in, so

- ``all_reduce``, ``broadcast``, ``reduce``, ``send``/``recv``/``isend``/``irecv``: the tensor;
- ``all_gather_into_tensor`` and ``all_gather``: this rank's input, one shard (the output
  is world x larger);
- ``reduce_scatter_tensor``: the input, all world chunks (the output is one chunk);
- ``all_to_all_single``: the input; ``batch_isend_irecv``: every op's tensor, summed;
- ``barrier`` and the object collectives: 0 (the pickled size is not known to the caller).

Bandwidths follow nccl-tests (in GB/s, 10^9 bytes per second): ``algbw = S / t`` with
``S`` the size of the whole collective (the message size, times the world for the
all-gathers) and ``busbw = algbw x factor``, the factor being ``2(n-1)/n`` for an
all-reduce, ``(n-1)/n`` for all-gathers, reduce-scatters and all-to-alls, and 1 for
broadcast, reduce and point-to-point; ``n`` is the size of the op's group. Over many
ops of one kind the bandwidth is total bytes over total latency (no per-op mean).
DeepSpeed counts an all-reduce's algbw twice and prints gigabits; these do not.

*Latency* is measured without changing what runs: a synchronous op is timed around the
call; an asynchronous one (``async_op=True``, the point-to-point ``i*`` ops) from its issue
to its completion, seen through ``work.get_future().then(...)`` where the backend gives a
future, else (gloo's point-to-point works, and the gloo all-gather and reduce-scatter
that terascale builds from them) when the caller's ``wait()`` returns: an upper bound
that includes whatever the caller ran before waiting. On CUDA, CUDA events are recorded
on the current stream at the issue and at the completion and read only when a result is
asked for (or when many are pending), so recording never synchronises the device. The
time of an async op includes any wait in the backend's queue behind earlier ops.

Records are completed from the backend's threads; every update is taken under a lock.
``prof_all: false`` records only the ops named in ``prof_ops`` (DeepSpeed's names, as
above); ``debug`` keys each record by op and calling function
(``"all_reduce | ShardedGrads._touched_anywhere"``), the first caller outside the comm
layer; ``verbose`` logs each op as it completes (logger ``terascale.comms``, INFO).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from terascale.comm import collectives as _collectives
from terascale.comm import ops
from terascale.config.profiling import CommsLoggerConfig

T = TypeVar("T")
logger = logging.getLogger("terascale.comms")

_GATHERS = frozenset({"all_gather", "all_gather_into_tensor"})
_HALF_RING = frozenset({"all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"})
_POINT_TO_POINT = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv"})
_MAX_UNRESOLVED = 256  # CUDA records pending before their events are polled
# Frames of these files are the comm layer, not the caller a debug record names.
_COMM_FILES = frozenset(os.path.normcase(os.path.abspath(f)) for f in (ops.__file__, _collectives.__file__, __file__))


def bus_factor(op: str, world: int) -> float:
    """busbw / algbw for collective ``op`` over ``world`` ranks (nccl-tests' factors)."""
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in _HALF_RING:
        return (world - 1) / world
    return 1.0


def algorithm_bytes(op: str, msg_bytes: int, world: int) -> int:
    """Bytes of the whole collective ``op`` whose message size is ``msg_bytes``."""
    return msg_bytes * world if op in _GATHERS else msg_bytes


def format_size(nbytes: float) -> str:
    """``nbytes`` in B, KiB, MiB, GiB or TiB, two decimals above bytes."""
    if nbytes < 1024:
        return f"{int(nbytes)} B"
    exp = min(int(math.log(nbytes, 1024)), 4)
    return f"{nbytes / 1024**exp:.2f} {('B', 'KiB', 'MiB', 'GiB', 'TiB')[exp]}"


@dataclass
class _Op:
    """One recorded collective between its issue and its completion."""

    op: str
    name: str
    nbytes: int
    world: int
    generation: int
    started: float = 0.0  # perf_counter at the issue (CPU timing)
    start_event: Any = None  # CUDA timing: events on the current stream
    end_event: Any = None
    outstanding: int = 1  # works still to complete (batch_isend_irecv: one per op)


@dataclass
class _Stats:
    count: int = 0
    latency_s: float = 0.0
    min_s: float = math.inf
    max_s: float = 0.0
    alg_bytes: float = 0.0
    bus_bytes: float = 0.0

    def add(self, latency_s: float, alg_bytes: float, bus_bytes: float) -> None:
        self.count += 1
        self.latency_s += latency_s
        self.min_s = min(self.min_s, latency_s)
        self.max_s = max(self.max_s, latency_s)
        self.alg_bytes += alg_bytes
        self.bus_bytes += bus_bytes


class _WaitedWork(dist.Work):
    """A backend's work without a future (gloo point-to-point), reporting its ``wait()``.

    A real ``dist.Work`` (a Python subclass), so callers see torch's type; every call goes
    to the backend's work, and the first successful ``wait()`` completes the record.
    """

    def __init__(self, work: dist.Work, done: Callable[[], None]) -> None:
        super().__init__()
        self._work, self._done = work, done

    def wait(self, timeout: Any = None) -> bool:
        ok = self._work.wait() if timeout is None else self._work.wait(timeout)
        if self._done is not None:
            done, self._done = self._done, None
            done()
        return ok

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> Any:
        return self._work.exception()

    def source_rank(self) -> int:
        return self._work.source_rank()

    def result(self) -> list[torch.Tensor]:
        return self._work.result()

    def synchronize(self) -> None:
        self._work.synchronize()

    def get_future(self) -> torch.futures.Future:
        return self._work.get_future()


class CommsLogger:
    """Records terascale's collectives while :meth:`active` (see [Note: comms logger]).

    ``config`` is the ``comms_logger`` section; ``rank`` (the global rank) only labels
    the output. The logger holds its records itself (no global state): make one per
    engine, enter ``with logger.active():`` around what should be counted, ask for
    :meth:`summary`, :meth:`records` or :meth:`totals` at any time.
    """

    def __init__(self, config: CommsLoggerConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        self._prof_ops = frozenset(config.prof_ops)
        self._lock = threading.Lock()
        self._stats: dict[tuple[str, str, int], _Stats] = {}  # (op, record name, message bytes)
        self._unresolved: list[_Op] = []  # CUDA records whose events are not read yet
        self._in_flight = 0
        self._generation = 0  # ops issued before a reset() are dropped when they complete

    # -- use -----------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def active(self) -> contextlib.AbstractContextManager:
        """A context in which terascale's collectives (in this thread or task) are
        recorded; a no-op when the logger is not enabled."""
        return ops.recording(self) if self.config.enabled else contextlib.nullcontext()

    def records(self) -> list[dict[str, Any]]:
        """One dict per (record name, message size), sorted by both: ``op``, ``name``
        (the op, or op and caller with ``debug``), ``msg_bytes``, ``count``,
        ``total_bytes``, ``total_latency_ms``, ``avg_latency_ms``, ``min_latency_ms``,
        ``max_latency_ms``, ``algbw_gbps`` and ``busbw_gbps`` (GB/s: 10^9 bytes/s).
        Completed ops only; CUDA timings pending are read first (waiting for them)."""
        self._resolve(block=True)
        with self._lock:
            items = sorted(self._stats.items(), key=lambda kv: (kv[0][1], kv[0][2]))
            return [_row(op, name, nbytes, s) for (op, name, nbytes), s in items]

    def totals(self) -> dict[str, dict[str, float]]:
        """Per op, over every message size and caller: ``count``, ``bytes``,
        ``latency_ms``, ``algbw_gbps`` and ``busbw_gbps`` (GB/s)."""
        self._resolve(block=True)
        with self._lock:
            merged: dict[str, tuple[_Stats, int]] = {}
            for (op, _, nbytes), s in self._stats.items():
                acc, total = merged.get(op, (_Stats(), 0))
                acc.count += s.count
                acc.latency_s += s.latency_s
                acc.alg_bytes += s.alg_bytes
                acc.bus_bytes += s.bus_bytes
                merged[op] = (acc, total + nbytes * s.count)
        return {
            op: {
                "count": acc.count,
                "bytes": total,
                "latency_ms": acc.latency_s * 1e3,
                "algbw_gbps": _gbps(acc.alg_bytes, acc.latency_s),
                "busbw_gbps": _gbps(acc.bus_bytes, acc.latency_s),
            }
            for op, (acc, total) in sorted(merged.items())
        }

    @property
    def in_flight(self) -> int:
        """Recorded ops issued but not completed yet (an async op nobody waited for)."""
        with self._lock:
            return self._in_flight

    def reset(self) -> None:
        """Forget every record; ops in flight now are not recorded when they complete."""
        with self._lock:
            self._stats.clear()
            self._unresolved.clear()
            self._in_flight = 0
            self._generation += 1

    def summary(self) -> str:
        """The records as a table, like DeepSpeed's ``log_summary``: per record name, one
        row per message size (count, total bytes, total and average latency, algbw,
        busbw), then each op's totals and the overall total."""
        rows = self.records()
        head = (
            f"{'Comm. op / message size':<40}{'Count':>8}{'Total bytes':>14}{'Total lat (ms)':>16}"
            f"{'Avg lat (ms)':>14}{'algbw (GB/s)':>14}{'busbw (GB/s)':>14}"
        )
        lines = [f"comms logger, rank {self.rank}", head, "-" * len(head)]
        name = None
        for r in rows:
            if r["name"] != name:
                name = r["name"]
                lines.append(name)
            lines.append(
                f"{'  ' + format_size(r['msg_bytes']):<40}{r['count']:>8}{format_size(r['total_bytes']):>14}"
                f"{r['total_latency_ms']:>16.3f}{r['avg_latency_ms']:>14.3f}"
                f"{r['algbw_gbps']:>14.3f}{r['busbw_gbps']:>14.3f}"
            )
        totals = self.totals()
        if totals:
            lines.append("-" * len(head))
            for op, t in totals.items():
                avg = t["latency_ms"] / t["count"] if t["count"] else 0.0
                lines.append(
                    f"{'total ' + op:<40}{t['count']:>8}{format_size(t['bytes']):>14}{t['latency_ms']:>16.3f}"
                    f"{avg:>14.3f}{t['algbw_gbps']:>14.3f}{t['busbw_gbps']:>14.3f}"
                )
            count = sum(t["count"] for t in totals.values())
            nbytes = sum(t["bytes"] for t in totals.values())
            ms = sum(t["latency_ms"] for t in totals.values())
            lines.append(f"{'total':<40}{count:>8}{format_size(nbytes):>14}{ms:>16.3f}")
        else:
            lines.append("(no collectives recorded)")
        pending = self.in_flight
        if pending:
            lines.append(f"{pending} recorded op(s) still in flight (issued, never waited for) are not counted")
        return "\n".join(lines)

    # -- the recorder protocol of terascale.comm.ops -------------------------------------------

    def record(
        self, op: str, payload: ops.Payload, group: ProcessGroup | None, async_op: bool, call: Callable[[], T]
    ) -> T:
        """Run ``call()`` (collective ``op``) and record it (see [Note: comms logger])."""
        if not self._wanted(op):
            return call()
        rec = self._begin(op, payload, group)
        try:
            result = call()
        except BaseException:
            self._abandon(rec)
            raise
        if not async_op or result is None:
            self._finish(rec)
            return result
        works = result if isinstance(result, list) else [result]
        if not works:
            self._finish(rec)
            return result
        rec.outstanding = len(works)
        part_done = functools.partial(self._part_done, rec)
        out = []
        for work in works:
            try:
                future = work.get_future()
            except RuntimeError:  # no future (gloo point-to-point): done when waited for
                out.append(_WaitedWork(work, part_done))
                continue
            future.then(lambda _: part_done())  # the value (or error) is the caller's
            out.append(work)
        return out if isinstance(result, list) else out[0]  # type: ignore[return-value]

    def start(self, op: str, payload: ops.Payload, group: ProcessGroup | None) -> Callable[[], None] | None:
        """Begin recording ``op`` composed of other calls; return what ends it."""
        if not self._wanted(op):
            return None
        return functools.partial(self._finish, self._begin(op, payload, group))

    # -- internals -----------------------------------------------------------------------------

    def _wanted(self, op: str) -> bool:
        return self.config.prof_all or op in self._prof_ops

    def _begin(self, op: str, payload: ops.Payload, group: ProcessGroup | None) -> _Op:
        tensors = [] if payload is None else [payload] if isinstance(payload, torch.Tensor) else list(payload)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        world = 1 if op in _POINT_TO_POINT else max(1, dist.get_world_size(group))
        name = f"{op} | {_caller()}" if self.config.debug else op
        rec = _Op(op, name, nbytes, world, self._generation)
        if tensors and tensors[0].device.type == "cuda":
            rec.start_event = torch.cuda.Event(enable_timing=True)
            rec.start_event.record()
        else:
            rec.started = time.perf_counter()
        with self._lock:
            self._in_flight += 1
        return rec

    def _abandon(self, rec: _Op) -> None:
        with self._lock:
            if rec.generation == self._generation:
                self._in_flight -= 1

    def _part_done(self, rec: _Op) -> None:
        with self._lock:
            rec.outstanding -= 1
            last = rec.outstanding == 0
        if last:
            self._finish(rec)

    def _finish(self, rec: _Op) -> None:
        """``rec`` has completed: take its time (CUDA: an end event, read later)."""
        if rec.start_event is None:
            self._add(rec, time.perf_counter() - rec.started)
            return
        rec.end_event = torch.cuda.Event(enable_timing=True)
        rec.end_event.record()  # in a future's callback: on a stream that follows the op
        with self._lock:
            if rec.generation != self._generation:
                return
            self._unresolved.append(rec)
            poll = len(self._unresolved) > _MAX_UNRESOLVED
        if poll:
            self._resolve(block=False)

    def _resolve(self, block: bool) -> None:
        """Read the CUDA events of completed records (all of them, waiting, with ``block``)."""
        with self._lock:
            pending, self._unresolved = self._unresolved, []
        keep = []
        for rec in pending:
            if block:
                rec.end_event.synchronize()
            elif not rec.end_event.query():
                keep.append(rec)
                continue
            self._add(rec, rec.start_event.elapsed_time(rec.end_event) / 1e3)
        if keep:
            with self._lock:
                self._unresolved = keep + self._unresolved

    def _add(self, rec: _Op, latency_s: float) -> None:
        alg = algorithm_bytes(rec.op, rec.nbytes, rec.world)
        with self._lock:
            if rec.generation != self._generation:
                return
            self._in_flight -= 1
            key = (rec.op, rec.name, rec.nbytes)
            stats = self._stats.get(key)
            if stats is None:
                stats = self._stats[key] = _Stats()
            stats.add(latency_s, alg, alg * bus_factor(rec.op, rec.world))
        if self.config.verbose:
            logger.info(
                "rank %d | %s | %s | %.3f ms | algbw %.3f GB/s | busbw %.3f GB/s", self.rank, rec.name,
                format_size(rec.nbytes), latency_s * 1e3, _gbps(alg, latency_s),
                _gbps(alg * bus_factor(rec.op, rec.world), latency_s),
            )  # fmt: skip


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def _row(op: str, name: str, nbytes: int, s: _Stats) -> dict[str, Any]:
    return {
        "op": op,
        "name": name,
        "msg_bytes": nbytes,
        "count": s.count,
        "total_bytes": nbytes * s.count,
        "total_latency_ms": s.latency_s * 1e3,
        "avg_latency_ms": s.latency_s * 1e3 / s.count,
        "min_latency_ms": s.min_s * 1e3,
        "max_latency_ms": s.max_s * 1e3,
        "algbw_gbps": _gbps(s.alg_bytes, s.latency_s),
        "busbw_gbps": _gbps(s.bus_bytes, s.latency_s),
    }


def _caller() -> str:
    """The function that called into the comm layer (``Class.method`` where known)."""
    frame = sys._getframe(1)
    while frame is not None and os.path.normcase(frame.f_code.co_filename) in _COMM_FILES:
        frame = frame.f_back
    if frame is None:
        return "?"
    code = frame.f_code
    return getattr(code, "co_qualname", code.co_name)
