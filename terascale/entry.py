"""``terascale.initialize``: one call from a model and a config to a training engine.

It composes the layers in order: the config is read and its ``"auto"`` values resolved;
the process groups are joined; the module is prepared (``prepare_model``, [Note: the order
of model preparation]); the data loader is built; and the engine is made, a
:class:`~terascale.pipe.PipelineEngine` for a ``PipelineModule`` (a layer over the
engine, which is why this call sits above both).
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed
from torch import nn
from torch.utils.data import DataLoader, Dataset

from terascale.comm import ModelParallelUnit, init_distributed
from terascale.config import AutoContext, Config
from terascale.engine import Engine, prepare_model
from terascale.engine.data import build_dataloader
from terascale.engine.monitor import check_monitor_packages
from terascale.engine.optimizer import OptimizerArg, SchedulerArg, check_optimizer_arguments
from terascale.engine.optimizer_handle import optimizer_handle
from terascale.engine.parallel import check_layout, model_parallel_unit
from terascale.errors import UsageError
from terascale.offload.policy import unpinned_keys
from terascale.parallel.sequence.groups import with_sequence_parallel
from terascale.pipe import PipelineEngine, PipelineModule
from terascale.plan import plan_for_initialize
from terascale.zero import WrapPolicy

logger = logging.getLogger("terascale")


def initialize(
    args: argparse.Namespace | None = None,
    model: nn.Module | None = None,
    optimizer: OptimizerArg = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Dataset | None = None,
    lr_scheduler: SchedulerArg = None,
    distributed_port: int | None = None,
    mpu: ModelParallelUnit | None = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable | None = None,
    config: Config | dict | str | pathlib.Path | None = None,
    mesh_param: tuple[int, int] | None = None,
    config_params: dict | None = None,
    *,
    wrap_policy: WrapPolicy | None = None,
) -> tuple[Engine, Any, DataLoader | None, Any]:
    """Build the engine for ``model`` from a DeepSpeed-compatible config.

    Joins (or creates) the process group, moves and casts the model, broadcasts rank 0's
    weights, and builds the optimizer and LR scheduler (from the config, or the ones
    passed in). Returns ``(engine, optimizer, dataloader, lr_scheduler)`` as DeepSpeed
    does; ``dataloader`` is None without ``training_data``; ``optimizer`` is an
    :class:`~terascale.engine.optimizer_handle.OptimizerHandle` on ``engine.optimizer``,
    whose ``step()`` updates the model as ``engine.step()`` does, without the scheduler.

    The arguments are DeepSpeed's, in its order (``args`` first: published programs call
    ``initialize(args, model, optimizer)`` and ``initialize(args, model=model)``).
    The config comes from ``config``, else ``config_params``, else ``args.config`` /
    ``args.deepspeed_config`` (see :func:`terascale.add_config_arguments`).
    ``wrap_policy`` chooses the parameter groups of ZeRO stages 1-3 (default: the
    repeated blocks of the model, see :class:`terascale.zero.WrapPolicy`).
    ``dist_init_required=False`` requires a process group to exist already instead of
    creating one; ``distributed_port`` is the rendezvous port where none is set;
    ``mesh_param=(data_parallel, sequence_parallel)`` sets the sequence-parallel size.
    """
    if model is None and isinstance(args, nn.Module):
        raise UsageError(
            "initialize: the first positional argument is args, as in DeepSpeed; pass the model as model=..."
        )
    if not isinstance(model, nn.Module):
        raise UsageError(f"initialize requires a model, a torch.nn.Module; got {type(model).__name__}")
    if dist_init_required is False and not torch.distributed.is_initialized():
        raise ValueError("initialize(dist_init_required=False): torch.distributed is not initialized; "
                         "initialize it first or pass dist_init_required=True")  # fmt: skip
    if distributed_port is not None and "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(distributed_port)  # as init_distributed(distributed_port=...)
    source = config if config is not None else config_params
    if source is None and args is not None:
        source = getattr(args, "config", None) or getattr(args, "deepspeed_config", None)
    if source is None:
        raise ValueError(
            "initialize needs a config: pass config= (a path, dict or JSON string) or "
            "args with --deepspeed_config"
        )
    cfg = Config.load(source)
    if mesh_param:
        cfg = _adopt_mesh(cfg, mesh_param)
    sequence_mpu = None
    if mpu is not None and hasattr(mpu, "initialize_sequence_parallel"):  # DeepSpeed's marker
        sequence_mpu, mpu = mpu, None
        cfg = _adopt_sequence_mpu(cfg, sequence_mpu)
    mpu = model_parallel_unit(model, cfg, mpu)
    dist_ctx = with_sequence_parallel(init_distributed(mpu), cfg.sp_size, sequence_mpu)
    check_layout(model, cfg, dist_ctx)
    # [Note: the planner at initialize]: "auto" stage, offload, micro-batch and checkpointing
    # chosen (or an explicit plan checked) before anything big is allocated.
    # A rank joining a running live elastic job takes its state from the running ranks, whose
    # plan stands: it runs none of its own (the planner's agreement is a collective they skip).
    planned = {} if dist_ctx.carried_state else plan_for_initialize(
        model, cfg, world=dist_ctx.dp_world_size, rank=dist_ctx.rank, training_data=training_data,
        collate_fn=collate_fn, wrap_policy=wrap_policy)  # fmt: skip
    # [Note: auto values]: what an integration gave is already in cfg; the rest comes
    # from the world size and the model as the user built it.
    cfg = cfg.resolve(AutoContext(world_size=dist_ctx.dp_world_size, model=model, given=planned))
    cfg.require_built().require_agreeing_precision()
    # Errors every rank raises alike, before the first collective.
    check_monitor_packages(cfg)
    check_optimizer_arguments(cfg, optimizer, lr_scheduler)
    if cfg.log_level is not None:
        logger.setLevel(cfg.log_level.upper())
    if dist_ctx.rank == 0:
        _log_config_notes(cfg)

    prepared = prepare_model(
        model, cfg, dist_ctx, wrap_policy=wrap_policy, optimizer=optimizer, model_parameters=model_parameters
    )
    loader = None
    if training_data is not None:
        loader = build_dataloader(
            training_data,
            micro_batch_size=cfg.resolve_batch(dist_ctx.dp_world_size).micro_batch_size,
            dp_rank=dist_ctx.dp_rank,
            dp_world_size=dist_ctx.dp_world_size,
            device=dist_ctx.device,
            collate_fn=collate_fn,
            drop_last=bool(getattr(cfg, "dataloader_drop_last", False)),
        )
    engine_class = PipelineEngine if isinstance(model, PipelineModule) else Engine
    # Built last: with checkpoint.auto_resume the engine resumes at the end of its
    # construction, the loader's position included.
    engine = engine_class(prepared, cfg, dist_ctx, optimizer=optimizer, lr_scheduler=lr_scheduler,
                          training_dataloader=loader)  # fmt: skip
    # A handle whose step() updates the model, as DeepSpeed's optimizer wrappers do
    # ([Note: the optimizer initialize returns]).
    handle = None if engine.optimizer is None else optimizer_handle(engine)
    return engine, handle, loader, engine.lr_scheduler


def _adopt_mesh(cfg: Config, mesh_param: tuple[int, int]) -> Config:
    """``cfg`` for DeepSpeed's ``mesh_param=(data_parallel, sequence_parallel)``: the sizes of
    a mesh over the world, whose second is the sequence-parallel size."""
    dp, sp = (int(n) for n in mesh_param)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    if dp * sp != world:
        raise ValueError(f"initialize(mesh_param={tuple(mesh_param)}): {dp} x {sp} ranks, but the world has {world}")
    return cfg.with_sp_size(sp, "mesh_param's sequence-parallel size")


def _adopt_sequence_mpu(cfg: Config, mpu: Any) -> Config:
    """``cfg`` for a DeepSpeed sequence-parallel ``mpu`` (DeepSpeed's ALST: its size; the
    program's data loader cuts the batches, so the engine does not). Raises ``ValueError``
    when the config names another size."""
    size = int(mpu.get_sequence_parallel_world_size())
    return cfg.with_sp_size(size, "the mpu's sequence-parallel size").with_section("sequence_parallel", split_batches=False)


def _log_config_notes(config: Config) -> None:
    """Say once, at start-up, what loading and resolving the config decided for the user."""
    for note in config.notes:
        logger.warning("config: %s", note)
    if config.resolved:
        logger.info('config: resolved "auto": %s', "; ".join(str(r) for r in config.resolved))
    offload = config.zero_optimization.offload_optimizer
    if offload is not None and offload.super_offload and not offload.overlap_step:
        logger.warning(
            "config: zero_optimization.offload_optimizer.super_offload: the host step runs as ZeRO-Offload's, "
            "after backward (terascale has no SuperOffload speculation); overlap_step: true runs it behind the "
            "next window instead, on parameters one step old"
        )
    unpinned = unpinned_keys(config)
    if unpinned:
        logger.warning(
            "config: %s: no accelerator on this machine, so host buffers are not pinned "
            "(pinning only speeds up copies to a GPU)", ", ".join(unpinned),
        )
