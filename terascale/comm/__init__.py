"""Process groups and collectives over explicit groups (the bottom layer)."""

from terascale.comm.buckets import GradientBuckets, ReducePolicy
from terascale.comm.collectives import all_gather_flat, all_reduce_flag, broadcast_tensors, reduce_scatter_flat
from terascale.comm.groups import DistributedContext, ModelParallelUnit, duplicate_group, init_distributed

__all__ = [
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
]
