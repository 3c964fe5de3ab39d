"""Where a rank sits in pipeline x data x tensor parallelism, and the groups it talks over.

[Note: topology]
The world's ranks form a ``(pp, dp, tp)`` grid, a ``DeviceMesh`` with those dim names,
tensor parallelism innermost: consecutive ranks (the GPUs of one host, joined by the
fastest links) hold the slices of one layer, data-parallel replicas come next, pipeline
stages outermost. Each parallelism talks over its own dim's group: tensor-parallel
all-reduces over ``tp``, ZeRO's reduce-scatters and all-gathers over ``dp``, activations
between stages over ``pp``. :meth:`Topology.mpu` gives the same groups under Megatron's
names, which is what ``terascale.initialize(mpu=...)`` (and DeepSpeed, and Megatron
models) expect: there the *model-parallel* group is the tensor-parallel one, the ranks
that hold slices of the same layers and see the same data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DIMS = ("pp", "dp", "tp")


def grid_sizes(world: int, pp: int = 1, tp: int = 1, dp: int | None = None) -> tuple[int, int, int]:
    """``(pp, dp, tp)`` for ``world`` ranks; ``dp`` defaults to what the others leave."""
    for name, value in (("pp", pp), ("tp", tp)):
        if value < 1:
            raise ValueError(f"Topology: {name} must be >= 1, got {value}")
    if world % (pp * tp):
        raise ValueError(f"Topology: {world} ranks do not split into pp={pp} x tp={tp} (need a multiple of {pp * tp})")
    if dp is None:
        dp = world // (pp * tp)
    if pp * dp * tp != world:
        raise ValueError(f"Topology: pp={pp} x dp={dp} x tp={tp} = {pp * dp * tp} ranks, but the world has {world}")
    return pp, dp, tp


class Topology:
    """The ``(pp, dp, tp)`` grid of all ranks (see [Note: topology]).

    Joins the default process group if needed (as ``terascale.initialize`` would) and
    builds one ``DeviceMesh``; collective: every rank constructs it with the same sizes.
    """

    def __init__(self, pp: int = 1, tp: int = 1, dp: int | None = None, *, device_type: str | None = None) -> None:
        from terascale.comm import init_distributed

        ctx = init_distributed()
        self.sizes = dict(zip(DIMS, grid_sizes(ctx.world_size, pp, tp, dp)))
        self.mesh: DeviceMesh = init_device_mesh(
            device_type or ctx.device.type, tuple(self.sizes[d] for d in DIMS), mesh_dim_names=DIMS
        )

    def group(self, dim: str) -> ProcessGroup:
        """The process group of this rank along ``dim`` (``pp``, ``dp`` or ``tp``)."""
        return self.mesh.get_group(self._dim(dim))

    def rank(self, dim: str) -> int:
        """This rank's coordinate along ``dim``."""
        return self.mesh.get_local_rank(self._dim(dim))

    def size(self, dim: str) -> int:
        return self.sizes[self._dim(dim)]

    def ranks(self, dim: str) -> list[int]:
        """The global ranks of this rank's group along ``dim``, in coordinate order."""
        return dist.get_process_group_ranks(self.group(dim))

    @staticmethod
    def _dim(dim: str) -> str:
        if dim not in DIMS:
            raise ValueError(f"Topology has dims {DIMS}; got '{dim}'")
        return dim

    def mpu(self) -> MegatronMpu:
        """These groups under Megatron's names (``initialize(mpu=topology.mpu())``)."""
        return MegatronMpu(self)

    def __repr__(self) -> str:
        coords = ", ".join(f"{d}={self.rank(d)}/{self.sizes[d]}" for d in DIMS)
        return f"Topology(rank {dist.get_rank()}: {coords})"


@dataclass(frozen=True)
class MegatronMpu:
    """Megatron's ``mpu`` over a :class:`Topology`: the data-parallel, tensor-parallel
    (also called model-parallel) and pipeline-parallel groups, ranks and sizes."""

    topology: Topology

    def get_data_parallel_group(self) -> ProcessGroup:
        return self.topology.group("dp")

    def get_data_parallel_rank(self) -> int:
        return self.topology.rank("dp")

    def get_data_parallel_world_size(self) -> int:
        return self.topology.size("dp")

    def get_tensor_model_parallel_group(self) -> ProcessGroup:
        return self.topology.group("tp")

    def get_tensor_model_parallel_rank(self) -> int:
        return self.topology.rank("tp")

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.topology.size("tp")

    # Megatron's older names: "model parallel" is tensor parallel.
    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size

    def get_pipe_parallel_group(self) -> ProcessGroup:
        return self.topology.group("pp")

    def get_pipe_parallel_rank(self) -> int:
        return self.topology.rank("pp")

    def get_pipe_parallel_world_size(self) -> int:
        return self.topology.size("pp")

    get_pipeline_model_parallel_group = get_pipe_parallel_group
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
