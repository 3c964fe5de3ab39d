"""Collectives after a fault: the rest of the step runs without communicating.

[Note: collectives after a fault]
When a member dies, the survivors learn it from a collective that fails (a connection
closed, or the group's timeout for a member that stopped answering) somewhere in
forward, backward or the step, often deep inside autograd. Raising there would leave
the training loop, which a DeepSpeed-style script does not expect. So, as torchft does
for its replicas, a live elastic engine runs every phase under a :class:`FaultGate`: a
recorder of :mod:`terascale.comm.ops` (every collective terascale issues goes through
those wrappers) that lets calls through until one fails and, from then on, turns each
collective into a no-op (an asynchronous one returns a finished work). The step's
remaining compute runs on whatever the buffers hold, nothing is applied, and at the
step's boundary the engine leaves the broken epoch ([Note: membership epochs]) and
restores the last complete step. A collective that fails only when waited on (an
asynchronous one) trips the gate at its ``wait()``.

An inner recorder (the comms logger) still sees the calls that run.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from terascale.comm.ops import Payload, Recorder

T = TypeVar("T")
logger = logging.getLogger("terascale")


def is_communication_error(error: BaseException) -> bool:
    """Whether ``error`` is a failed or timed-out collective (gloo, NCCL, the store)."""
    import torch.distributed as dist

    kinds = tuple(k for k in (getattr(dist, "DistError", None), getattr(dist, "DistBackendError", None)) if k)
    if kinds and isinstance(error, kinds):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        marker in text
        for marker in ("gloo", "Connection", "connection", "Timed out", "timed out", "NCCL", "ProcessGroup", "closed")
    )


class _DoneWork:
    """A finished work: what a collective returns once the gate is broken."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return False

    def result(self) -> list:
        return []

    def exception(self) -> None:
        return None


class _GatedWork:
    """A real work whose failure at ``wait()`` trips the gate instead of raising."""

    def __init__(self, work: Any, gate: FaultGate) -> None:
        self._work, self._gate = work, gate

    def wait(self, timeout: Any = None) -> bool:
        if self._gate.broken:
            return True
        timeout = timeout if timeout is not None else self._gate.timeout
        try:
            # A point-to-point work waits forever by default: a peer that stopped must time out.
            return self._work.wait() if timeout is None else self._work.wait(timeout)
        except Exception as err:  # noqa: BLE001 - the gate decides whether it is a fault
            self._gate.trip(err)
            return True

    def is_completed(self) -> bool:
        return self._gate.broken or self._work.is_completed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class FaultGate:
    """A :class:`~terascale.comm.ops.Recorder` that stops communicating after a failure."""

    sees_parts = True  # the sends and receives of a composed collective pass through it one by one

    def __init__(self, inner: Recorder | None = None, timeout: Any = None) -> None:
        self.inner = inner
        self.timeout = timeout  # a datetime.timedelta for waits that give none
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    @property
    def broken(self) -> bool:
        return self.error is not None

    def trip(self, error: BaseException) -> None:
        if not is_communication_error(error):
            raise error
        with self._lock:
            if self.error is None:
                self.error = error
                logger.warning("elastic: a collective failed (%s: %s); this step will not be applied",
                               type(error).__name__, str(error).splitlines()[0][:200])  # fmt: skip

    def reset(self) -> None:
        self.error = None

    def record(self, op: str, payload: Payload, group: Any, async_op: bool, call: Callable[[], T]) -> T:
        if self.broken:
            return _DoneWork() if async_op else None  # type: ignore[return-value]
        try:
            result = call() if self.inner is None else self.inner.record(op, payload, group, async_op, call)
        except Exception as err:  # noqa: BLE001 - trip() re-raises what is not a fault
            self.trip(err)
            return _DoneWork() if async_op else None  # type: ignore[return-value]
        if async_op and result is not None:
            if isinstance(result, list):
                return [_GatedWork(w, self) for w in result]  # type: ignore[return-value]
            return _GatedWork(result, self)  # type: ignore[return-value]
        return result

    def start(self, op: str, payload: Payload, group: Any) -> Callable[[], None] | None:
        return None if self.inner is None else self.inner.start(op, payload, group)
