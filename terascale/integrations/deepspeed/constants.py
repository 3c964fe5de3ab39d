"""DeepSpeed's config-key constants and the small pure helpers its modules export.

Programs build scheduler and config dicts from these names (``{WARMUP_MIN_LR: 0, ...}``)
and call the helpers directly; the values are DeepSpeed's JSON keys, which terascale's
config reads unchanged.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

# deepspeed.runtime.lr_schedules: scheduler types and their parameter keys.
LR_SCHEDULE, LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR = "lr_schedule", "LRRangeTest", "OneCycle", "WarmupLR"
WARMUP_DECAY_LR, WARMUP_COSINE_LR = "WarmupDecayLR", "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_RATE = "lr_range_test_min_lr", "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE, LR_RANGE_TEST_STAIRCASE = "lr_range_test_step_size", "lr_range_test_staircase"
EDGE_VALUE, MID_VALUE = "edge_value", "mid_value"
CYCLE_FIRST_STEP_SIZE, CYCLE_FIRST_STAIR_COUNT = "cycle_first_step_size", "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE, CYCLE_SECOND_STAIR_COUNT = "cycle_second_step_size", "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR, CYCLE_MAX_LR, DECAY_LR_RATE = "cycle_min_lr", "cycle_max_lr", "decay_lr_rate"
CYCLE_MIN_MOM, CYCLE_MAX_MOM, DECAY_MOM_RATE = "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"
WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS = "warmup_min_lr", "warmup_max_lr", "warmup_num_steps"
WARMUP_TYPE, WARMUP_LOG_RATE, WARMUP_LINEAR_RATE = "warmup_type", "log", "linear"
WARMUP_MIN_RATIO, COS_MIN_RATIO = "warmup_min_ratio", "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"

# deepspeed.runtime.constants: DeepSpeed 0.19's keys and defaults. [Note: gradient clipping
# default] DeepSpeed 0.19 clips at 1.0 when gradient_clipping is absent; terascale's config
# default is 0.0 (no clipping), so these constants describe DeepSpeed, not terascale's config.
GRADIENT_CLIPPING, GRADIENT_CLIPPING_DEFAULT = "gradient_clipping", 1.0
TRAIN_BATCH_SIZE, TRAIN_MICRO_BATCH_SIZE_PER_GPU = "train_batch_size", "train_micro_batch_size_per_gpu"
GRADIENT_ACCUMULATION_STEPS = "gradient_accumulation_steps"
STEPS_PER_PRINT, STEPS_PER_PRINT_DEFAULT = "steps_per_print", None
ZERO_OPTIMIZATION = "zero_optimization"
# deepspeed.runtime.swap_tensor: the smallest tensor DeepSpeed swaps to NVMe (1 MiB); programs
# size test tensors by it.
MIN_SWAPPABLE_BYTES = 1024**2


def get_gradient_clipping(param_dict: dict[str, Any]) -> float:
    """``gradient_clipping`` of a config dict; DeepSpeed's default (1.0) when absent."""
    return param_dict.get(GRADIENT_CLIPPING, GRADIENT_CLIPPING_DEFAULT)


class ZeroStageEnum(enum.IntEnum):
    """DeepSpeed's names of the ZeRO stages."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


def prefix_sum_inc(weights: Sequence[float]) -> list[float]:
    """Inclusive prefix sums: ``[w0, w0+w1, ...]``."""
    out: list[float] = []
    total = 0
    for w in weights:
        total += w
        out.append(total)
    return out


def trim_mean(data: Sequence[float], trim_percent: float) -> float:
    """Mean of ``data`` without the lowest and highest ``trim_percent`` (0..1) of it."""
    if not 0 <= trim_percent <= 1:
        raise ValueError(f"trim_percent must be between 0 and 1, got {trim_percent}")
    n = len(data)
    if n == 0:
        return 0
    data = sorted(data)
    k = int(round(n * trim_percent))
    kept = data[k : n - k] or data
    return sum(kept) / len(kept)


def parse_range(rng: str) -> list[int]:
    """``"3"`` -> ``[3]``; ``"2-5"`` -> ``[2, 3, 4, 5]``."""
    try:
        value = int(rng)
        return [value]
    except ValueError:
        pass
    parts = rng.split("-")
    if len(parts) != 2:
        raise ValueError(f"bad range {rng!r}: expected N or N-M")
    lo, hi = int(parts[0]), int(parts[1])
    if lo > hi:
        raise ValueError(f"bad range {rng!r}: {lo} > {hi}")
    return list(range(lo, hi + 1))


def parse_range_list(range_str: str) -> list[int]:
    """``"0,2-4"`` -> ``[0, 2, 3, 4]`` (core lists of ``--bind_core_list``); ranges must ascend."""
    out: list[int] = []
    last = -1
    for piece in range_str.split(","):
        values = parse_range(piece)
        if values[0] <= last:
            raise ValueError(f"bad range list {range_str!r}: {piece!r} overlaps or is not ascending")
        last = values[-1]
        out.extend(values)
    return out


def get_bfloat16_config(param_dict: dict[str, Any]) -> Any:
    """The ``bf16`` section of a config dict (DeepSpeed's older ``bfloat16`` spelling too), validated."""
    from terascale.config.schema import Bf16Config

    section = param_dict.get("bf16", param_dict.get("bfloat16", {}))
    return Bf16Config(**(section or {}))


def get_fp16_config(param_dict: dict[str, Any]) -> Any:
    """The ``fp16`` section of a config dict, validated."""
    from terascale.config.schema import Fp16Config

    return Fp16Config(**(param_dict.get("fp16") or {}))
