"""Optimizers and learning-rate schedules with DeepSpeed-compatible names and configs."""

from terascale.optim.compact import CompactAdam
from terascale.optim.cyclic import LRRangeTest, OneCycle
from terascale.optim.factory import (
    SUPPORTED_OPTIMIZERS,
    SUPPORTED_SCHEDULERS,
    build_optimizer,
    build_scheduler,
)
from terascale.optim.lamb import Lamb
from terascale.optim.lion import Lion
from terascale.optim.onebit import OneBitAdam, ReducesOwnGradients
from terascale.optim.onebit_lamb import OneBitLamb
from terascale.optim.zoadam import ZeroOneAdam
from terascale.optim.schedulers import LRSchedule
from terascale.optim.warmup import WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = [
    "SUPPORTED_OPTIMIZERS",
    "SUPPORTED_SCHEDULERS",
    "CompactAdam",
    "LRRangeTest",
    "LRSchedule",
    "Lamb",
    "Lion",
    "OneBitAdam",
    "OneBitLamb",
    "OneCycle",
    "ReducesOwnGradients",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "ZeroOneAdam",
    "build_optimizer",
    "build_scheduler",
]
