"""terascale: train PyTorch models far larger than one device's memory.

One call (:func:`initialize`) and one DeepSpeed-compatible config file. See
``DESIGN.md`` for the architecture and ``README.md`` for the user guide.
"""

from terascale.config import Config, ConfigError, add_config_arguments
from terascale.engine import Engine, initialize

__all__ = ["Config", "ConfigError", "Engine", "add_config_arguments", "initialize"]
__version__ = "0.1.0"
