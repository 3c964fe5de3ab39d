"""DeepSpeed's helpers for optimizer groups of expert parameters (``deepspeed.moe.utils``).

Under ZeRO a DeepSpeed program keeps expert parameters in optimizer groups of their own,
marked ``'moe': True`` and named by their expert-parallel size; these helpers build such
groups. terascale's ZeRO splits its groups by parameter class whatever the optimizer
groups are ([Note: expert parameters]); it checks the same rule as DeepSpeed so that a
program that runs on one runs on the other (``terascale.engine.experts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from terascale.moe.experts import ExpertParameter, is_expert_param
from terascale.moe.layer import MoE

ParamGroups = dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]]
DEFAULT_MAX_GROUP_SIZE = 178956971  # DeepSpeed's default: elements per expert optimizer group


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert's parameter."""
    return is_expert_param(param)


def has_moe_layers(model: nn.Module) -> tuple[bool, int]:
    """``(True, num_experts of the first MoE layer)`` if ``model`` has one, else ``(False, 0)``."""
    for m in model.modules():
        if isinstance(m, MoE):
            return True, m.num_experts
    return False, 0


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    return bool(param_group.get("moe", False))


def split_params_into_shared_and_expert_params(
    params: Sequence[nn.Parameter],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``params`` as (dense ones, expert ones), order kept."""
    shared = [p for p in params if not is_expert_param(p)]
    return shared, [p for p in params if is_expert_param(p)]


def split_params_grads_into_shared_and_expert_params(
    group: Sequence[nn.Parameter],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The gradients of ``group``'s parameters that have one, as (dense, expert), each in
    its parameter's dtype."""
    shared = [p.grad.to(p.dtype) for p in group if p.grad is not None and not is_expert_param(p)]
    return shared, [p.grad.to(p.dtype) for p in group if p.grad is not None and is_expert_param(p)]


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: ParamGroups, max_group_size: int | float | None = DEFAULT_MAX_GROUP_SIZE
) -> list[dict[str, Any]]:
    """Move the expert parameters out of ``param_groups`` into groups of their own.

    Each input group (a dict with ``'params'`` and a ``'name'``) loses its expert
    parameters, in place, and for every expert-parallel size among them a copy of its
    options is appended with ``'name'`` = ``ep_size_<N>``, ``'moe'`` = True and those
    parameters, cut into groups of at most ``max_group_size`` elements (None: uncut).
    Returns the list: the input groups first, then the expert groups (DeepSpeed's order).
    """
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)):
        groups = list(param_groups)
    else:
        raise ValueError(f"param_groups must be a dict or a list or tuple of dicts, got {type(param_groups).__name__}")
    for g in groups:
        g["params"] = list(g["params"])  # a generator (model.parameters()) is read more than once
    names = sorted({p.group_name for g in groups for p in g["params"] if isinstance(p, ExpertParameter)})
    added: list[dict[str, Any]] = []
    for g in groups:
        params = g["params"]
        if names and "name" not in g:
            raise ValueError(
                "split_params_into_different_moe_groups_for_optimizer: every param group needs a 'name' "
                f"(its expert groups are keyed by it); got a group with keys {sorted(g)}"
            )
        g["params"] = [p for p in params if not is_expert_param(p)]
        for name in names:
            experts = [p for p in params if isinstance(p, ExpertParameter) and p.group_name == name]
            for chunk in _chunks(experts, max_group_size):
                added.append({**g, "name": name, "moe": True, "params": chunk})
    return groups + added


def configure_moe_param_groups(model_parameters: list) -> list[dict[str, Any]]:
    """DeepSpeed's engine-side grouping: a list of parameters becomes one group named
    ``dense-params`` split as above; a list of groups is split unless one is already
    marked ``'moe'``."""
    if not isinstance(model_parameters, list) or not model_parameters:
        raise ValueError("model_parameters must be a non-empty list of parameters or of param groups")
    if not all(isinstance(p, (torch.Tensor, dict)) for p in model_parameters):
        raise TypeError("model_parameters must hold tensors or dicts (what a torch optimizer takes)")
    if isinstance(model_parameters[0], torch.Tensor):
        return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters, "name": "dense-params"})
    if any("moe" in g for g in model_parameters):
        return model_parameters
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)


def _chunks(params: list[nn.Parameter], max_numel: int | float | None) -> list[list[nn.Parameter]]:
    """``params`` in order, cut into runs of at most ``max_numel`` elements (a bigger
    parameter alone); no runs for no parameters."""
    if max_numel is None:
        return [params] if params else []
    out: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        if out and size + p.numel() <= max_numel:
            out[-1].append(p)
            size += p.numel()
        else:
            out.append([p])
            size = p.numel()
    return out
