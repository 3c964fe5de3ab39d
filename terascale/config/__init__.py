"""Typed, DeepSpeed-compatible training config.

``Config.load(path_or_dict)`` validates a ds_config.json-style config, reporting every
problem at once with key paths and suggestions; ``cfg.require_built()`` refuses settings
that ask for features this version does not provide yet.
"""

from terascale.config.args import add_config_arguments
from terascale.config.auto import AutoContext, Given
from terascale.config.batch import BatchSizes
from terascale.config.errors import ConfigError
from terascale.config.schema import Config

__all__ = ["AutoContext", "BatchSizes", "Config", "ConfigError", "Given", "add_config_arguments"]
