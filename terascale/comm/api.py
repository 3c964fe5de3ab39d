"""DeepSpeed's module-level collective API (``deepspeed.comm``) over terascale's wrappers.

DeepSpeed programs call collectives as module functions with an implicit default group
(``dist.get_rank()``, ``dist.all_reduce(t)``, ``dist.barrier()`` after ``from deepspeed
import comm as dist``). These are those functions: each keeps DeepSpeed's (which is
torch's) name and signature and calls :mod:`terascale.comm.ops`, so the comms logger sees
them as it sees terascale's own collectives. terascale itself never calls them: inside
terascale every collective names its group ([Note: explicit groups] in ``groups.py``).

:func:`init_distributed` serves both spellings: terascale's ``init_distributed(mpu,
backend=...)`` and DeepSpeed's ``init_distributed(dist_backend=..., init_method=...,
rank=..., world_size=...)``.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from terascale.comm import ops
from terascale.comm.groups import DistributedContext, ModelParallelUnit
from terascale.comm.groups import init_distributed as _init_groups


def init_distributed(
    dist_backend: str | ModelParallelUnit | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int | None = None,
    verbose: bool = True,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
    *,
    mpu: ModelParallelUnit | None = None,
    backend: str | None = None,
    device: torch.device | str | None = None,
) -> DistributedContext:
    """Join (or create) the default process group and describe this rank.

    terascale's form: ``init_distributed(mpu, backend=..., device=..., timeout=...)``
    (see :func:`terascale.comm.groups.init_distributed`). DeepSpeed's form:
    ``init_distributed(dist_backend="nccl", init_method=..., rank=..., world_size=...)``;
    an explicit ``init_method`` or ``rank``/``world_size`` initialises the group from them
    instead of torchrun's environment. ``auto_mpi_discovery`` (default True, as in
    DeepSpeed) lets processes started by ``mpirun`` or ``srun`` find each other from their
    launcher's variables (:mod:`terascale.comm.discovery`); False refuses such a launch
    rather than run it as separate worlds of one. ``verbose`` and ``config`` are accepted
    and change nothing. ``dist_init_required=False`` with no group yet is a ValueError,
    as in DeepSpeed.
    """
    del verbose, config
    if dist_backend is not None and not isinstance(dist_backend, str):
        mpu, dist_backend = dist_backend, None  # terascale's positional mpu
    if dist_backend is not None and backend is not None and dist_backend != backend:
        raise ValueError(f"init_distributed: dist_backend={dist_backend!r} and backend={backend!r} disagree")
    backend = backend or dist_backend
    if distributed_port is not None and "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(distributed_port)
    if not dist.is_initialized():
        if dist_init_required is False:
            raise ValueError("init_distributed(dist_init_required=False) but no process group is initialised")
        if (rank >= 0) != (world_size >= 0):
            raise ValueError(f"init_distributed: give rank and world_size together (got {rank}, {world_size})")
    return _init_groups(mpu, backend=backend, device=device, timeout=timeout, init_method=init_method,
                        rank=rank if rank >= 0 else None, world_size=world_size if world_size >= 0 else None,
                        discover=auto_mpi_discovery)


# -- where this rank is ---------------------------------------------------------------------------


def is_initialized() -> bool:
    return dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: the world); 0 before any group exists."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: ProcessGroup | None = None) -> int:
    """The number of ranks in ``group`` (default: the world); 1 before any group exists."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    """This process's index on its machine (torchrun's ``LOCAL_RANK``)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group: ProcessGroup | None = None) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order."""
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def get_world_group() -> ProcessGroup:
    return dist.group.WORLD


def new_group(ranks: Sequence[int] | None = None, **kwargs: Any) -> ProcessGroup:
    """A process group of ``ranks`` (collective over the world, as torch's)."""
    return dist.new_group(list(ranks) if ranks is not None else None, **kwargs)


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    dist.destroy_process_group(group)


# -- collectives (torch's names and signatures) ----------------------------------------------------

all_reduce = ops.all_reduce
broadcast = ops.broadcast
all_gather = ops.all_gather
all_gather_into_tensor = ops.all_gather_into_tensor
reduce_scatter_tensor = ops.reduce_scatter_tensor
reduce = ops.reduce
all_to_all_single = ops.all_to_all_single
send = ops.send
recv = ops.recv
isend = ops.isend
irecv = ops.irecv
barrier = ops.barrier
all_gather_object = ops.all_gather_object
broadcast_object_list = ops.broadcast_object_list
inference_all_reduce = ops.all_reduce  # DeepSpeed's fast path for inference: the same result


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup | None = None,
                 async_op: bool = False, debug: Any = None):  # fmt: skip
    """DeepSpeed's name for the flat all-gather (``all_gather_into_tensor``)."""
    return ops.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                      group: ProcessGroup | None = None, async_op: bool = False, debug: Any = None):  # fmt: skip
    """DeepSpeed's name for the flat reduce-scatter (``reduce_scatter_tensor``)."""
    return ops.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: ProcessGroup | None = None, async_op: bool = False):  # fmt: skip
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM,
                   group: ProcessGroup | None = None, async_op: bool = False):  # fmt: skip
    return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,
           group: ProcessGroup | None = None, async_op: bool = False):  # fmt: skip
    return dist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0,
            group: ProcessGroup | None = None, async_op: bool = False):  # fmt: skip
    return dist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op)


def all_reduce_coalesced(tensors: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM,
                         group: ProcessGroup | None = None, async_op: bool = False):  # fmt: skip
    """Each of ``tensors`` all-reduced; one collective per tensor (their sum is what counts)."""
    works = [ops.all_reduce(t, op=op, group=group, async_op=async_op) for t in tensors]
    return works[-1] if async_op and works else None


def monitored_barrier(group: ProcessGroup | None = None, timeout: datetime.timedelta | None = None,
                      wait_all_ranks: bool = False) -> None:  # fmt: skip
    """A barrier that names the ranks that did not arrive (gloo only, as torch's)."""
    dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def has_all_gather_into_tensor() -> bool:
    return True  # every supported torch has it


def has_reduce_scatter_tensor() -> bool:
    return True


def has_all_reduce_coalesced() -> bool:
    return True


def has_coalescing_manager() -> bool:
    return False  # no coalescing manager: collectives run one by one


__all__ = [
    "ProcessGroup", "ReduceOp", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce",
    "all_reduce_coalesced", "all_to_all", "all_to_all_single", "allgather_fn", "barrier", "broadcast",
    "broadcast_object_list", "destroy_process_group", "gather", "get_all_ranks_from_group", "get_global_rank",
    "get_local_rank", "get_rank", "get_world_group", "get_world_size", "has_all_gather_into_tensor",
    "has_all_reduce_coalesced", "has_coalescing_manager", "has_reduce_scatter_tensor", "inference_all_reduce",
    "init_distributed", "irecv", "is_available", "is_initialized", "isend", "monitored_barrier", "new_group",
    "recv", "reduce", "reduce_scatter", "reduce_scatter_fn", "reduce_scatter_tensor", "scatter", "send",
]  # fmt: skip
