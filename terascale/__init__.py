"""terascale: train PyTorch models far larger than one device's memory.

One call (:func:`initialize`) and one DeepSpeed-compatible config file. See
``DESIGN.md`` for the architecture and ``README.md`` for the user guide.

The public names are imported on first use, so that ``terascale --help`` and the
launcher start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "Config": "terascale.config",
    "ConfigError": "terascale.config",
    "add_config_arguments": "terascale.config",
    "Engine": "terascale.engine",
    "initialize": "terascale.entry",
    "estimate_memory": "terascale.zero.estimate",
}
__all__ = sorted(_PUBLIC)

if TYPE_CHECKING:
    from terascale.config import Config, ConfigError, add_config_arguments
    from terascale.engine import Engine
    from terascale.entry import initialize
    from terascale.zero.estimate import estimate_memory


def __getattr__(name: str) -> Any:
    if name == "zero":
        return importlib.import_module("terascale.zero")
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'terascale' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
