"""``terascale.initialize``: one call from a model and a config to a training engine."""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from torch.utils.data import DataLoader, Dataset

from terascale.comm import ModelParallelUnit, init_distributed
from terascale.config import AutoContext, Config
from terascale.engine.data import build_dataloader
from terascale.engine.engine import Engine, OptimizerArg, SchedulerArg
from terascale.engine.parallel import check_layout, model_parallel_unit
from terascale.parallel.tensor import auto_tp
from terascale.zero import WrapPolicy


def initialize(
    model: nn.Module,
    optimizer: OptimizerArg = None,
    model_parameters: Iterable[Any] | None = None,
    config: Config | dict | str | pathlib.Path | None = None,
    training_data: Dataset | None = None,
    lr_scheduler: SchedulerArg = None,
    mpu: ModelParallelUnit | None = None,
    collate_fn: Callable | None = None,
    args: argparse.Namespace | None = None,
    config_params: dict | None = None,
    wrap_policy: WrapPolicy | None = None,
) -> tuple[Engine, Any, DataLoader | None, Any]:
    """Build the engine for ``model`` from a DeepSpeed-compatible config.

    Joins (or creates) the process group, moves and casts the model, broadcasts rank 0's
    weights, and builds the optimizer and LR scheduler (from the config, or the ones
    passed in). Returns ``(engine, optimizer, dataloader, lr_scheduler)`` as DeepSpeed
    does; ``dataloader`` is None without ``training_data``.

    The config comes from ``config``, else ``config_params``, else ``args.config`` /
    ``args.deepspeed_config`` (see :func:`terascale.add_config_arguments`).
    ``wrap_policy`` chooses the parameter groups of ZeRO stages 1-3 (default: the
    repeated blocks of the model, see :class:`terascale.zero.WrapPolicy`).
    """
    source = config if config is not None else config_params
    if source is None and args is not None:
        source = getattr(args, "config", None) or getattr(args, "deepspeed_config", None)
    if source is None:
        raise ValueError(
            "terascale.initialize needs a config: pass config= (a path, dict or JSON string) or "
            "args with --config"
        )
    cfg = Config.load(source)
    mpu = model_parallel_unit(model, cfg, mpu)
    dist_ctx = init_distributed(mpu)
    check_layout(model, cfg, dist_ctx)
    if cfg.tensor_parallel.autotp_size > 1:
        # Sliced before anything reads the model's sizes or parameters (auto values, ZeRO).
        auto_tp(model, dist_ctx.mp_group)
    # [Note: auto values]: what an integration gave is already in cfg; the rest comes
    # from the world size and the model.
    cfg = cfg.resolve(AutoContext(world_size=dist_ctx.dp_world_size, model=model))
    cfg.require_built()
    engine = Engine(
        model,
        cfg,
        dist_ctx,
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler,
        wrap_policy=wrap_policy,
    )
    loader = None
    if training_data is not None:
        loader = build_dataloader(
            training_data,
            micro_batch_size=engine.micro_batch_size,
            dp_rank=dist_ctx.dp_rank,
            dp_world_size=dist_ctx.dp_world_size,
            device=dist_ctx.device,
            collate_fn=collate_fn,
            drop_last=bool(getattr(cfg, "dataloader_drop_last", False)),
        )
    engine.training_dataloader = loader
    # After the loader exists: resuming restores its position too.
    engine._resilience.auto_resume()
    return engine, engine.optimizer, loader, engine.lr_scheduler
