"""Warmup schedules with DeepSpeed's names, parameters and formulas.

All three share one warmup ramp (:class:`WarmupRamp`): for iteration ``i`` below the
warmup length ``N`` (``N = max(2, warmup_num_steps)``, as in DeepSpeed) the ramp
fraction is ``ln(i + 1) / ln(N)`` (``warmup_type="log"``) or ``i / N`` (``"linear"``);
from ``i = N`` on the warmup is over. Before the first ``step()`` (``i = -1``) the
schedules hold their starting value.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

from terascale.optim.schedulers import LRSchedule, as_float_list, check_int, per_group

__all__ = ["WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "WarmupRamp"]

WARMUP_TYPES = ("log", "linear")


@dataclass(frozen=True)
class WarmupRamp:
    """The warmup shape shared by every warmup schedule.

    ``num_steps`` is the effective warmup length (already clamped to >= 2, which keeps
    ``ln(num_steps)`` non-zero for the log ramp).
    """

    num_steps: int
    kind: str

    @classmethod
    def build(cls, warmup_num_steps: Any, warmup_type: Any) -> WarmupRamp:
        """Validate DeepSpeed's ``warmup_num_steps`` / ``warmup_type`` and build the ramp."""
        check_int(warmup_num_steps, "warmup_num_steps", 1)
        if warmup_type not in WARMUP_TYPES:
            # DeepSpeed warns and silently uses "log"; a typo here changes training, so
            # it is an error.
            raise ValueError(
                f"warmup_type must be one of {list(WARMUP_TYPES)}, got {warmup_type!r}"
            )
        return cls(num_steps=max(2, warmup_num_steps), kind=warmup_type)

    def active(self, iteration: int) -> bool:
        """True while ``iteration`` is still inside the warmup."""
        return iteration < self.num_steps

    def fraction(self, iteration: int) -> float:
        """Ramp position in [0, 1) for a warmup iteration >= 0."""
        if self.kind == "log":
            return math.log(iteration + 1) / math.log(self.num_steps)
        return iteration / self.num_steps


class WarmupLR(LRSchedule):
    """Ramp each group's LR from ``warmup_min_lr`` to ``warmup_max_lr``, then hold it.

    ``lr(i) = min_lr + (max_lr - min_lr) * gamma(i)`` with ``gamma`` the warmup ramp
    fraction for ``i < N`` and ``1`` after; ``lr(-1) = min_lr`` (the value set at
    construction). ``warmup_max_lr=None`` uses each group's current LR.

    Args:
        optimizer: the optimizer (or a wrapper with ``.optimizer``) whose groups to drive.
        warmup_min_lr: starting LR, a number or one per param group.
        warmup_max_lr: LR reached at the end of warmup, a number or one per group.
        warmup_num_steps: warmup length in optimizer steps (clamped to >= 2).
        warmup_type: ``"log"`` or ``"linear"`` ramp.
        last_batch_iteration: iteration already done when resuming; ``-1`` starts fresh.
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        groups = self.optimizer.param_groups
        if warmup_max_lr is None:
            # DeepSpeed broadcasts group 0's LR; each group's own LR is the same for one
            # group and the only sensible reading for several.
            warmup_max_lr = [float(g["lr"]) for g in groups]
        self.min_lrs = as_float_list(per_group(warmup_min_lr, len(groups), "warmup_min_lr"),
                                     "warmup_min_lr")
        self.max_lrs = as_float_list(per_group(warmup_max_lr, len(groups), "warmup_max_lr"),
                                     "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.ramp = WarmupRamp.build(warmup_num_steps, warmup_type)
        self._start()

    def _gamma(self) -> float:
        """Interpolation weight between min and max LR at the current iteration."""
        if self.ramp.active(self.last_batch_iteration):
            return self.ramp.fraction(self.last_batch_iteration)
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then linear decay to 0 at ``total_num_steps``.

    After warmup (``i >= N``): ``gamma(i) = max(0, (T - i) / max(1, T - N))`` with ``T =
    total_num_steps``; the LR is ``min_lr + (max_lr - min_lr) * gamma``, so it falls to
    ``min_lr`` at ``i = T`` and stays there.

    Args:
        total_num_steps: the step at which the decay reaches ``warmup_min_lr``.
        (others as :class:`WarmupLR`; ``warmup_max_lr`` defaults to 0.001 as in DeepSpeed)
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = check_int(total_num_steps, "total_num_steps", 1)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps,
                         warmup_type, last_batch_iteration)
        if self.total_num_steps < self.ramp.num_steps:
            warnings.warn(
                f"total_num_steps ({total_num_steps}) is less than warmup_num_steps "
                f"({warmup_num_steps}); the LR drops to warmup_min_lr right after warmup",
                stacklevel=2,
            )

    def _gamma(self) -> float:
        if self.ramp.active(self.last_batch_iteration):
            return self.ramp.fraction(self.last_batch_iteration)
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, float(self.total_num_steps - self.ramp.num_steps)))


class WarmupCosineLR(LRSchedule):
    """Warm up a ratio of each group's base LR, then cosine-decay it.

    The LR is ``base_lr * ratio(i)`` where ``base_lr`` is each group's LR when the
    schedule is built, and

    * ``i < 0``: ``ratio = 0``;
    * ``0 <= i < N``: ``ratio = warmup_min_ratio + (1 - warmup_min_ratio) * ramp(i)``;
    * ``i >= N``: with ``p = min(1, (i - N + 1) / max(1, T - N))``,
      ``ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2)``,
      so it reaches ``cos_min_ratio`` at ``i = T - 1`` and holds it.

    Args:
        total_num_steps: ``T``, the end of the cosine decay.
        warmup_min_ratio: ratio at the start of warmup.
        warmup_num_steps: warmup length (clamped to >= 2).
        cos_min_ratio: final ratio.
        warmup_type: ``"log"`` or ``"linear"``.
        last_batch_iteration: iteration already done when resuming; ``-1`` starts fresh.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = check_int(total_num_steps, "total_num_steps", 1)
        self.warmup_min_ratio = as_float_list([warmup_min_ratio], "warmup_min_ratio")[0]
        self.cos_min_ratio = as_float_list([cos_min_ratio], "cos_min_ratio")[0]
        self.ramp = WarmupRamp.build(warmup_num_steps, warmup_type)
        if self.total_num_steps < self.ramp.num_steps:
            warnings.warn(
                f"total_num_steps ({total_num_steps}) is less than warmup_num_steps "
                f"({warmup_num_steps}); the LR drops to cos_min_ratio right after warmup",
                stacklevel=2,
            )
        self.base_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        self._start()

    def get_lr_ratio(self) -> float:
        """The multiplier applied to every group's base LR at the current iteration."""
        i = self.last_batch_iteration
        if i < 0:
            return 0.0
        if self.ramp.active(i):
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * self.ramp.fraction(i)
        span = max(1, self.total_num_steps - self.ramp.num_steps)
        progress = min(1.0, (i - self.ramp.num_steps + 1) / span)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [base * ratio for base in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        # The base LRs are saved too: a schedule rebuilt after the optimizer state was
        # restored would otherwise read an already-decayed LR as its base.
        return {**super().state_dict(), "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "base_lrs" in state_dict:  # absent in DeepSpeed-written state dicts
            self.base_lrs = as_float_list(
                per_group(state_dict["base_lrs"], len(self.optimizer.param_groups), "base_lrs"),
                "base_lrs",
            )
        super().load_state_dict(state_dict)
