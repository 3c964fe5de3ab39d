"""The sharded model state as checkpoint spans (see ``[Note: logical checkpoints]``).

A rank's state at stages 1-3 is its shard of every group: frozen parameter parts (kept
in the compute dtype, there is no master) and master pieces with their optimizer state.
:func:`sharded_slices` maps both to spans of named parameters through the group's flat
layout, one chunk at a time: a group's frozen parts, then each optimizer run (swapped in
from NVMe where it lives there, so one run is in memory at a time).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Sequence
from typing import Protocol

import torch

from terascale.checkpoint.spans import (
    GRAD,
    MASTER,
    PARAM,
    OptimKey,
    Slice,
    SliceMode,
    Span,
    create_optimizer_state,
    optimizer_slices,
    optimizer_state_view,
    settle_loaded_state,
)
from terascale.offload.optimizer import MASTER_KEY, OptimizerSwapper
from terascale.offload.params import OffloadedParams
from terascale.zero.flat_group import FlatParamGroup
from terascale.zero.grads import ShardedGrads
from terascale.zero.masters import Piece, ShardedMasters
from terascale.zero.wrap import GroupPlan


class ShardedParts(Protocol):
    """What :func:`sharded_slices` reads of a sharded model state
    (:class:`terascale.zero.ShardedState`): its groups with their plans, the fp32 master
    pieces, the optimizer's swap files and the parameter shards' tier, if any."""

    plans: Sequence[GroupPlan]
    groups: Sequence[FlatParamGroup]
    masters: ShardedMasters
    swapper: OptimizerSwapper | None
    params: OffloadedParams | None

    def shards_resident(self, groups: list[int], write_back: bool) -> contextlib.AbstractContextManager: ...


def piece_spans(fg: FlatParamGroup, piece: Piece) -> list[tuple[str, int, int, int]]:
    """``(name, start, end, offset)`` for each parameter part in ``piece``: elements
    ``[start, end)`` of parameter ``name`` sit at ``offset`` of the piece's master."""
    out = []
    for f in fg.layout.fragments(fg.rank):
        a, b = max(piece.lo, f.shard_offset), min(piece.hi, f.shard_offset + f.numel)
        if a < b:
            start = f.start + a - f.shard_offset
            out.append((fg.layout.slots[f.slot].name, start, start + b - a, a - piece.lo))
    return out


def sharded_slices(
    st: ShardedParts,
    optimizer: torch.optim.Optimizer,
    mode: SliceMode,
    optim_keys: dict[str, OptimKey] | None = None,
    state_dtype: torch.dtype = torch.float32,
) -> Iterator[list[Slice]]:
    """This rank's spans of ``st`` chunk by chunk (see :class:`SliceMode`).

    With LOAD, optimizer state entries ``optim_keys`` are created where missing (None:
    no optimizer state is loaded; floating ones in ``state_dtype``), each chunk goes back to its tier once the consumer
    moves on, and the loaded masters are written into the parameter shards and the
    persistent groups all-gathered when the iteration ends.
    """
    load = mode is SliceMode.LOAD
    describe = mode is SliceMode.DESCRIBE
    for g, (plan, fg) in enumerate(zip(st.plans, st.groups)):
        frozen = [f for f in fg.layout.fragments(fg.rank) if plan.opt_group[f.slot] < 0]
        if not frozen:
            continue
        with contextlib.nullcontext() if describe else st.shards_resident([g], write_back=load):
            shard = fg.shard
            if describe and shard.numel() == 0:  # on NVMe: only its dtype and size matter
                shard = torch.empty(fg.layout.shard_numel, dtype=fg.dtype, device="meta")
            yield [
                (Span(PARAM, fg.layout.slots[f.slot].name, f.start, f.end), shard[f.shard_offset : f.shard_offset + f.numel])
                for f in frozen
            ]

    swapped = {} if st.swapper is None else {run[0]: k for k, run in enumerate(st.swapper.runs)}
    write = None if st.params is None else st.params.write_piece
    if load and st.params is not None:
        st.params.settle()
    masters = st.masters
    for run in masters.runs:
        k = swapped.get(run[0])
        if k is not None and describe:
            layout = st.swapper.run_layout(k)
            states = {
                i: optimizer_state_view(optimizer, masters.masters[i], {
                    **_in_memory(optimizer.state.get(masters.masters[i], {}), st.swapper.in_memory_state),
                    **{key: t for key, t in layout[i].items() if key != MASTER_KEY}})
                for i in run
            }  # fmt: skip
            tensors = {i: layout[i][MASTER_KEY] for i in run}
            yield _run_slices(st, run, tensors, states, with_all_scalars=False)
            continue
        resident = contextlib.nullcontext() if k is None else st.swapper.run_resident(k, optimizer, write_back=load)
        with resident:
            if load and optim_keys:
                for i in run:
                    create_optimizer_state(optimizer, masters.masters[i], optim_keys, state_dtype)
            tensors = {i: masters.masters[i] for i in run}
            states = {i: optimizer_state_view(optimizer, masters.masters[i]) if (optim_keys or not load) else {} for i in run}
            yield _run_slices(st, run, tensors, states, with_all_scalars=load)
            if load:
                if optim_keys:
                    settle_loaded_state(optimizer, [masters.masters[i] for i in run])
                masters.write_to_shards(run, write)
    if load:
        st.invalidate_secondaries()
        if st.params is not None:
            st.params.finish_step()
        for fg in st.groups:
            if fg.persistent:
                fg.regather()


def _in_memory(state: dict, keys: Collection[str]) -> dict:
    """A swapped run's state entries that are not in its file: 0-d counters, ``keys``."""
    return {key: v for key, v in state.items() if isinstance(v, torch.Tensor) and (v.dim() == 0 or key in keys)}


def _run_slices(
    st: ShardedParts,
    run: list[int],
    tensors: dict[int, torch.Tensor],
    states: dict[int, dict],
    *,
    with_all_scalars: bool,
) -> list[Slice]:
    out: list[Slice] = []
    for i in run:
        piece = st.masters.pieces[i]
        flat = tensors[i].reshape(-1)
        for name, start, end, offset in piece_spans(st.groups[piece.group], piece):
            out.append((Span(MASTER, name, start, end), flat[offset : offset + end - start]))
            out.extend(
                optimizer_slices(states[i], name, start, end, offset, with_scalars=with_all_scalars or start == 0)
            )
    return out


def sharded_grad_slices(plans: Sequence[GroupPlan], groups: Sequence[FlatParamGroup], grads: ShardedGrads) -> list[Slice]:
    """This rank's gradient shards as ``grad`` spans of the trained parameters: the
    window's reduced, averaged, still loss-scaled gradients (read by DeepSpeed's
    ``safe_get_*_grad``). A rank holds exactly what it would save, so there is one form.
    Only after the window's last backward."""
    if grads.swapper is not None:
        raise ValueError(
            "the gradients are in swap files (offload_optimizer.device 'nvme' at stage 2-3), which are not "
            "readable by parameter; offload the optimizer to 'cpu' to read them"
        )
    out: list[Slice] = []
    for plan, fg, shard in zip(plans, groups, grads.shards):
        if shard is None:
            continue
        for f in fg.layout.fragments(fg.rank):
            if plan.opt_group[f.slot] >= 0:
                span = Span(GRAD, fg.layout.slots[f.slot].name, f.start, f.end)
                out.append((span, shard[f.shard_offset : f.shard_offset + f.numel]))
    return out
