"""What ``initialize`` does for a model with experts: groups, initial values, optimizer groups.

The model's MoE layers ([Note: expert parameters]) are found by what they are, not by
name: any module with an ``ep_size`` and a ``set_expert_groups`` method (terascale's and
DeepSpeed-shaped :class:`terascale.moe.layer.MoE`, the Hugging Face blocks that
``terascale.moe.hf`` converts) takes its expert-parallel group from here, and any
:class:`terascale.moe.experts.ExpertParameter` is sharded and reduced over its
expert-data-parallel group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist
from torch import nn

from terascale.comm import DistributedContext, broadcast_tensors
from terascale.comm import ops as comm_ops
from terascale.config.parallel import ExpertParallelConfig
from terascale.moe.experts import Experts, expert_group_name, is_expert_param
from terascale.moe.groups import ExpertGroups, ExpertLayout, expert_groups
from terascale.moe.hf import ExpertParallelExperts, split_hf_experts
from terascale.moe.utils import split_params_into_different_moe_groups_for_optimizer
from terascale.parallel.slicing import TensorSlice


@runtime_checkable
class ExpertParallel(Protocol):
    """A layer whose experts are split over expert-parallel groups of ``ep_size`` ranks."""

    ep_size: int

    def set_expert_groups(self, groups: ExpertGroups) -> None: ...


def setup_experts(
    module: nn.Module, dist_ctx: DistributedContext, section: ExpertParallelConfig | None = None
) -> tuple[ExpertLayout, dict[int, nn.Parameter]]:
    """Split a Hugging Face model's experts when ``section`` (the config's
    ``expert_parallel``) asks for it, build the expert-parallel groups ``module``'s MoE
    layers ask for, hand each layer its own, and say which parameters are experts'.
    Returns the layout and, for parameters the split replaced, ``id(old) -> new`` (an
    optimizer built before holds the old ones). Collective over the world (every rank
    holds the same layers). Empty for a model without experts."""
    groups: dict[int, ExpertGroups] = {}
    replaced: dict[int, nn.Parameter] = {}
    split: dict[str, ExpertParallelExperts] = {}
    if section is not None and section.active:
        _check_model_parallel(dist_ctx, [section.autoep_size])
        n = section.autoep_size
        groups[n] = expert_groups(dist_ctx.dp_group, n)
        before = list(module.named_parameters())
        split = split_hf_experts(module, groups[n], grouped_mm=section.use_grouped_mm)
        _check_split(module, section, split)
        after = dict(module.named_parameters())
        replaced = {id(p): after[name] for name, p in before if name in after and after[name] is not p}
    layers = [m for m in module.modules() if isinstance(m, ExpertParallel)]
    ep_size_of = {id(p): p.ep_size for p in module.parameters() if is_expert_param(p)}
    sizes = sorted({m.ep_size for m in layers} | set(ep_size_of.values()))
    if dist_ctx.pp_world_size > 1:
        # Stages hold different layers, and building groups is collective over the world:
        # every stage builds those of every stage's experts.
        everyone: list[Any] = [None] * dist.get_world_size()
        comm_ops.all_gather_object(everyone, sizes)
        sizes = sorted({n for s in everyone for n in s})
    if not sizes:
        return ExpertLayout(), replaced
    _check_model_parallel(dist_ctx, sizes)
    for n in sizes:
        if n not in groups:
            groups[n] = expert_groups(dist_ctx.dp_group, n)
    for m in layers:
        m.set_expert_groups(groups[m.ep_size])
    slices = {
        f"{path}.{w}": TensorSlice(0, m.ep_size, groups[m.ep_size].ep_rank)
        for path, m in split.items()
        if m.ep_size > 1
        for w in ("gate_up_proj", "down_proj")
    }
    automatic = frozenset(id(p) for m in split.values() for p in m.parameters())
    return ExpertLayout(groups, ep_size_of, global_expert_names(module, groups), slices, automatic), replaced


def _check_model_parallel(dist_ctx: DistributedContext, sizes: Sequence[int]) -> None:
    if dist_ctx.mp_world_size > 1:
        raise ValueError(
            f"expert parallelism ({', '.join(map(expert_group_name, sizes))}) with tensor-parallel size "
            f"{dist_ctx.mp_world_size}: terascale does not split experts over tensor-parallel ranks yet (DeepSpeed's "
            "expert tensor parallelism); use expert and data parallelism, with pipeline stages if needed"
        )


def _check_split(module: nn.Module, section: ExpertParallelConfig, split: dict[str, ExpertParallelExperts]) -> None:
    """The config asked for expert parallelism: the model must have experts to split, of
    the family ``preset_model`` names if it names one."""
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    if not split:
        raise ValueError(
            f"expert_parallel asks for expert-parallel size {section.autoep_size}, but the model "
            f"({type(module).__name__}) has no Hugging Face fused-experts module to split (Mixtral, Qwen2-MoE, "
            "Qwen3-MoE, DeepSeek-V2/V3, OLMoE); a program's own deepspeed.moe.layer.MoE layers take ep_size "
            "from their constructor instead"
        )
    if section.preset_model is not None and model_type is not None and model_type != section.preset_model:
        raise ValueError(
            f"expert_parallel.preset_model is '{section.preset_model}' but the model is a '{model_type}' model"
        )


def global_expert_names(module: nn.Module, groups: dict[int, ExpertGroups]) -> dict[str, str]:
    """Each parameter of ``module``'s :class:`Experts` under its global expert number: local
    expert ``i`` of ep rank ``r`` is expert ``r * num_local_experts + i``."""
    names = {id(p): n for n, p in module.named_parameters()}
    out = {}
    for path, m in module.named_modules():
        if not isinstance(m, Experts) or m.ep_size == 1:
            continue
        first = groups[m.ep_size].ep_rank * m.num_local_experts
        for i, expert in enumerate(m.deepspeed_experts):
            for rest, p in expert.named_parameters():
                local = names[id(p)]
                out[local] = f"{path + '.' if path else ''}deepspeed_experts.{first + i}.{rest}"
    return out


def broadcast_initial_values(module: nn.Module, dist_ctx: DistributedContext, experts: ExpertLayout) -> None:
    """Rank 0's values everywhere, whatever each process's seed did: dense parameters and
    buffers over the data-parallel group, each expert's parameters over the ranks that
    replicate it (its expert-data-parallel group: the other ranks hold other experts)."""
    params = list(module.parameters())
    dense = [p.data for p in params if id(p) not in experts.ep_size_of]
    broadcast_tensors(dense + list(module.buffers()), dist_ctx.zero_group)
    for n, groups in sorted(experts.groups.items()):
        broadcast_tensors([p.data for p in params if experts.ep_size_of.get(id(p)) == n], groups.edp_group)


def group_experts_apart(param_groups: list[dict], experts: ExpertLayout) -> list[dict]:
    """The optimizer groups an engine-built optimizer steps: as DeepSpeed's engine does
    (``configure_moe_param_groups``), groups that no one marked ``'moe'`` have their expert
    parameters moved into groups of their own, named ``ep_size_<N>``; unnamed groups are
    named ``dense-params`` (``dense-params-<k>`` when there are several). Experts that
    terascale split from a Hugging Face model leave the groups as they are: the same
    optimizer groups at every expert-parallel size (1 included) let a checkpoint load on
    any of them."""
    user_experts = set(experts.ep_size_of) - experts.automatic
    if not user_experts or any("moe" in g for g in param_groups):
        return param_groups
    named = [
        {"name": "dense-params" if len(param_groups) == 1 else f"dense-params-{k}", **g} for k, g in enumerate(param_groups)
    ]
    return split_params_into_different_moe_groups_for_optimizer(named, max_group_size=None)


def check_expert_param_groups(param_groups: Sequence[dict], experts: ExpertLayout, stage: int) -> None:
    """DeepSpeed's rule for optimizer groups under ZeRO, kept so that a program runs the
    same on both: expert parameters go in groups of their own, marked ``'moe': True`` and
    named by their expert-parallel size (``split_params_into_different_moe_groups_for_optimizer``
    builds them). A group mixing them with dense parameters, or a marked group holding
    dense ones, is refused with the counts. (terascale would reduce them right either way:
    its ZeRO groups split by parameter class, not by optimizer group; stage 0 takes any
    groups, as DeepSpeed's does.)"""
    if not experts or stage == 0:
        return
    for k, group in enumerate(param_groups):
        params = [p for p in group["params"] if id(p) not in experts.automatic]
        sizes = [experts.ep_size_of.get(id(p)) for p in params]
        n_expert = sum(s is not None for s in sizes)
        n_dense = len(params) - n_expert
        label = f"optimizer param group {k}" + (f" ('{group['name']}')" if "name" in group else "")
        if group.get("moe"):
            if n_dense:
                raise ValueError(
                    f"{label} is marked 'moe': True but holds {n_dense} dense parameter(s) beside {n_expert} expert "
                    "parameter(s); build the groups with split_params_into_different_moe_groups_for_optimizer"
                )
            names = {expert_group_name(s) for s in sizes if s is not None}
            if names and group.get("name") not in names:
                raise ValueError(
                    f"{label} holds the expert parameters of {sorted(names)} but is named {group.get('name')!r}; "
                    "an expert group is named by its expert-parallel size (as the split function names it)"
                )
        elif n_expert:
            raise ValueError(
                f"{label} mixes {n_expert} expert parameter(s) ({', '.join(sorted({expert_group_name(s) for s in sizes if s}))}) "
                f"with {n_dense} dense one(s): expert parameters are reduced and sharded over their own groups. Pass "
                "the groups through terascale.moe.utils.split_params_into_different_moe_groups_for_optimizer "
                "(deepspeed.moe.utils' function) before building the optimizer"
            )
