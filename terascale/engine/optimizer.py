"""The optimizer and LR scheduler an engine steps: from the config, or the user's own.

``initialize`` accepts DeepSpeed's forms: an optimizer instance built over the model's
parameters (its groups and options are kept; its parameters become the fp32 masters), a
callable ``params -> optimizer``, or the config's ``optimizer`` section; likewise a
scheduler instance, a callable ``optimizer -> scheduler`` or the ``scheduler`` section.
Passing one and configuring the other is an error, raised before any work is done.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from terascale.config import Config
from terascale.engine.autocast import scales_loss
from terascale.engine.model_state import ModelState, adopt_optimizer
from terascale.engine.parallel import ParallelLayout
from terascale.errors import UsageError
from terascale.optim import build_optimizer, build_scheduler
from terascale.optim.lamb import Lamb
from terascale.optim.muon import Muon
from terascale.optim.onebit import ReducesOwnGradients

OptimizerArg = torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None
SchedulerArg = Any  # an LR scheduler instance or a callable(optimizer) -> scheduler


FORWARD_ONLY = (
    "this engine has no optimizer (its config has no 'optimizer' section and terascale.initialize got no "
    "optimizer=), so it runs forward only, for evaluation or as a reference model; to train, add an 'optimizer' "
    'section (e.g. {"type": "AdamW", "params": {"lr": 1e-3}}) or pass optimizer='
)


def forward_only(config: Config, optimizer: OptimizerArg) -> bool:
    """Whether the engine is built without an optimizer: DeepSpeed's evaluation-only engine
    (``deepspeed.initialize(model=..., config=...)``, as TRL prepares its reference models).
    It keeps no fp32 masters, gradients or optimizer state; ZeRO-3 still shards its
    parameters and gathers them for forward; backward and step raise ``FORWARD_ONLY``."""
    return optimizer is None and config.optimizer is None


def check_optimizer_arguments(config: Config, optimizer: OptimizerArg, lr_scheduler: SchedulerArg) -> None:
    """Refuse an optimizer (scheduler) passed to ``initialize`` beside the config's own, and
    a scheduler without an optimizer."""
    if forward_only(config, optimizer) and (lr_scheduler is not None or config.scheduler is not None):
        raise UsageError(
            "an LR scheduler (the config's 'scheduler' section or lr_scheduler=) needs an optimizer: add an "
            "'optimizer' section or pass optimizer= to terascale.initialize, or drop the scheduler for a "
            "forward-only engine"
        )
    if optimizer is not None and config.optimizer is not None:
        raise ValueError(
            "an optimizer was passed to terascale.initialize and the config has an 'optimizer' "
            "section; remove one of them"
        )
    if lr_scheduler is not None and config.scheduler is not None:
        raise ValueError(
            "an lr_scheduler was passed to terascale.initialize and the config has a "
            "'scheduler' section; remove one of them"
        )


def engine_optimizer(
    optimizer: OptimizerArg, config: Config, state: ModelState, layout: ParallelLayout
) -> torch.optim.Optimizer | None:
    """The optimizer over ``state``'s parameter groups (fp32 masters or their shards),
    checked against what the state and the parallel layout can step; None for a
    forward-only engine (:func:`forward_only`)."""
    if forward_only(config, optimizer):
        return None
    section = config.optimizer
    groups = state.optimizer_param_groups()
    if isinstance(optimizer, torch.optim.Optimizer):
        adopt_optimizer(optimizer, groups)
        built = optimizer
    elif callable(optimizer):
        built = optimizer(groups)
    else:
        # Muon at stage 0 splits the matrices between ranks that hold the same ones; expert
        # parallelism gives ranks different experts, so each then orthogonalizes its own.
        group = None if section.type.lower() == "muon" and layout.experts.groups else layout.dist.zero_group
        built = build_optimizer(section.type, dict(section.params), groups, group=group)
    if isinstance(built, ReducesOwnGradients):
        own_gradient_reduction(built, config, state, layout)
    state.check_optimizer(built)
    layout.check_optimizer(built)
    offload = getattr(state, "parameter_offload", None)
    if offload is not None:  # stage 3: where TRL looks ([Note: the parameter coordinator TRL reads])
        built.parameter_offload = offload
    return built


def own_gradient_reduction(
    optimizer: ReducesOwnGradients, config: Config, state: ModelState, layout: ParallelLayout
) -> None:
    """Let ``optimizer`` decide, window by window, whether ``state`` all-reduces the
    gradients (``[Note: optimizers that reduce their own gradients]``); refuse the layouts
    it cannot run on with a ValueError naming what to change."""
    name = type(optimizer).__name__
    stage = config.zero_optimization.stage
    if config.gradient_allreduce_op == "sum":
        raise ValueError(
            f'gradient_allreduce_op "sum" with {name}: it averages its own compressed momenta over the ranks; '
            'use "mean" (the default) with it, or another optimizer'
        )
    if stage != 0:
        raise ValueError(
            f"{name} averages its own 1-bit compressed momenta over the data-parallel ranks and needs whole "
            f"parameters and optimizer state on every rank: it runs at zero_optimization.stage 0 only (as in "
            f"DeepSpeed), and the stage is {stage}; set zero_optimization.stage to 0, or use Adam/AdamW/Lamb with "
            f"stage {stage}"
        )
    ctx = layout.dist
    others = [f"{what} {size}" for what, size in (
        ("tensor parallelism of size", ctx.mp_world_size), ("pipeline parallelism of size", ctx.pp_world_size),
        ("sequence parallelism of size", ctx.sp_world_size)) if size > 1]  # fmt: skip
    if layout.experts:
        others.append("expert parallelism (MoE layers)")
    if others:
        raise ValueError(
            f"{name} runs with plain data parallelism only; this run has {' and '.join(others)}: train without "
            f"them, or use Adam/AdamW/Lamb"
        )
    state.gate_reduction(optimizer.reduces_gradients)


def engine_scheduler(lr_scheduler: SchedulerArg, config: Config, optimizer: torch.optim.Optimizer | None) -> Any:
    """The LR scheduler of ``optimizer``: the config's, the one passed, or None."""
    section = config.scheduler
    if optimizer is None:  # forward only: check_optimizer_arguments refused a scheduler
        return None
    if section is not None:
        return build_scheduler(section.type, dict(section.params), optimizer)
    if lr_scheduler is not None and not hasattr(lr_scheduler, "step") and callable(lr_scheduler):
        return lr_scheduler(optimizer)
    return lr_scheduler


