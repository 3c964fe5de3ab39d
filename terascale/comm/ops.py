"""Every collective terascale issues, as thin wrappers over ``torch.distributed``.

Each function here has torch's name, signature and return value, and calls torch's
function of that name (for the flat collectives: its ``*_single`` successor where torch
has one). The only addition is an optional *recorder*: while one is active (see
:func:`recording`; :class:`terascale.profiling.comms.CommsLogger` is one) every call is
timed and counted by it; otherwise the wrapper calls torch at once.

[Note: collective wrappers, not a dispatch mode]
A recorder must see every collective terascale issues, with its size and its latency,
without changing what runs. Two ways were weighed:

- a ``TorchDispatchMode`` that intercepts the ``c10d`` ops. It needs no change at the call
  sites and would also see collectives issued by user code, but a dispatch mode routes
  *every* aten op through Python while it is active, not just the collectives: measured
  on the GPT demo step it made the step about 10% slower, far above the comms logger's
  budget (a step with the logger on at most 1.03x of one without).
- wrappers in one module (this one), which every call site in terascale uses instead of
  ``torch.distributed``. With no recorder active a wrapper costs one ``ContextVar`` lookup
  and one thread-local key check (see the next note) on top of torch's own call, well
  under a microsecond; with one active, the recorder's bookkeeping (a few microseconds
  a collective), and nothing for the aten ops between collectives.

terascale's rule that no torch function is monkey-patched rules out the third way
(replacing ``dist.all_reduce`` and friends). So: wrappers. What they cannot see are
collectives user code issues with ``torch.distributed`` directly, which is also how
DeepSpeed's comms logger behaves (it sees ``deepspeed.comm`` calls only).

The recorder lives in a ``ContextVar``, like torch's own modes: it is scoped to a
``with`` block, and threads or tasks started outside the block do not inherit it. It is
the only mutable module state here.

[Note: recorders in backward threads]
A backward over device (CUDA) tensors runs its hooks, and with them terascale's gradient
reduce-scatters, stage-3 re-gathers and tensor-parallel backward all-reduces, on the
autograd engine's worker thread, whose ``contextvars`` context is not the caller's: the
recorder would vanish exactly where most of the traffic is. torch's backward entry
(``torch.autograd.graph._engine_run_backward``) stashes a copy of the caller's context in
ATen's thread-local state, which the engine carries to its workers; where the variable is
unset in the current context, the lookup reads it from that copy (a check of one
thread-local key, about 0.1 us). Where torch has no such stash (older versions) the
workers' collectives go unrecorded.

:func:`composed` marks a collective terascale builds out of other wrapped calls (the
point-to-point all-gather and reduce-scatter of :mod:`terascale.comm.collectives` on
gloo): the recorder sees it as one collective of the kind it stands for, and not the
sends and receives it is made of.

:func:`named_range` is here too, at the bottom layer, so that every layer (this one
included) can mark its phases for a trace (:mod:`terascale.profiling.trace`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any, Protocol, TypeVar

import torch
import torch.autograd.profiler as _autograd_profiler
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

T = TypeVar("T")
Payload = torch.Tensor | Sequence[torch.Tensor] | None


class Recorder(Protocol):
    """What a recorder does with the collectives issued while it is active."""

    def record(
        self, op: str, payload: Payload, group: ProcessGroup | None, async_op: bool, call: Callable[[], T]
    ) -> T:
        """Run ``call()`` (torch's collective ``op``) and record it; return what it returned.

        ``payload``: the tensor (or tensors) whose bytes are the op's message size (see
        :mod:`terascale.profiling.comms`); ``async_op``: ``call`` returns a work (or, for
        ``batch_isend_irecv``, a list of works) that completes later. The recorder may
        return a work of its own in place of torch's when it must see the ``wait()``.
        """
        ...

    def start(self, op: str, payload: Payload, group: ProcessGroup | None) -> Callable[[], None] | None:
        """A collective ``op`` composed of other calls begins now; return the function to
        call once it has completed, or None if the recorder does not record ``op``."""
        ...


_RECORDER: ContextVar[Any] = ContextVar("terascale_comm_recorder", default=None)
_SILENCED = object()  # set inside a ``composed`` block: its calls go unrecorded
_tls_has = getattr(torch._C, "_is_key_in_tls", None)
_tls_get = getattr(torch._C, "_get_obj_in_tls", None)


def _recorder() -> Recorder | None:
    """The recorder of the current context, or of the backward-launching thread's context
    on an autograd worker thread ([Note: recorders in backward threads])."""
    rec = _RECORDER.get()
    if rec is None and _tls_has is not None and _tls_has("context"):
        rec = _tls_get("context").get(_RECORDER)
    return None if rec is _SILENCED else rec


@contextlib.contextmanager
def recording(recorder: Recorder) -> Iterator[None]:
    """Make ``recorder`` see every collective issued through this module in the block
    (in this thread or task; nested blocks replace it until they end)."""
    token = _RECORDER.set(recorder)
    try:
        yield
    finally:
        _RECORDER.reset(token)


def active_recorder() -> Recorder | None:
    """The recorder that would see a collective issued now, if any."""
    return _recorder()


class _Composed:
    """``with composed(...) as done``: the inner calls go unrecorded; ``done`` ends the record."""

    def __init__(self, recorder: Recorder, op: str, payload: Payload, group: ProcessGroup | None) -> None:
        self._recorder, self._op, self._payload, self._group = recorder, op, payload, group

    def __enter__(self) -> Callable[[], None] | None:
        done = self._recorder.start(self._op, self._payload, self._group)
        self._token = _RECORDER.set(_SILENCED)
        return done

    def __exit__(self, *exc: object) -> None:
        _RECORDER.reset(self._token)


_NOT_RECORDING = contextlib.nullcontext(None)  # stateless: one instance serves every call


def composed(op: str, payload: Payload, group: ProcessGroup | None) -> contextlib.AbstractContextManager:
    """A collective ``op`` that the block issues as several wrapped calls.

    ``with composed("all_gather_into_tensor", shard, group) as done:`` gives ``done``, the
    function to call once the whole collective has completed (None when nothing records
    it); the wrapped calls inside the block are not recorded on their own.
    """
    recorder = _recorder()
    if recorder is None or getattr(recorder, "sees_parts", False):
        return _NOT_RECORDING  # a recorder that must see every part (a fault gate) sees them on their own
    return _Composed(recorder, op, payload, group)


# -- collectives ---------------------------------------------------------------------------------

# torch 2.13 renamed the flat collectives (``*_single``) and deprecated the old names;
# torch 2.4, the oldest supported, has only the old ones.
_ALL_GATHER_FLAT = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_FLAT = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(
    tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None, async_op: bool = False
):
    """``tensor`` becomes its reduction (``op``) over the ranks of ``group``, on every rank."""
    rec = _recorder()
    if rec is None:
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return rec.record(
        "all_reduce", tensor, group, async_op, lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    )


def all_gather_into_tensor(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup | None = None, async_op: bool = False
):
    """``output_tensor`` becomes every rank's ``input_tensor``, concatenated in rank order."""
    rec = _recorder()
    if rec is None:
        return _ALL_GATHER_FLAT(output_tensor, input_tensor, group=group, async_op=async_op)
    return rec.record(
        "all_gather_into_tensor", input_tensor, group, async_op,
        lambda: _ALL_GATHER_FLAT(output_tensor, input_tensor, group=group, async_op=async_op),
    )  # fmt: skip


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002 - torch's name
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
):
    """``output`` becomes this rank's chunk of ``input`` reduced over the ranks of ``group``."""
    rec = _recorder()
    if rec is None:
        return _REDUCE_SCATTER_FLAT(output, input, op=op, group=group, async_op=async_op)
    return rec.record(
        "reduce_scatter_tensor", input, group, async_op,
        lambda: _REDUCE_SCATTER_FLAT(output, input, op=op, group=group, async_op=async_op),
    )  # fmt: skip


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup | None = None, async_op: bool = False
):
    """``tensor_list[r]`` becomes rank r's ``tensor``, on every rank of ``group``."""
    rec = _recorder()
    if rec is None:
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    return rec.record(
        "all_gather", tensor, group, async_op,
        lambda: dist.all_gather(tensor_list, tensor, group=group, async_op=async_op),
    )  # fmt: skip


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, async_op: bool = False):
    """``tensor`` becomes global rank ``src``'s ``tensor`` on every rank of ``group``."""
    rec = _recorder()
    if rec is None:
        return dist.broadcast(tensor, src=src, group=group, async_op=async_op)
    return rec.record(
        "broadcast", tensor, group, async_op, lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op)
    )


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
):
    """Global rank ``dst``'s ``tensor`` becomes the reduction (``op``) over ``group``."""
    rec = _recorder()
    if rec is None:
        return dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op)
    return rec.record(
        "reduce", tensor, group, async_op, lambda: dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op)
    )


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002 - torch's name
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
):
    """Rank r's ``output`` becomes chunk r of every rank's ``input``, in rank order."""

    def call():
        return dist.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
        )

    rec = _recorder()
    return call() if rec is None else rec.record("all_to_all_single", input, group, async_op, call)


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> None:
    """Send ``tensor`` to global rank ``dst`` (returns once it is sent)."""
    rec = _recorder()
    if rec is None:
        return dist.send(tensor, dst, group=group, tag=tag)
    return rec.record("send", tensor, group, False, lambda: dist.send(tensor, dst, group=group, tag=tag))


