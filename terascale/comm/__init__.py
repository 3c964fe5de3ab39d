"""Process groups and collectives over explicit groups (the bottom layer).

DeepSpeed's module-level functions (``deepspeed.comm``: ``get_rank``, ``all_reduce``,
``barrier``, ... over the default group) are here too, from :mod:`terascale.comm.api`;
terascale's own code never uses them.
"""

from terascale.comm.api import *  # noqa: F403 - DeepSpeed's deepspeed.comm names
from terascale.comm.api import __all__ as _deepspeed_names
from terascale.comm.api import init_distributed
from terascale.comm.buckets import GradientBuckets, ReducePolicy
from terascale.comm.collectives import all_gather_flat, all_reduce_flag, broadcast_tensors, reduce_scatter_flat
from terascale.comm.groups import DistributedContext, ModelParallelUnit, duplicate_group

__all__ = sorted({
    "DistributedContext",
    "GradientBuckets",
    "ModelParallelUnit",
    "ReducePolicy",
    "all_gather_flat",
    "all_reduce_flag",
    "broadcast_tensors",
    "duplicate_group",
    "init_distributed",
    "reduce_scatter_flat",
    *_deepspeed_names,
})
