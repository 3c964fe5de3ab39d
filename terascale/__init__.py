"""terascale: train PyTorch models far larger than one device's memory.

One call (:func:`initialize`) and one DeepSpeed-compatible config file. See
``DESIGN.md`` for the architecture and ``README.md`` for the user guide.

The public names are imported on first use, so that ``terascale --help`` and the
launcher start without importing torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import pkgutil
import sys
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


# terascale's own subpackages and modules, importable as attributes (``terascale.comm``, as
# ``deepspeed.comm`` after ``import terascale as deepspeed``).
_SUBMODULES = frozenset(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"terascale.{name}")
    if name.startswith("__"):
        raise AttributeError(f"module 'terascale' has no attribute {name!r}")
    # DeepSpeed's other top-level names (see [Note: DeepSpeed's module paths]).
    from terascale.integrations.deepspeed.names import attribute

    return attribute("", name)


class _DeepSpeedPaths(importlib.abc.MetaPathFinder):
    """Finds DeepSpeed's module paths under ``terascale`` (``terascale.runtime.utils``, ...)
    that no file provides, from the compatibility layer's map ([Note: DeepSpeed's module
    paths] in ``terascale/integrations/deepspeed/names.py``). Last on ``sys.meta_path``, so
    it is asked only about modules nothing else found; the map is imported then."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not fullname.startswith("terascale.") or fullname.startswith("terascale.integrations"):
            return None
        from terascale.integrations.deepspeed.names import find_spec

        return find_spec(fullname)


if not any(type(f).__name__ == "_DeepSpeedPaths" for f in sys.meta_path):
    sys.meta_path.append(_DeepSpeedPaths())


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