def recv(tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0) -> int:
    """Fill ``tensor`` from global rank ``src`` (any rank if None); return the sender's rank."""
    rec = _recorder()
    if rec is None:
        return dist.recv(tensor, src, group=group, tag=tag)
    return rec.record("recv", tensor, group, False, lambda: dist.recv(tensor, src, group=group, tag=tag))


def isend(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0):
    """Start sending ``tensor`` to global rank ``dst``; return its work."""
    rec = _recorder()
    if rec is None:
        return dist.isend(tensor, dst, group=group, tag=tag)
    return rec.record("isend", tensor, group, True, lambda: dist.isend(tensor, dst, group=group, tag=tag))


def irecv(tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0):
    """Start filling ``tensor`` from global rank ``src``; return its work."""
    rec = _recorder()
    if rec is None:
        return dist.irecv(tensor, src, group=group, tag=tag)
    return rec.record("irecv", tensor, group, True, lambda: dist.irecv(tensor, src, group=group, tag=tag))


def batch_isend_irecv(p2p_op_list: list[dist.P2POp]) -> list:
    """Post every send and receive of ``p2p_op_list`` (``dist.P2POp`` of ``dist.isend`` /
    ``dist.irecv``) at once; return their works (one per op, or one for the batch)."""
    rec = _recorder()
    if rec is None:
        return dist.batch_isend_irecv(p2p_op_list)
    group = p2p_op_list[0].group if p2p_op_list else None
    payload = [p.tensor for p in p2p_op_list]
    return rec.record("batch_isend_irecv", payload, group, True, lambda: dist.batch_isend_irecv(p2p_op_list))


