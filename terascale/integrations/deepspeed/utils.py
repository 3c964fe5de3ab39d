"""Small helpers DeepSpeed programs import from ``deepspeed.utils``, ``deepspeed.runtime.utils``,
``deepspeed.checkpoint.utils`` and ``deepspeed`` itself: a repeating loader, the logger,
seeding, memory printouts, device moves, ``OnDevice``, and the names of things terascale
has one way of doing (the sequence-parallel group queries, ZeRO-3 parameter status).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import psutil
import torch
import torch.distributed as dist

from terascale.integrations.deepspeed.accelerator import get_accelerator
from terascale.pipe.partition import min_max_split
from terascale.zero.param_attributes import ZeroParamStatus  # noqa: F401  (what param.ds_status answers)

logger = logging.getLogger("terascale")  # DeepSpeed's ``logger``: terascale's own


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the global ranks in ``ranks`` (``[-1]``: every rank). With a
    process group and no ``ranks`` nothing is logged, as in DeepSpeed; without a group
    (one process) it always is."""
    ranks = list(ranks or [])
    rank = dist.get_rank() if dist.is_initialized() else -1
    if not dist.is_initialized() or (ranks and ranks[0] == -1) or rank in ranks:
        logger.log(level, "[Rank %d] %s", rank, message)


class RepeatingLoader:
    """Iterate ``loader`` forever: a new pass starts where one ends (pipeline
    ``train_batch`` pulls micro-batches without counting epochs)."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (every device's)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def see_memory_usage(message: str, force: bool = False) -> None:
    """Print device and host memory on rank 0 when ``force`` (DeepSpeed prints nothing
    otherwise), then reset the device's peak counters."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    acc, gib = get_accelerator(), 2**30
    vm = psutil.virtual_memory()
    print(
        f"{message}\nMA {acc.memory_allocated() / gib:.2f} GB  Max_MA {acc.max_memory_allocated() / gib:.2f} GB  "
        f"CA {acc.memory_reserved() / gib:.2f} GB  Max_CA {acc.max_memory_reserved() / gib:.2f} GB\n"
        f"CPU Virtual Memory: used = {(vm.total - vm.available) / gib:.2f} GB, percent = {vm.percent}%",
        flush=True,
    )
    acc.reset_peak_memory_stats()


def move_to_device(item: Any, device: torch.device | str, criterion_func: Callable[[Any], bool] | None = None) -> Any:
    """``item`` with every tensor (in lists, tuples, dicts) moved to ``device``; with
    ``criterion_func`` only the tensors it accepts."""
    if isinstance(item, torch.Tensor):
        return item.to(device) if criterion_func is None or criterion_func(item) else item
    if isinstance(item, (list, tuple)):
        return type(item)(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """``item`` with every tensor copied to ``device`` into storage of its own, so that
    ``torch.save`` writes the tensor and not the (possibly much larger) buffer it views."""
    if isinstance(item, torch.Tensor):
        return item.detach().to(device, copy=True).contiguous()
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return {k: clone_tensors_for_torch_save(v, device) for k, v in item.items()}
    return item


# DeepSpeed's zero.Init replaces torch's tensor constructors with wrappers made by this
# function, and tools that must keep a dtype (transformers' RoPE buffers) swap the wrapper
# for their own around it. terascale's Init replaces no constructor, so it never calls
# this: the tools' swap is harmless, and the function does what its name says for
# anyone who calls it. ``_orig_torch_arange`` is torch's own, as nothing replaced it.
_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype, target_device: Any = None
) -> Callable[..., torch.Tensor]:
    """``fn`` (a tensor constructor) creating on ``target_device`` unless told otherwise,
    with a floating-point result cast to ``target_fp_dtype``."""

    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped


