"""A group's row-sparse slots: its dense part packed per shard, its rows added into shards.

[Note: sparse rows in a group]
With ``sparse_gradients`` a group holding parameters named in ``GradPolicy.sparse_params``
(sparse embeddings, see [Note: sparse gradients] in :mod:`terascale.comm.sparse`) is
reduced in two parts, so that no rank ever builds those parameters' dense gradients:

- its flat buffer holds only the dense parameters' slots, back to back (:class:`SparseLayout`);
  at reduction each rank packs, for every rank r, the dense elements that fall in r's
  shard into chunk r of a ``world x chunk`` buffer (``chunk``: the most dense elements
  any shard has) and reduce-scatters that, so dense traffic is unchanged;
- each sparse parameter's micro-step gradients accumulate as coalesced rows; they are
  all-gathered right after the group's dense reduction is launched (same order on every
  rank), and each rank adds only the rows, or parts of rows at its shard's edges, that
  fall inside its own shard range.

The rows are averaged like the dense part and added straight into the gradient shard
(stages 2-3 accumulate into it across micro-steps; stage 1 builds it at the window's end).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from terascale.comm.sparse import SparseGather, add_rows_to_range
from terascale.zero.flat_group import FlatLayout, FlatParamGroup


@dataclass(frozen=True)
class SparseLayout:
    """A group with row-sparse slots (see the note).

    ``offsets[i]``: slot i's offset in the compact buffer of dense slots (-1: sparse).
    ``runs[r]``: ``(compact_lo, compact_hi, shard_offset)`` of the dense elements inside
    rank r's shard; ``chunk``: the most dense elements any rank's shard holds.
    """

    sparse: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    runs: tuple[tuple[tuple[int, int, int], ...], ...]
    chunk: int

    @staticmethod
    def build(fg: FlatParamGroup, sparse: Sequence[bool]) -> SparseLayout:
        layout = fg.layout
        offsets, numel = [], 0
        for slot, is_sparse in zip(layout.slots, sparse):
            offsets.append(-1 if is_sparse else numel)
            numel += 0 if is_sparse else slot.numel
        runs = []
        for r in range(layout.world_size):
            lo, hi = layout.shard_range(r)
            mine: list[tuple[int, int, int]] = []
            for slot, off in zip(layout.slots, offsets):
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if off < 0 or a >= b:
                    continue
                run = (off + a - slot.offset, off + b - slot.offset, a - lo)
                if mine and mine[-1][1] == run[0] and mine[-1][2] + mine[-1][1] - mine[-1][0] == run[2]:
                    prev = mine.pop()  # contiguous in both buffers: one copy instead of two
                    run = (prev[0], run[1], prev[2])
                mine.append(run)
            runs.append(tuple(mine))
        chunk = max(sum(b - a for a, b, _ in mine) for mine in runs)
        sparse_slots = tuple(i for i, is_sparse in enumerate(sparse) if is_sparse)
        return SparseLayout(sparse_slots, tuple(offsets), numel, tuple(runs), chunk)

    def pack(self, flat: torch.Tensor, world: int, dtype: torch.dtype) -> torch.Tensor:
        """The dense slots of compact buffer ``flat`` as ``world`` chunks: chunk r holds, in
        order, the elements of rank r's shard (zero-padded to ``chunk``), for one
        reduce-scatter."""
        chunk = self.chunk
        comm = torch.empty(world * chunk, dtype=dtype, device=flat.device)
        for r, runs in enumerate(self.runs):
            pos = r * chunk
            for lo, hi, _ in runs:
                comm[pos : pos + hi - lo].copy_(flat[lo:hi])
                pos += hi - lo
            comm[pos : (r + 1) * chunk].zero_()
        return comm

    @torch.no_grad()
    def add_to_shard(self, out: torch.Tensor, reduced: torch.Tensor, layout: FlatLayout, rank: int,
                     rows: Sequence[tuple[int, SparseGather]], post: float) -> None:  # fmt: skip
        """Add rank ``rank``'s reduced dense chunk (of the packed ``reduced``) and the
        gathered ``rows`` of the sparse slots that fall inside its shard range into its
        gradient shard ``out``, each scaled by ``post``."""
        lo, hi = layout.shard_range(rank)
        own = reduced[rank * self.chunk : (rank + 1) * self.chunk]
        if post != 1.0:
            own.mul_(post)
        pos = 0
        for c_lo, c_hi, s_off in self.runs[rank]:
            out[s_off : s_off + c_hi - c_lo].add_(own[pos : pos + c_hi - c_lo])
            pos += c_hi - c_lo
        for i, gather in rows:
            indices, values = gather.wait()
            slot = layout.slots[i]
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:
                values = values.to(out.dtype)
                if post != 1.0:
                    values = values * post
                add_rows_to_range(out[a - lo : b - lo], a - slot.offset, indices, values)
