"""What the engine's step needs to know about model parallelism: who counts which gradient.

[Note: gradient norm under model parallelism]
With tensor and pipeline parallelism no rank holds the whole model. The global gradient
norm (for clipping and for the fp16 overflow check) is the norm of every parameter of
the model counted once, so each rank adds up the squares of the gradients it is the
one to count, the model state sums those over the data-parallel group (shards) and the
engine sums the result over the *replica group*, the ranks with this rank's
data-parallel coordinate, which together hold one copy of everything:

- a tensor-parallel slice (``terascale.parallel.slicing.sliced_parameters``, or a
  Megatron layer's ``tensor_model_parallel`` parameter) is counted by the rank holding it;
- a parameter every tensor-parallel rank holds in full (norm weights, a row-parallel
  bias, replicated embeddings) has the same gradient on all of them and is counted by
  tensor-parallel rank 0 only;
- a tied layer's copies on several pipeline stages are summed first
  ([Note: tied parameters across stages]) and counted by the owner stage only;
- an expert's parameters are counted by the ranks holding that expert: their ZeRO groups
  shard over the expert-data-parallel group, so the data-parallel sum of shards covers
  every expert once (stage 0 sums its replicated experts over the expert-parallel group
  instead: [Note: expert parameters]).

Every rank then holds the same norm, so they all clip alike and agree on an overflow.
Which parameters a rank counts is decided per ZeRO group ([Note: parameter classes]),
which is why the classes below go to the model state's group plan.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from terascale.comm import DistributedContext, ModelParallelUnit
from terascale.comm import ops as comm_ops
from terascale.config import Config
from terascale.engine.model_state import ModelState
from terascale.moe.groups import ExpertLayout
from terascale.optim.lamb import Lamb
from terascale.optim.muon import Orthogonalize
from terascale.parallel.topology import Topology
from terascale.parallel.sliced_matrices import SlicedOrthogonalizer
from terascale.parallel.slicing import TensorSlice, join_slices, sliced_parameters
from terascale.parallel.ties import Tie
from terascale.zero.optimizers import SumNorms

logger = logging.getLogger("terascale")

TIED = "tied"
# pipeline settings that are PipelineModule arguments (the module decides; the config may repeat them)
_MODULE_KEYS = frozenset({"seed_layers", "activation_checkpoint_interval", "virtual_stages"})
TP_REPLICATED = "tp-replicated"


@runtime_checkable
class HasTies(Protocol):
    """A model with layers tied across pipeline stages (``terascale.pipe.PipelineModule``)."""

    def ties(self) -> list[Tie]: ...


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's part in counting and summing gradients (see the note above).

    ``skip``: ids of parameters whose gradient another rank counts; ``ties``: tied
    layers whose copies' gradients are summed before the step; ``classes``: the ZeRO
    group class of each parameter that needs one.
    """

    dist: DistributedContext
    slices: dict[str, TensorSlice] = field(default_factory=dict)  # model_slices(), found once
    slice_of: dict[int, TensorSlice] = field(default_factory=dict)  # ``slices`` by parameter id
    skip: frozenset[int] = frozenset()
    ties: tuple[Tie, ...] = ()
    classes: dict[int, Hashable] = field(default_factory=dict)
    experts: ExpertLayout = field(default_factory=ExpertLayout)  # expert parallelism's share

    @staticmethod
    def build(module: nn.Module, dist_ctx: DistributedContext, experts: ExpertLayout | None = None) -> ParallelLayout:
        ties = tuple(module.ties()) if isinstance(module, HasTies) else ()
        experts = experts or ExpertLayout()
        classes: dict[int, Hashable] = experts.classes()
        skip: set[int] = set()
        slices = model_slices(module, dist_ctx)
        if dist_ctx.mp_world_size > 1:
            for name, p in module.named_parameters():
                if name not in slices:
                    classes[id(p)] = TP_REPLICATED
                    if dist_ctx.tp_rank != 0:
                        skip.add(id(p))
        for tie in ties:
            for p in tie.params:
                classes[id(p)] = (TIED, tie.key)
                if not tie.owner:
                    skip.add(id(p))
        slice_of = {id(p): slices[name] for name, p in module.named_parameters() if name in slices}
        return ParallelLayout(dist_ctx, slices, slice_of, frozenset(skip), ties, classes, experts)

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse what would step tensor-parallel slices wrongly: Lamb's own gradient
        clipping takes the norm of what this rank holds; the engine's is the model's."""
        if isinstance(optimizer, Lamb) and self.slice_of and optimizer.clips:
            raise ValueError(
                "Lamb(max_grad_norm=...) with tensor parallelism clips by the norm of this rank's slices; "
                "set max_grad_norm=0 and the config's gradient_clipping, which clips by the whole model's norm"
            )

    @functools.cached_property
    def orthogonalize(self) -> Orthogonalize | None:
        """Muon's orthogonalization of whole matrices from their tensor-parallel slices
        ([Note: whole matrices across tensor-parallel slices]); None without tensor
        parallelism (each matrix is then whole on its rank)."""
        if self.dist.mp_world_size == 1:
            return None
        ctx = self.dist
        return SlicedOrthogonalizer(self.slice_of, ctx.mp_group, ctx.tp_rank, ctx.mp_world_size)

    @property
    def sum_norms(self) -> SumNorms | None:
        """Lamb's per-parameter norm completion for tensor-parallel slices (None without any)."""
        return self._sum_sliced_norms if self.slice_of else None

    def _sum_sliced_norms(self, rows: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
        """Sum ``rows[k]`` over the tensor-parallel group where ``params[k]`` is a slice, in
        place: each tensor-parallel rank holds its own slice of the same parameter, so the
        summed squares are the whole parameter's. Rows of parameters every tensor-parallel
        rank holds in full stay. Collective over the tensor-parallel group."""
        index = [k for k, p in enumerate(params) if id(p) in self.slice_of]
        if not index:  # the same on every tensor-parallel rank: they hold the same parameters
            return
        at = torch.tensor(index, device=rows.device)
        part = rows.index_select(0, at)
        comm_ops.all_reduce(part, group=self.dist.mp_group)
        rows.index_copy_(0, at, part)

    def sum_tied_grads(self, state: ModelState) -> None:
        """Sum each tied layer's gradients over its copies (collective over each tie's group)."""
        for tie in self.ties:
            state.sum_grads(tie.params, tie.group)

    def grad_norm(self, state: ModelState, extra: torch.Tensor | None = None) -> torch.Tensor:
        """The global L2 norm of the window's reduced gradients, every parameter counted
        once (collective over the world); still loss-scaled. Every rank's ``extra`` (0-d)
        is added to the squared norm: a NaN there makes the norm NaN everywhere."""
        sq = state.grad_sq_norm(self.skip, extra)
        group = self.dist.replica_group
        if group is not None and dist.get_world_size(group) > 1:
            comm_ops.all_reduce(sq, group=group)
        return sq.sqrt()


def model_slices(module: nn.Module, dist_ctx: DistributedContext) -> dict[str, TensorSlice]:
    """Every tensor-parallel slice of ``module`` by parameter name: terascale's layers'
    (``sliced_parameters``), and those a user's own Megatron layers mark with
    ``tensor_model_parallel``/``partition_dim`` (read, never set)."""
    if dist_ctx.mp_world_size == 1:
        return {}
    out = {}
    for name, p in module.named_parameters():
        if getattr(p, "tensor_model_parallel", False):
            out[name] = TensorSlice(int(getattr(p, "partition_dim", 0)), dist_ctx.mp_world_size, dist_ctx.tp_rank)
    out.update(sliced_parameters(module))
    return out


def model_parallel_unit(model: nn.Module, config: Config, mpu: ModelParallelUnit | None) -> ModelParallelUnit | None:
    """The mpu to train ``model`` with: the one passed, else a ``PipelineModule``'s
    topology's, else a tensor-parallel topology when the config asks for one
    (``tensor_parallel.autotp_size``/``tp_size``); None for plain data parallelism.

    Collective when it builds a topology (every rank calls it alike)."""
    topology = getattr(model, "topology", None)
    if mpu is None and isinstance(topology, Topology):
        return topology.mpu()
    if mpu is None and config.tensor_parallel.size > 1:
        return Topology(tp=config.tensor_parallel.size).mpu()
    return mpu


def check_layout(model: nn.Module, config: Config, dist_ctx: DistributedContext) -> None:
    """The config's model-parallel sizes must be the ones the model is trained with."""
    tp = config.tensor_parallel.size
    if tp > 1 and dist_ctx.mp_world_size != tp:
        raise ValueError(
            f"tensor_parallel asks for tensor-parallel size {tp}, but the mpu's tensor-parallel group has "
            f"{dist_ctx.mp_world_size} ranks; make them agree (or drop the key and let the mpu decide)"
        )
    pipeline = config.pipeline
    given = {k: getattr(pipeline, k) for k in pipeline.model_fields_set & _MODULE_KEYS}
    if isinstance(getattr(model, "topology", None), Topology):
        for key, value in given.items():
            if key == "activation_checkpoint_interval" and value > 0:
                # DeepSpeed's rule: a positive interval in the config is the module's (the
                # module reads it at each forward, so it can change after building).
                model.activation_checkpoint_interval = value
                continue
            if getattr(model, key) != value:
                raise ValueError(
                    f"pipeline.{key} is {value!r} in the config but the PipelineModule was built with "
                    f"{key}={getattr(model, key)!r}: the module's arguments decide; make them agree or drop the key"
                )
    elif given:
        logger.warning(
            "config: %s: these pipeline settings apply to a terascale.pipe.PipelineModule; this model is "
            "not one, so they are ignored (as DeepSpeed ignores them)", ", ".join(f"pipeline.{k}" for k in sorted(given))
        )
    stages = pipeline.stages
    if stages != "auto" and stages != dist_ctx.pp_world_size:
        where = "the PipelineModule has" if isinstance(getattr(model, "topology", None), Topology) else "the model runs on"
        raise ValueError(
            f"pipeline.stages is {stages} but {where} {dist_ctx.pp_world_size} pipeline stage(s); "
            "pipeline parallelism needs a terascale.pipe.PipelineModule (its num_stages or topology "
            'decides the stages): set pipeline.stages to "auto" or to that number'
        )


@torch.no_grad()
def join_model_parallel(state: dict[str, torch.Tensor], layout: ParallelLayout) -> dict[str, torch.Tensor]:
    """The whole model's state dict from this rank's part of it (``state``: full over the
    data-parallel ranks, CPU tensors): tensor-parallel slices joined over the
    tensor-parallel group, every pipeline stage's entries merged, every expert-parallel
    rank's experts under their global numbers. Collective over those groups; every rank
    gets the result."""
    dist_ctx, slices = layout.dist, layout.slices
    experts = layout.experts
    for name in [n for n in state if n in experts.slices]:  # fused experts: dim-0 slices over the ep group
        s = experts.slices[name]
        group = experts.groups[s.parts].ep_group
        local = state[name].to(dist_ctx.device).contiguous()
        parts = [torch.empty_like(local) for _ in range(s.parts)]
        comm_ops.all_gather(parts, local, group=group)
        state[name] = torch.cat(parts, dim=0).cpu()
    if experts.global_names:
        own = {experts.global_names[n]: state.pop(n) for n in list(state) if n in experts.global_names}
        for n, groups in sorted(experts.groups.items()):
            if groups.ep_group is None:
                continue
            parts: list[Any] = [None] * n
            comm_ops.all_gather_object(parts, own, group=groups.ep_group)
            for part in parts:
                own.update(part)
        state.update(own)
    if slices:
        group = dist_ctx.mp_group
        for name in [n for n in state if n in slices]:
            s = slices[name]
            local = state[name].to(dist_ctx.device)
            parts = [torch.empty_like(local) for _ in range(s.parts)]
            comm_ops.all_gather(parts, local.contiguous(), group=group)
            state[name] = join_slices([p.cpu() for p in parts], s.dim, s.fused)
    if dist_ctx.pp_world_size > 1:
        stages: list[Any] = [None] * dist_ctx.pp_world_size
        comm_ops.all_gather_object(stages, state, group=dist_ctx.pp_group)
        merged: dict[str, torch.Tensor] = {}
        for stage in stages:
            for name, t in stage.items():
                merged.setdefault(name, t)  # a tied layer's copies are equal: the first stage's
        state = merged
    return state
