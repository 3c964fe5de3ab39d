"""``deepspeed.elasticity``: the elastic batch size of a config, as DeepSpeed computes it.

``compute_elastic_config(ds_config, target_deepspeed_version, world_size=0)`` returns the
global batch size and the valid GPU counts of the config's ``elasticity`` section (and,
with a ``world_size``, the micro batch to use there), by terascale's elasticity planner
(:mod:`terascale.config.elasticity`, [Note: elastic batch sizes]), which is also what the
engine applies at start-up. Its errors are terascale's config errors:
:class:`ElasticityError` is :class:`terascale.config.ConfigError`, so code catching either
sees the engine's elasticity errors too.
"""

from __future__ import annotations

import os
from typing import Any

from packaging import version as _pv
from pydantic import ValidationError

from terascale.config.elasticity import ElasticityConfig, elastic_batch_sizes, plan_elastic
from terascale.config.errors import ConfigError

ElasticityError = ConfigError
LATEST_ELASTICITY_VERSION = 0.2
MINIMUM_DEEPSPEED_VERSION = "0.3.8"


class ElasticityConfigError(ConfigError):
    """The ``elasticity`` section is missing, disabled or invalid."""


class ElasticityIncompatibleWorldSize(ConfigError):
    """The world size is not one the elastic batch size runs on."""


def compute_elastic_config(ds_config: dict[str, Any], target_deepspeed_version: str, world_size: int = 0,
                           return_microbatch: bool = False) -> tuple:  # fmt: skip
    """``(train_batch_size, valid_gpus)``, plus the micro batch for ``world_size`` when one is
    given (or, for version 0.2, taken from ``WORLD_SIZE``) or ``return_microbatch`` is set."""
    if not isinstance(ds_config, dict):
        raise ValueError(f"ds_config must be a dict, got {type(ds_config).__name__}")
    if "elasticity" not in ds_config:
        raise ElasticityConfigError("'elasticity' is missing from the config; add an elasticity section")
    if _pv.parse(str(target_deepspeed_version)) < _pv.parse(MINIMUM_DEEPSPEED_VERSION):
        raise ElasticityError(f"elasticity needs DeepSpeed >= {MINIMUM_DEEPSPEED_VERSION}, "
                              f"target version is {target_deepspeed_version}")  # fmt: skip
    raw = ds_config["elasticity"]
    if isinstance(raw, dict) and float(raw.get("version", LATEST_ELASTICITY_VERSION)) > LATEST_ELASTICITY_VERSION:
        raise ElasticityConfigError(f"elasticity version {raw['version']} is newer than the latest supported, "
                                    f"{LATEST_ELASTICITY_VERSION}")  # fmt: skip
    try:
        section = ElasticityConfig(**raw)
    except (ValidationError, TypeError) as err:
        raise ElasticityConfigError(f"elasticity: {err}") from None
    if not section.enabled:
        raise ElasticityConfigError("elasticity.enabled is false; enable it to compute an elastic batch size")
    if section.model_parallel_size > 1 and section.version < 0.2:
        raise ElasticityConfigError("elasticity version 0.1 has no model parallelism; use version 0.2")
    try:
        plan = plan_elastic(section)
    except ConfigError as err:
        raise ElasticityConfigError(str(err)) from None
    gpus = list(plan.valid_gpu_counts)
    if section.version >= 0.2 and world_size == 0 and os.environ.get("WORLD_SIZE"):
        world_size = int(os.environ["WORLD_SIZE"])
    if world_size > 0:
        if world_size not in gpus:
            raise ElasticityIncompatibleWorldSize(f"world size {world_size} is not one of the valid GPU counts {gpus}")
        dp = world_size // plan.model_parallel_size
        micro = elastic_batch_sizes(plan, dp).micro_batch_size
        return plan.train_batch_size, gpus, micro
    if return_microbatch:
        raise ElasticityError("return_microbatch needs a world_size")
    return plan.train_batch_size, gpus


def elasticity_enabled(ds_config: dict[str, Any]) -> bool:
    section = ds_config.get("elasticity")
    return isinstance(section, dict) and bool(section.get("enabled", False))
