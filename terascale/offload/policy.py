"""Where model states live, as small frozen policies built from the config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from terascale.offload.aio import AioOptions
from terascale.offload.probe import aio_options


@dataclass(frozen=True)
class _Tier:
    """What both offload policies share: the device ("none", "cpu" or "nvme"), the NVMe
    directory, pinned host buffers (where a GPU is present) and the I/O engine's options."""

    device: str = "none"
    nvme_path: Path | None = None
    pin_memory: bool = False
    aio: AioOptions = field(default_factory=AioOptions)

    def __post_init__(self) -> None:
        assert self.device in ("none", "cpu", "nvme"), self.device
        assert self.device != "nvme" or self.nvme_path is not None

    @property
    def enabled(self) -> bool:
        return self.device != "none"


@dataclass(frozen=True)
class OptimizerOffload(_Tier):
    """``zero_optimization.offload_optimizer``: the tier of fp32 masters and optimizer state.

    "cpu" keeps them in host memory, "nvme" in swap files under ``nvme_path`` moved through
    ``buffer_count`` host buffers. ``ratio``: the fraction of this rank's optimizer runs (by
    elements, first runs first) that go to the tier; the rest stay with the parameter shards.
    """

    buffer_count: int = 4
    ratio: float = 1.0
    state_bytes: float = 8.0  # optimizer state per element beside the master (Adam: 8)
    # state entries kept in memory, not in the NVMe swap files (Muon's momentum with
    # zero_optimization.save_muon_momentum_buffer_in_memory, as in DeepSpeed)
    in_memory_state: tuple[str, ...] = ()
    overlap_step: bool = False  # the step behind the next window ([Note: the overlapped host step])
    overlap_step_warmup: int = 0  # steps taken synchronously first


@dataclass(frozen=True)
class ParamOffload(_Tier):
    """``zero_optimization.offload_param``: where stage-3 parameter shards live between uses.

    ``buffer_count`` host buffers, each as large as the largest group shard, carry NVMe
    reads and the step's writes; no parameter may exceed ``buffer_size`` elements (as in
    DeepSpeed, whose buffers hold one parameter each); the first ``max_in_cpu`` elements
    of shards stay in host memory.
    """

    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000


def optimizer_offload(config: object) -> OptimizerOffload:
    """The :class:`OptimizerOffload` a validated :class:`terascale.config.Config` asks for."""
    from terascale.optim.muon import MOMENTUM_KEY
    from terascale.zero.estimate import optimizer_state_bytes

    policy = _policy(OptimizerOffload, config.zero_optimization.offload_optimizer, config.aio, ("ratio", "overlap_step", "overlap_step_warmup"))
    section = config.optimizer
    state = optimizer_state_bytes(section.type if section else None, section.params if section else None)
    if config.bf16.states_in_bf16:
        state /= 2  # [Note: bf16 masters and optimizer states]: Adam's moments in bf16
    muon = section is not None and section.type.lower() == "muon"
    in_memory = (MOMENTUM_KEY,) if muon and config.zero_optimization.save_muon_momentum_buffer_in_memory else ()
    return dataclasses.replace(policy, state_bytes=state, in_memory_state=in_memory)


def param_offload(config: object) -> ParamOffload:
    """The :class:`ParamOffload` a validated :class:`terascale.config.Config` asks for."""
    fields = ("buffer_size", "max_in_cpu")
    return _policy(ParamOffload, config.zero_optimization.offload_param, config.aio, fields)


def _policy(cls: type, section: object, aio: object, extra: tuple[str, ...]):
    if section is None or section.device == "none":
        return cls()
    common = ("device", "nvme_path", "buffer_count", *extra)
    # Published configs ask for pinned buffers (written for GPU machines); without an
    # accelerator there is nothing to pin for, and the engine says so once at start-up.
    pin = section.pin_memory and can_pin_memory()
    options = aio_options(aio, section.nvme_path if section.device == "nvme" else None)
    return cls(**{name: getattr(section, name) for name in common}, pin_memory=pin, aio=options)


def can_pin_memory() -> bool:
    """Whether page-locked host memory means anything here: only with an accelerator to
    copy to (torch refuses ``pin_memory=True`` without one)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return torch.cuda.is_available()


def unpinned_keys(config: object) -> list[str]:
    """The config's ``pin_memory: true`` settings that this machine cannot honour."""
    if can_pin_memory():
        return []
    zero = config.zero_optimization
    return [
        f"zero_optimization.{name}.pin_memory"
        for name in ("offload_optimizer", "offload_param")
        if getattr(zero, name) is not None and getattr(zero, name).pin_memory
    ]