def step_in_backward(
    config: Config,
    state: ModelState,
    optimizer: torch.optim.Optimizer,
    layout: ParallelLayout,
    *,
    checks_non_finite: bool,
    begin: Callable[[], torch.Tensor],
) -> bool:
    """Let ``state`` step ``optimizer`` under each window's last backward where
    ``zero_optimization.offload_optimizer.step_in_backward`` asks for it (``true``) or
    allows it (``"auto"``) and nothing in the config is in the way ([Note: the optimizer
    step under backward]); ``true`` with something in the way is a ValueError naming it.
    ``begin()`` is what ``engine.step()`` does before the update (see ``EarlyStep``).
    Returns whether it is on."""
    zero = config.zero_optimization
    wanted = "auto" if zero.offload_optimizer is None else zero.offload_optimizer.step_in_backward
    if wanted is False or optimizer is None:
        return False
    device = "none" if zero.offload_optimizer is None else zero.offload_optimizer.device
    reasons = []
    if zero.stage not in (2, 3):
        reasons.append(
            f"it needs zero_optimization.stage 2 or 3, which reduce gradients during backward (stage is {zero.stage})"
        )
    if device != "nvme":
        reasons.append(f"it applies to offload_optimizer.device 'nvme' (device is '{device}')")
    if config.gradient_clipping > 0:
        reasons.append(
            f"gradient_clipping {config.gradient_clipping} scales the update by the norm of all gradients, known only "
            "after backward; set gradient_clipping to 0"
        )
    if not config.managed_gradient_accumulation:
        reasons.append("managed_gradient_accumulation false: a window's last backward is known only at engine.step()")
    if scales_loss(config, layout.dist.device):  # fp16, or an fp16 autocast
        reasons.append("fp16 checks the gradients for overflow after backward and skips the step if any; use bf16")
    if config.bf16.enabled and config.bf16.check_grad_overflow:
        reasons.append("bf16.check_grad_overflow skips the step after backward if a gradient is not finite")
    if checks_non_finite:
        policy = config.health.non_finite.policy
        reasons.append(f"health.non_finite.policy '{policy}' decides after backward whether the step is taken")
    if isinstance(optimizer, Lamb):
        reasons.append("Lamb's trust ratios need whole-parameter norms over every run before any update")
    if isinstance(optimizer, Muon):
        reasons.append("Muon orthogonalizes whole matrices, gathered from every rank, before any update")
    if zero.offload_optimizer is not None and zero.offload_optimizer.overlap_step:
        reasons.append("offload_optimizer.overlap_step runs the step behind the next window instead")
    if layout.ties:
        reasons.append("layers tied across pipeline stages sum their gradients after backward")
    if reasons:
        if wanted is True:
            raise ValueError(
                "zero_optimization.offload_optimizer.step_in_backward is true, but " + "; ".join(reasons)
                + '. Set it to "auto" (on where allowed) or false'
            )
        return False
    state.step_in_backward(optimizer, begin)
    return True
