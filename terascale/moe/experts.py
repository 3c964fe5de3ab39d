"""The experts one rank holds, and how their parameters are told apart from dense ones.

[Note: expert parameters]
An expert's parameters differ from every other parameter in two ways: each rank of an
expert-parallel group holds *different* experts (rank ``p`` holds experts
``[p * E / P, (p + 1) * E / P)``), and a given expert is replicated only over the
*expert-data-parallel* group, the ranks at the same position of the other
expert-parallel groups. So their gradients are reduced, and their ZeRO shards split,
over that smaller group, while the gradient is still averaged over the whole
data-parallel world (each expert already received its expert-parallel peers' tokens
through the all-to-all: summing over the expert-data-parallel ranks covers every token
once, as DeepSpeed's engine does).

A parameter says it is an expert's by its type, :class:`ExpertParameter`, which carries
the expert-parallel size it was built for: DeepSpeed's ``is_moe_param(p)``, its
``split_params_into_different_moe_groups_for_optimizer`` and the engine's group plan all
need that from the parameter alone, and a subclass states it without attributes
monkey-patched onto plain tensors. (DeepSpeed's own spelling, ``p.allreduce is False``
and ``p.group_name``, are read-only properties of the type.)
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from torch import nn


def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's name for the expert-parallel groups of size ``ep_size``; its optimizer
    groups of expert parameters carry it as ``'name'``."""
    return f"ep_size_{ep_size}"


class ExpertParameter(nn.Parameter):
    """A parameter of one expert, split over expert-parallel groups of ``ep_size`` ranks
    (see [Note: expert parameters])."""

    ep_size: int

    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = True, ep_size: int = 1) -> ExpertParameter:
        if data is None:
            data = torch.empty(0)
        out = super().__new__(cls, data.detach(), requires_grad)
        out.ep_size = int(ep_size)
        return out

    @property
    def group_name(self) -> str:
        return expert_group_name(self.ep_size)

    @property
    def allreduce(self) -> bool:
        """DeepSpeed's marker: expert parameters are not all-reduced over the whole world."""
        return False

    def __deepcopy__(self, memo: dict) -> ExpertParameter:
        if id(self) in memo:
            return memo[id(self)]
        out = ExpertParameter(self.data.clone(memory_format=torch.preserve_format), self.requires_grad, self.ep_size)
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol: int):
        return (ExpertParameter, (self.data, self.requires_grad, self.ep_size))

    def __repr__(self) -> str:
        return f"ExpertParameter(ep_size={self.ep_size}) containing:\n{self.data!r}"


def is_expert_param(p: torch.Tensor) -> bool:
    """Whether ``p`` is an expert's parameter (DeepSpeed's ``is_moe_param``)."""
    return isinstance(p, ExpertParameter)


def mark_expert_params(module: nn.Module, ep_size: int) -> None:
    """Make every parameter of ``module`` an :class:`ExpertParameter` of ``ep_size``, in
    place (same values, same names; the module holds the new objects)."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None and not (is_expert_param(p) and p.ep_size == ep_size):
                sub._parameters[name] = ExpertParameter(p.data, p.requires_grad, ep_size)


class Experts(nn.Module):
    """``num_local_experts`` copies of ``expert``, the experts this rank holds (DeepSpeed's
    ``Experts``: same parameter names, ``deepspeed_experts.<i>.*``). Every copy starts
    with ``expert``'s values; its parameters are :class:`ExpertParameter`s."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        self.ep_size = _ep_size_of(expert_group_name)
        for e in self.deepspeed_experts:
            mark_expert_params(e, self.ep_size)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's layout: ``inputs`` [..., num_local_experts * C, ...] split into one
        chunk per local expert along dim 1; outputs concatenated the same way."""
        outs = []
        for chunk, expert in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts):
            out = expert(chunk)
            outs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outs, dim=1)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.deepspeed_experts)

    def __len__(self) -> int:
        return self.num_local_experts


def _ep_size_of(group_name: str | None) -> int:
    if group_name is None:
        return 1
    prefix = "ep_size_"
    if not group_name.startswith(prefix) or not group_name[len(prefix) :].isdigit():
        raise ValueError(f"expert group names are DeepSpeed's 'ep_size_<N>', got {group_name!r}")
    return int(group_name[len(prefix) :])
