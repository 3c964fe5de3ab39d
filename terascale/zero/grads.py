"""Gradients of sharded groups: accumulate per group, reduce-scatter, keep this rank's shard.

[Note: sharded gradients]
A post-accumulate-grad hook adds each fresh ``param.grad`` into its slot of the group's
flat gradient buffer (padded like the parameter buffer) and frees ``param.grad`` at
once. When every trainable parameter of a group has reported in a synchronising
backward, the group's buffer is reduce-scattered asynchronously (overlapping the rest
of backward) in place: rank r's slice of the buffer then holds the sum over ranks of
slice r. Groups are launched strictly in descending group order on every rank, even if
they complete out of order, and on a separate process group from the parameter
all-gathers, so the collectives match across ranks whatever order hooks fire in.

Stage 1 keeps the full flat buffers for the whole accumulation window and reduces only
on the last micro-step; this rank's gradient shard is then a view of its own slice of
the buffer (no extra memory). Stages 2 and 3 reduce on every micro-step, add the
reduced slice into a separate shard-sized accumulator and drop the full buffer.
Buffers are never zeroed whole: a slot's first gradient is copied in and later ones
added, and only the padding and slots without a gradient are zeroed before a reduction.

A parameter that gets no gradient on a rank contributes zeros; one unused on every
rank gets a zero gradient (DeepSpeed's ZeRO semantics; stage 0 leaves it ``None``).

[Note: reduce what a backward touched]
At stages 2-3 a backward need not reduce every group: a pipeline stage with virtual
stages runs each chunk's backward separately, and reducing the other chunks' groups (as
zeros) would multiply the reduce traffic by the number of chunks. Which groups a
backward touched is known only locally, though, and a group may get gradients on one
rank and none on another (data-dependent branches), while every rank must launch the
same reductions in the same order. So each backward of a window reduces the groups of a
*plan* that all ranks share: ``plan[k]`` is the set of groups that some rank touched in
backward ``k`` of an earlier window (no plan yet, or more backwards than it has: every
group, as before). Skipping a group whose buffer holds gradients is always correct, it
only defers them: the buffer keeps accumulating, as at stage 1, until a later reduction.
At the window's last backward the ranks agree, with one all-reduce of a
``backwards x groups`` flag table, on what each backward touched anywhere; groups touched
after their last reduction, and groups never reduced in the window (their gradient is
zero), are reduced then, and the table becomes the next window's plan. When the last
backward reduces every group nothing can be left over, and a plan that exists is kept
without the all-reduce (plain data parallelism pays it once). A group's reduction that
the plan says is its last of the window passes ``last_micro_step`` to the gradient
swapper (its norm is taken then); a norm left stale by a plan that did not hold is
retaken at the window's end. Stage 1 reduces once per window and has nothing to skip.
A shard completed on the window's last backward is final (at stage 1 too, which reduces
then); where the optimizer steps under backward, or the host step's gradients go down
under it, a listener (:class:`FinalGradients`) is told of each one then, and reductions
already finished are completed at once rather than when the bucket overflows ([Note: the
optimizer step under backward], [Note: the host step's transfers]).

[Note: deferred reduction]
Two ways of training leave a window's reduction to its end, whatever the stage:
``engine.coalesce_grad_reduction()`` (DeepSpeed's: the backwards inside are one window,
reduced in one pass) and ``managed_gradient_accumulation: false`` (the caller's
``engine.step()`` ends the window). A *deferred* backward that does not end the window
reduces nothing, at stages 2-3 too: its gradients add into the full flat buffers, which
stay until the window's end, as at stage 1 (more memory for fewer collectives: the
user's choice). The window ends at a synchronising backward, which then reduces every
group rather than the plan's, or, when no backward of it synchronises, at
``finish_window()``, which reduces what is still unreduced: every group at stage 1 or
after a deferred backward; at stages 2-3 otherwise (unmanaged accumulation: each
backward reduced its groups as usual) only what ``_end_window`` finds left over. A
deferred window teaches the plan nothing. Every rank defers and finishes at the same
points, so the collectives still match.

Groups with row-sparse gradients reduce in two parts: [Note: sparse rows in a group] in
:mod:`terascale.zero.sparse_rows`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from terascale.comm import ops
from terascale.comm.collectives import reduce_scatter_flat
from terascale.comm.hierarchy import NodeGroups
from terascale.comm.quant import BlockQuant
from terascale.comm.quantized import quantized_nbytes_sent, reduce_scatter_quantized
from terascale.comm.sparse import CommStats, SparseGather, accumulate_sparse, all_gather_sparse
from terascale.offload.grads import GradSwapper
from terascale.zero.flat_group import FlatParamGroup
from terascale.zero.sparse_rows import SparseLayout


@dataclass(frozen=True)
class GradPolicy:
    """When and how group gradients are reduced (DeepSpeed's ``zero_optimization`` knobs)."""

    reduce_every_micro_step: bool  # stages 2-3; stage 1 reduces at the window's end only
    dtype: torch.dtype  # the flat buffers and shards accumulate in this dtype
    comm_dtype: torch.dtype | None = None  # None: reduce in ``dtype``
    bucket_numel: int = 500_000_000  # reduce_bucket_size: most elements in flight
    overlap: bool = True  # overlap_comm: False waits for each reduction at once
    reduce_scatter: bool = True  # False: all-reduce the buffer and keep the own slice
    prescale: bool = False
    predivide_factor: float = 1.0
    average: bool = True  # gradient_allreduce_op "mean"; False ("sum"): summed over the ranks, not divided
    sparse_gradients: bool = False  # the config's sparse_gradients; off: a sparse gradient is an error
    sparse_params: frozenset[str] = frozenset()  # names of parameters with row-sparse gradients


@dataclass(frozen=True)
class QuantizedReduce:
    """ZeRO++'s qgZ: the flat groups in ``groups`` are reduce-scattered over ``nodes`` with
    ``spec``'s codes ([Note: the hierarchical quantized reduce-scatter]) instead of the
    plain reduce-scatter (or all-reduce: ``reduce_scatter: false`` changes nothing here)."""

    nodes: NodeGroups
    spec: BlockQuant
    groups: frozenset[int]


class FinalGradients(Protocol):
    """Takes each group's gradient shard as it becomes final, on the window's last backward
    (the optimizer step under backward: ``terascale.zero.early_step``; the host step's
    gradients copied down ahead: ``terascale.offload.transfer.GradientsAhead``)."""

    def receive(self, g: int) -> torch.Tensor | None:
        """A tensor to receive group ``g``'s final shard if it is handed over instead of being
        swapped to disk ([Note: gradient swapping]), else None."""

    def final(self, g: int, shard: torch.Tensor) -> None:
        """Group ``g``'s gradient shard is final (summed over the window's backwards and the
        ranks, averaged): ``shard`` stays valid until the window's gradients are zeroed."""

    def poll(self) -> None:
        """A gradient arrived: a moment to make progress (called often in backward)."""


@dataclass
class _Pending:
    group: int
    work: dist.Work | None
    comm: torch.Tensor  # the buffer being reduced (the flat buffer, its comm-dtype copy, or the packed chunks)
    rows: list[tuple[int, SparseGather]] = field(default_factory=list)  # sparse slots' gathers


class ShardedGrads:
    """Reduces the gradients of ``groups`` over ``group`` into per-rank gradient shards.

    ``trainable[g][i]`` says whether parameter i of group g receives gradients.
    ``on_group_done(g)`` is called when every trainable parameter of group g has its
    gradient for the current backward (stage 3 frees the gathered parameters then).
    After :meth:`post_backward` of a synchronising backward, :attr:`shards` holds each
    group's summed-and-averaged gradient slice (or None for a group without trainables),
    unless a ``swapper`` keeps them on NVMe (see [Note: gradient swapping]).
    """

    def __init__(
        self,
        groups: Sequence[FlatParamGroup],
        trainable: Sequence[Sequence[bool]],
        group: ProcessGroup,
        policy: GradPolicy,
        on_group_done: Callable[[int], None] | None = None,
        swapper: GradSwapper | None = None,
        reduce_groups: Sequence[ProcessGroup] | None = None,
        quantized: QuantizedReduce | None = None,
        comm_dtypes: Sequence[torch.dtype | None] | None = None,
    ) -> None:
        """``comm_dtypes[g]``: the dtype group ``g`` is reduced in, over the policy's (None:
        the policy's ``comm_dtype``)."""
        assert swapper is None or policy.reduce_every_micro_step, "gradient swapping needs stage 2 or 3"
        self.quantized = quantized
        self._comm_dtypes = [
            (c if c is not None else policy.comm_dtype) for c in (comm_dtypes or [None] * len(groups))
        ]
        self.groups = list(groups)
        self.swapper = swapper  # stages 2-3 with the optimizer on NVMe: shards go to disk
        self.policy = policy
        self.pg = group
        # Gradients are averaged over ``group``; a group whose shards split over a subgroup
        # of it (an expert's: [Note: expert parameters]) is reduced over that subgroup.
        self.world = dist.get_world_size(group)
        self._divisor = self.world if policy.average else 1  # gradients are averaged over it
        self._pgs = list(reduce_groups) if reduce_groups is not None else [group] * len(self.groups)
        assert len(self._pgs) == len(self.groups)
        self._ranks = [dist.get_rank(pg) for pg in self._pgs]
        self._sizes = [dist.get_world_size(pg) for pg in self._pgs]
        self.blocked_s = 0.0  # waiting for reduce-scatters ([Note: straggler compute time])
        self._on_group_done = on_group_done
        # Set for a window whose optimizer steps under its last backward ([Note: the
        # optimizer step under backward]): told of each final shard, polled from the hooks.
        self.listener: FinalGradients | None = None
        self._expected = [sum(t) for t in trainable]
        # Backward runs roughly last group to first: launch in that order. At stage 3 the
        # persistent group gathers small parameters from the whole model (norms, biases of
        # every block), so its last gradient arrives near the end of backward: it goes
        # last, or launching in order would wait for it and hold every block's gradient
        # until then. (At stages 1-2 every group is persistent: the stable sort keeps the order.)
        backward = [g for g in reversed(range(len(self.groups))) if self._expected[g] > 0]
        self._order = sorted(backward, key=lambda g: self.groups[g].persistent)
        self._flat: list[torch.Tensor | None] = [None] * len(self.groups)
        self._spare: list[torch.Tensor] = []  # reduced full buffers kept for reuse (stages 2-3)
        self._shard_store: list[torch.Tensor | None] = [None] * len(self.groups)
        # Which slots of each flat buffer hold a gradient since the buffer was (re)started.
        self._written = [[False] * len(fg.params) for fg in self.groups]
        self.shards: list[torch.Tensor | None] = [None] * len(self.groups)
        self._count = [0] * len(self.groups)
        self._done = [False] * len(self.groups)
        self._next = 0
        self._sync = True
        self._window_end = True
        self._pending: list[_Pending] = []
        # [Note: reduce what a backward touched]: the shared plan, this window's backwards
        # so far as (groups touched on this rank, groups reduced), the groups the current
        # backward reduces (in launch order) and the groups whose swapped norm is stale.
        self._plan: list[frozenset[int]] = []
        self._window: list[tuple[list[bool], frozenset[int]]] = []
        self._scope: list[int] = self._order
        self._stale_norms: set[int] = set()
        self._deferred = False  # a backward of this window deferred its reduction ([Note: deferred reduction])
        self.comm = CommStats()  # bytes this rank sends reducing gradients (for benchmarks)
        # Groups with row-sparse slots (see [Note: sparse rows in a group]); fixed by the
        # names in the policy, so every rank reduces the same groups the same way.
        self._sparse: list[SparseLayout | None] = []
        for fg, flags in zip(self.groups, trainable):
            sparse = [t and policy.sparse_gradients and n in policy.sparse_params for n, t in zip(fg.names, flags)]
            self._sparse.append(SparseLayout.build(fg, sparse) if any(sparse) else None)
        self._rows: list[dict[int, torch.Tensor]] = [{} for _ in self.groups]  # slot -> accumulated rows
        self._handles = []
        for g, (fg, flags) in enumerate(zip(self.groups, trainable)):
            for i, (p, t) in enumerate(zip(fg.params, flags)):
                if t:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._hook(g, i)))

    # -- backward --------------------------------------------------------------------------

    def prepare_backward(self, sync: bool, defer: bool = False) -> None:
        """Start a backward; ``sync`` marks the last micro-step of an accumulation window.
        At stages 2-3 the backward reduces the groups that the plan gives its place in the
        window (see [Note: reduce what a backward touched]); a ``defer``-red one reduces
        nothing unless it ends the window (see [Note: deferred reduction])."""
        self._deferred = self._deferred or defer
        self._sync = sync or (self.policy.reduce_every_micro_step and not defer)
        self._window_end = sync
        self._start_scope(full=self._deferred)

    def _start_scope(self, full: bool) -> None:
        self._count = [0] * len(self.groups)
        self._done = [False] * len(self.groups)
        self._next = 0
        k = len(self._window)
        if self.policy.reduce_every_micro_step and k < len(self._plan) and not full:
            self._scope = [g for g in self._order if g in self._plan[k]]
        else:
            self._scope = self._order

    def finish_window(self) -> None:
        """End the window without a backward: reduce what its backwards left unreduced
        (see [Note: deferred reduction]). Collective: every rank calls it at the same point."""
        self._sync = self._window_end = True
        # Stage 1 and a window with deferred backwards reduce every group now; at stages 2-3
        # the backwards reduced their groups already, and _end_window reduces the rest.
        full = not self.policy.reduce_every_micro_step or self._deferred or not self._window
        self._start_scope(full=True)
        if not full:
            self._scope = []
        self._reduce_rest_of_scope()
        if not self.policy.reduce_every_micro_step:
            self._deferred = False
            return
        self._window.append(([False] * len(self.groups), frozenset(self._scope)))
        self._end_window()

    def _hook(self, g: int, i: int) -> Callable[[nn.Parameter], None]:
        slot = self.groups[g].layout.slots[i]
        sparse = self._sparse[g]
        as_rows = sparse is not None and i in sparse.sparse  # a sparse embedding's weight
        offset = slot.offset if sparse is None else sparse.offsets[i]

        @torch.no_grad()
        def hook(p: nn.Parameter) -> None:
            if p.grad is None:
                return
            if p.grad.is_sparse and not self.policy.sparse_gradients:
                raise ValueError(
                    f"parameter '{self.groups[g].names[i]}' produced a sparse gradient; ZeRO stages 1-3 "
                    'reduce sparse gradients only with "sparse_gradients": true in the config (or use a '
                    "dense embedding)"
                )
            if self._count[g] >= self._expected[g]:
                raise RuntimeError(
                    f"parameter '{self.groups[g].names[i]}' received a second gradient in one "
                    "backward (reentrant activation checkpointing or two backward calls per "
                    "micro-step); use torch.utils.checkpoint(..., use_reentrant=False) or sum the "
                    "losses before engine.backward"
                )
            if as_rows:  # kept as coalesced rows until the group's reduction
                self._rows[g][i] = accumulate_sparse(self._rows[g].get(i), p.grad, self.policy.dtype)
            elif p.grad.is_sparse:  # not a known sparse embedding: its rows go into the dense slot
                dst = self._buffer(g)[offset : offset + slot.numel]
                if not self._written[g][i]:
                    dst.zero_()
                    self._written[g][i] = True
                dst.view(slot.shape).add_(p.grad.to(dst.dtype))
            else:
                dst = self._buffer(g)[offset : offset + slot.numel]
                if self._written[g][i]:
                    dst.add_(p.grad.reshape(-1))
                else:  # the buffer is not zeroed in advance (see _fill_unwritten)
                    dst.copy_(p.grad.reshape(-1))
                    self._written[g][i] = True
            p.grad = None
            self._count[g] += 1
            if self._count[g] == self._expected[g]:
                self._done[g] = True
                if self._sync:
                    self._launch_ready()
                if self._on_group_done is not None:
                    self._on_group_done(g)
            if self.listener is not None:
                self.listener.poll()

        return hook

    def _buffer(self, g: int) -> torch.Tensor:
        if self._flat[g] is None:
            sparse = self._sparse[g]
            numel = self.groups[g].layout.padded_numel if sparse is None else sparse.numel
            spare = next((i for i, t in enumerate(self._spare) if t.numel() == numel), None)
            if spare is None:
                self._flat[g] = torch.empty(numel, dtype=self.policy.dtype, device=self.groups[g].device)
            else:
                self._flat[g] = self._spare.pop(spare)
            self._written[g] = [False] * len(self._written[g])
        return self._flat[g]

    @torch.no_grad()
    def _fill_unwritten(self, g: int) -> None:
        """Zero what no gradient was written to since the buffer was (re)started: the
        padding and the slots of parameters without a gradient. Buffers are never zeroed
        whole: the first gradient of each slot is copied in, later ones added."""
        flat, layout, sparse = self._buffer(g), self.groups[g].layout, self._sparse[g]
        if sparse is None:
            flat[layout.numel :].zero_()
        for i, (slot, written) in enumerate(zip(layout.slots, self._written[g])):
            offset = slot.offset if sparse is None else sparse.offsets[i]
            if not written and offset >= 0:  # sparse slots (offset -1) have no place here
                flat[offset : offset + slot.numel].zero_()
                self._written[g][i] = True

    def _launch_ready(self) -> None:
        while self._next < len(self._scope) and self._done[self._scope[self._next]]:
            self._launch(self._scope[self._next])
            self._next += 1

    def _launch(self, g: int) -> None:
        self._fill_unwritten(g)
        flat = self._buffer(g)
        pol = self.policy
        sparse = self._sparse[g]
        if sparse is None:
            comm_dtype = self._comm_dtypes[g]
            comm = flat if comm_dtype in (None, flat.dtype) else flat.to(comm_dtype)
            lo, hi = self.groups[g].layout.shard_range(self._ranks[g])
        else:
            comm = self._sparse[g].pack(flat, self._sizes[g], self._comm_dtypes[g] or flat.dtype)
            lo, hi = self._ranks[g] * sparse.chunk, (self._ranks[g] + 1) * sparse.chunk
        pre = 1.0 / self._divisor if pol.prescale else 1.0 / pol.predivide_factor
        if pre != 1.0:
            comm.mul_(pre)
        size, pg = self._sizes[g], self._pgs[g]
        quantized = self.quantized
        if size == 1 or comm.numel() == 0:
            work = None
        elif quantized is not None and g in quantized.groups and sparse is None:
            with ops.named_range("terascale::reduce_scatter group (quantized)", g):
                work = reduce_scatter_quantized(comm[lo:hi], comm, quantized.nodes, quantized.spec, async_op=True)
            self.comm.sent(sum(quantized_nbytes_sent(quantized.spec, hi - lo, quantized.nodes, comm.element_size())))
        elif pol.reduce_scatter:
            with ops.named_range("terascale::reduce_scatter group", g):
                work = reduce_scatter_flat(comm[lo:hi], comm, pg, async_op=True)
            self.comm.reduce_scatter(comm, size)
        else:
            with ops.named_range("terascale::all_reduce group", g):
                work = ops.all_reduce(comm, group=pg, async_op=True)
            self.comm.all_reduce(comm, size)
        rows = [] if sparse is None else [(i, self._gather_rows(g, i, pre)) for i in sparse.sparse]
        self._pending.append(_Pending(g, work, comm, rows))
        in_flight = sum(item.comm.numel() for item in self._pending)
        while self._pending and (not pol.overlap or (in_flight > pol.bucket_numel and len(self._pending) > 1)):
            in_flight -= self._pending[0].comm.numel()
            self._complete(self._pending.pop(0))
        if self.listener is not None and self._window_end:
            # A listener steps a group's runs once its gradient is final: finish reductions
            # that are done already (in order) rather than when the bucket overflows.
            while self._pending and not self._pending[0].rows and _finished(self._pending[0].work):
                self._complete(self._pending.pop(0))

    def _gather_rows(self, g: int, i: int, pre: float) -> SparseGather:
        """Start all-gathering slot ``i``'s accumulated rows (scaled by ``pre``) of group ``g``."""
        rows = self._rows[g].pop(i, None)
        if rows is not None and pre != 1.0:
            rows = rows * pre
        fg = self.groups[g]
        return all_gather_sparse(
            rows, fg.layout.slots[i].shape[1:], self._pgs[g], dtype=self._comm_dtypes[g] or self.policy.dtype,
            device=fg.device, stats=self.comm,
        )  # fmt: skip

    @torch.no_grad()
    def _complete_sparse(self, item: _Pending) -> None:
        """Finish sparse group ``item.group``: this rank's dense chunk and the gathered rows
        inside its shard range, averaged, go into its gradient shard (added to it at stages
        2-3 after the first micro-step; built fresh otherwise)."""
        g, pol = item.group, self.policy
        sparse = self._sparse[g]
        assert sparse is not None
        layout = self.groups[g].layout
        lo, hi = layout.shard_range(self._ranks[g])
        post = 1.0 if pol.prescale else pol.predivide_factor / self._divisor
        accumulate = pol.reduce_every_micro_step and self.swapper is None and self.shards[g] is not None
        if accumulate:
            out = self.shards[g]
        else:
            if self.swapper is not None:
                out = torch.zeros(hi - lo, dtype=pol.dtype, device=self.groups[g].device)
            else:
                out = self._shard_storage(g).zero_()
        sparse.add_to_shard(out, item.comm, layout, self._ranks[g], item.rows, post)
        if self.swapper is not None:  # [Note: gradient swapping]
            self._store(g, out)
        else:
            self.shards[g] = out
            self._hand_over(g)
        if pol.reduce_every_micro_step:
            self._retire(g)

    @torch.no_grad()
    def _complete(self, item: _Pending) -> None:
        if item.work is not None:
            started = time.perf_counter()
            with ops.named_range("terascale::reduce wait group", item.group):
                item.work.wait()
            self.blocked_s += time.perf_counter() - started
        if self._sparse[item.group] is not None:
            self._complete_sparse(item)
            return
        g = item.group
        lo, hi = self.groups[g].layout.shard_range(self._ranks[g])
        reduced = item.comm[lo:hi]
        pol = self.policy
        post = 1.0 if pol.prescale else pol.predivide_factor / self._divisor
        if post != 1.0:
            reduced.mul_(post)
        flat = self._flat[g]
        if self.swapper is not None:  # [Note: gradient swapping]
            self._store(g, reduced)
            self._retire(g)
            return
        if not pol.reduce_every_micro_step:
            # Stage 1: the shard is this rank's slice of the persistent full buffer.
            if reduced.data_ptr() != flat[lo:hi].data_ptr():
                flat[lo:hi].copy_(reduced)
            self.shards[g] = flat[lo:hi]
            self._hand_over(g)
            return
        if self.shards[g] is None:
            self.shards[g] = self._shard_storage(g)
            self.shards[g].copy_(reduced)
        else:
            self.shards[g].add_(reduced)
        self._retire(g)
        self._hand_over(g)

    def _hand_over(self, g: int) -> None:
        """On the window's last backward, tell the listener group ``g``'s in-memory shard is final."""
        if self.listener is not None and self._window_end:
            self.listener.final(g, self.shards[g])

    def _store(self, g: int, reduced: torch.Tensor) -> None:
        """Hand group ``g``'s reduced shard to the swapper, saying whether the plan makes
        this its last reduction of the window ([Note: reduce what a backward touched])."""
        assert self.swapper is not None
        out = self.listener.receive(g) if self._window_end and self.listener is not None else None
        if out is not None:  # stepped under this backward: the final shard goes to the optimizer, not to disk
            self.listener.final(g, self.swapper.final(g, reduced, out))
            self._stale_norms.discard(g)
            return
        k = len(self._window)  # this backward's index in the window
        last = self._window_end or (k < len(self._plan) and not any(g in later for later in self._plan[k + 1 :]))
        self.swapper.store(g, reduced, last_micro_step=last)
        if last:
            self._stale_norms.discard(g)
        else:
            self._stale_norms.add(g)

    def _shard_storage(self, g: int) -> torch.Tensor:
        """Group ``g``'s gradient-shard storage, kept across windows (it is model state: 2Ψ/N bytes)."""
        if self._shard_store[g] is None:
            lo, hi = self.groups[g].layout.shard_range(self._ranks[g])
            self._shard_store[g] = torch.empty(hi - lo, dtype=self.policy.dtype, device=self.groups[g].device)
        return self._shard_store[g]

    def _retire(self, g: int) -> None:
        # Stages 2-3: keep the reduced full buffer for the next group of the same size
        # (transformer blocks all match), so backward reuses a few buffers instead of
        # allocating and faulting in fresh memory for every group on every micro-step.
        # Two suffice (one accumulating while one is reduced); older ones are dropped.
        if self._flat[g] is not None:
            self._spare = [*self._spare[-1:], self._flat[g]]
            self._flat[g] = None

    def post_backward(self) -> None:
        """End a backward: on a synchronising one, reduce every group of its scope left
        and wait for all; at stages 2-3 the window's last one also reduces what earlier
        backwards left (see [Note: reduce what a backward touched]).

        Groups of the scope whose parameters did not all get gradients (unused on this
        rank) are reduced here, so every rank takes part in every group's collective.
        """
        if not self._sync:
            return
        self._reduce_rest_of_scope()
        if not self.policy.reduce_every_micro_step:
            self._deferred = False
            return  # stage 1: the window's end, every group reduced
        self._window.append(([c > 0 for c in self._count], frozenset(self._scope)))
        if self._window_end:
            self._end_window()

    def _reduce_rest_of_scope(self) -> None:
        for g in self._scope:
            self._done[g] = True
        self._launch_ready()
        while self._pending:
            self._complete(self._pending.pop(0))

    def _end_window(self) -> None:
        """After the window's last backward (stages 2-3): reduce the groups earlier
        backwards left unreduced, learn the next plan, retake stale swapped norms."""
        if not (self._plan and len(self._scope) == len(self._order)):
            touched = self._touched_anywhere()
            self._scope, self._next = [g for g in self._order if self._left_over(g, touched)], 0
            self._reduce_rest_of_scope()
            if not self._deferred:  # a deferred window's backwards say nothing of the usual windows'
                self._plan = [frozenset(g for g in self._order if row[g]) for row in touched]
        self._window = []
        self._deferred = False
        assert all(flat is None for flat in self._flat), "a group's gradients were left unreduced"
        for g in sorted(self._stale_norms):
            assert self.swapper is not None
            self.swapper.update(g, lambda shard: None)  # only retakes the norm
        self._stale_norms.clear()

    def _touched_anywhere(self) -> list[list[bool]]:
        """Per backward of this window, per group: whether some rank of the group gave it
        gradients (one all-reduce of the flags)."""
        flags = torch.tensor([row for row, _ in self._window], dtype=torch.int32)
        if self.world > 1 and self.groups:
            flags = flags.to(self.groups[0].device)
            ops.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.pg)
        return (flags > 0).tolist()

    def _left_over(self, g: int, touched: list[list[bool]]) -> bool:
        """Whether group ``g`` was never reduced in the window or touched after its last
        reduction (``touched``: agreed by every rank, so every rank decides alike)."""
        reduced = [k for k, (_, scope) in enumerate(self._window) if g in scope]
        last_touch = max((k for k, row in enumerate(touched) if row[g]), default=-1)
        return not reduced or last_touch > reduced[-1]

    def zero_(self) -> None:
        """Forget the gradients of the finished window."""
        for g in range(len(self.groups)):
            if self.policy.reduce_every_micro_step:
                self._retire(g)
            self._written[g] = [False] * len(self._written[g])  # stage 1: overwrite next window
            self._rows[g] = {}
            self.shards[g] = None
        self._window = []  # a window dropped half-way starts again at its first backward
        self._deferred = False
        self._stale_norms.clear()
        if self.swapper is not None:
            self.swapper.zero_()

    def remove_hooks(self) -> None:
        if self.swapper is not None:
            self.swapper.close()
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def scope(self) -> list[int]:
        """The groups the current backward reduces, in launch order (the order their
        reductions complete in: [Note: reduce what a backward touched])."""
        return list(self._scope)

    # -- accounting ----------------------------------------------------------------------------

    def exchange_shards(self, storage: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None] | None:
        """Hand over the finished window's gradient shards and take ``storage`` (shards an
        earlier exchange handed over, or None each) as the next window's: no copy. Stages
        2-3 with the shards in memory only (stage 1's are views of the full buffers, which
        the next window fills again); None where this does not hold."""
        if not self.policy.reduce_every_micro_step or self.swapper is not None:
            return None
        if any(t is not None and t is not self._shard_store[g] for g, t in enumerate(self.shards)):
            return None
        out = list(self.shards)
        for g, t in enumerate(out):
            if t is not None:
                self._shard_store[g] = storage[g]
        return out

    def exchange_swapper(self, other: GradSwapper) -> GradSwapper:
        """Hand over the swap files of the finished window's shards and take ``other``'s
        (which an earlier exchange handed over) for the next window's."""
        assert self.swapper is not None
        out, self.swapper = self.swapper, other
        return out

    def spare_nbytes(self) -> int:
        """Bytes of full buffers kept for reuse between reductions (a working set, not state)."""
        return sum(t.numel() * t.element_size() for t in self._spare)

    def nbytes(self) -> int:
        """Bytes of gradient storage this rank holds right now (buffers and shards)."""
        seen: set[int] = set()
        total = 0
        for t in [*self._flat, *self.shards, *self._shard_store]:
            if t is not None and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
        return total


def _finished(work: object) -> bool:
    """Whether a reduction in flight has finished (None: nothing was sent)."""
    if work is None:
        return True
    is_completed = getattr(work, "is_completed", None)
    return bool(is_completed()) if is_completed is not None else False
