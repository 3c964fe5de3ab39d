"""The collective watchdog: turns a hang into an error that names the rank, the operation,
the group and the peers that did not arrive.

[Note: collective watchdog]
A rank blocked in a collective sits inside C++ (gloo's or NCCL's wait) and cannot be
interrupted from Python, so the watchdog is a daemon thread that watches from the side:

* Progress, not collectives, is what it times. The engine calls ``progress(step, phase)``
  at every phase change; a rank that has made none for ``timeout_s`` is hung wherever it
  is. Wrapping every collective instead would tax the hot path, miss the collectives that
  torch, user code or third-party modules issue themselves, and still not know what the
  peers are doing.
* The operation and group come from the training thread's Python stack (the thread that
  last called ``progress``, via ``sys._current_frames``): the ``torch.distributed`` frame
  it waits in, and that frame's ``group`` local. No torch function is patched. On NCCL a
  collective returns at once and runs on the device, so the host is usually found at its
  next wait for the device (``.item()``, a copy); the heartbeats still name the late peer.
* The peers come from heartbeats in the rendezvous store: every ``poll_s`` each rank's
  thread writes one small record (step, phase, how long it has been in it, wall time, and
  once it is stalled, what it is blocked in). On a timeout the stalled rank reads its
  peers' records and names those behind it, elsewhere, or silent (dead or frozen).
  The thread uses a clone of the store (its own connection), so a main thread blocked in
  a store wait (NCCL's lazy communicator set-up) cannot block the watchdog too.
* The process-group timeout alone is not enough: gloo's timeout error names neither the
  operation nor the late peer, and NCCL only turns its timeout into an error with async
  error handling enabled, after which the communicator is unusable anyway.

On a timeout the default action ends the process (``os._exit(WATCHDOG_EXIT_CODE)``): the
main thread cannot be unwound out of C++, which is also what NCCL's own watchdog does, and
torchrun then restarts or fails the job with the message in its summary.
"""

from __future__ import annotations

import contextlib
import json
import linecache
import logging
import os
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Any

import torch.distributed as dist

from terascale.comm.groups import DistributedContext

__all__ = ["WATCHDOG_EXIT_CODE", "CollectiveWatchdog", "waiting_in"]

logger = logging.getLogger("terascale")

# The exit status of a process the watchdog ended: 124 is timeout(1)'s "timed out".
WATCHDOG_EXIT_CODE = 124

# Phases whose order within one step is known; other phases ("save", "load", ...) are
# only ever "the same" or "different".
_PHASE_ORDER = {"forward": 0, "backward": 1, "step": 2}
_STORE_PREFIX = "terascale/watchdog"
_MAX_PEER_LINES = 6
_STDLIB = sysconfig.get_paths()["stdlib"]


@dataclass(frozen=True)
class _Where:
    """What a thread is doing, from its stack."""

    op: str | None  # e.g. "all_reduce on the data-parallel group (ranks [0, 1])"; None: no collective
    site: str  # "file:line in function" of the calling code
    group_ranks: tuple[int, ...] | None = None
    waiting: bool = False  # no torch frame, but the line waits on something (an async handle)

    def summary(self) -> str:
        if self.op is not None:
            return f"{self.op} at {self.site}"
        return f"{'waiting' if self.waiting else 'not in a collective'} at {self.site}"


