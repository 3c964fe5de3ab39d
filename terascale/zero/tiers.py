"""Where a ZeRO model state's masters, optimizer state and gradient shards live.

The optimizer's tier (``zero_optimization.offload_optimizer``) takes the first ``ratio``
of this rank's master runs: host memory, or NVMe swap files ([Note: optimizer
swapping]); the rest stay with the parameter shards. With the optimizer on NVMe at
stages 2-3 the window's gradient shards go to NVMe too once they outgrow the swap
buffers ([Note: gradient swapping]).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from terascale.offload import AsyncIO
from terascale.offload.grads import GradSwapper
from terascale.offload.optimizer import OptimizerSwapper
from terascale.offload.swap import SwapDirectory
from terascale.zero.flat_group import FlatParamGroup
from terascale.zero.masters import NVME_RUN_SPLIT_NUMEL, RUN_SPLIT_NUMEL, ShardedMasters
from terascale.zero.options import ZeroOptions
from terascale.zero.wrap import GroupPlan

# create(masters, run, device): make run's masters from its parameter shards on device
# (None: the masters' own), reading the shards back where they are on NVMe.
CreateRun = Callable[[ShardedMasters, list[int], "torch.device | None"], None]


def place_masters(
    plans: Sequence[GroupPlan],
    groups: Sequence[FlatParamGroup],
    options: ZeroOptions,
    device: torch.device,
    swap_io: AsyncIO | None,
    create: CreateRun,
) -> tuple[ShardedMasters, OptimizerSwapper | None]:
    """Masters (fp32, or bf16: [Note: bf16 masters and optimizer states]) on the
    optimizer's tier; the first ``tier.ratio`` of the runs there, the rest with the
    parameter shards on ``device`` (see [Note: optimizer swapping])."""
    tier = options.offload_optimizer
    masters = ShardedMasters(
        plans,
        groups,
        options.masters.dtype,
        options.sub_group_size,
        device=torch.device("cpu") if tier.enabled else None,
        # Masters that alias a shard would move (or vanish) with it.
        # So would the overlapped step's updates, under the next window ([Note: the
        # overlapped host step]).
        share_storage=tier.device != "nvme" and not options.offload_param.enabled and not tier.overlap_step,
        create=False,
        run_split_numel=NVME_RUN_SPLIT_NUMEL if tier.device == "nvme" else RUN_SPLIT_NUMEL,
    )
    total = sum(p.hi - p.lo for p in masters.pieces)
    offloaded, numel = [], 0
    for run in masters.runs:
        if tier.enabled and numel < tier.ratio * total:
            offloaded.append(run)
            numel += sum(masters.pieces[i].hi - masters.pieces[i].lo for i in run)
        else:  # no offload, or beyond the ratio: with the parameter shards
            create(masters, run, device)
    if tier.device != "nvme":
        for run in offloaded:
            create(masters, run, None)
        return masters, None
    assert swap_io is not None, "an NVMe tier has its I/O engine"
    directory = SwapDirectory(tier.nvme_path, "optimizer", dist.get_rank())
    swapper = OptimizerSwapper(
        masters, offloaded, directory, swap_io, tier.buffer_count, pin_memory=tier.pin_memory,
        create_run=lambda run: create(masters, run, None), state_bytes=tier.state_bytes,
        in_memory_state=tier.in_memory_state,
    )  # fmt: skip
    return masters, swapper


def grad_swapper(
    plans: Sequence[GroupPlan],
    groups: Sequence[FlatParamGroup],
    options: ZeroOptions,
    masters: ShardedMasters,
    swapper: OptimizerSwapper | None,
    swap_io: AsyncIO | None,
    kind: str = "grads",
) -> GradSwapper | None:
    """Gradient shards on NVMe when the optimizer state is there (stages 2-3) and they
    outgrow its buffers (see [Note: gradient swapping]); ``kind`` names their folder."""
    tier = options.offload_optimizer
    if tier.device != "nvme" or not options.grads.reduce_every_micro_step:
        return None
    assert swapper is not None and swap_io is not None
    numel = [fg.layout.shard_numel if any(k >= 0 for k in plan.opt_group) else 0
             for plan, fg in zip(plans, groups)]  # fmt: skip
    pieces = masters.pieces
    largest_run = max((sum(pieces[i].hi - pieces[i].lo for i in run) for run in swapper.runs), default=0)
    if sum(numel) <= tier.buffer_count * largest_run:
        return None
    directory = SwapDirectory(tier.nvme_path, kind, dist.get_rank())
    return GradSwapper(numel, options.grads.dtype, directory, swap_io, pin_memory=tier.pin_memory)
