"""Rebuilding an engine's model state for a new world, in the running process.

A live resize ([Note: membership epochs]) keeps the user's module, its preparation
(precision, activation checkpointing, wrapping) and the engine's optimizer and scheduler
objects; what depends on the world is built again, by the functions that built it the
first time: the model state over the new data-parallel group (step 6 of [Note: the
order of model preparation]) and the parallel layout (here), and the engine's parts
(``Engine.rebuild``, which calls these). The optimizer object adopts the new state's masters and starts
with empty state, which the resize then fills from the peers' spans.

At stage 3 the module's parameters hold no data once sharded, so the new state takes
them over from a :class:`_Reshaping` owner that knows their full shapes and gives zeros
for values: the resize overwrites every master (and so every parameter) afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from terascale.comm import DistributedContext
from terascale.config import Config
from terascale.engine.model_state import ModelState, adopt_optimizer
from terascale.engine.parallel import ParallelLayout
from terascale.engine.precision import PrecisionPolicy
from terascale.engine.prepare import build_model_state
from terascale.zero import WrapPolicy
from terascale.zero.gather import owner_of, register_owner


class _Reshaping:
    """Owner of stage-3 parameters between two model states: their shapes, zero values."""

    def __init__(self, shapes: dict[int, torch.Size], device: torch.device) -> None:
        self._shapes, self._device = shapes, device

    def shape_of(self, param: nn.Parameter) -> torch.Size:
        return self._shapes[id(param)]

    def full_value(self, param: nn.Parameter) -> torch.Tensor:
        return torch.zeros(self._shapes[id(param)], dtype=param.dtype, device=self._device)

    def gather(self, params: list[nn.Parameter]) -> object:
        raise AssertionError("parameters are gathered only once the resize built their new state")

    def release(self, params: list[nn.Parameter], token: object, modifier_rank: int | None) -> None:
        raise AssertionError("parameters are gathered only once the resize built their new state")


def full_shapes(module: nn.Module) -> dict[int, torch.Size]:
    """Every parameter's full shape, also where ZeRO-3 holds it sharded."""
    out = {}
    for p in module.parameters():
        shape_of = getattr(owner_of(p), "shape_of", None)
        out[id(p)] = p.shape if shape_of is None else shape_of(p)
    return out


def rebuild_model_state(
    module: nn.Module,
    old: ModelState,
    param_groups: Sequence[dict],
    config: Config,
    dist_ctx: DistributedContext,
    precision: PrecisionPolicy,
    wrap: WrapPolicy | None,
) -> tuple[ParallelLayout, ModelState]:
    """The parallel layout and a model state of ``module`` over ``dist_ctx``'s groups, in
    place of ``old`` (whose groups are gone). The state's values are not set: the caller
    loads them."""
    shapes = full_shapes(module)
    sharded = [p for p in module.parameters() if p.numel() != shapes[id(p)].numel()]
    old.remove_hooks()
    if sharded:
        register_owner(sharded, _Reshaping(shapes, dist_ctx.device))
    layout = ParallelLayout.build(module, dist_ctx, None)
    state = build_model_state(module, param_groups, config, dist_ctx, precision, wrap, layout.classes, None)
    return layout, state


def readopt_optimizer(optimizer: torch.optim.Optimizer, state: ModelState) -> None:
    """Point ``optimizer`` (the engine's, kept through a resize) at ``state``'s masters,
    with empty state for the resize to fill."""
    adopt_optimizer(optimizer, state.optimizer_param_groups())
    optimizer.state.clear()
    state.check_optimizer(optimizer)
    offload = getattr(state, "parameter_offload", None)
    if offload is not None:
        optimizer.parameter_offload = offload
