"""The engine layer: ``initialize`` and the training ``Engine``."""

from terascale.engine.engine import Engine
from terascale.engine.initialize import initialize

__all__ = ["Engine", "initialize"]