class CollectiveWatchdog:
    """Watches this rank's progress from a daemon thread and reports a hang.

    The thread wakes every ``poll_s``, publishes this rank's heartbeat to ``store``, and
    when ``progress`` has not been called for more than ``timeout_s`` it diagnoses the hang
    and calls ``on_timeout(message)`` once per stall. The default ``on_timeout`` logs the
    message, prints it to stderr, writes torchelastic's error file and **ends the whole
    process** with ``os._exit(WATCHDOG_EXIT_CODE)``. ``store`` defaults to the default
    process group's store (under a ``terascale/watchdog`` prefix); without one, the
    message has no peer information.
    """

    def __init__(
        self,
        ctx: DistributedContext,
        timeout_s: float,
        poll_s: float | None = None,
        store: dist.Store | None = None,
        on_timeout: Callable[[str], None] | None = None,
        blocked_only: bool = False,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.ctx = ctx
        self.timeout_s = float(timeout_s)
        self.poll_s = float(poll_s) if poll_s is not None else min(self.timeout_s / 4, 5.0)
        self._on_timeout = on_timeout or self._report_and_exit
        # Report a stall only while the training thread waits in a collective (or on an
        # async handle): a rank busy with the user's own work between steps is left alone,
        # and its peers, blocked in the next collective, name it instead.
        self._blocked_only = blocked_only
        # The thread connects its own store client when it starts, not here: a clone that
        # finds the store's host gone (rank 0 already finished) retries for the whole
        # process-group timeout, which must not hold up the engine's construction.
        self._given_store = store
        self._store: dist.Store | None = None
        # (step, phase, monotonic start, wall start, thread id): written whole by
        # progress() on the training thread, only read by the watchdog thread.
        self._state: tuple[int, str, float, float, int] = (
            0, "start", time.monotonic(), time.time(), threading.get_ident())
        self._reported: tuple | None = None
        self._stack = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="terascale-watchdog", daemon=True)
        self._thread.start()

    def progress(self, step: int, phase: str) -> None:
        """Record that this rank entered ``phase`` of ``step``; restarts the timeout.

        Called on the training thread, whose stack is the one inspected on a timeout.
        """
        self._state = (step, phase, time.monotonic(), time.time(), threading.get_ident())

    def close(self) -> None:
        """Stop the thread (idempotent); peers then see this rank as closed, not dead."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(2 * self.poll_s, 5.0))

    def __enter__(self) -> CollectiveWatchdog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        self._store = _private_store(self._given_store)
        while True:
            state = self._state
            stalled = time.monotonic() - state[2]
            self._publish(state, stalled)
            if stalled > self.timeout_s and state is not self._reported and self._may_report(state):
                self._reported = state  # once per stall: the next progress() re-arms
                try:
                    message = self._diagnose(state, stalled)
                except Exception as e:  # never lose the report to a bug in the diagnosis
                    message = (f"terascale watchdog: rank {self.ctx.rank} made no progress for "
                               f"{stalled:.1f} s (step {state[0]}, phase {state[1]!r}); diagnosis failed: {e!r}")
                try:
                    self._on_timeout(message)
                except Exception:
                    logger.exception("terascale watchdog: on_timeout raised")
            if self._stop.wait(self.poll_s):
                break
        self._publish(self._state, 0.0, closed=True)

    def _may_report(self, state: tuple) -> bool:
        return not self._blocked_only or waiting_in(state[4], self.ctx) is not None

    def _publish(self, state: tuple, stalled: float, closed: bool = False) -> None:
        """One small ``store.set``: where this rank is, and once stalled, what it waits in."""
        if self._store is None:
            return
        record: dict[str, Any] = {"step": state[0], "phase": state[1], "age": round(stalled, 3),
                                  "t": time.time(), "poll": self.poll_s, "closed": closed}
        try:
            if stalled > 2 * self.poll_s and not closed:
                where = _where(sys._current_frames().get(state[4]), self.ctx)
                record["op"] = where.summary() if where else "exited"
            self._store.set(f"hb/{self.ctx.rank}", json.dumps(record))
        except Exception as e:  # the store's host may be gone; the diagnosis will say so
            logger.debug("terascale watchdog: heartbeat not published: %r", e)

    # -- the diagnosis -----------------------------------------------------------------

    def _diagnose(self, state: tuple, stalled: float) -> str:
        step, phase = state[0], state[1]
        frame = sys._current_frames().get(state[4])
        self._stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        where = _where(frame, self.ctx)
        del frame  # a frame keeps its locals alive
        head = (f"terascale watchdog: rank {self.ctx.rank} made no progress for {stalled:.1f} s "
                f"(step {step}, phase {phase!r}): ")
        if where is None:
            head += "its training thread has exited (close() was not called)."
        elif where.op is not None:
            head += f"blocked in {where.op} at {where.site}."
        elif where.waiting:
            head += f"not inside a torch.distributed call; waiting at {where.site} (an async collective's handle?)."
        elif getattr(self.ctx, "backend", "gloo") == "nccl":
            # NCCL collectives return at once and run on the device; the host blocks where
            # it next waits for the device (.item(), a copy, synchronize).
            head += (f"not in a torch.distributed call; its training thread is at {where.site} "
                     "(on NCCL this may be a wait for the device, behind a stuck collective).")
        else:
            head += (f"not in a collective; its training thread is at {where.site}. "
                     "This rank itself is stuck (its peers may be waiting for it).")
        in_collective = where is not None and (where.op is not None or where.waiting)
        return " ".join([head, *self._peers(step, phase, where, in_collective)])

    def _peers(self, step: int, phase: str, where: _Where | None, in_collective: bool) -> list[str]:
        """Sentences about the other ranks, from their heartbeats."""
        world = self.ctx.world_size
        others = [r for r in range(world) if r != self.ctx.rank]
        if not others:
            return []
        if self._store is None:
            return ["(No store: peers unknown.)"]
        try:
            beats = _read(self._store, [f"hb/{r}" for r in others])
        except Exception as e:
            return [f"Peer heartbeats unavailable (store error: {e}; the store's host may be down)."]
        members = set(where.group_ranks) if where and where.group_ranks else set(range(world))
        now = time.time()
        # kind -> (text after "Rank(s) N is/are", ranks, longest age)
        found: dict[str, tuple[str, list[int], float]] = {}

        def note(text: str, rank: int, age: float) -> None:
            t, ranks, longest = found.get(text, (text, [], 0.0))
            found[text] = (t, [*ranks, rank], max(longest, age))

        same: list[int] = []
        for rank, raw in zip(others, beats):
            if raw is None:
                note("has published no heartbeat (no watchdog yet, or never started)", rank, 0.0)
                continue
            hb = json.loads(raw)
            since = now - hb["t"]
            at = f"step {hb['step']}, phase {hb['phase']!r}"
            if hb.get("closed"):
                note(f"has closed its watchdog at {at} (finished or left training)", rank, since)
            elif since > 3 * max(self.poll_s, hb.get("poll", 0.0)):
                note(f"is silent, last at {at}: dead or frozen (last heartbeat {{age}} ago)", rank, since)
            elif rank in members:
                age, order = hb["age"] + since, _compare(hb["step"], hb["phase"], step, phase)
                op = f", {hb['op']}" if hb.get("op") else ""
                if order is not None and order < 0:
                    tail = ": it has not reached this collective" if in_collective else ""
                    note(f"is still at {at} (for {{age}}){op}{tail}", rank, age)
                elif order is None or order > 0:
                    note(f"is {'ahead, ' if order else ''}at {at} (for {{age}}){op}", rank, age)
                elif hb.get("op") and where is not None and hb["op"] != where.summary():
                    note(f"is at the same point but {hb['op']}", rank, age)
                else:
                    same.append(rank)
        lines = [_sentence(ranks, text.replace("{age}", f"{longest:.1f} s")) for text, ranks, longest in found.values()]
        if len(lines) > _MAX_PEER_LINES:
            lines = [*lines[:_MAX_PEER_LINES], f"({len(lines) - _MAX_PEER_LINES} more kinds of peer state left out.)"]
        if not lines and same:
            lines = [f"Every other rank of the group ({len(same)}) is at the same point and alive: the "
                     "collective itself is stuck (network, device or backend)."]
        return lines

    # -- the default action ------------------------------------------------------------

    def _report_and_exit(self, message: str) -> None:
        """Log, print, write torchelastic's error file, then end the process: the blocked
        training thread cannot be unwound out of C++."""
        logger.error(message)
        stack = f"training thread's stack (innermost last):\n{self._stack}" if self._stack else ""
        # Without any handler, logging's last resort already printed the message to stderr.
        printed = logging.lastResort is not None and not logger.hasHandlers()
        print(("" if printed else message + "\n") + stack, file=sys.stderr, flush=True)
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file:
            # torch.distributed.elastic.multiprocessing.errors' format; torchrun's failure
            # summary shows "py_callstack" as the traceback.
            record = {"message": {"message": message, "extraInfo": {
                "py_callstack": f"{message}\n\n{stack}", "timestamp": str(int(time.time()))}}}
            try:
                with open(error_file, "w") as f:
                    json.dump(record, f)
            except OSError as e:
                print(f"terascale watchdog: could not write {error_file}: {e}", file=sys.stderr, flush=True)
        os._exit(WATCHDOG_EXIT_CODE)


def waiting_in(thread_id: int, ctx: DistributedContext) -> str | None:
    """The collective (or async handle) thread ``thread_id`` waits in, as a phrase with its
    call site ("all_reduce on the data-parallel group (ranks [0, 1]) at ..."); None when
    the thread is not waiting on a peer."""
    where = _where(sys._current_frames().get(thread_id), ctx)
    return where.summary() if where is not None and (where.op is not None or where.waiting) else None


def _private_store(store: dist.Store | None) -> dist.Store | None:
    """The store the thread uses: its own connection (a clone), with a short timeout."""
    if store is None:
        try:
            store = dist.PrefixStore(_STORE_PREFIX, dist.distributed_c10d._get_default_store())
        except Exception:  # no default group, or a backend without a store
            return None
    with contextlib.suppress(Exception):  # a store without clone() is shared
        store = store.clone()
    with contextlib.suppress(Exception):
        store.set_timeout(timedelta(seconds=10))
    return store


def _read(store: dist.Store, keys: list[str]) -> list[bytes | None]:
    """Values for ``keys``, None where missing (``get`` would block on a missing key)."""
    if store.check(keys):
        return list(store.multi_get(keys))
    return [store.get(k) if store.check([k]) else None for k in keys]


def _compare(step: int, phase: str, my_step: int, my_phase: str) -> int | None:
    """-1: behind this rank, 0: same point, 1: ahead, None: unordered phases of one step."""
    if step != my_step:
        return -1 if step < my_step else 1
    if phase == my_phase:
        return 0
    a, b = _PHASE_ORDER.get(phase), _PHASE_ORDER.get(my_phase)
    return None if a is None or b is None else (-1 if a < b else 1)


def _sentence(ranks: list[int], text: str) -> str:
    """Say 'Rank 1 is ...' or 'Ranks [1, 2] are ...' (``text`` starts with a verb)."""
    if len(ranks) == 1:
        return f"Rank {ranks[0]} {text}."
    verb, rest = text.split(" ", 1)
    plural = {"is": "are", "has": "have"}.get(verb, verb)
    return f"Ranks {_fmt_ranks(ranks)} {plural} {rest}."


def _fmt_ranks(ranks: list[int] | tuple[int, ...]) -> str:
    ranks = list(ranks)
    if len(ranks) <= 8:
        return str(ranks)
    return f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)} ranks)"


def _is_torch_dist(frame: FrameType) -> bool:
    return f"{os.sep}torch{os.sep}distributed{os.sep}" in frame.f_code.co_filename


def _is_own(frame: FrameType) -> bool:
    """Code of terascale (but not this module) or of the user: neither the standard
    library nor an installed package."""
    path = frame.f_code.co_filename
    if f"{os.sep}terascale{os.sep}" in path:
        return f"{os.sep}terascale{os.sep}health{os.sep}" not in path
    return not (path.startswith(("<", _STDLIB)) or "-packages" + os.sep in path)


def _site(frame: FrameType) -> str:
    """``file:line in function``, the file shortened to what a reader recognises."""
    path = frame.f_code.co_filename
    for anchor in (f"-packages{os.sep}", f"{os.sep}terascale{os.sep}", _STDLIB + os.sep):
        i = path.rfind(anchor)
        if i >= 0:
            path = path[i + (1 if anchor == f"{os.sep}terascale{os.sep}" else len(anchor)):]
            break
    else:
        path = os.path.relpath(path) if path.startswith(os.getcwd()) else path
    return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"


def _where(frame: FrameType | None, ctx: DistributedContext) -> _Where | None:
    """The collective (and group) a thread waits in, or the code it is stuck in."""
    if frame is None:
        return None
    frames: list[FrameType] = []
    while frame is not None:
        frames.append(frame)  # innermost first
        frame = frame.f_back
    inner = next((i for i, f in enumerate(frames) if _is_torch_dist(f)), None)
    if inner is None:
        # Not in torch.distributed: the innermost frame, and the own code that called it.
        top = frames[0]
        own = next((f for f in frames if _is_own(f)), None)
        site = _site(top) if own is None or own is top else f"{_site(top)}, called from {_site(own)}"
        # A C++ wait called straight from own code (an async collective's ``work.wait()``).
        line = linecache.getline(top.f_code.co_filename, top.f_lineno) if own is top else ""
        return _Where(None, site, waiting=".wait(" in line or "synchronize(" in line)
    outer = inner
    while outer + 1 < len(frames) and _is_torch_dist(frames[outer + 1]):
        outer += 1
    run = frames[inner:outer + 1]
    # The public functions of the run, outermost (what the caller called) first; the
    # decorators' "wrapper" frames and private helpers are not operations.
    public = [f for f in reversed(run) if not f.f_code.co_name.startswith("_") and f.f_code.co_name != "wrapper"]
    entry = public[0] if public else run[-1]
    op = entry.f_code.co_name
    if public and public[-1] is not entry:
        op += f" (in {public[-1].f_code.co_name})"
    caller = _site(frames[outer + 1]) if outer + 1 < len(frames) else _site(entry)
    local = next((f.f_locals for f in public or run if "group" in f.f_locals), entry.f_locals)
    name, ranks = _name_group(local.get("group"), ctx)
    op += f" on {name} (ranks {_fmt_ranks(ranks)})" if ranks is not None else f" on {name}"
    for key, word in (("src", "from"), ("dst", "to"), ("group_src", "from"), ("group_dst", "to")):
        peer = local.get(key)
        if isinstance(peer, int):
            if key.startswith("group_") and ranks is not None and 0 <= peer < len(ranks):
                peer = ranks[peer]
            op += f" {word} rank {peer}"
            break
    return _Where(op, caller, tuple(ranks) if ranks is not None else None)


def _name_group(group: Any, ctx: DistributedContext) -> tuple[str, list[int] | None]:
    """("the data-parallel group", its global ranks) for a process group of ``ctx``."""
    named = [("data-parallel", getattr(ctx, "dp_group", None)), ("tensor-parallel", getattr(ctx, "mp_group", None)),
             ("pipeline", getattr(ctx, "pp_group", None)), ("replica", getattr(ctx, "replica_group", None)),
             ("sequence-parallel", getattr(ctx, "sp_group", None)),
             ("sequence x data-parallel", getattr(ctx, "sdp_group", None)), ("world", dist.group.WORLD)]
    group = group if group is not None else dist.group.WORLD

    def ranks_of(g: Any) -> list[int] | None:
        try:
            return dist.get_process_group_ranks(g) if g is not None else None
        except Exception:
            return None

    ranks = ranks_of(group)
    for name, g in named:  # identity first: a duplicate of a group has the same ranks
        if g is not None and g is group:
            return f"the {name} group", ranks
    for name, g in named:
        if ranks is not None and ranks_of(g) == ranks:
            return f"the {name} group", ranks
    return "a group", ranks
