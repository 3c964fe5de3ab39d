"""Where model states live, as small frozen policies built from the config."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from terascale.offload.aio import AioOptions


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


@dataclass(frozen=True)
class ParamOffload(_Tier):
    """``zero_optimization.offload_param``: where stage-3 parameter shards live between uses.

    ``buffer_count`` host buffers, each as large as the largest shard (which must not
    exceed ``buffer_size`` elements), carry NVMe reads; the first ``max_in_cpu`` elements of
    shards stay in host memory.
    """

    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000


def optimizer_offload(config: object) -> OptimizerOffload:
    """The :class:`OptimizerOffload` a validated :class:`terascale.config.Config` asks for."""
    return _policy(OptimizerOffload, config.zero_optimization.offload_optimizer, config.aio, ("ratio",))


def param_offload(config: object) -> ParamOffload:
    """The :class:`ParamOffload` a validated :class:`terascale.config.Config` asks for."""
    fields = ("buffer_size", "max_in_cpu")
    return _policy(ParamOffload, config.zero_optimization.offload_param, config.aio, fields)


def _policy(cls: type, section: object, aio: object, extra: tuple[str, ...]):
    if section is None or section.device == "none":
        return cls()
    common = ("device", "nvme_path", "pin_memory", "buffer_count", *extra)
    return cls(**{name: getattr(section, name) for name in common}, aio=AioOptions.from_config(aio))
