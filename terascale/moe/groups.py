"""Expert-parallel and expert-data-parallel groups, carved out of the data-parallel groups.

[Note: expert-parallel groups]
Expert parallelism lives inside data parallelism: the ``D`` ranks of a data-parallel
group (one per replica of everything else) are cut into ``D / P`` expert-parallel
groups of ``P`` consecutive ranks, and the ranks at the same position of those groups
form the expert-data-parallel groups that replicate one set of experts. This is
DeepSpeed's default layout, so a checkpoint's expert files and a program's rank
arithmetic mean the same here: with 4 data-parallel ranks and ``P = 2`` the
expert-parallel groups are ``[0, 1], [2, 3]`` and the expert-data-parallel groups
``[0, 2], [1, 3]``. Consecutive ranks share a host first, so the all-to-all, the heavy
exchange of every MoE layer, stays on the fastest links when ``P`` fits in a host.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from terascale.comm import ops
from terascale.moe.experts import expert_group_name
from terascale.parallel.slicing import TensorSlice


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's groups for expert-parallel size ``ep_size`` (see [Note: expert-parallel groups]).

    ``ep_group``: the ranks that split the experts among them (None when ``ep_size`` is 1);
    ``edp_group``: the ranks holding the same experts as this one; ``ep_rank``: this rank's
    place in ``ep_group``, which decides the global ids of its experts;
    ``dp_world_size``: the data-parallel world the experts' gradients are averaged over.
    """

    ep_size: int
    ep_group: ProcessGroup | None
    edp_group: ProcessGroup
    ep_rank: int
    dp_world_size: int

    @property
    def name(self) -> str:
        return expert_group_name(self.ep_size)

    @property
    def edp_size(self) -> int:
        return self.dp_world_size // self.ep_size


def expert_groups(dp_group: ProcessGroup, ep_size: int) -> ExpertGroups:
    """Cut every data-parallel group into expert-parallel groups of ``ep_size`` ranks and
    expert-data-parallel groups across them; return this rank's. Collective over the
    world: every rank calls it with the same ``ep_size``."""
    dp_world = dist.get_world_size(dp_group)
    if ep_size < 1 or dp_world % ep_size:
        raise ValueError(
            f"ep_size {ep_size} does not divide the data-parallel world of {dp_world} ranks: expert parallelism "
            f"splits the data-parallel ranks into groups of ep_size (choose a divisor of {dp_world})"
        )
    # Every rank learns every data-parallel group (there is one per model-parallel coordinate).
    mine = dist.get_process_group_ranks(dp_group)
    everyone: list[list[int] | None] = [None] * dist.get_world_size()
    ops.all_gather_object(everyone, mine)
    dp_groups = sorted({tuple(r) for r in everyone if r is not None})
    ep_lists = [list(dp[i : i + ep_size]) for dp in dp_groups for i in range(0, dp_world, ep_size)]
    edp_lists = [list(dp[j::ep_size]) for dp in dp_groups for j in range(ep_size)]
    ep_group, _ = dist.new_subgroups_by_enumeration(ep_lists)
    edp_group, _ = dist.new_subgroups_by_enumeration(edp_lists)
    ep_rank = mine.index(dist.get_rank()) % ep_size
    return ExpertGroups(ep_size, ep_group if ep_size > 1 else None, edp_group, ep_rank, dp_world)


def expert_class(ep_size: int) -> tuple[str, int]:
    """The parameter class ([Note: parameter classes]) of experts split ``ep_size`` ways."""
    return ("experts", ep_size)


@dataclass(frozen=True)
class ExpertLayout:
    """A model's expert parameters and this rank's groups for them.

    ``groups``: by expert-parallel size; ``ep_size_of``: ``id(param)`` -> the size its
    experts are split by, for every expert parameter of the model."""

    groups: Mapping[int, ExpertGroups] = field(default_factory=dict)
    ep_size_of: Mapping[int, int] = field(default_factory=dict)
    # Parameter name -> its name in the whole model: a local expert's index replaced by its
    # global one (``...deepspeed_experts.1.w`` is expert 3 on ep rank 1 of 2 ranks x 2).
    # Checkpoints and full state dicts use these names, so they hold every expert once and
    # load on any expert-parallel size.
    global_names: Mapping[str, str] = field(default_factory=dict)
    # Parameter name -> its part of the whole model's tensor, for experts fused into one
    # tensor per layer (Hugging Face's [E, ...] weights): this rank's rows of dim 0.
    slices: Mapping[str, TensorSlice] = field(default_factory=dict)
    # ids of the expert parameters terascale made (from a Hugging Face model's experts):
    # no user optimizer group could have been split for them.
    automatic: frozenset[int] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.ep_size_of)

    def classes(self) -> dict[int, Hashable]:
        return {pid: expert_class(n) for pid, n in self.ep_size_of.items()}

    def class_groups(self) -> dict[Hashable, ProcessGroup]:
        """Each expert class's sharding group: its expert-data-parallel group."""
        return {expert_class(n): g.edp_group for n, g in self.groups.items()}

    def split(self, params: Sequence[torch.Tensor]) -> list[tuple[ExpertGroups | None, list[int]]]:
        """Positions of ``params`` by expert-parallel size: the dense ones first (None),
        then each size's experts, in size order (the same on every rank)."""
        parts: dict[int, list[int]] = {0: []}
        for i, p in enumerate(params):
            parts.setdefault(self.ep_size_of.get(id(p), 0), []).append(i)
        return [(self.groups[n] if n else None, parts[n]) for n in sorted(parts)]
