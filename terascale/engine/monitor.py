"""Where training metrics go: CSV files, TensorBoard, Weights & Biases; step timers.

One rank writes (:class:`Reporter`). Each backend is built from its DeepSpeed config
section; asking for a backend whose package is missing is an error at start-up, not a
silent no-op.
"""

from __future__ import annotations

import csv
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from terascale.comm import DistributedContext


class Monitor(Protocol):
    def write(self, events: Sequence[tuple[str, float, int]]) -> None:
        """Record ``(name, value, step)`` events."""

    def close(self) -> None: ...


class CsvMonitor:
    """One CSV file per metric, ``<output_path>/<job_name>/<metric>.csv`` with step,value rows."""

    def __init__(self, output_path: str, job_name: str) -> None:
        self.dir = os.path.join(output_path or "./csv_monitor", job_name or "terascale")
        os.makedirs(self.dir, exist_ok=True)

    def write(self, events: Sequence[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            path = os.path.join(self.dir, name.replace("/", "_") + ".csv")
            new = not os.path.exists(path)
            with open(path, "a", newline="") as f:
                w = csv.writer(f)
                if new:
                    w.writerow(["step", name])
                w.writerow([step, value])

    def close(self) -> None:
        pass


class TensorBoardMonitor:
    def __init__(self, output_path: str, job_name: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # tensorboard is an optional dependency
            raise ValueError(
                "tensorboard.enabled is true but the 'tensorboard' package is not installed; "
                "pip install tensorboard, or set tensorboard.enabled to false"
            ) from e
        self._writer = SummaryWriter(log_dir=os.path.join(output_path or "./runs", job_name or "terascale"))

    def write(self, events: Sequence[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbMonitor:
    def __init__(self, project: str | None, group: str | None, team: str | None) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ValueError(
                "wandb.enabled is true but the 'wandb' package is not installed; "
                "pip install wandb, or set wandb.enabled to false"
            ) from e
        self._wandb = wandb
        wandb.init(project=project, group=group, entity=team)

    def write(self, events: Sequence[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            self._wandb.log({name: value}, step=step)

    def close(self) -> None:
        self._wandb.finish()


def check_monitor_packages(config) -> None:
    """Raise the ValueError a missing monitor package causes, on every rank: only the
    writing rank builds the monitors, and an error there alone would leave its peers
    waiting in the engine's first collective."""
    import importlib.util

    for section, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if getattr(config, section).enabled and importlib.util.find_spec(package) is None:
            raise ValueError(
                f"{section}.enabled is true but the '{package}' package is not installed; "
                f"pip install {package}, or set {section}.enabled to false"
            )


def build_monitors(config) -> list[Monitor]:
    """The monitors a config enables (call on the writing rank only)."""
    monitors: list[Monitor] = []
    if config.csv_monitor.enabled:
        monitors.append(CsvMonitor(config.csv_monitor.output_path, config.csv_monitor.job_name))
    if config.tensorboard.enabled:
        monitors.append(TensorBoardMonitor(config.tensorboard.output_path, config.tensorboard.job_name))
    if config.wandb.enabled:
        monitors.append(WandbMonitor(config.wandb.project, config.wandb.group, config.wandb.team))
    return monitors


class Reporter:
    """The run's metrics writer: owns the config's monitors on the reporting rank.

    That rank is the first of its data-parallel, tensor-parallel and pipeline groups
    (``reports``): every tensor-parallel rank and pipeline stage sees the same loss, so one
    writes and logs for all. Elsewhere the reporter writes nothing. Events are stamped
    with ``samples()``, the global sample count (the x axis DeepSpeed's monitors use).
    """

    def __init__(self, config, dist_ctx: DistributedContext, samples: Callable[[], int]) -> None:
        self.reports = dist_ctx.dp_rank == 0 and dist_ctx.tp_rank == 0 and dist_ctx.pp_rank == 0 and dist_ctx.sp_rank == 0
        self._monitors: list[Monitor] = build_monitors(config) if self.reports else []
        self._samples = samples

    @property
    def writes(self) -> bool:
        """Whether any monitor is listening (on this rank)."""
        return bool(self._monitors)

    def write(self, metrics: Mapping[str, float]) -> None:
        """Record ``{name: value}`` at the current sample count (a no-op off the reporting rank)."""
        if not self._monitors:
            return
        x = self._samples()
        events = [(name, float(value), x) for name, value in metrics.items()]
        for m in self._monitors:
            m.write(events)

    def close(self) -> None:
        for m in self._monitors:
            m.close()
        self._monitors = []


class StepTimers:
    """Wall-clock time of forward, backward and step, summed between reports.

    Timing a device that runs asynchronously needs a synchronisation per phase, so the
    timers are only active when ``wall_clock_breakdown`` asks for them.
    """

    PHASES = ("forward", "backward", "step")

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled = enabled
        self._device = device
        self._start: dict[str, float] = {}
        self.totals: dict[str, float] = dict.fromkeys(self.PHASES, 0.0)

    def _sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def start(self, phase: str) -> None:
        if self.enabled:
            self._sync()
            self._start[phase] = time.perf_counter()

    def stop(self, phase: str) -> None:
        if self.enabled:
            self._sync()
            self.totals[phase] += time.perf_counter() - self._start.pop(phase)

    def take(self) -> dict[str, float]:
        """Seconds per phase since the last call, then reset."""
        totals, self.totals = self.totals, dict.fromkeys(self.PHASES, 0.0)
        return totals
