"""Expert parallelism for Hugging Face MoE models, without model edits.

[Note: Hugging Face experts]
Transformers 5 keeps a sparse block's experts in one module with two fused 3-D weights,
``gate_up_proj`` [E, 2I, H] (gate rows, then up rows) and ``down_proj`` [E, H, I], and
calls it as ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``; the
router, shared experts and auxiliary loss live around it (Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V2/V3, OLMoE). So only that module is replaced: by :class:`ExpertParallelExperts`,
holding this rank's ``E / P`` experts (dim 0 of both weights, under the same names) and
answering the same call by dispatching the routes to the experts' ranks
([Note: expert-parallel dispatch]). The router's choices and weights are used as they
come, so routing (top-k, renormalisation, DeepSeek's groups and bias, jitter) stays the
model's; the load-balancing loss the model computes from its router logits is unchanged.

Each weight is a slice along the expert dim: checkpoints record it at its full shape and
load on any expert-parallel size, and ``full_state_dict`` joins the slices, so a model
saved after training loads with ``from_pretrained`` as before.
"""

from __future__ import annotations

import torch
from torch import nn

from terascale.moe.dispatch import combine, dispatch
from terascale.moe.experts import ExpertParameter
from terascale.moe.grouped import grouped_linear
from terascale.moe.groups import ExpertGroups

_WEIGHTS = ("gate_up_proj", "down_proj")


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face fused-experts module terascale can split: the
    two weights in the default layout (concatenated gate and up, not transposed, no
    biases, no norm after the experts)."""
    params = dict(module.named_parameters(recurse=False))
    return (
        set(params) == set(_WEIGHTS)
        and all(params[n].dim() == 3 for n in _WEIGHTS)
        and hasattr(module, "act_fn")
        and getattr(module, "is_concatenated", True)
        and not getattr(module, "is_transposed", False)
        and not getattr(module, "has_bias", False)
        and getattr(module, "has_gate", True)
        and not getattr(module, "has_post_expert_norm", False)
    )


class ExpertParallelExperts(nn.Module):
    """This rank's share of a Hugging Face fused-experts module (see [Note: Hugging Face
    experts]): experts ``[r * E / P, (r + 1) * E / P)`` of ``experts`` for ep rank ``r`` of
    ``groups``, as :class:`ExpertParameter` slices named ``gate_up_proj`` and ``down_proj``.
    ``grouped_mm`` multiplies all local experts in one grouped matmul where the shapes
    allow (``terascale.moe.grouped``)."""

    def __init__(self, experts: nn.Module, groups: ExpertGroups, *, grouped_mm: bool = True) -> None:
        super().__init__()
        total = experts.gate_up_proj.shape[0]
        if total % groups.ep_size:
            raise ValueError(
                f"{type(experts).__name__} has {total} experts, which do not split over expert-parallel groups of "
                f"{groups.ep_size} ranks (expert_parallel.autoep_size must divide the number of experts)"
            )
        self.global_num_experts = total
        self.num_experts = total // groups.ep_size  # Hugging Face's attribute: the experts this module holds
        self.ep_size = groups.ep_size
        self.first_expert = groups.ep_rank * self.num_experts
        lo, hi = self.first_expert, self.first_expert + self.num_experts
        for name in _WEIGHTS:
            p = getattr(experts, name)
            setattr(self, name, ExpertParameter(p.data[lo:hi].clone(), p.requires_grad, groups.ep_size))
        self.act_fn = experts.act_fn
        self.grouped_mm = grouped_mm
        self.source_class = type(experts).__name__
        self._group = groups.ep_group

    def set_expert_groups(self, groups: ExpertGroups) -> None:
        assert groups.ep_size == self.ep_size and groups.ep_rank * self.num_experts == self.first_expert
        self._group = groups.ep_group

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Each token's ``k`` routes through their experts, wherever they live, weighted by
        ``top_k_weights`` and summed (in fp32): [T, H] in ``hidden_states``' dtype. An
        index of ``E`` or more (Hugging Face's sentinel) is a route to no expert."""
        kept = top_k_index < self.global_num_experts
        rows, counts, record = dispatch(hidden_states, top_k_index, self.global_num_experts, self._group, kept)
        gate_up = grouped_linear(rows, self.gate_up_proj, counts, grouped_mm=self.grouped_mm)
        gate, up = gate_up.chunk(2, dim=-1)
        out = grouped_linear(self.act_fn(gate) * up, self.down_proj, counts, grouped_mm=self.grouped_mm)
        return combine(out, top_k_weights, record)  # weighs the kept routes only

    def extra_repr(self) -> str:
        return (
            f"{self.source_class}: experts {self.first_expert}..{self.first_expert + self.num_experts - 1} "
            f"of {self.global_num_experts}, ep_size={self.ep_size}"
        )


def split_hf_experts(module: nn.Module, groups: ExpertGroups, *, grouped_mm: bool = True) -> dict[str, ExpertParallelExperts]:
    """Replace every Hugging Face fused-experts module inside ``module`` by this rank's
    :class:`ExpertParallelExperts` (same attribute, so the same parameter names); returns
    the replacements by module path. Every rank holds the same model, so every rank
    replaces the same modules."""
    found = [(name, m) for name, m in module.named_modules() if is_fused_experts(m)]
    out = {}
    for name, m in found:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        replacement = ExpertParallelExperts(m, groups, grouped_mm=grouped_mm)
        setattr(parent, attr, replacement)
        out[name] = replacement
    return out