def barrier(group: ProcessGroup | None = None, async_op: bool = False, device_ids: list[int] | None = None):
    """Return once every rank of ``group`` has entered the barrier."""
    rec = _recorder()
    if rec is None:
        return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)
    return rec.record(
        "barrier", None, group, async_op, lambda: dist.barrier(group=group, async_op=async_op, device_ids=device_ids)
    )


def all_gather_object(object_list: list[Any], obj: Any, group: ProcessGroup | None = None) -> None:
    """``object_list[r]`` becomes rank r's (picklable) ``obj``, on every rank of ``group``."""
    rec = _recorder()
    if rec is None:
        return dist.all_gather_object(object_list, obj, group=group)
    return rec.record(
        "all_gather_object", None, group, False, lambda: dist.all_gather_object(object_list, obj, group=group)
    )


def broadcast_object_list(
    object_list: list[Any], src: int = 0, group: ProcessGroup | None = None, device: torch.device | None = None
) -> None:
    """``object_list`` becomes global rank ``src``'s list on every rank of ``group``."""
    rec = _recorder()
    if rec is None:
        return dist.broadcast_object_list(object_list, src=src, group=group, device=device)
    return rec.record(
        "broadcast_object_list", None, group, False,
        lambda: dist.broadcast_object_list(object_list, src=src, group=group, device=device),
    )  # fmt: skip


def gather_object(
    obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0, group: ProcessGroup | None = None
) -> None:
    """Global rank ``dst``'s ``object_gather_list[r]`` becomes rank r's ``obj``."""
    rec = _recorder()
    if rec is None:
        return dist.gather_object(obj, object_gather_list, dst=dst, group=group)
    return rec.record(
        "gather_object", None, group, False, lambda: dist.gather_object(obj, object_gather_list, dst=dst, group=group)
    )


# -- named ranges --------------------------------------------------------------------------------


def named_range(name: str, index: object = None) -> contextlib.AbstractContextManager:
    """A ``torch.profiler.record_function`` range ``"name index"`` (or ``name``) while a
    torch profiler runs; otherwise a shared no-op context, without building the name.

    ``record_function`` itself costs several microseconds even with no profiler running
    (it enters a torch op); checking torch's profiler flag first costs well under one.
    """
    if not getattr(_autograd_profiler, "_is_profiler_enabled", True):
        return _NOT_RECORDING
    return torch.profiler.record_function(name if index is None else f"{name} {index}")
