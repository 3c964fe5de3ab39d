"""Process groups and collectives over explicit groups (the bottom layer).

DeepSpeed's module-level functions (``deepspeed.comm``: ``get_rank``, ``all_reduce``,
``barrier``, ... over the default group) are here too, from :mod:`terascale.comm.api`;
terascale's own code never uses them.

Names are imported on first use: the rank shim (``terascale.launcher.worker``) reads
:mod:`terascale.comm.discovery` before the script runs and must not import torch.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

_OWN = {
    "DistributedContext": "groups",
    "ModelParallelUnit": "groups",
    "duplicate_group": "groups",
    "split_group": "groups",
    "GradientBuckets": "buckets",
    "ReducePolicy": "buckets",
    "all_gather_flat": "collectives",
    "all_reduce_flag": "collectives",
    "all_to_all_rows": "collectives",
    "broadcast_tensors": "collectives",
    "reduce_scatter_flat": "collectives",
    "init_distributed": "api",
}


_SUBMODULES = frozenset(m.name for m in pkgutil.iter_modules(__path__))


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:  # `from terascale.comm import ops` asks here before importing it
        return importlib.import_module(f"terascale.comm.{name}")
    if name in _OWN:
        return getattr(importlib.import_module(f"terascale.comm.{_OWN[name]}"), name)
    api = importlib.import_module("terascale.comm.api")
    if name == "__all__":
        return sorted({*_OWN, *api.__all__})
    if name in api.__all__:
        return getattr(api, name)
    raise AttributeError(f"module 'terascale.comm' has no attribute '{name}'")
