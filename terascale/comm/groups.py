"""Process-group set-up: from torchrun's environment, or one process with none.

terascale never relies on an implicit "current group" deeper than this module: the
engine receives a :class:`DistributedContext` and passes its ``dp_group`` explicitly to
every collective. Model parallelism plugs in through an ``mpu`` object (Megatron's
convention, which DeepSpeed also accepts) that owns the data-parallel group.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import os
import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


@runtime_checkable
class ModelParallelUnit(Protocol):
    """What terascale needs from a model-parallel unit (``mpu``).

    Any object with these methods works (Megatron's ``mpu`` module does). The
    data-parallel group is the one ZeRO shards over and gradients are averaged over.
    """

    def get_data_parallel_group(self) -> ProcessGroup: ...

    def get_model_parallel_group(self) -> ProcessGroup: ...

    def get_data_parallel_world_size(self) -> int: ...

    def get_data_parallel_rank(self) -> int: ...

    def get_model_parallel_world_size(self) -> int: ...

    def get_model_parallel_rank(self) -> int: ...


@dataclass(frozen=True)
class DistributedContext:
    """Where this process sits: its device and the groups it talks over."""

    device: torch.device
    backend: str
    rank: int  # global rank
    world_size: int  # global world size
    local_rank: int
    dp_group: ProcessGroup
    dp_rank: int
    dp_world_size: int
    mp_group: ProcessGroup | None = None
    mp_world_size: int = 1


def _default_backend(device_type: str) -> str:
    if device_type == "cuda" and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def init_distributed(
    mpu: ModelParallelUnit | None = None,
    *,
    backend: str | None = None,
    device: torch.device | str | None = None,
    timeout: datetime.timedelta | None = None,
) -> DistributedContext:
    """Join (or create) the default process group and describe this rank.

    Under torchrun (``RANK``/``WORLD_SIZE`` set) this initialises the default group from
    the environment; with no environment it creates a one-process group, so the rest of
    terascale always has a real group to pass to collectives. An already-initialised
    default group is reused as is. The device is ``cuda:LOCAL_RANK`` when CUDA is
    available, else the CPU; the ``TERASCALE_DEVICE`` environment variable (``cpu`` or
    ``cuda``) and then the ``device`` argument override that choice.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = os.environ.get("TERASCALE_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", local_rank)
        if device.index >= torch.cuda.device_count():
            raise ValueError(
                f"this process wants {device} (LOCAL_RANK={local_rank}) but {torch.cuda.device_count()} "
                "CUDA device(s) are visible: start at most one process per GPU (terascale run --nproc), "
                "or set TERASCALE_DEVICE=cpu to train on the CPU"
            )
        torch.cuda.set_device(device)

    if not dist.is_initialized():
        backend = backend or _default_backend(device.type)
        kwargs = {"timeout": timeout} if timeout is not None else {}
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend=backend, init_method="env://", **kwargs)
        else:
            # A private in-memory store: a single process needs no rendezvous.
            dist.init_process_group(
                backend=backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs
            )
    backend = str(dist.get_backend())
    _release_the_gil_at_exit()

    if mpu is not None:
        dp_group = mpu.get_data_parallel_group()
        mp_group = mpu.get_model_parallel_group()
        mp_world_size = mpu.get_model_parallel_world_size()
    else:
        dp_group = dist.group.WORLD
        mp_group = None
        mp_world_size = 1
    assert dp_group is not None
    return DistributedContext(
        device=device,
        backend=backend,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        dp_group=dp_group,
        dp_rank=dist.get_rank(dp_group),
        dp_world_size=dist.get_world_size(dp_group),
        mp_group=mp_group,
        mp_world_size=mp_world_size,
    )


@functools.cache
def _release_the_gil_at_exit() -> None:
    """[Note: exiting with collective threads] A gloo worker thread that finished a
    collective drops its tensors afterwards, and dropping a tensor Python also knows takes
    the GIL. Training scripts (the Hugging Face Trainer's among them) often end right
    after a collective without destroying the process group; if the interpreter starts
    finalising while such a thread still waits for the GIL, the thread is killed inside
    C++ and the process aborts ("terminate called without an active exception", PyTorch
    issue 190489), turning a finished run into a failed one. Letting go of the GIL for a
    moment at exit lets those threads finish first. No collective is issued: a rank that
    has already gone cannot hang the others."""
    atexit.register(time.sleep, 0.05)


def duplicate_group(group: ProcessGroup) -> ProcessGroup:
    """A new process group over the same ranks as ``group`` (a second, independent channel).

    Collectives on different groups need not be issued in the same relative order on
    every rank, and on NCCL they run on different communicators and can overlap. Every
    rank of the default group must call this at the same point (``new_group`` is
    collective over the world): each rank contributes its group's members, and every
    distinct member list is created in the same order everywhere.
    """
    if dist.get_world_size(group) == 1:
        return group
    mine = dist.get_process_group_ranks(group)
    everyone: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out = None
    for ranks in sorted({tuple(r) for r in everyone if r is not None}):
        created = dist.new_group(list(ranks))
        if list(ranks) == mine:
            out = created
    assert out is not None
    return out
