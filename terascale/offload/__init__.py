"""Offload tiers: model states in host memory or on NVMe, moved by an asynchronous I/O engine."""

from terascale.offload.aio import AioError, AioOptions, AsyncIO, IoActivity, IoHandle
from terascale.offload.host_buffers import ALIGNMENT, aligned_empty
from terascale.offload.policy import OptimizerOffload, ParamOffload, optimizer_offload, param_offload

__all__ = [
    "ALIGNMENT",
    "AioError",
    "AioOptions",
    "AsyncIO",
    "IoActivity",
    "IoHandle",
    "OptimizerOffload",
    "ParamOffload",
    "aligned_empty",
    "optimizer_offload",
    "param_offload",
]
