"""Sequence-parallel groups: which ranks share a sequence, which hold the same data.

[Note: sequence-parallel groups]
With sequence-parallel size P, each run of P consecutive ranks (DeepSpeed's layout: the
all-to-alls of attention stay among neighbours, inside a node) splits the same sequences
between them, and the ranks at the same place in each run are the data-parallel replicas
that read different samples. So a world of 4 at P = 2 has sequence groups [0, 1], [2, 3]
and data replicas [0, 2], [1, 3].

Every rank holds the same parameters, so ZeRO shards the model state over all of them
(the *sequence x data-parallel* group, DeepSpeed's ``seq_data_parallel_group``) and
averages the gradients over all of them, as DeepSpeed does: the loss of each rank of a
sequence group carries the factor that makes that average the sum of the slices' shares
([Note: the loss under sequence parallelism]). The engine's data-parallel rank and size
(batch arithmetic, samplers, ``dp_world_size``) stay those of the replicas: a sequence
group reads one sample stream.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch.distributed as dist
from torch.distributed import ProcessGroup

from terascale.comm.groups import DistributedContext


class SequenceGroups(Protocol):
    """Sequence-parallel groups built beforehand (DeepSpeed's sequence-parallel mpu)."""

    def get_sequence_parallel_group(self) -> ProcessGroup: ...

    def get_data_parallel_group(self) -> ProcessGroup: ...


def with_sequence_parallel(ctx: DistributedContext, size: int, built: SequenceGroups | None = None) -> DistributedContext:
    """``ctx`` with sequence-parallel groups of ``size`` consecutive ranks (see the note),
    or ``built``'s: its data-parallel group becomes the data replicas, its ``sdp_group``
    the ranks it held before. Collective over the world (every rank calls it alike).
    Raises ``ValueError`` where ``size`` does not divide the ranks or model parallelism is on."""
    if size == 1:
        return ctx
    if ctx.mp_world_size > 1 or ctx.pp_world_size > 1:
        raise ValueError(
            f"sequence_parallel_size {size} with tensor-parallel size {ctx.mp_world_size} and "
            f"{ctx.pp_world_size} pipeline stage(s): sequence parallelism composes with data parallelism and "
            "ZeRO only (as DeepSpeed's Ulysses does); drop the tensor or pipeline parallelism"
        )
    world = ctx.dp_world_size
    if world % size:
        raise ValueError(
            f"sequence_parallel_size {size} does not divide the {world} ranks; run on a multiple of {size} "
            f"ranks or choose a size that divides {world}"
        )
    if built is not None:
        sp_group, replicas = built.get_sequence_parallel_group(), built.get_data_parallel_group()
    else:
        sp_group, replicas = sequence_groups(dist.get_process_group_ranks(ctx.dp_group), size)
    assert dist.get_world_size(sp_group) == size
    return dataclasses.replace(
        ctx,
        dp_group=replicas,
        dp_rank=dist.get_rank(replicas),
        dp_world_size=world // size,
        sp_group=sp_group,
        sp_rank=dist.get_rank(sp_group),
        sp_world_size=size,
        sdp_group=ctx.dp_group,
    )


def sequence_groups(ranks: list[int], size: int) -> tuple[ProcessGroup, ProcessGroup]:
    """(this rank's sequence group, its data replicas) over ``ranks`` (see the note):
    consecutive runs of ``size``, and the ranks at the same place in each run. Collective
    over the world; ``size`` divides ``len(ranks)``."""
    assert len(ranks) % size == 0
    sp_group, _ = dist.new_subgroups_by_enumeration([ranks[i : i + size] for i in range(0, len(ranks), size)])
    replicas, _ = dist.new_subgroups_by_enumeration([ranks[j::size] for j in range(size)])
    return sp_group, replicas
