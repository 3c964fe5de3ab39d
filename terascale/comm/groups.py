"""Process-group set-up: from torchrun's environment, an MPI or SLURM launch, or one process.

terascale never relies on an implicit "current group" deeper than this module: the
engine receives a :class:`DistributedContext` and passes its ``dp_group`` explicitly to
every collective. Model parallelism plugs in through an ``mpu`` object (Megatron's
convention, which DeepSpeed also accepts) that owns the data-parallel group.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import functools
import os
import time
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from terascale.comm import discovery, ops
from terascale.elastic import world
from terascale.elastic.membership import JobClosed


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
    mp_group: ProcessGroup | None = None  # Megatron's "model parallel": the tensor-parallel group
    mp_world_size: int = 1
    tp_rank: int = 0
    pp_group: ProcessGroup | None = None
    pp_rank: int = 0
    pp_world_size: int = 1
    # The ranks with this rank's data-parallel coordinate (one replica of the model, every
    # tensor- and pipeline-parallel part of it); None without model parallelism.
    replica_group: ProcessGroup | None = None
    # Ulysses sequence parallelism ([Note: sequence-parallel groups]): the ranks sharing
    # this rank's sequences, and the sequence x data-parallel ranks that hold the same
    # parameters (ZeRO shards over them); None without sequence parallelism.
    sp_group: ProcessGroup | None = None
    sp_rank: int = 0
    sp_world_size: int = 1
    sdp_group: ProcessGroup | None = None
    # A live elastic job ([Note: membership epochs]): this process's membership (a
    # terascale.elastic.membership.Membership), and whether peers of the running job hold
    # the training state this rank must take (it joined an epoch that carries state).
    elastic: Any = None
    carried_state: bool = False

    @property
    def zero_group(self) -> ProcessGroup:
        """The ranks holding the same parameters: ZeRO shards the model state over them,
        and gradients are averaged over them ([Note: sequence-parallel groups])."""
        return self.sdp_group if self.sdp_group is not None else self.dp_group


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
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    discover: bool = True,
) -> DistributedContext:
    """Join (or create) the default process group and describe this rank.

    An explicit ``init_method`` or ``rank``/``world_size`` (DeepSpeed's
    ``init_distributed`` takes them) initialises the default group from them. Otherwise,
    under torchrun (``RANK``/``WORLD_SIZE`` set) this initialises the default group from
    the environment; processes started by ``mpirun`` (OpenMPI, MPICH, Intel MPI, MVAPICH)
    or ``srun`` first export what their launcher says as torchrun's variables
    (:mod:`terascale.comm.discovery`; ``discover=False`` refuses such a launch instead);
    with no launcher it creates a one-process group, so the rest of terascale always has
    a real group to pass to collectives. An already-initialised default group is reused
    as is. The device is ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU; the
    ``TERASCALE_DEVICE`` environment variable (``cpu`` or ``cuda``) and then the ``device``
    argument override that choice. Raises ``ValueError`` when a launcher started several
    processes but they cannot find each other (the message names what to set).
    """
    if not dist.is_initialized() and init_method is None and rank is None:
        _adopt_launcher_environment(discover)  # before LOCAL_RANK is read: it picks the device
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

    membership, carried = None, False
    if not dist.is_initialized() and init_method is None and rank is None and world.started_live():
        # [Note: the live elastic agent]: the membership gives the rank and world size.
        membership = world.connect()
        try:
            epoch = membership.join()
        except JobClosed as done:
            print(f"terascale: {done}; nothing to do", flush=True)
            raise SystemExit(0) from None
        world.init_epoch_group(membership, epoch, backend or _default_backend(device.type))
        carried = bool(epoch.carried)
    if not dist.is_initialized():
        backend = backend or _default_backend(device.type)
        kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
        if init_method is not None or rank is not None:
            if rank is not None:
                kwargs.update(rank=rank, world_size=world_size)
            dist.init_process_group(backend=backend, init_method=init_method or "env://", **kwargs)
        elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend=backend, init_method="env://", **kwargs)
        else:
            # A private in-memory store: a single process needs no rendezvous.
            dist.init_process_group(
                backend=backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs
            )
    backend = str(dist.get_backend())
    _release_the_gil_at_exit()

    dp_group = dist.group.WORLD if mpu is None else mpu.get_data_parallel_group()
    assert dp_group is not None
    ctx = DistributedContext(
        device=device,
        backend=backend,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        dp_group=dp_group,
        dp_rank=dist.get_rank(dp_group),
        dp_world_size=dist.get_world_size(dp_group),
        elastic=membership,
        carried_state=carried,
    )
    if mpu is None:
        return ctx
    # Newer Megatron calls tensor + pipeline together "model parallel" and names the
    # tensor-parallel group separately; older mpus (and DeepSpeed's) only have the former.
    tp = "get_tensor_model_parallel_" if hasattr(mpu, "get_tensor_model_parallel_group") else "get_model_parallel_"
    mp_group = getattr(mpu, tp + "group")()
    pp = _pipe_groups(mpu)
    ctx = dataclasses.replace(
        ctx,
        mp_group=mp_group,
        mp_world_size=getattr(mpu, tp + "world_size")(),
        tp_rank=getattr(mpu, tp + "rank")() if hasattr(mpu, tp + "rank") else dist.get_rank(mp_group),
        pp_group=pp[0],
        pp_rank=pp[1],
        pp_world_size=pp[2],
    )
    _check_mpu(ctx)
    return dataclasses.replace(ctx, replica_group=_replica_group(ctx))


def _adopt_launcher_environment(discover: bool) -> None:
    """Set torchrun's variables in this process's environment from an MPI or SLURM launch,
    where ``env://``, the device choice and the user's own code read them; torchrun's own
    win. Raises ``ValueError`` rather than let several launched processes each run as a
    world of one."""
    if discover:
        launch = discovery.discover(os.environ)
        if launch is not None:
            os.environ.update(launch.torch_environment())
        return
    started = discovery.started_by(os.environ)
    if started is not None and started.world_size > 1:
        raise ValueError(
            f"{started.launcher} started {started.world_size} processes ({started.describe()}) but "
            "init_distributed(auto_mpi_discovery=False) does not read them: allow the discovery, or set "
            "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT yourself"
        )


def _pipe_groups(mpu: ModelParallelUnit) -> tuple[ProcessGroup | None, int, int]:
    """The mpu's pipeline group, rank and size (Megatron's mpu may have none)."""
    for prefix in ("get_pipe_parallel_", "get_pipeline_model_parallel_"):
        if hasattr(mpu, prefix + "group"):
            return getattr(mpu, prefix + "group")(), getattr(mpu, prefix + "rank")(), getattr(mpu, prefix + "world_size")()
    return None, 0, 1


def _check_mpu(ctx: DistributedContext) -> None:
    """A user's mpu must describe this world: its groups' sizes multiply to the world size
    and this rank is in each of them."""
    if ctx.dp_rank < 0 or (ctx.mp_group is not None and dist.get_rank(ctx.mp_group) < 0):
        raise ValueError(
            f"mpu: rank {ctx.rank} is not a member of the data-parallel or model-parallel group the mpu returned"
        )
    if ctx.mp_group is not None and dist.get_world_size(ctx.mp_group) != ctx.mp_world_size:
        raise ValueError(
            f"mpu: get_model_parallel_world_size() is {ctx.mp_world_size} but its group has "
            f"{dist.get_world_size(ctx.mp_group)} ranks"
        )
    total = ctx.dp_world_size * ctx.mp_world_size * ctx.pp_world_size
    if total != ctx.world_size:
        raise ValueError(
            f"mpu does not match the world: data-parallel {ctx.dp_world_size} x model(tensor)-parallel "
            f"{ctx.mp_world_size} x pipeline {ctx.pp_world_size} = {total} ranks, but the world has "
            f"{ctx.world_size}; check the mpu's groups (or pass none)"
        )


def _replica_group(ctx: DistributedContext) -> ProcessGroup | None:
    """The ranks sharing this rank's data-parallel coordinate (see ``DistributedContext``).

    Collective over the world: ranks with the same data-parallel rank hold one replica
    between them; every distinct group is created in the same order on every rank.
    """
    if ctx.dp_world_size == ctx.world_size:
        return None
    coords: list[int | None] = [None] * ctx.world_size
    ops.all_gather_object(coords, ctx.dp_rank)
    out = None
    for coord in sorted(set(coords)):  # type: ignore[type-var]
        members = [r for r, c in enumerate(coords) if c == coord]
        created = dist.new_group(members)
        if coord == ctx.dp_rank:
            out = created
    return out


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
    ops.all_gather_object(everyone, mine)
    out = None
    for ranks in sorted({tuple(r) for r in everyone if r is not None}):
        created = dist.new_group(list(ranks))
        if list(ranks) == mine:
            out = created
    assert out is not None
    return out


def split_group(group: ProcessGroup, color: Any) -> ProcessGroup:
    """The ranks of ``group`` whose ``color`` equals this rank's, as a new process group
    (MPI's ``Comm_split``), ordered as in ``group``.

    Collective over the default group (``new_group`` is): every rank calls it at the same
    point, each with its own ``group``; every distinct member list of every group is
    created in the same order everywhere. ``color`` must be hashable and comparable.
    """
    mine = dist.get_process_group_ranks(group)
    everyone: list[tuple[tuple[int, ...], Any, int] | None] = [None] * dist.get_world_size()
    ops.all_gather_object(everyone, (tuple(mine), color, dist.get_rank()))
    members: dict[tuple[tuple[int, ...], Any], list[int]] = {}
    for entry in everyone:
        assert entry is not None
        ranks, c, rank = entry
        members.setdefault((ranks, c), []).append(rank)
    out = None
    for key in sorted(members, key=lambda k: (k[0], repr(k[1]))):
        order = {r: i for i, r in enumerate(key[0])}
        ranks = sorted(members[key], key=order.__getitem__)
        created = group if len(ranks) == len(key[0]) else dist.new_group(ranks)
        if key == (tuple(mine), color):
            out = created
    assert out is not None
    return out
