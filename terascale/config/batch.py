"""The batch-size triplet: train = micro × accumulation steps × data-parallel world size.

DeepSpeed lets a config give any of ``train_batch_size``, ``train_micro_batch_size_per_gpu``
and ``gradient_accumulation_steps`` and derives the rest from the data-parallel world size;
:func:`resolve_batch_sizes` applies the same rules but refuses, with the arithmetic shown,
anything that does not divide exactly (DeepSpeed floors and then fails an assertion).
"""

from __future__ import annotations

from dataclasses import dataclass

from terascale.config.errors import ConfigError

_TRAIN = "train_batch_size"
_MICRO = "train_micro_batch_size_per_gpu"
_GAS = "gradient_accumulation_steps"


@dataclass(frozen=True)
class BatchSizes:
    """Resolved batch sizes for one data-parallel world size.

    ``train_batch_size`` samples make one optimizer step, across all ranks;
    each rank runs ``gradient_accumulation_steps`` micro-batches of ``micro_batch_size``.
    """

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int


def _check_positive(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or value <= 0):
        raise ConfigError(f"{name}: expected a positive integer, got {value!r}")


def resolve_batch_sizes(
    train_batch_size: int | None,
    micro_batch_size: int | None,
    gradient_accumulation_steps: int | None,
    world_size: int,
) -> BatchSizes:
    """Derive the missing members of the triplet for ``world_size`` data-parallel ranks.

    Rules (DeepSpeed's): all three given → checked; two given → the third derived; only
    train → 1 step, micro = train / world; only micro → 1 step (train = micro × world); only
    accumulation steps or nothing → error. Raises ConfigError when a value is not positive,
    a division is not exact, or the three disagree.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(
            f"data-parallel world size must be a positive integer, got {world_size!r}"
        )
    _check_positive(_TRAIN, train_batch_size)
    _check_positive(_MICRO, micro_batch_size)
    _check_positive(_GAS, gradient_accumulation_steps)
    train, micro, gas = train_batch_size, micro_batch_size, gradient_accumulation_steps
    world = world_size

    if train is None and micro is None:
        given = f" (only {_GAS} {gas} is set)" if gas is not None else ""
        raise ConfigError(f"set {_TRAIN} or {_MICRO} (or both){given}")

    if train is not None and micro is not None and gas is not None:
        if train != micro * gas * world:
            raise ConfigError(
                f"{_TRAIN} {train} != {_MICRO} {micro} × {_GAS} {gas} × data-parallel world "
                f"size {world} = {micro * gas * world}"
            )
        return BatchSizes(train, micro, gas)

    if train is not None and micro is not None:
        per_step = micro * world
        if train % per_step:
            raise ConfigError(
                f"{_TRAIN} {train} is not divisible by {_MICRO} {micro} × data-parallel world "
                f"size {world} = {per_step}, so {_GAS} would not be a whole number"
            )
        return BatchSizes(train, micro, train // per_step)

    if train is not None:
        steps = 1 if gas is None else gas
        per_micro = steps * world
        if train % per_micro:
            raise ConfigError(
                f"{_TRAIN} {train} is not divisible by {_GAS} {steps} × data-parallel world "
                f"size {world} = {per_micro}, so {_MICRO} would not be a whole number"
            )
        return BatchSizes(train, train // per_micro, steps)

    assert micro is not None
    steps = 1 if gas is None else gas
    return BatchSizes(micro * steps * world, micro, steps)
