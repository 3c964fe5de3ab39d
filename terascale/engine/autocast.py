"""The ``torch_autocast`` section: the forward under ``torch.autocast``, as DeepSpeed runs it.

The engine's forward (and, through ``torch.utils.checkpoint``, its recompute) runs under
``torch.autocast(device, dtype)``: matmuls and convolutions compute in ``dtype`` from the
parameters' own dtype (fp32 unless bf16/fp16 is on), which autocast casts per op. An
autocast the caller opened around the engine's forward gives way to the section's, and
with the section off the engine's forward runs without autocast (DeepSpeed's rule: the
engine's precision is the config's). fp16 needs loss scaling: the engine's dynamic loss
scaler runs as the ``fp16`` section's would (its keys, its defaults). The gradients of the
parameters of ``lower_precision_safe_modules`` are reduced over the ranks in the autocast
dtype (their own buckets at stage 0, their own ZeRO groups at stages 1-3).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch
from torch import nn

from terascale.config import Config
from terascale.config.section import TORCH_DTYPES

# DeepSpeed's default lower_precision_safe_modules.
SAFE_MODULES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def autocast_dtype(config: Config, device: torch.device) -> torch.dtype | None:
    """The dtype the forward computes in under ``torch_autocast`` (None: the section is off);
    an unnamed dtype is torch's default for ``device`` (bf16 on the host, fp16 on CUDA)."""
    section = config.torch_autocast
    if not section.enabled:
        return None
    if section.dtype is not None:
        return TORCH_DTYPES[section.dtype]
    return torch.get_autocast_dtype(device.type)


def scales_loss(config: Config, device: torch.device) -> bool:
    """Whether the loss is scaled: fp16 training, or an fp16 autocast."""
    return config.fp16.enabled or autocast_dtype(config, device) == torch.float16


@contextlib.contextmanager
def forward_autocast(dtype: torch.dtype | None, device: torch.device) -> Iterator[None]:
    """Around the engine's forward: autocast in ``dtype`` (None: autocast off, also where
    the caller turned it on)."""
    if dtype is None:
        if torch.is_autocast_enabled(device.type):
            with torch.autocast(device_type=device.type, enabled=False):
                yield
        else:
            yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


def safe_module_classes(config: Config) -> tuple[type[nn.Module], ...]:
    """The classes of ``torch_autocast.lower_precision_safe_modules`` (import paths)."""
    names = config.torch_autocast.lower_precision_safe_modules
    if names is None:
        return SAFE_MODULES
    out = []
    for name in names:
        package, _, attr = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(package), attr)
        except (ImportError, AttributeError, ValueError) as err:
            raise ValueError(f"torch_autocast.lower_precision_safe_modules: cannot import {name!r} ({err})") from None
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"torch_autocast.lower_precision_safe_modules: {name!r} is not an nn.Module class")
        out.append(cls)
    return tuple(out)


def low_precision_comm(module: nn.Module, config: Config, device: torch.device,
                       param_dtype: torch.dtype) -> dict[int, torch.dtype]:  # fmt: skip
    """Parameter id -> the dtype its gradient is reduced in, for the parameters of the
    ``lower_precision_safe_modules`` (instances of exactly those classes, as DeepSpeed
    matches them), where the autocast dtype is narrower than the parameters'."""
    dtype = autocast_dtype(config, device)
    if dtype is None or dtype == param_dtype:
        return {}
    classes = safe_module_classes(config)
    return {id(p): dtype for m in module.modules() if type(m) in classes for p in m.parameters(recurse=False)}
