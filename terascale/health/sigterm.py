"""SIGTERM as a preemption notice: seen at once, and told apart from a job that is already lost.

[Note: saving on SIGTERM]
Schedulers announce a preemption with SIGTERM and kill the process a grace period later
(torchrun's agent: 30 s). The engine then saves at the next optimizer step boundary, where
every rank agrees that one of them was signalled (``Resilience.after_step``), and exits with
143. This module decides everything that must happen *before* that boundary, where the
main thread cannot be relied on:

* A Python signal handler runs only when the main thread returns to the interpreter; a
  rank blocked in a collective's C++ wait would not see the signal at all (checked: a gloo
  all-reduce returned, and only then ran the handler). So the handler is paired with
  ``signal.set_wakeup_fd``: the C-level handler writes the signal number to a socket that
  a daemon thread reads, and that thread records the signal and arms the deadline
  (``checkpoint.signal_deadline_s``) at once, whatever the main thread is doing.
* torchrun also sends SIGTERM when a *peer* died and it restarts the workers. Catching it
  then would hold the survivor back from a restart it cannot help: the save needs the dead
  peer too. Two signs say the job is already lost, and end the process with 143 at once:
  an exception left the engine's forward/backward/step (gloo fails the survivor's
  collective within milliseconds of the peer's death), before or after the signal; or,
  after the signal, the main thread stays in one collective wait with no engine progress
  for ``deadline / 5`` seconds (NCCL and other hangs). A wait the thread cannot be seen in
  (an NCCL kernel behind ``.item()``) is still ended by the deadline.
* Once the save starts nothing is judged any more: its own waits may be long.

The atomic save protocol leaves the previous checkpoint intact whenever the process ends.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["SIGTERM_EXIT_CODE", "SigtermWatch"]

logger = logging.getLogger("terascale")

SIGTERM_EXIT_CODE = 128 + signal.SIGTERM
_POLL_S = 0.05
_STOP = b"\0"  # not a signal number: wakes the reader to end it


class SigtermWatch:
    """Watches for SIGTERM on behalf of the engine (see [Note: saving on SIGTERM]).

    ``waiting()`` names the collective the training thread waits in (None when it does
    not wait); the engine calls ``progressed`` at every phase, ``failed`` when an
    exception leaves a phase, and ``saving`` when its signal save starts.
    """

    def __init__(self, deadline_s: float, waiting: Callable[[], str | None]) -> None:
        self.deadline_s = deadline_s
        self.received_at = 0.0
        self._waiting = waiting
        self._progress = 0
        self._failing = False
        self._lock = threading.Lock()
        self._judging = threading.Event()
        self._done = threading.Event()
        self._previous: Any = None
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self._installed = threading.current_thread() is threading.main_thread()
        if self._installed:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._start_reader()

    @property
    def received(self) -> bool:
        return self.received_at > 0

    def progressed(self) -> None:
        self._progress += 1

    def failed(self) -> None:
        """An exception is leaving the engine: a SIGTERM, now or later, ends the process."""
        self._failing = True
        if self.received:
            _exit("SIGTERM while the step failed (a peer is probably gone): exiting without a checkpoint")

    def saving(self) -> None:
        self._done.set()

    def uninstall(self) -> None:
        self._done.set()
        if not self._installed:
            return
        self._installed = False
        signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
        if self._sockets is not None:
            reader, writer = self._sockets
            current = signal.set_wakeup_fd(-1)
            if current != writer.fileno():  # someone replaced ours since: leave theirs
                signal.set_wakeup_fd(current)
            writer.send(_STOP)

    # -- receiving -------------------------------------------------------------------------------

    def _start_reader(self) -> None:
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        if previous != -1:  # the program watches signals itself (asyncio): keep its fd, handler only
            signal.set_wakeup_fd(previous)
            reader.close(), writer.close()
            return
        self._sockets = (reader, writer)
        threading.Thread(target=self._read, name="terascale-sigterm", daemon=True).start()

    def _read(self) -> None:
        assert self._sockets is not None
        reader, writer = self._sockets
        try:
            while True:
                data = reader.recv(64)
                if not data or _STOP in data:
                    return
                if signal.SIGTERM in data and not self._judging.is_set():
                    self._receive()  # the Python handler may have been first: the judging is still ours
                    self._judging.set()
                    self._judge()
        finally:
            reader.close(), writer.close()

    def _handle(self, signum: int, frame: object) -> None:
        """The Python-level handler (main thread, when it gets there); chains the previous one."""
        self._receive()
        if callable(self._previous) and self._previous not in (signal.SIG_IGN, signal.SIG_DFL):
            self._previous(signum, frame)

    def _receive(self) -> bool:
        """Record the first SIGTERM and arm the deadline; False for a repeat."""
        with self._lock:
            if self.received:
                return False
            self.received_at = time.monotonic()
        timer = threading.Timer(self.deadline_s, _exit, args=(
            f"SIGTERM: no checkpoint finished within {self.deadline_s:.0f} s (checkpoint.signal_deadline_s); "
            "exiting without it, the previous checkpoint is intact",))
        timer.daemon = True
        timer.start()
        if self._failing:
            _exit("SIGTERM after the step failed (a peer is probably gone): exiting without a checkpoint")
        return True

    def _judge(self) -> None:
        """Until the save starts: exit when the training thread stays in one collective wait
        without progress for a fifth of the deadline (its peers are gone)."""
        grace = self.deadline_s / 5
        last: tuple[str | None, int] | None = None
        since = time.monotonic()
        while not self._done.wait(_POLL_S):
            where = self._waiting()
            now = (where, self._progress)
            if where is None or now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= grace:
                _exit(f"SIGTERM, then blocked for {grace:.1f} s in {where} with no progress: a peer is "
                      "probably gone; exiting without a checkpoint, the previous checkpoint is intact")


def _exit(message: str) -> None:
    logger.error(message)
    sys.stderr.flush()
    os._exit(SIGTERM_EXIT_CODE)
