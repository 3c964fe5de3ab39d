"""Checkpoint coordinates of this rank's state under tensor and pipeline parallelism.

The model state describes its tensors in *local* coordinates: spans of the parameters
this rank holds, shaped as it holds them. A checkpoint needs coordinates every layout
shares ([Note: logical checkpoints]): the full parameter's name and shape. This module
translates both ways:

- a tensor-parallel slice is recorded under its full shape and its spans are moved to
  the slice's place in the part-after-part order ([Note: sliced tensors in
  checkpoints]); loading on another slicing reorders through the full tensor;
- pipeline stages hold different parameters under names that do not depend on the
  stage count, so each stage simply saves its own; only the owner of a tied layer
  saves it ([Note: tied parameters across stages]);
- buffers are saved by one rank per pipeline stage (data- and tensor-parallel rank 0);
- an expert is recorded under its global number, whichever rank of an expert-parallel
  group holds it and as which local expert, so a checkpoint holds every expert once and
  loads on another expert-parallel size (each rank reads the experts it now holds);
  experts fused into one tensor per layer are slices of it along dim 0, recorded as
  tensor-parallel slices are.

Every rank contributes its parameters' records to the manifest, which rank 0 merges.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from terascale.checkpoint.order import SliceOrder, part_of
from terascale.checkpoint.reader import CheckpointReader
from terascale.checkpoint.spans import MASTER, OPTIM, PARAM, RANK_LOCAL, ParamInfo, Slice, Span
from terascale.comm import DistributedContext
from terascale.comm import ops as comm_ops
from terascale.engine.model_state import ModelState
from terascale.engine.parallel import ParallelLayout
from terascale.parallel.slicing import TensorSlice

logger = logging.getLogger("terascale")


class CheckpointLayout:
    """This rank's local spans <-> checkpoint spans (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, state: ModelState, dist_ctx: DistributedContext, parallel: ParallelLayout) -> None:
        self._global = dict(parallel.experts.global_names)  # local name -> the whole model's
        self._local = state.checkpoint_params()
        self._slices = {
            n: TensorSlice(s.dim % len(self._local[n].shape), s.parts, s.index, s.fused)
            for n, s in {**parallel.slices, **parallel.experts.slices}.items()
            if n in self._local
        }
        self._not_saved = {n for tie in parallel.ties if not tie.owner for n in tie.names}
        self.saves_buffers = dist_ctx.dp_rank == 0 and dist_ctx.tp_rank == 0 and dist_ctx.sp_rank == 0
        self._dist = dist_ctx
        self._full: dict[str, tuple[str, torch.Tensor]] = {}  # key -> (name, full tensor): the last one read

    # -- what this rank records ----------------------------------------------------------------

    def params(self) -> dict[str, ParamInfo]:
        """This rank's parameters as the checkpoint records them: full shapes, slice orders."""
        out = {}
        for name, info in self._local.items():
            s = self._slices.get(name)
            if s is None:
                out[self._name(name)] = info
                continue
            shape = list(info.shape)
            shape[s.dim] *= s.parts
            out[name] = ParamInfo(tuple(shape), info.dtype, info.opt_group, SliceOrder.of(s.dim, s.parts, s.fused))
        return out

    def _name(self, local: str) -> str:
        return self._global.get(local, local)

    def saved(self, chunk: list[Slice]) -> list[Slice]:
        """``chunk``'s spans in checkpoint coordinates; a tied layer's copies but the
        owner's are left out."""
        out = []
        for span, t in chunk:
            if span.name in self._not_saved:
                continue
            out.append((self._moved(span, t), t))
        return out

    def _moved(self, span: Span, t: torch.Tensor) -> Span:
        s = self._slices.get(span.name)
        if s is None or t.dim() == 0:  # a 0-d optimizer value (a step count) is no element
            return Span(span.key, self._name(span.name), span.start, span.end)
        offset = s.index * self._local[span.name].numel
        return Span(span.key, span.name, span.start + offset, span.end + offset)

    def all_names(self, buffers: set[str]) -> set[str]:
        """The parameter and buffer names of the whole model, ``buffers`` being this rank's:
        every pipeline stage's (collective then)."""
        names = {self._name(n) for n in self._local} | buffers
        if self._dist.pp_world_size > 1 or self._global:  # every stage's, every expert
            everyone: list[Any] = [None] * dist.get_world_size()
            comm_ops.all_gather_object(everyone, sorted(names))
            names = {n for ns in everyone for n in ns}
        return names

    # -- loading -------------------------------------------------------------------------------

    @torch.no_grad()
    def read(self, reader: CheckpointReader, span: Span, out: torch.Tensor) -> None:
        """Fill ``out`` with local span ``span`` from whatever layout saved it. A parameter
        trainable in one run and frozen in the other is found under the other kind (master
        vs param) and cast; optimizer state the saving run never created is zeroed."""
        if span.key.startswith(RANK_LOCAL):  # [Note: rank-local checkpoint state]
            if reader.has(span.key, span.name):  # else another world size's (see rank_local_dropped),
                reader.read_into(span, out)  # or saved before the state existed: as the optimizer reset it
            return
        span = Span(span.key, self._name(span.name), span.start, span.end)  # a local expert: its global number
        if not reader.has(span.key, span.name):
            other = {MASTER: PARAM, PARAM: MASTER}.get(span.key)
            if other is not None and reader.has(other, span.name):
                span = Span(other, span.name, span.start, span.end)
            elif span.key.startswith(OPTIM):
                # The saving optimizer never stepped this parameter (no gradient at stage 0):
                # its state is the fresh one. A 0-d value is shared by the parameters of one
                # master, so it is left to those that have it.
                if out.dim() > 0:
                    out.zero_()
                return
        info = reader.manifest.params.get(span.name)
        s = self._slices.get(span.name)
        mine = None if s is None else SliceOrder.of(s.dim, s.parts, s.fused)
        if info is None or out.dim() == 0 or info.order == mine:
            reader.read_into(self._moved(span, out), out)
            return
        full = self._read_full(reader, span.key, span.name, info)
        local = full if s is None else part_of(full, s.dim, s.parts, s.index, s.fused)
        out.reshape(-1).copy_(local.reshape(-1)[span.start : span.end])

    def _read_full(self, reader: CheckpointReader, key: str, name: str, info: ParamInfo) -> torch.Tensor:
        cached = self._full.get(key)
        if cached is not None and cached[0] == name:
            return cached[1]
        flat = reader.read(key, name, math.prod(info.shape), reader.manifest.stored_dtype(key, info))
        full = flat.view(info.shape) if info.order is None else info.order.to_full(flat, info.shape)
        self._full[key] = (name, full)
        return full

    def done(self) -> None:
        self._full.clear()

    def rank_local_dropped(self, reader: CheckpointReader) -> None:
        """Warn (rank 0) when the checkpoint holds rank-local state that this run cannot
        use: saved on another number of ranks ([Note: rank-local checkpoint state])."""
        saved, now = reader.manifest.world_size, dist.get_world_size()
        if saved != now and dist.get_rank() == 0 and _has_rank_local(reader):
            logger.warning(
                "the checkpoint was saved on %d ranks and loads on %d: each rank's own optimizer state (the 1-bit "
                "optimizers' error feedback) cannot be matched to a rank, so it starts from zero (as DeepSpeed resets "
                "it on every load); resume on %d ranks to continue it exactly", saved, now, saved,
            )  # fmt: skip


def _has_rank_local(reader: CheckpointReader) -> bool:
    """Whether the checkpoint holds any rank's own state ([Note: rank-local checkpoint state])."""
    return any(span.key.startswith(RANK_LOCAL) for f in reader.manifest.files for span in f.spans)
