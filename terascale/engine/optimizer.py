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
from terascale.engine.model_state import ModelState, adopt_optimizer
from terascale.engine.parallel import ParallelLayout
from terascale.optim import build_optimizer, build_scheduler

OptimizerArg = torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None
SchedulerArg = Any  # an LR scheduler instance or a callable(optimizer) -> scheduler


def check_optimizer_arguments(config: Config, optimizer: OptimizerArg, lr_scheduler: SchedulerArg) -> None:
    """Refuse an optimizer (scheduler) passed to ``initialize`` beside the config's own."""
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
) -> torch.optim.Optimizer:
    """The optimizer over ``state``'s parameter groups (fp32 masters or their shards),
    checked against what the state and the parallel layout can step."""
    section = config.optimizer
    groups = state.optimizer_param_groups()
    if isinstance(optimizer, torch.optim.Optimizer):
        adopt_optimizer(optimizer, groups)
        built = optimizer
    elif callable(optimizer):
        built = optimizer(groups)
    elif section is None:
        raise ValueError(
            "no optimizer: add an 'optimizer' section to the config (e.g. "
            '{"type": "AdamW", "params": {"lr": 1e-3}}) or pass optimizer= to terascale.initialize'
        )
    else:
        built = build_optimizer(section.type, dict(section.params), groups)
    state.check_optimizer(built)
    layout.check_optimizer(built)
    return built


def engine_scheduler(lr_scheduler: SchedulerArg, config: Config, optimizer: torch.optim.Optimizer) -> Any:
    """The LR scheduler of ``optimizer``: the config's, the one passed, or None."""
    section = config.scheduler
    if section is not None:
        return build_scheduler(section.type, dict(section.params), optimizer)
    if lr_scheduler is not None and not hasattr(lr_scheduler, "step") and callable(lr_scheduler):
        return lr_scheduler(optimizer)
    return lr_scheduler
