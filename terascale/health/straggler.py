"""Names the ranks whose compute lags their peers': the step-time straggler detector.

[Note: straggler compute time]
Collectives equalise wall time: a fast rank waits inside the gradient reduction (or, at
ZeRO-3, the next parameter gather) for the slow one, so every rank's step takes as long
as the slowest rank's. What differs is the time *not* spent waiting. Each rank therefore
measures its forward and backward wall time and subtracts the time it was blocked in the
model state's collective waits (``terascale.engine.model_state.collective_wait_s``: FlatParamGroup gathers,
reduce-scatters, bucket all-reduces), which leaves its own compute. On an accelerator
that runs asynchronously, wall time on the host means little, so only the window before
a check is measured, with the device synchronised around each phase; the other windows
run untouched. Ranks compare themselves with the ranks of their own pipeline stage
(different stages hold different layers).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from terascale.comm import ops

logger = logging.getLogger("terascale")


@dataclass(frozen=True)
class StragglerReport:
    """One check: every rank's compute seconds for the measured step, and the slow ones."""

    step: int
    compute_s: tuple[float, ...]  # by global rank
    stage: tuple[int, ...]  # pipeline stage of each rank
    stragglers: tuple[tuple[int, float], ...]  # (rank, compute / median of its stage)

    @property
    def max_ratio(self) -> float:
        return max((self.ratio(r) for r in range(len(self.compute_s))), default=1.0)

    def ratio(self, rank: int) -> float:
        median = self._median(self.stage[rank])
        return self.compute_s[rank] / median if median > 0 else 1.0

    def _median(self, stage: int) -> float:
        return statistics.median(c for c, s in zip(self.compute_s, self.stage) if s == stage)

    def describe(self) -> str:
        parts = []
        for rank, ratio in self.stragglers:
            median = self._median(self.stage[rank])
            parts.append(
                f"rank {rank} computed for {self.compute_s[rank]:.3f} s, {ratio:.2f}x the median {median:.3f} s"
                + (f" of pipeline stage {self.stage[rank]}" if max(self.stage) > 0 else "")
            )
        return f"straggler at step {self.step}: " + "; ".join(parts)


def find_stragglers(step: int, compute_s: list[float], stage: list[int], threshold: float) -> StragglerReport:
    """The ranks whose ``compute_s`` exceeds ``threshold`` x the median of their stage's ranks."""
    report = StragglerReport(step, tuple(compute_s), tuple(stage), ())
    slow = tuple((r, report.ratio(r)) for r in range(len(compute_s)) if report.ratio(r) > threshold)
    return StragglerReport(step, tuple(compute_s), tuple(stage), slow)


class StragglerDetector:
    """Measures one step in every ``every_n_steps`` and compares the ranks (collective).

    The engine wraps its forward and backward in :meth:`phase` and calls :meth:`check`
    after each optimizer step; ``waited`` returns the model state's cumulative seconds
    blocked in collectives.
    """

    def __init__(
        self,
        every_n_steps: int,
        threshold: float,
        *,
        device: torch.device,
        pp_rank: int,
        waited: Callable[[], float],
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.every_n_steps = every_n_steps
        self.threshold = threshold
        self._device = device
        self._pp_rank = pp_rank
        self._waited = waited
        self._group = group  # every rank (None: the default group)
        self._measuring = False
        self._compute_s = 0.0
        self.last: StragglerReport | None = None

    def window_starts(self, next_step: int) -> None:
        """The window that completes optimizer step ``next_step`` begins: measure it if a
        check follows it."""
        self._measuring = next_step % self.every_n_steps == 0
        self._compute_s = 0.0

    @contextmanager
    def phase(self) -> Iterator[None]:
        """Time the enclosed forward or backward into this window's compute (when measured)."""
        if not self._measuring:
            yield
            return
        _synchronize(self._device)
        waited, started = self._waited(), time.perf_counter()
        yield
        _synchronize(self._device)
        self._compute_s += (time.perf_counter() - started) - (self._waited() - waited)

    def check(self, step: int) -> StragglerReport | None:
        """After optimizer step ``step``: on a measured step, gather every rank's compute
        time (all ranks call this) and return the report; else None."""
        if not self._measuring:
            return None
        self._measuring = False
        world = dist.get_world_size(self._group) if dist.is_initialized() else 1
        mine = torch.tensor([self._compute_s, float(self._pp_rank)], dtype=torch.float64, device=self._device)
        everyone = [torch.empty_like(mine) for _ in range(world)]
        if world > 1:
            ops.all_gather(everyone, mine, group=self._group)
        else:
            everyone = [mine]
        rows = torch.stack(everyone).cpu().tolist()
        self.last = find_stragglers(step, [r[0] for r in rows], [int(r[1]) for r in rows], self.threshold)
        return self.last


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
