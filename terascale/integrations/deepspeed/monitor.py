"""``deepspeed.monitor``: the metric writers built from their config sections.

DeepSpeed's monitors take one section (``TensorBoardMonitor(config.monitor_config.tensorboard)``),
expose its fields (``enabled``, ``output_path``, ``job_name``, ...) and write
``[(name, value, step), ...]`` with ``write_events``. Here each is a view of the section
that, when enabled, writes through terascale's own backend
(:mod:`terascale.engine.monitor`), on the rank that reports (global rank 0), as
DeepSpeed's do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from pydantic import BaseModel, ConfigDict

from terascale.config.schema import Config, CsvMonitorConfig, TensorBoardConfig, WandbConfig
from terascale.engine import monitor as _backends


def _writes() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class _SectionMonitor:
    """A monitor over one config section: its fields as attributes, a backend when enabled."""

    def __init__(self, section: Any) -> None:
        self.config = section
        for name in type(section).model_fields:
            setattr(self, name, getattr(section, name))
        self._backend: Any = None

    def _build(self) -> Any:
        raise NotImplementedError

    def write_events(self, event_list: Sequence[tuple[str, float, int]]) -> None:
        """Record ``(name, value, step)`` events (nothing when disabled or off rank 0)."""
        if not (self.enabled and _writes()):
            return
        if self._backend is None:
            self._backend = self._build()
        self._backend.write(list(event_list))

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
            self._backend = None


class TensorBoardMonitor(_SectionMonitor):
    def _build(self) -> Any:
        return _backends.TensorBoardMonitor(self.output_path, self.job_name)


class csvMonitor(_SectionMonitor):  # noqa: N801 - DeepSpeed's name
    def _build(self) -> Any:
        return _backends.CsvMonitor(self.output_path, self.job_name)


class WandbMonitor(_SectionMonitor):
    def _build(self) -> Any:
        return _backends.WandbMonitor(self.project, self.group, self.team)


class CometConfig(BaseModel):
    """``comet``: DeepSpeed's Comet monitor section (terascale's config refuses it enabled)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = False
    samples_log_interval: int = 100
    project: str | None = None
    workspace: str | None = None
    api_key: str | None = None
    experiment_name: str | None = None
    experiment_key: str | None = None
    online: bool | None = None
    mode: str | None = None


class CometMonitor(_SectionMonitor):
    """The Comet monitor: its section's fields; enabled, it is refused (no Comet backend)."""

    def __init__(self, section: Any) -> None:
        super().__init__(section)
        if self.enabled:
            raise ValueError("comet.enabled: terascale has no Comet monitor; use tensorboard, wandb or csv_monitor")


class DeepSpeedMonitorConfig:
    """The monitor sections of a config (``DeepSpeedMonitorConfig()``: their defaults)."""

    def __init__(self, config: Config | None = None, **sections: Any) -> None:
        self.tensorboard = config.tensorboard if config else TensorBoardConfig(**sections.get("tensorboard", {}))
        self.wandb = config.wandb if config else WandbConfig(**sections.get("wandb", {}))
        self.csv_monitor = config.csv_monitor if config else CsvMonitorConfig(**sections.get("csv_monitor", {}))
        comet = getattr(config, "comet", None) if config else sections.get("comet")
        self.comet = CometConfig(**(comet or {}))

    @property
    def enabled(self) -> bool:
        return self.tensorboard.enabled or self.wandb.enabled or self.csv_monitor.enabled


class MonitorMaster:
    """Every enabled monitor of a :class:`DeepSpeedMonitorConfig`, written together."""

    def __init__(self, monitor_config: DeepSpeedMonitorConfig) -> None:
        self.enabled = monitor_config.enabled
        self.tb_monitor = TensorBoardMonitor(monitor_config.tensorboard)
        self.wandb_monitor = WandbMonitor(monitor_config.wandb)
        self.csv_monitor = csvMonitor(monitor_config.csv_monitor)

    def write_events(self, event_list: Sequence[tuple[str, float, int]]) -> None:
        for m in (self.tb_monitor, self.wandb_monitor, self.csv_monitor):
            m.write_events(event_list)
