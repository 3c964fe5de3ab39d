"""What DeepSpeed's ``git_version_info`` and ``utils.torch`` tell a program about the install.

``deepspeed.git_version_info`` is written at DeepSpeed's build: its version, git hash,
the ops it compiled and the torch/CUDA/NCCL versions it was built against. terascale
builds nothing, so the same facts are read from the running process: the version is
the stand-in's distribution version (``0.19.8+terascale...``: DeepSpeed's version it
answers for, so version gates in programs pass), no op is installed (terascale compiles
no C++/CUDA), and torch's facts are torch's own.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from packaging import version as _pv

from terascale import __version__ as _terascale_version

# The DeepSpeed release whose API the stand-in answers for (standin.py serves the same number
# as the distribution's version).
DEEPSPEED_VERSION = "0.19.8"
version = f"{DEEPSPEED_VERSION}+terascale.{_terascale_version}"
git_hash = "terascale"
git_branch = "terascale"
installed_ops: dict[str, bool] = {}  # terascale compiles no ops
compatible_ops: dict[str, bool] = {}


def _two(v: str | None) -> str:
    """``"12.4.1"`` -> ``"12.4"``; ``None`` (no CUDA/HIP) -> ``"0.0"``."""
    if not v:
        return "0.0"
    parts = str(v).split(".")
    return ".".join((parts + ["0"])[:2])


def _nccl() -> str:
    try:
        v = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return "0.0"
    return f"{v[0]}.{v[1]}" if isinstance(v, tuple) else "0.0"


torch_info: dict[str, Any] = {
    "version": _two(torch.__version__),
    "bf16_support": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
    "cuda_version": _two(torch.version.cuda),
    "nccl_version": _nccl(),
    "hip_version": _two(getattr(torch.version, "hip", None)),
}


def _accelerator_name() -> str:
    from terascale.integrations.deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def __getattr__(name: str) -> Any:
    # The accelerator is decided at first use (TERASCALE_DEVICE), not at import.
    if name == "accelerator_name":
        return _accelerator_name()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def required_torch_version(min_version: float | str | None = None, max_version: float | str | None = None) -> bool:
    """Whether the running torch's ``major.minor`` lies in ``[min_version, max_version]``."""
    running = _pv.parse(_two(torch.__version__))
    if min_version is not None and running < _pv.parse(str(min_version)):
        return False
    return not (max_version is not None and running > _pv.parse(str(max_version)))


def jit_script_compat(fn: Any) -> Any:
    """DeepSpeed's ``torch.jit.script`` for torch versions that still have it: ``fn`` scripted."""
    return torch.jit.script(fn)


def register_grad_hook(param: torch.Tensor, hook: Any) -> Any:
    """A hook run after ``param``'s gradient is accumulated (torch's post-accumulate hook)."""
    return param.register_post_accumulate_grad_hook(hook)


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None) -> None:
    """Set terascale's logger (or ``custom_logger``) to the level named ``log_level_str``."""
    level = logging.getLevelName(log_level_str.upper())
    if not isinstance(level, int):
        raise ValueError(f"log level {log_level_str!r} is not one of debug, info, warning, error, critical")
    (custom_logger or logging.getLogger("terascale")).setLevel(level)


def get_log_level_from_string(log_level_str: str) -> int:
    level = logging.getLevelName(log_level_str.upper())
    if not isinstance(level, int):
        raise ValueError(f"log level {log_level_str!r} is not one of debug, info, warning, error, critical")
    return level
