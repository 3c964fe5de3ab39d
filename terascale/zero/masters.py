"""Master shards (fp32, or bf16: [Note: bf16 masters and optimizer states]): what the
optimizer steps when parameters are sharded.

[Note: master pieces]
Each rank steps only its own shard of every group. Because a group's parameters are
ordered by optimizer param group (``[Note: group plan]``), the shard splits into at most
one contiguous *piece* per optimizer param group; each piece gets one fp32 master tensor
(``nn.Parameter``) that the optimizer sees, so a fused optimizer updates a whole piece
in one kernel. Where the model already computes in fp32 the master is a view of the
parameter shard itself and no memory is spent twice. Frozen parameters and padding are
in no piece. Pieces may be split further so that no optimizer call handles more than
``sub_group_size`` elements at once (the fp32 gradients are materialised per call), into
at most ``MAX_PIECES_PER_SPAN`` pieces per param group's span of a shard.
Consecutive pieces form *runs*, one optimizer call each: a run ends before it would
exceed ``sub_group_size``, and at the end of a group once it has ``run_split_numel``
elements (a million; four million when the runs are swapped to NVMe, see
``[Note: optimizer swapping]``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from terascale.zero.flat_group import FlatParamGroup
from terascale.zero.wrap import GroupPlan


RUN_SPLIT_NUMEL = 1 << 20
MAX_PIECES_PER_SPAN = 64
# Runs swapped to NVMe end at a group end only from this size: see [Note: optimizer swapping].
NVME_RUN_SPLIT_NUMEL = 1 << 22


@dataclass(frozen=True)
class MasterPrecision:
    """The dtypes of the masters and of their optimizer state, and how a step narrows into
    bf16 ones ([Note: bf16 masters and optimizer states]): DeepSpeed's
    ``bf16.bf16_master_weights_and_grads`` and ``bf16.bf16_optimizer_states``."""

    dtype: torch.dtype = torch.float32
    state_dtype: torch.dtype = torch.float32
    stochastic_rounding: bool = True

    @property
    def low(self) -> bool:
        """Whether anything the optimizer keeps is narrower than fp32."""
        return self.dtype != torch.float32 or self.state_dtype != torch.float32


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
            # At most MAX_PIECES_PER_SPAN pieces: a sub_group_size far below the shard
            # (DeepSpeed's tests use 8) would otherwise make a master, an optimizer
            # parameter and a Python call per few elements. DeepSpeed never splits a
            # parameter across its sub-groups at all.
            step = max(1, max_numel, -(-(b - a) // MAX_PIECES_PER_SPAN))
            for s in range(a, b, step):
                out.append(Piece(g, k, s - lo_global, min(b, s + step) - lo_global))
        i = j + 1
    return out


class ShardedMasters:
    """One master tensor per :class:`Piece` of this rank's shards.

    Masters live on ``device`` (default: the shards' device; the host for optimizer
    offload). A master shares the shard's storage when both are fp32 on one device and
    ``share_storage`` allows it; an offload tier that moves masters away needs copies.
    With ``create=False`` the masters start empty and :meth:`create_run` fills them one
    optimizer run at a time, so an offload tier can move each away before the next exists.
    """

    def __init__(
        self,
        plans: Sequence[GroupPlan],
        groups: Sequence[FlatParamGroup],
        master_dtype: torch.dtype = torch.float32,
        sub_group_size: int = 1_000_000_000,
        *,
        device: torch.device | None = None,
        share_storage: bool = True,
        create: bool = True,
        run_split_numel: int = RUN_SPLIT_NUMEL,
    ) -> None:
        self.groups = list(groups)
        self._bases = [0, *itertools.accumulate(fg.layout.numel for fg in self.groups)]  # see positions()
        self.pieces = [p for g, (plan, fg) in enumerate(zip(plans, groups)) for p in _pieces(plan, fg, g, sub_group_size)]
        self.sub_group_size = max(1, sub_group_size)
        self.runs = self._runs(run_split_numel)
        self.dtype = master_dtype
        self.device = device
        self._share = share_storage
        self.masters = [nn.Parameter(torch.empty(0, dtype=master_dtype, device=device)) for _ in self.pieces]
        self.shares_storage = [False] * len(self.pieces)
        if create:
            for run in self.runs:
                self.create_run(run)

    @torch.no_grad()
    def create_run(self, run: Sequence[int], device: torch.device | None = None) -> None:
        """Give the masters of pieces ``run`` their values from the parameter shards, on
        ``device`` (default: the masters' device)."""
        for i in run:
            piece = self.pieces[i]
            shard = self.groups[piece.group].shard[piece.lo : piece.hi]
            target = device or self.device or shard.device
            share = self._share and shard.dtype == self.dtype and shard.device == target
            self.masters[i].data = shard if share else shard.to(device=target, dtype=self.dtype, copy=True)
            self.shares_storage[i] = share

    def param_groups(self, options: Sequence[dict]) -> list[dict]:
        """Optimizer param groups: the user's options with this rank's master pieces as params."""
        return [
            {**opts, "params": [m for p, m in zip(self.pieces, self.masters) if p.opt_group == k]}
            for k, opts in enumerate(options)
        ]

    def segments(self, number: dict[int, int]) -> list[list[tuple[int, int, int]]]:
        """For each piece, its parts ``(parameter, start, end)``: elements ``[start, end)`` of
        the piece belong to the parameter ``number[id(param)]`` numbers."""
        out = []
        for p in self.pieces:
            fg = self.groups[p.group]
            lo = fg.layout.shard_range(fg.rank)[0] + p.lo
            hi = lo + (p.hi - p.lo)
            parts = []
            for slot, param in zip(fg.layout.slots, fg.params):
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if a < b:
                    parts.append((number[id(param)], a - lo, b - lo))
            out.append(parts)
        return out

    def grad_pieces(self, shards: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """Each piece's slice of the gradient shards (the optimizer's gradients, before scaling)."""
        out = []
        for p in self.pieces:
            shard = shards[p.group]
            if shard is None:  # reached by a script, not an internal slip: say what to call
                raise RuntimeError(
                    f"the optimizer step found no gradient for group {p.group}: no backward of this "
                    "accumulation window went through the engine. Compute the loss from the engine's "
                    "forward (engine(batch), not engine.module(batch)) and call engine.backward(loss) "
                    "or loss.backward() on it before engine.step()"
                )
            out.append(shard[p.lo : p.hi])
        return out

    def positions(self, run: Sequence[int]) -> list[int]:
        """Each piece's model position: its group's base (the elements of the groups
        before it) plus its first element's offset in the group's flat layout, the same
        at every world size and on every rank."""
        out = []
        for i in run:
            p = self.pieces[i]
            fg = self.groups[p.group]
            out.append(self._bases[p.group] + fg.layout.shard_range(fg.rank)[0] + p.lo)
        return out

    def sub_groups(self) -> list[list[int]]:
        """Piece indices in runs of at most ``sub_group_size`` elements (one optimizer call each)."""
        return self.runs

    def _runs(self, split_numel: int) -> list[list[int]]:
        # A run also ends where a group ends once it holds split_numel elements, so the
        # step can start all-gathering a finished group while it updates the next one.
        runs: list[list[int]] = [[]]
        numel = 0
        for i, p in enumerate(self.pieces):
            at_group_end = runs[-1] and self.pieces[runs[-1][-1]].group != p.group and numel >= split_numel
            if runs[-1] and (numel + (p.hi - p.lo) > self.sub_group_size or at_group_end):
                runs.append([])
                numel = 0
            runs[-1].append(i)
            numel += p.hi - p.lo
        return [r for r in runs if r]

    @torch.no_grad()
    def write_to_shards(self, indices: Sequence[int], write: Callable[[int, int, torch.Tensor], None] | None = None) -> None:
        """Copy updated masters into the low-precision parameter shards, or hand each to
        ``write(group, lo, master)`` (an offload tier that holds the shard elsewhere)."""
        for i in indices:
            if not self.shares_storage[i]:
                p = self.pieces[i]
                if write is None:
                    self.groups[p.group].shard[p.lo : p.hi].copy_(self.masters[i])
                else:
                    write(p.group, p.lo, self.masters[i])

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
        """Bytes of master storage in memory that is not shared with the parameter shards."""
        return sum(m.numel() * m.element_size() for m, shared in zip(self.masters, self.shares_storage) if not shared)