class OnDevice:
    """Within the block, tensors (and so modules) are created on ``device`` (``"meta"``:
    nowhere) and floating ones in ``dtype``; ``enabled=False`` does nothing."""

    def __init__(self, dtype: torch.dtype | None, device: torch.device | str = "meta", enabled: bool = True) -> None:
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"OnDevice(dtype={dtype}): the default dtype must be a floating type")
        self.dtype, self.device, self.enabled = dtype, torch.device(device), enabled
        self._saved: torch.dtype | None = None

    def __enter__(self) -> OnDevice:
        if self.enabled:
            self.device.__enter__()
            if self.dtype is not None:
                self._saved = torch.get_default_dtype()
                torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            if self._saved is not None:
                torch.set_default_dtype(self._saved)
                self._saved = None
            self.device.__exit__(*exc)


# DeepSpeed's process-wide group queries, answered from the live engine (the one engine of
# a sequence-parallel run: ``sequence_parallel_size``); without one, as DeepSpeed does
# without sequence parallelism.
def _sequence_engine() -> Any:
    from terascale.engine.deepspeed_api import live_engines

    engines = [e for e in live_engines() if e.dist.sp_world_size > 1]
    if len(engines) > 1:
        raise ValueError("several live engines train with sequence parallelism: ask the engine itself "
                         "(engine.get_sequence_parallel_group())")  # fmt: skip
    return engines[0] if engines else None


def _get_sequence_parallel_group() -> Any:
    engine = _sequence_engine()
    return None if engine is None else engine.dist.sp_group


def _get_sequence_parallel_world_size() -> int:
    engine = _sequence_engine()
    return 1 if engine is None else engine.dist.sp_world_size


def _get_sequence_parallel_rank() -> int:
    engine = _sequence_engine()
    return 0 if engine is None else engine.dist.sp_rank


def partition_balanced(weights: Sequence[float], num_parts: int, eps: float = 1e-3) -> list[int]:
    """DeepSpeed's ``runtime.utils.partition_balanced``: ``num_parts + 1`` boundaries of
    contiguous runs of ``weights`` whose heaviest run is as light as possible and, among
    those, whose lightest is as heavy as possible; past ``len(weights)`` parts the last runs
    are empty. (Pipeline stages use ``terascale.pipe.partition``'s, which spreads weightless
    layers instead. ``eps``, of DeepSpeed's older signature, is unused.)"""
    n = len(weights)
    if num_parts < 1:
        raise ValueError(f"partition_balanced: num_parts must be at least 1, got {num_parts}")
    if num_parts > n:
        return [*(partition_balanced(weights, n) if n else [0]), *([n] * (num_parts - n))]
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    heaviest, _ = min_max_split(n, num_parts, lambda lo, hi: prefix[hi] - prefix[lo])
    # The lightest run as heavy as possible: the smallest largest negated sum, under the bound.
    _, bounds = min_max_split(n, num_parts, lambda lo, hi: -(prefix[hi] - prefix[lo])
                              if prefix[hi] - prefix[lo] <= heaviest else float("inf"))  # fmt: skip
    return bounds


def PipeModelDataParallelTopology(num_pp: int, num_mp: int, num_dp: int) -> Any:  # noqa: N802 - DeepSpeed's name
    """DeepSpeed's pipeline x model x data grid: terascale's :class:`~terascale.parallel.Topology`
    (pass it to ``PipelineModule(topology=...)``; its queries are ``group``/``rank``/``size``)."""
    from terascale.parallel.topology import Topology

    return Topology(pp=num_pp, tp=num_mp, dp=num_dp)


def PipeDataParallelTopology(num_pp: int, num_dp: int) -> Any:  # noqa: N802 - DeepSpeed's name
    from terascale.parallel.topology import Topology

    return Topology(pp=num_pp, dp=num_dp)


def env_report_main(hide_operator_status: bool = False, hide_errors_and_warnings: bool = False) -> int:
    """``deepspeed.env_report.main()``: terascale's ``terascale env`` table."""
    from terascale.launcher.env_report import print_env

    return print_env()


# DeepSpeed's constants that scripts compare against.
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
CROSS_RANK, CROSS_SIZE = "CROSS_RANK", "CROSS_SIZE"  # environment variable names
ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, SGD_OPTIMIZER = "adam", "adamw", "lamb", "sgd"
ONEBIT_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER = "onebitadam", "onebitlamb", "zerooneadam"
