"""Base class shared by the DeepSpeed-compatible learning-rate schedules.

A schedule is a pure function of the batch iteration: ``get_lr()`` evaluates it at
``last_batch_iteration`` and ``step()`` advances the iteration and writes the result
into every param group of the optimizer. Because the value is recomputed from the
iteration alone, resuming only needs ``last_batch_iteration`` (what DeepSpeed saves).

Concrete schedules live in :mod:`terascale.optim.warmup` (WarmupLR, WarmupDecayLR,
WarmupCosineLR) and :mod:`terascale.optim.cyclic` (OneCycle, LRRangeTest).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["LRSchedule", "as_float_list", "check_int", "per_group", "unwrap_optimizer"]


def unwrap_optimizer(optimizer: Any) -> Optimizer:
    """Return the ``torch.optim.Optimizer`` that owns the param groups.

    Accepts an optimizer, or a wrapper exposing the real one as ``.optimizer`` (as
    mixed-precision and ZeRO wrappers do), mirroring what DeepSpeed schedules accept.
    """
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    raise ValueError(
        f"an LR schedule needs a torch.optim.Optimizer (or a wrapper with an `.optimizer` "
        f"attribute holding one), got {type(optimizer).__name__}"
    )


def per_group(value: Any, num_groups: int, name: str) -> list[Any]:
    """Broadcast a scalar to one value per param group, or check a per-group list."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise ValueError(
                f"{name} has {len(value)} values but the optimizer has {num_groups} param "
                f"groups; give one value per group or a single number"
            )
        return list(value)
    return [value] * num_groups


def check_int(value: Any, name: str, minimum: int) -> int:
    """Return ``value`` if it is an int >= ``minimum`` (bools rejected), else raise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


class LRSchedule(ABC):
    """Iteration-indexed LR schedule over every param group of an optimizer.

    Subclasses implement :meth:`get_lr` as a closed-form function of
    ``self.last_batch_iteration`` (``-1`` means "before the first step"). The
    constructor of a subclass sets up its parameters and then calls
    :meth:`_start`, which, for a fresh schedule (``last_batch_iteration == -1``),
    writes the iteration ``-1`` value into the optimizer exactly as DeepSpeed does, so
    the first optimizer step already runs at the schedule's starting LR.
    """

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = unwrap_optimizer(optimizer)
        self.last_batch_iteration = check_int(last_batch_iteration, "last_batch_iteration", -1)
        self._last_lr: list[float] = []

    @abstractmethod
    def get_lr(self) -> list[float]:
        """LR of every param group at ``self.last_batch_iteration``."""

    # -- shared behaviour ---------------------------------------------------------
    def _start(self) -> None:
        if self.last_batch_iteration == -1:
            self._apply()
        else:
            # Resuming mid-run: DeepSpeed leaves the optimizer alone (its own state dict
            # carries the LR); the next step() recomputes from the iteration.
            self._last_lr = self.get_lr()

    def _apply(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            current = group["lr"]
            if isinstance(current, torch.Tensor):
                # Update in place so a tensor LR (capturable / CUDA-graph optimizers)
                # keeps its identity and device.
                current.fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = list(lrs)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: the next one) and set the LRs.

        Call once per optimizer step, after it, like DeepSpeed's engine does.
        """
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = check_int(last_batch_iteration, "last_batch_iteration", -1)
        self._apply()

    def get_last_lr(self) -> list[float]:
        """The LRs most recently written to (or, after a resume, implied for) the groups."""
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: DeepSpeed's ``last_batch_iteration``."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the iteration; the optimizer's own state dict restores its LRs."""
        self.last_batch_iteration = check_int(
            state_dict["last_batch_iteration"], "last_batch_iteration", -1
        )
        self._last_lr = self.get_lr()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(last_batch_iteration={self.last_batch_iteration})"


def as_float_list(values: Sequence[Any], name: str) -> list[float]:
    """Convert per-group values to floats, naming ``name`` when one is not a number."""
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{name} must be a number (or one number per group), got {v!r}")
        out.append(float(v))
    return out
