"""Where model states live, as small frozen policies built from the config."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from terascale.offload.aio import AioOptions


@dataclass(frozen=True)
class OptimizerOffload:
    """``zero_optimization.offload_optimizer``: the tier of fp32 masters and optimizer state.

    ``device``: "none" (with the parameter shards), "cpu" (host memory, pinned with
    ``pin_memory`` where a GPU is present) or "nvme" (swap files under ``nvme_path``,
    moved through ``buffer_count`` host buffers). ``ratio``: the fraction of this rank's
    optimizer runs (by elements, first runs first) that go to the tier; the rest stay with
    the parameter shards.
    """

    device: str = "none"
    nvme_path: Path | None = None
    pin_memory: bool = False
    buffer_count: int = 4
    ratio: float = 1.0
    aio: AioOptions = field(default_factory=AioOptions)

    def __post_init__(self) -> None:
        assert self.device in ("none", "cpu", "nvme"), self.device
        assert self.device != "nvme" or self.nvme_path is not None

    @property
    def enabled(self) -> bool:
        return self.device != "none"


def optimizer_offload(config: object) -> OptimizerOffload:
    """The :class:`OptimizerOffload` a validated :class:`terascale.config.Config` asks for."""
    section = config.zero_optimization.offload_optimizer
    if section is None or section.device == "none":
        return OptimizerOffload()
    return OptimizerOffload(
        device=section.device,
        nvme_path=section.nvme_path,
        pin_memory=section.pin_memory,
        buffer_count=section.buffer_count,
        ratio=section.ratio,
        aio=AioOptions.from_config(config.aio),
    )
