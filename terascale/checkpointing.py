"""DeepSpeed's activation checkpointing API (``deepspeed.checkpointing``), on terascale's.

Megatron-style models call ``checkpointing.configure(mpu, deepspeed_config=...)`` once and
``checkpointing.checkpoint(layer, *inputs)`` in their forward. This module keeps what
those calls configure - one :class:`~terascale.activation.ActivationCheckpointing` and the
tensor-parallel RNG tracker - in a single process-wide holder: the API is module-level
by its definition, as torch's default generator is. Everything else in terascale passes
its checkpointing object explicitly. ``terascale.initialize`` configures this API from
its config when no ``configure`` call came first, so calls inside a model follow the
``activation_checkpointing`` section.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from terascale.activation import ActivationCheckpointing, build_checkpointing, tensor_parallel_group
from terascale.activation.rng import MODEL_PARALLEL_RNG, RNGStatesTracker, default_device, seed_model_parallel


class _Holder:
    """What ``configure`` set: the checkpointing object, the mpu, the tracker."""

    def __init__(self) -> None:
        self.tracker = RNGStatesTracker()
        self.checkpointing: ActivationCheckpointing | None = None
        self.mpu: Any = None
        self.owned = False  # built by configure (closed by reset), not lent by an engine


_API = _Holder()


def configure(
    mpu_: Any = None,
    deepspeed_config: str | Path | dict | Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Configure checkpointing from a config (path, dict or ``Config``) and/or arguments;
    arguments override the config's ``activation_checkpointing`` keys."""
    from terascale.config import Config

    if deepspeed_config is None:
        config = Config.load({})
    elif isinstance(deepspeed_config, Config):
        config = deepspeed_config
    else:
        config = Config.load(deepspeed_config)
    overrides = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    section = config.activation_checkpointing.model_copy(update={k: v for k, v in overrides.items() if v is not None})
    _close_owned()
    _API.mpu = mpu_
    rank = dist.get_rank() if dist.is_initialized() else 0
    _API.checkpointing = build_checkpointing(
        section, default_device(), _API.tracker, aio=config.aio, partition_group=tensor_parallel_group(mpu_), rank=rank
    )
    _API.owned = True


def adopt(checkpointing: ActivationCheckpointing, mpu: Any = None) -> bool:
    """Let the module-level calls use an engine's ``checkpointing`` unless ``configure`` was
    called; returns whether it was adopted."""
    if _API.checkpointing is not None:
        return False
    _API.checkpointing, _API.mpu, _API.owned = checkpointing, mpu, False
    return True


def release(checkpointing: ActivationCheckpointing) -> None:
    """An engine is done with ``checkpointing``: stop using it here if it was adopted."""
    if _API.checkpointing is checkpointing and not _API.owned:
        _API.checkpointing, _API.mpu = None, None


def is_configured() -> bool:
    """Whether ``configure`` was called (or an engine lent its checkpointing)."""
    return _API.checkpointing is not None


def reset() -> None:
    """Clear per-step state: statistics and the contiguous buffers' fill (DeepSpeed calls it
    between forwards that have no backward, e.g. in evaluation)."""
    if _API.checkpointing is not None:
        _API.checkpointing.reset_stats()


def _close_owned() -> None:
    if _API.checkpointing is not None and _API.owned:
        _API.checkpointing.close()
    _API.checkpointing, _API.owned = None, False


def _current() -> ActivationCheckpointing:
    if _API.checkpointing is None:  # DeepSpeed's defaults: checkpoints on the device
        configure()
    return _API.checkpointing


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` keeping only its inputs; recomputed in backward with
    the same random numbers. Outputs may be tensors, tuples of tensors and non-tensors."""
    return _current().checkpoint(function, *args, **kwargs)


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's name for the non-reentrant form, which :func:`checkpoint` is too. A
    function of its own, not an alias, because DeepSpeed's pipeline tells the two forms
    apart by identity: a ``PipelineModule`` whose ``activation_checkpoint_func`` is this one
    checkpoints without re-entering backward (``pipeline.use_reentrant: false``)."""
    return _current().checkpoint(function, *args, **kwargs)


def reentrant_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """:func:`checkpoint` in torch's reentrant form (the forward under ``no_grad``, a nested
    backward around the recompute), with the same RNG replay and input placement: what
    DeepSpeed's ``checkpoint`` is, and a pipeline's default (``pipeline.use_reentrant``)."""
    return _current().run(function, args, kwargs, reentrant=True)


def checkpoint_sequential(functions: nn.Sequential | Sequence[Callable], segments: int, input: Any, **kwargs: Any) -> Any:
    """``functions`` applied in order, checkpointed in ``segments`` pieces."""
    return _current().checkpoint_sequential(functions, segments, input, **kwargs)


def get_rng_tracker() -> RNGStatesTracker:
    """The tensor-parallel RNG tracker (``with get_rng_tracker().fork():`` for sliced dropout)."""
    return _API.tracker


get_cuda_rng_tracker = get_rng_tracker  # DeepSpeed's and Megatron's name


def model_parallel_manual_seed(seed: int) -> None:
    """Seed the default stream with ``seed`` (shared by tensor-parallel ranks) and the
    tracker's ``model-parallel-rng`` stream per tensor-parallel rank."""
    mpu = _API.mpu
    tp_rank = 0
    for name in ("get_tensor_model_parallel_rank", "get_model_parallel_rank"):
        if mpu is not None and hasattr(mpu, name):
            tp_rank = getattr(mpu, name)()
            break
    seed_model_parallel(_API.tracker, seed, tp_rank)


model_parallel_cuda_manual_seed = model_parallel_manual_seed  # DeepSpeed's and Megatron's name

__all__ = [
    "MODEL_PARALLEL_RNG",
    "checkpoint",
    "checkpoint_sequential",
    "configure",
    "get_cuda_rng_tracker",
    "get_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "model_parallel_manual_seed",
    "non_reentrant_checkpoint",
    "reentrant_checkpoint",
    "reset",
]
