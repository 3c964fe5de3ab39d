"""Gradient buckets: average gradients over the data-parallel group during backward.

[Note: gradient buckets]
Every trainable parameter owns a slice of one flat accumulation buffer (``accum_dtype``,
fp32 by default, so bf16/fp16 micro-step gradients accumulate without rounding). The
buffer is cut into buckets of about ``bucket_numel`` elements, in reverse parameter
order because backward visits parameters roughly last-to-first. A post-accumulate-grad
hook adds each fresh ``param.grad`` into its slice and frees ``param.grad`` at once, so
low-precision gradients never pile up across micro-steps.

On a synchronising micro-step (the last one of an accumulation window) a bucket is
all-reduced asynchronously as soon as all of its parameters have reported, overlapping
the rest of backward. Buckets are launched strictly in index order on every rank, even
if they fill out of order, so the collectives always match across ranks. Each bucket
ends with one "used" flag per parameter that is summed with the gradients: a parameter
that received no gradient on any rank (e.g. a branch not taken this step) gets ``None``
instead of a zero gradient, exactly as in single-process PyTorch, and costs no extra
collective.

With ``sparse_gradients`` on, the parameters named in ``ReducePolicy.sparse_params``
(sparse embeddings, see [Note: sparse gradients] in :mod:`terascale.comm.sparse`) are in
no bucket: their sparse micro-step gradients accumulate as coalesced rows, and
:meth:`GradientBuckets.finish` all-gathers every rank's rows (after launching the
buckets, in parameter order on every rank), sums them and adds them into the parameter's
slot of the flat buffer, which is zero until then. The optimizer therefore steps the same
dense averaged gradient as with a dense embedding: plain PyTorch's result for every
optimizer (SGD also matches a sparse embedding in plain PyTorch; Adam cannot step sparse
gradients there). Only the communication is sparse. Without ``sparse_gradients`` a
sparse gradient is added into its dense slot and all-reduced like any other.

[Note: windows without a reduction]
An optimizer that communicates on its own (the 1-bit optimizers of
:mod:`terascale.optim.onebit`, after their warm-up) wants each rank's own gradient: for
such a window ``prepare_backward(sync, reduce=False)`` launches nothing, and
:meth:`GradientBuckets.finish` leaves the flat buffer as this rank accumulated it (summed
over the window's micro-steps, not averaged), with sparse rows added into their slots.
The used-flags are then this rank's alone: a parameter this rank gave no gradient has
None where another rank may have one, which is why such an optimizer steps every
parameter alike (see ``[Note: optimizers that reduce their own gradients]``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from terascale.comm import ops
from terascale.comm.sparse import CommStats, SparseGather, accumulate_sparse, all_gather_sparse, coalesce_rows


@dataclass(frozen=True)
class ReducePolicy:
    """How gradients are accumulated and averaged (DeepSpeed's knobs)."""

    bucket_numel: int = 500_000_000  # DeepSpeed's reduce_bucket_size default
    accum_dtype: torch.dtype = torch.float32
    comm_dtype: torch.dtype | None = None  # None: communicate in accum_dtype
    prescale: bool = False  # divide by the world size before the all-reduce
    predivide_factor: float = 1.0  # with prescale off: divide by this before, by world/this after
    average: bool = True  # gradient_allreduce_op "mean"; False ("sum"): summed over the ranks, not divided
    sparse_gradients: bool = False  # the config's sparse_gradients: reduce sparse_params as rows
    sparse_params: frozenset[str] = frozenset()  # names of parameters with row-sparse gradients


@dataclass
class _Bucket:
    param_indices: list[int]
    flat: torch.Tensor  # [grads of its params..., one used-flag per param]
    grad_numel: int
    pending: int = 0
    launched: bool = False
    work: dist.Work | None = None
    comm_buffer: torch.Tensor | None = None
    ready: bool = field(default=False)


class GradientBuckets:
    """Accumulates ``params``' gradients into flat buckets and averages them over ``group``.

    After :meth:`finish`, :meth:`grad` returns each parameter's gradient averaged over the
    ranks of ``group`` (summed over micro-steps), a view into the flat buffer.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        group: ProcessGroup,
        policy: ReducePolicy,
        device: torch.device,
        average_over: int | None = None,
        stats: CommStats | None = None,
    ) -> None:
        assert len(params) == len(names)
        self._params = list(params)
        self._names = list(names)
        self._group = group
        self._world = dist.get_world_size(group)
        # Summed over ``group``, averaged over ``average_over`` ranks (default: the group's);
        # experts' gradients are summed over a subgroup and averaged over the whole
        # data-parallel world ([Note: expert parameters]).
        # With ``policy.average`` off (gradient_allreduce_op "sum") nothing is divided.
        self._divisor = (average_over or self._world) if policy.average else 1
        self._policy = policy
        self._sync = True
        self._reduce = True
        self.blocked_s = 0.0  # waiting for all-reduces ([Note: straggler compute time])
        # Bytes this rank sends reducing gradients (for benchmarks); ``stats`` lets several
        # buckets' owners count into one record.
        self.comm = stats if stats is not None else CommStats()
        # Sparse parameters are reduced as rows in finish(), outside every bucket.
        self._sparse = [policy.sparse_gradients and n in policy.sparse_params for n in self._names]
        self._sparse_acc: list[torch.Tensor | None] = [None] * len(self._params)

        # Assign parameters (last first) to buckets, then lay buckets out contiguously.
        layout: list[list[int]] = []
        numel = 0
        for i in reversed(range(len(self._params))):
            if self._sparse[i]:
                continue
            n = self._params[i].numel()
            if layout and numel + n <= policy.bucket_numel:
                layout[-1].append(i)
                numel += n
            else:
                layout.append([i])
                numel = n
        total = sum(p.numel() for p in self._params) + len(self._params)
        self._buffer = torch.zeros(total, dtype=policy.accum_dtype, device=device)
        self._grads: list[torch.Tensor] = [torch.empty(0)] * len(self._params)
        self._flags: list[torch.Tensor] = [torch.empty(0)] * len(self._params)
        self._bucket_of: list[int] = [0] * len(self._params)
        self._buckets: list[_Bucket] = []
        offset = 0
        for b, indices in enumerate(layout):
            grad_numel = sum(self._params[i].numel() for i in indices)
            flat = self._buffer[offset : offset + grad_numel + len(indices)]
            offset += flat.numel()
            pos = 0
            for k, i in enumerate(indices):
                n = self._params[i].numel()
                self._grads[i] = flat[pos : pos + n].view(self._params[i].shape)
                self._flags[i] = flat[grad_numel + k : grad_numel + k + 1]
                self._bucket_of[i] = b
                pos += n
            self._buckets.append(_Bucket(indices, flat, grad_numel, pending=len(indices)))
        # Sparse parameters' dense gradients follow the buckets, each with its used-flag.
        for i in (i for i, sparse in enumerate(self._sparse) if sparse):
            n = self._params[i].numel()
            self._grads[i] = self._buffer[offset : offset + n].view(self._params[i].shape)
            self._flags[i] = self._buffer[offset + n : offset + n + 1]
            self._bucket_of[i] = -1
            offset += n + 1
        assert offset == total
        self._next_launch = 0
        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self._params)
        ]

    # -- micro-step protocol -------------------------------------------------------------

    def prepare_backward(self, sync: bool, reduce: bool = True) -> None:
        """Declare whether the coming backward ends an accumulation window (and so reduces),
        and whether this window's gradients are reduced at all: with ``reduce`` False they
        stay this rank's own ([Note: windows without a reduction]). Every backward of a
        window passes the same ``reduce``."""
        self._sync = sync
        self._reduce = reduce

    def finish(self) -> None:
        """Reduce what is still unreduced, wait for every bucket and average the gradients.

        Called at the accumulation boundary. Buckets whose parameters did not all receive
        gradients (unused parameters) are launched here, still in index order; then the
        sparse parameters' rows are gathered, in parameter order (the same on every rank).
        In a window without a reduction the gradients are left as this rank summed them.
        """
        if not self._reduce:
            self._finish_locally()
            return
        for bucket in self._buckets:
            bucket.ready = True
        self._launch_ready()
        gathers = [(i, self._launch_sparse(i)) for i, sparse in enumerate(self._sparse) if sparse]
        for bucket in self._buckets:
            self._complete(bucket)
        for i, gather in gathers:
            self._complete_sparse(i, gather)

    def grad(self, index: int) -> torch.Tensor | None:
        """Parameter ``index``'s averaged gradient, or None if no rank produced one."""
        return self._grads[index] if self._flags[index].item() > 0 else None

    def grads(self) -> list[torch.Tensor | None]:
        """All averaged gradients (see :meth:`grad`), read with one device-to-host copy."""
        used = torch.cat(self._flags).cpu().tolist() if self._flags else []
        return [g if u > 0 else None for g, u in zip(self._grads, used)]

    def zero_(self) -> None:
        """Start a new accumulation window."""
        self._buffer.zero_()
        self._sparse_acc = [None] * len(self._params)
        for bucket in self._buckets:
            bucket.pending = len(bucket.param_indices)
            bucket.launched = bucket.ready = False
            bucket.work = bucket.comm_buffer = None
        self._next_launch = 0

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def buffer(self) -> torch.Tensor:
        return self._buffer

    # -- internals -------------------------------------------------------------------------

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            self._accumulate(index, param)

        return hook

    def _accumulate(self, index: int, param: torch.Tensor) -> None:
        grad = param.grad
        assert grad is not None
        if self._sparse[index]:
            # Kept as rows until finish(); a dense gradient here keeps its non-zero rows.
            self._sparse_acc[index] = accumulate_sparse(self._sparse_acc[index], grad, self._policy.accum_dtype)
            param.grad = None
            return
        if grad.is_sparse:
            # Not reduced as rows (sparse_gradients off, or an unexpected source): the
            # rows are added into the dense slot and all-reduced with the bucket.
            grad = grad.to(self._policy.accum_dtype)
        bucket = self._buckets[self._bucket_of[index]]
        if bucket.launched:
            raise RuntimeError(
                f"parameter '{self._names[index]}' received a gradient after its bucket was "
                "already reduced in this backward. This happens when backward runs through the "
                "same parameter twice (e.g. reentrant activation checkpointing or two backward "
                "calls in one micro-step); use torch.utils.checkpoint(..., use_reentrant=False) "
                "or sum the losses before calling engine.backward."
            )
        with torch.no_grad():
            self._grads[index].add_(grad)
            self._flags[index].fill_(1)
        param.grad = None
        if self._sync and self._reduce:
            bucket.pending -= 1
            if bucket.pending == 0:
                bucket.ready = True
                self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].ready:
            self._launch(self._buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        policy = self._policy
        grads = bucket.flat[: bucket.grad_numel]
        if self._divisor > 1:
            if policy.prescale:
                grads.mul_(1.0 / self._divisor)
            elif policy.predivide_factor != 1.0:
                grads.mul_(1.0 / policy.predivide_factor)
        tensor = bucket.flat
        if policy.comm_dtype is not None and policy.comm_dtype != tensor.dtype:
            bucket.comm_buffer = tensor = tensor.to(policy.comm_dtype)
        bucket.launched = True
        if self._world > 1:
            with ops.named_range("terascale::all_reduce bucket", self._next_launch):
                bucket.work = ops.all_reduce(tensor, group=self._group, async_op=True)
            self.comm.all_reduce(tensor, self._world)

    @torch.no_grad()
    def _finish_locally(self) -> None:
        """End a window without a reduction: sparse rows go into their dense slots; the
        used-flags say which parameters this rank gave a gradient."""
        for i, sparse in enumerate(self._sparse):
            rows, self._sparse_acc[i] = self._sparse_acc[i], None
            if sparse and rows is not None:
                self._grads[i].index_add_(0, rows.indices()[0], rows.values().to(self._policy.accum_dtype))
                self._flags[i].fill_(1)
        for bucket in self._buckets:
            bucket.launched = True  # nothing to send: a gradient arriving now is an error as in any window

    def _launch_sparse(self, index: int) -> SparseGather:
        """Start gathering parameter ``index``'s accumulated rows from every rank, prescaled
        like a bucket, in the communication dtype."""
        policy = self._policy
        rows, self._sparse_acc[index] = self._sparse_acc[index], None
        if rows is not None and self._divisor > 1:
            pre = 1.0 / self._divisor if policy.prescale else 1.0 / policy.predivide_factor
            if pre != 1.0:
                rows = rows * pre
        shape = self._params[index].shape
        return all_gather_sparse(
            rows, shape[1:], self._group, dtype=policy.comm_dtype or policy.accum_dtype,
            device=self._buffer.device, stats=self.comm,
        )  # fmt: skip

    @torch.no_grad()
    def _complete_sparse(self, index: int, gather: SparseGather) -> None:
        """Sum every rank's rows (in ``accum_dtype``), average them like a bucket and add
        them into the parameter's dense slot (zero until now)."""
        indices, values = gather.wait()
        policy = self._policy
        grad = self._grads[index]
        indices, values = coalesce_rows(indices, values.to(policy.accum_dtype), grad.shape[0])
        if self._divisor > 1 and not policy.prescale:
            post = policy.predivide_factor / self._divisor
            if post != 1.0:
                values = values * post
        grad.index_add_(0, indices, values)
        self._flags[index].fill_(1.0 if gather.used else 0.0)

    def _complete(self, bucket: _Bucket) -> None:
        assert bucket.launched
        if bucket.work is not None:
            started = time.perf_counter()
            bucket.work.wait()
            self.blocked_s += time.perf_counter() - started
            bucket.work = None
        if bucket.comm_buffer is not None:
            bucket.flat.copy_(bucket.comm_buffer)
            bucket.comm_buffer = None
        policy = self._policy
        if self._divisor > 1 and not policy.prescale:
            post = policy.predivide_factor / self._divisor
            if post != 1.0:
                bucket.flat[: bucket.grad_numel].mul_(post)
