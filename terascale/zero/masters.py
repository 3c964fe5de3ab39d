"""fp32 master shards: what the optimizer steps when parameters are sharded.

[Note: master pieces]
Each rank steps only its own shard of every group. Because a group's parameters are
ordered by optimizer param group (``[Note: group plan]``), the shard splits into at most
one contiguous *piece* per optimizer param group; each piece gets one fp32 master tensor
(``nn.Parameter``) that the optimizer sees, so a fused optimizer updates a whole piece
in one kernel. Where the model already computes in fp32 the master is a view of the
parameter shard itself and no memory is spent twice. Frozen parameters and padding are
in no piece. Pieces may be split further so that no optimizer call handles more than
``sub_group_size`` elements at once (the fp32 gradients are materialised per call).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from terascale.zero.flat_group import FlatParamGroup
from terascale.zero.wrap import GroupPlan


@dataclass(frozen=True)
class Piece:
    """Elements ``[lo, hi)`` of group ``group``'s shard, stepped by optimizer group ``opt_group``."""

    group: int
    opt_group: int
    lo: int
    hi: int


def _pieces(plan: GroupPlan, fg: FlatParamGroup, g: int, max_numel: int) -> list[Piece]:
    lo_global, hi_global = fg.layout.shard_range(fg.rank)
    out = []
    i = 0
    slots = fg.layout.slots
    while i < len(slots):
        k = plan.opt_group[i]
        j = i
        while j + 1 < len(slots) and plan.opt_group[j + 1] == k:
            j += 1
        start, end = slots[i].offset, slots[j].offset + slots[j].numel
        a, b = max(start, lo_global), min(end, hi_global)
        if k >= 0 and a < b:
            step = max(1, max_numel)
            for s in range(a, b, step):
                out.append(Piece(g, k, s - lo_global, min(b, s + step) - lo_global))
        i = j + 1
    return out


class ShardedMasters:
    """One master tensor per :class:`Piece` of this rank's shards."""

    def __init__(
        self,
        plans: Sequence[GroupPlan],
        groups: Sequence[FlatParamGroup],
        master_dtype: torch.dtype = torch.float32,
        sub_group_size: int = 1_000_000_000,
    ) -> None:
        self.groups = list(groups)
        self.pieces = [p for g, (plan, fg) in enumerate(zip(plans, groups)) for p in _pieces(plan, fg, g, sub_group_size)]
        self.masters: list[nn.Parameter] = []
        with torch.no_grad():
            for piece in self.pieces:
                shard = self.groups[piece.group].shard[piece.lo : piece.hi]
                data = shard if shard.dtype == master_dtype else shard.to(master_dtype)
                self.masters.append(nn.Parameter(data, requires_grad=True))
        self.shares_storage = [m.data_ptr() == self.groups[p.group].shard[p.lo :].data_ptr() for p, m in zip(self.pieces, self.masters)]
        self.sub_group_size = max(1, sub_group_size)

    def param_groups(self, options: Sequence[dict]) -> list[dict]:
        """Optimizer param groups: the user's options with this rank's master pieces as params."""
        return [
            {**opts, "params": [m for p, m in zip(self.pieces, self.masters) if p.opt_group == k]}
            for k, opts in enumerate(options)
        ]

    def grad_pieces(self, shards: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """Each piece's slice of the gradient shards (the optimizer's gradients, before scaling)."""
        out = []
        for p in self.pieces:
            shard = shards[p.group]
            assert shard is not None, f"group {p.group} has trainable parameters but no gradient shard"
            out.append(shard[p.lo : p.hi])
        return out

    def sub_groups(self) -> list[list[int]]:
        """Piece indices in runs of at most ``sub_group_size`` elements (one optimizer call each)."""
        runs: list[list[int]] = [[]]
        numel = 0
        for i, p in enumerate(self.pieces):
            if runs[-1] and numel + (p.hi - p.lo) > self.sub_group_size:
                runs.append([])
                numel = 0
            runs[-1].append(i)
            numel += p.hi - p.lo
        return [r for r in runs if r]

    @torch.no_grad()
    def write_to_shards(self, indices: Sequence[int]) -> None:
        """Copy updated masters into the low-precision parameter shards."""
        for i in indices:
            if not self.shares_storage[i]:
                p = self.pieces[i]
                self.groups[p.group].shard[p.lo : p.hi].copy_(self.masters[i])

    @torch.no_grad()
    def refresh_from_shard(self, g: int) -> None:
        """Take new values written into group ``g``'s parameter shard into its masters.

        Only elements whose low-precision value changed are replaced, so masters of
        untouched parameters keep their full fp32 precision.
        """
        for i, (p, m) in enumerate(zip(self.pieces, self.masters)):
            if p.group == g and not self.shares_storage[i]:
                new = self.groups[g].shard[p.lo : p.hi]
                changed = new != m.to(new.dtype)
                m.copy_(torch.where(changed, new.to(m.dtype), m))

    @torch.no_grad()
    def fp32_shard(self, g: int) -> torch.Tensor:
        """Group ``g``'s shard in fp32, exact (from the masters) wherever a master exists."""
        out = self.groups[g].shard.to(torch.float32, copy=True)
        for p, m in zip(self.pieces, self.masters):
            if p.group == g:
                out[p.lo : p.hi].copy_(m)
        return out

    def nbytes(self) -> int:
        """Bytes of master storage that is not shared with the parameter shards."""
        return sum(m.numel() * m.element_size() for m, shared in zip(self.masters, self.shares_storage) if not shared)
