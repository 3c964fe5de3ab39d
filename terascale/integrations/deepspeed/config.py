"""``DeepSpeedConfig``: a loaded config read through DeepSpeed's attribute names.

DeepSpeed programs build one to read batch sizes and precision before (or without) an
engine: ``DeepSpeedConfig(args.deepspeed_config).train_micro_batch_size_per_gpu``. It is
a view of :class:`terascale.config.Config` (validated the same way, with the same errors);
the batch sizes are resolved for the data-parallel world size of the current process
group (the world divided by the ``mpu``'s model-parallel size, if one is given).
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from terascale.config import Config


class DeepSpeedConfig:
    """DeepSpeed's config object over terascale's :class:`~terascale.config.Config`."""

    def __init__(self, config: str | os.PathLike | dict | Config, mpu: Any = None, mesh_device: Any = None) -> None:
        self.config = Config.load(config)
        self._param_dict = self.config.to_dict()
        world = dist.get_world_size() if dist.is_initialized() else 1
        if mpu is not None:
            world = mpu.get_data_parallel_world_size()
        self.world_size = world
        zero = self.config.zero_optimization
        self.zero_config = zero
        self.zero_optimization_stage = zero.stage
        self.zero_enabled = zero.stage > 0
        self.fp16_enabled = self.config.fp16.enabled
        self.bfloat16_enabled = self.config.bf16.enabled
        self.gradient_clipping = self.config.gradient_clipping
        self.steps_per_print = self.config.steps_per_print
        self.wall_clock_breakdown = self.config.wall_clock_breakdown
        self.optimizer_name = None if self.config.optimizer is None else self.config.optimizer.type.lower()
        self.optimizer_params = None if self.config.optimizer is None else dict(self.config.optimizer.params)
        self.scheduler_name = None if self.config.scheduler is None else self.config.scheduler.type
        self.scheduler_params = None if self.config.scheduler is None else dict(self.config.scheduler.params)
        self.sparse_attention = None  # refused by the config when present: never configured here
        from terascale.integrations.deepspeed.monitor import DeepSpeedMonitorConfig

        self.monitor_config = DeepSpeedMonitorConfig(self.config)
        if self.config.auto_keys:  # an integration fills these at initialize
            self.train_batch_size = self.train_micro_batch_size_per_gpu = self.gradient_accumulation_steps = None
        else:
            batch = self.config.resolve_batch(world)
            self.train_batch_size = batch.train_batch_size
            self.train_micro_batch_size_per_gpu = batch.micro_batch_size
            self.gradient_accumulation_steps = batch.gradient_accumulation_steps

    def __repr__(self) -> str:
        return f"DeepSpeedConfig({self._param_dict!r})"
