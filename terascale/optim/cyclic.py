"""Cyclic schedules with DeepSpeed's names, parameters and formulas: the 1Cycle policy
and the LR range test used to pick its bounds (Smith, "A disciplined approach to
neural network hyper-parameters", arXiv:1803.09820).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from terascale.optim.schedulers import LRSchedule, as_float_list, check_int, per_group

__all__ = ["LRRangeTest", "OneCycle"]


class OneCycle(LRSchedule):
    """1Cycle: LR up then down between two bounds (momentum the opposite way), then decay.

    With ``b = i + 1`` (``i`` = ``last_batch_iteration``), ``S1``/``S2`` the two half-cycle
    lengths, ``S = S1 + S2`` and ``r = S1 / S``, the cycle position is
    ``x = 1 + b/S - floor(1 + b/S)`` and the scale is ``x / r`` on the way up
    (``x <= r``) and ``(x - 1) / (r - 1)`` on the way down. With a stair count ``k > 0``
    for that half, the scale is quantised from the integer offset ``c = b mod S``:
    ``floor(c * k / S1) / k`` going up, ``floor((S - c) * k / S2) / k`` going down.

    * cycle (``i < S``): ``lr = min_lr + (max_lr - min_lr) * scale`` and
      ``mom = max_mom - (max_mom - min_mom) * scale``;
    * decay (``i >= S``, ``d = i - S + 1``): ``lr = min_lr / (1 + decay_lr_rate * d /
      decay_step_size)`` and ``mom = max_mom * (1 + decay_mom_rate * d /
      decay_step_size)``; with ``decay_step_size = 0`` or a zero rate they stay at
      ``min_lr`` / ``max_mom``.

    A fresh schedule sets ``lr = cycle_min_lr`` and ``mom = cycle_min_mom`` at
    construction, as DeepSpeed does. The momentum is written to ``betas[0]`` of groups
    that have ``betas`` (Adam, Lamb; ``betas[1]`` is kept, where DeepSpeed resets it to
    0.99) and to ``momentum`` of groups that have it (SGD); for optimizers with neither,
    momentum cycling is turned off with a warning.

    Args:
        optimizer: the optimizer (or a wrapper with ``.optimizer``) whose groups to drive.
        cycle_min_lr, cycle_max_lr: LR bounds, numbers or one per group.
        decay_lr_rate: LR decay rate after the cycle.
        cycle_first_step_size: ``S1``, steps of the increasing half.
        cycle_second_step_size: ``S2``, steps of the decreasing half (default ``S1``).
        cycle_first_stair_count, cycle_second_stair_count: stairs per half; 0 (default)
            is continuous; the second defaults to the first.
        decay_step_size: decay interval; 0 disables the decay.
        cycle_momentum: whether to cycle momentum.
        cycle_min_mom, cycle_max_mom: momentum bounds, numbers or one per group.
        decay_mom_rate: momentum growth rate after the cycle.
        last_batch_iteration: iteration already done when resuming; ``-1`` starts fresh.
    """

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float | list[float],
        cycle_max_lr: float | list[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | list[float] = 0.8,
        cycle_max_mom: float | list[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        groups = self.optimizer.param_groups
        n = len(groups)

        self.first_step_size = float(check_int(cycle_first_step_size, "cycle_first_step_size", 1))
        if cycle_second_step_size is None:
            self.second_step_size = self.first_step_size
        else:
            self.second_step_size = float(
                check_int(cycle_second_step_size, "cycle_second_step_size", 1))
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        # DeepSpeed's config default for a stair count is -1, meaning "continuous" like 0.
        self.first_stair_count = check_int(cycle_first_stair_count, "cycle_first_stair_count", -1)
        self.second_stair_count = (self.first_stair_count if cycle_second_stair_count is None
                                   else check_int(cycle_second_stair_count,
                                                  "cycle_second_stair_count", -1))
        self.decay_step_size = check_int(decay_step_size, "decay_step_size", 0)

        self.min_lrs = as_float_list(per_group(cycle_min_lr, n, "cycle_min_lr"), "cycle_min_lr")
        self.max_lrs = as_float_list(per_group(cycle_max_lr, n, "cycle_max_lr"), "cycle_max_lr")
        self.decay_lr_rate = as_float_list([decay_lr_rate], "decay_lr_rate")[0]
        self.min_moms = as_float_list(per_group(cycle_min_mom, n, "cycle_min_mom"),
                                      "cycle_min_mom")
        self.max_moms = as_float_list(per_group(cycle_max_mom, n, "cycle_max_mom"),
                                      "cycle_max_mom")
        self.decay_mom_rate = as_float_list([decay_mom_rate], "decay_mom_rate")[0]
        self.skip_lr_decay = self.decay_step_size == 0 or math.isclose(self.decay_lr_rate, 0)
        self.skip_mom_decay = self.decay_step_size == 0 or math.isclose(self.decay_mom_rate, 0)

        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and not all("betas" in g or "momentum" in g for g in groups):
            warnings.warn(
                f"OneCycle: cycle_momentum is disabled because {type(self.optimizer).__name__} "
                f"has neither `betas` nor `momentum` in its param groups",
                stacklevel=2,
            )
            self.cycle_momentum = False

        if self.last_batch_iteration == -1 and self.cycle_momentum:
            self._set_momentum(self.min_moms)
        self._start()

    # -- the cycle shape ---------------------------------------------------------
    def _scale_factor(self) -> float:
        batch = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        if x <= self.step_ratio:
            scale = x / self.step_ratio
            stairs = self.first_stair_count
        else:
            scale = (x - 1) / (self.step_ratio - 1)
            stairs = self.second_stair_count
        if stairs > 0:
            # Quantise from the integer offset: the float scale at a half-cycle boundary
            # can land just below an exact stair and floor() would drop a whole stair.
            offset = batch % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_iterations(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * self._decay_iterations()
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[float] | None:
        """Momentum (``betas[0]`` or SGD ``momentum``) per group, None if not cycling."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1.0 + self.decay_mom_rate * self._decay_iterations()
        return [hi * factor for hi in self.max_moms]

    def _set_momentum(self, moms: list[float]) -> None:
        for group, mom in zip(self.optimizer.param_groups, moms):
            if "betas" in group:
                group["betas"] = (mom, group["betas"][1])
            else:
                group["momentum"] = mom

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one iteration (or to ``last_batch_iteration``); set LR and momentum."""
        super().step(last_batch_iteration)
        moms = self.get_mom()
        if moms is not None:
            self._set_momentum(moms)


class LRRangeTest(LRSchedule):
    """LR range test: grow the LR from ``lr_range_test_min_lr`` without bound.

    ``lr(i) = min_lr * (1 + step_rate * q)`` with ``q = (i + 1) / step_size``
    (continuous) or ``floor((i + 1) / step_size)`` (staircase); a fresh schedule sets
    ``lr = min_lr`` at construction.

    Args:
        optimizer: the optimizer (or a wrapper with ``.optimizer``) whose groups to drive.
        lr_range_test_min_lr: starting LR, a number or one per group.
        lr_range_test_step_size: steps per LR increase interval.
        lr_range_test_step_rate: growth per interval, relative to the starting LR.
        lr_range_test_staircase: grow in steps instead of continuously.
        last_batch_iteration: iteration already done when resuming; ``-1`` starts fresh.
    """

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: float | list[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        n = len(self.optimizer.param_groups)
        self.min_lrs = as_float_list(per_group(lr_range_test_min_lr, n, "lr_range_test_min_lr"),
                                     "lr_range_test_min_lr")
        self.step_size = check_int(lr_range_test_step_size, "lr_range_test_step_size", 1)
        self.step_rate = as_float_list([lr_range_test_step_rate], "lr_range_test_step_rate")[0]
        self.staircase = bool(lr_range_test_staircase)
        self._start()

    def _interval(self) -> float:
        progress = (self.last_batch_iteration + 1) / self.step_size
        return float(math.floor(progress)) if self.staircase else progress

    def get_lr(self) -> list[float]:
        increase = 1.0 + self.step_rate * self._interval()
        return [lo * increase for lo in self.min_lrs]
