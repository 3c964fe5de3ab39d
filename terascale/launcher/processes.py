"""Running the launcher's commands: one local agent, or one per host with their output merged.

``terascale run`` waits for what it started and passes signals on: Ctrl-C and SIGTERM stop
every child (after a grace period for torchrun to stop its workers), and a remote host
that fails stops the others.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import IO, TextIO

__all__ = ["run_local", "run_remote"]


class _Terminated(Exception):
    """SIGTERM arrived; unwinds to the cleanup that stops our children."""


@contextmanager
def _sigterm_as_exception() -> Iterator[None]:
    # Signal handlers can only be installed from the main thread; elsewhere the
    # caller's own handling applies.
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_code(returncode: int) -> int:
    # Shell convention for "killed by signal N".
    return 128 - returncode if returncode < 0 else returncode


def _stop(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """Terminate still-running ``procs``, killing those that outlive ``grace_s``."""
    live = [p for p in procs if p.poll() is None]
    for proc in live:
        proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in live:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_local(argv: Sequence[str], env: Mapping[str, str] | None = None, grace_s: float = 30.0,
              pid_file: str | None = None) -> int:  # fmt: skip
    """Run the torchrun ``argv`` here and return its exit code (128+N if killed by signal N).

    On Ctrl-C torchrun gets ``grace_s`` to stop its workers before it is
    terminated; SIGTERM to this process is passed on to torchrun. ``pid_file``: a file
    holding the child's pid while it runs (DeepSpeed's ``--save_pid``).
    """
    proc = subprocess.Popen(list(argv), env=None if env is None else dict(env))
    try:
        if pid_file is not None:
            with open(pid_file, "w") as f:
                f.write(str(proc.pid))
        return _wait_local(proc, grace_s)
    finally:
        if pid_file is not None and os.path.exists(pid_file):
            os.remove(pid_file)


def _wait_local(proc: subprocess.Popen, grace_s: float) -> int:
    try:
        with _sigterm_as_exception():
            return _exit_code(proc.wait())
    except KeyboardInterrupt:
        # A terminal's Ctrl-C reached torchrun too (same process group); signalling
        # again would interrupt its own shutdown, so first just wait for it.
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _stop([proc], grace_s)
    except _Terminated:
        _stop([proc], grace_s)
    return _exit_code(proc.wait())


def _pump(host: str, stream: IO[bytes], out: TextIO, lock: threading.Lock) -> None:
    """Copy ``stream`` to ``out`` line by line, each line prefixed with ``host``."""
    for raw in iter(stream.readline, b""):
        # A remote pty ends lines with \r\n.
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        with lock:
            out.write(f"{host}: {line}\n")
            out.flush()
    stream.close()


def run_remote(
    commands: Sequence[tuple[str, Sequence[str]]],
    out: TextIO | None = None,
    grace_s: float = 10.0,
    poll_s: float = 0.1,
) -> int:
    """Run ``(host, argv)`` commands concurrently; stream output as ``host: line``.

    Returns 0 when all succeed. As soon as one exits non-zero the others are
    terminated and that exit code is returned; Ctrl-C/SIGTERM stop them all.
    """
    out = sys.stdout if out is None else out
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    try:
        with _sigterm_as_exception():
            for host, argv in commands:
                proc = subprocess.Popen(
                    list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
                )
                procs.append(proc)
                pump = threading.Thread(target=_pump, args=(host, proc.stdout, out, lock), daemon=True)
                pump.start()
                pumps.append(pump)
            while True:
                codes = [p.poll() for p in procs]
                failed = [(host, c) for (host, _), c in zip(commands, codes) if c not in (None, 0)]
                if failed:
                    host, code = failed[0]
                    with lock:
                        print(f"terascale: {host} exited with code {code}; stopping the other hosts",
                              file=sys.stderr, flush=True)
                    _stop(procs, grace_s)
                    return _exit_code(code)
                if all(c == 0 for c in codes):
                    return 0
                time.sleep(poll_s)
    except (KeyboardInterrupt, _Terminated):
        _stop(procs, grace_s)
        return 130
    except BaseException:
        # e.g. a command that cannot be started: do not leave the others running
        _stop(procs, grace_s)
        raise
    finally:
        for pump in pumps:
            pump.join(timeout=5.0)
