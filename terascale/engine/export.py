"""Weights out of the engine for other tools: a Hugging Face folder, one 16-bit file.

Both gather the full state dict on every rank (``engine.full_state_dict()``) and write on
rank 0 through ``engine.write_on_ranks``, so that every rank returns once the files are
complete, or raises the writer's error. They use only the engine's public API.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from torch import nn

from terascale.comm import DistributedContext
from terascale.comm import ops as comm_ops
from terascale.config import Config
from terascale.engine.precision import PrecisionPolicy

logger = logging.getLogger("terascale")


class Exporting(Protocol):
    """What the writers read of an engine."""

    module: nn.Module
    config: Config
    dist: DistributedContext
    precision: PrecisionPolicy

    def full_state_dict(self) -> dict[str, torch.Tensor]: ...

    def write_on_ranks(self, write: Callable[[], None] | None, what: str) -> None: ...


def save_pretrained(engine: Exporting, save_dir: str | Path, **kwargs: Any) -> None:
    """Write a Hugging Face folder of the current weights (fp32 masters) on rank 0 with
    the model's own ``save_pretrained``; ``from_pretrained`` loads it. Collective.

    For the wrapped module to be a ``transformers.PreTrainedModel``; ``kwargs`` go to its
    ``save_pretrained``. Gathers the full state dict in host memory; for models larger
    than that, save a checkpoint and run ``terascale consolidate --hf``, which streams one
    parameter at a time.
    """
    module = engine.module
    if not hasattr(module, "save_pretrained"):
        raise ValueError(
            f"save_pretrained needs a Hugging Face PreTrainedModel, this engine wraps a "
            f"{type(module).__name__}; use save_checkpoint and `terascale consolidate`"
        )
    state = engine.full_state_dict()

    def write() -> None:
        module.save_pretrained(str(save_dir), state_dict=state, **kwargs)

    engine.write_on_ranks(write if engine.dist.rank == 0 else None, f"save_pretrained to {save_dir}")


def buffer_dtypes(engine: Exporting) -> dict[str, torch.dtype]:
    """The dtype the model holds each buffer in, by name, every pipeline stage's (collective
    over the pipeline group): ``full_state_dict`` gives them all in fp32."""
    held = {name: b.dtype for name, b in engine.module.named_buffers()}
    if engine.dist.pp_world_size > 1:
        stages: list[Any] = [None] * engine.dist.pp_world_size
        comm_ops.all_gather_object(stages, held, group=engine.dist.pp_group)
        held = {name: dtype for stage in stages for name, dtype in stage.items()}
    return held


def in_compute_dtype(
    engine: Exporting, state: dict[str, torch.Tensor], buffers: dict[str, torch.dtype]
) -> dict[str, torch.Tensor]:
    """``state`` (a full state dict) as the model holds it, the weights a 16-bit save writes:
    floating parameters in the engine's compute dtype, each buffer in its own dtype
    (``buffers``, from :func:`buffer_dtypes`: [Note: buffer dtypes])."""
    dtype = engine.precision.compute_dtype

    def held(name: str, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t.contiguous()
        return t.to(buffers.get(name, dtype)).contiguous()

    return {k: held(k, v) for k, v in state.items()}


def save_16bit_model(engine: Exporting, save_dir: str | Path, save_filename: str = "pytorch_model.bin") -> bool:
    """Write the model's weights in the compute dtype (buffers in theirs) to
    ``save_dir/save_filename`` (rank 0).

    Collective. ``.safetensors`` names are written with safetensors, others with
    ``torch.save``, atomically (a failed write leaves an earlier file intact). At ZeRO
    stage 3 this needs ``zero_optimization.stage3_gather_16bit_weights_on_model_save`` (as
    in DeepSpeed): without it nothing is written and False is returned.
    """
    zero = engine.config.zero_optimization
    if zero.stage == 3 and not zero.gather_16bit_weights_on_model_save:
        logger.warning(
            "save_16bit_model: nothing saved; at stage 3 set "
            "zero_optimization.stage3_gather_16bit_weights_on_model_save to true"
        )
        return False
    state = in_compute_dtype(engine, engine.full_state_dict(), buffer_dtypes(engine))
    path = Path(save_dir) / save_filename

    def write() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        if path.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(state, str(tmp))  # full_state_dict copies every name: nothing shared
        else:
            torch.save(state, tmp)
        tmp.replace(path)  # atomic: a failed write leaves the previous file intact

    engine.write_on_ranks(write if engine.dist.rank == 0 else None, f"save_16bit_model to {path}")
    return True
