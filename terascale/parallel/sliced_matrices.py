"""Muon under tensor parallelism: each sliced matrix orthogonalized whole, at one rank.

[Note: whole matrices across tensor-parallel slices]
A tensor-parallel rank holds one slice of a column- or row-parallel weight ([Note:
tensor slices]). Muon's update of the weight is the orthogonalization of its whole
momentum; orthogonalizing each slice apart is a different optimizer (each slice's
singular values go to 1, not the matrix's). Momentum, Nesterov's direction and weight
decay act element by element, so they may run on slices; only the orthogonalization
needs the whole matrix. So a rank that has the direction of a matrix to orthogonalize -
at stage 0 the data-parallel rank the step's split gave it to, at ZeRO stages the owner
that gathered the matrix from its shards ([Note: whole matrices on shards]) - hands its
list to :class:`SlicedOrthogonalizer`, and the list goes through a second exchange over
the tensor-parallel group:

1. each matrix of the list gets one owner among the tensor-parallel ranks, chosen by the
   whole matrix's cost (the same longest-first split as the data-parallel one);
2. one ``all_to_all`` sends every rank's slice of each sliced matrix to its owner, which
   joins the slices (``join_slices``, fused blocks included), orthogonalizes the whole
   matrix and scales it by the whole matrix's ``√max(1, rows/cols)``;
3. a second ``all_to_all`` sends each rank its slice of the result back.

A Muon matrix that every tensor-parallel rank holds whole (not sliced) is sent nowhere:
its owner orthogonalizes its own copy and sends the result to the others, so it is not
computed once per rank either.

The two exchanges compose because the layouts are symmetric: every rank of a
tensor-parallel group has the same modules with the same local shapes, so the ZeRO
groups, the data-parallel owners and hence the lists handed here are the same on each of
them, in the same order; a group's members call the exchange together, and every
tensor-parallel group runs its own at once. The result is the unsliced model's Muon
step, each rank doing ``1/(dp·tp)`` of the orthogonalization work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.distributed import ProcessGroup

from terascale.comm import ops
from terascale.optim.muon import MatrixTask, balanced_owners, matrix_cost, orthogonalize_each, orthogonalized
from terascale.parallel.slicing import TensorSlice, join_slices, take_slice


class SlicedOrthogonalizer:
    """``Orthogonalize`` over tensor-parallel slices (see the note): collective over
    ``group``, whose ranks pass lists of the same matrices in the same order."""

    def __init__(self, slices: Mapping[int, TensorSlice], group: ProcessGroup, rank: int, world: int) -> None:
        """``slices``: the slice of every sliced model parameter, by ``id``; ``rank`` and
        ``world``: this rank's place in the tensor-parallel ``group``."""
        for s in slices.values():
            assert s.parts == world and s.index == rank, f"a slice {s} on tensor-parallel rank {rank} of {world}"
        self.slices = slices
        self.group = group
        self.rank = rank
        self.world = world

    def __call__(self, tasks: Sequence[MatrixTask]) -> list[torch.Tensor]:
        if self.world == 1 or not tasks:
            return orthogonalize_each(tasks)
        cut = [self.slices.get(id(t.param)) for t in tasks]
        whole = [t.shape if s is None else torch.Size(s.full_shape(t.shape)) for t, s in zip(tasks, cut)]
        owners = balanced_owners([matrix_cost(shape) for shape in whole], self.world)
        numel = [t.shape.numel() for t in tasks]
        mine = [k for k, o in enumerate(owners) if o == self.rank]
        device = tasks[0].direction.device

        # To the owners: this rank's slice of each sliced matrix, by owner then matrix.
        send = [[k for k in range(len(tasks)) if owners[k] == r and cut[k] is not None] for r in range(self.world)]
        sliced_mine = [k for k in mine if cut[k] is not None]
        inbox = self._exchange([tasks[k].direction for r in range(self.world) for k in send[r]],
                               [sum(numel[k] for k in send[r]) for r in range(self.world)],
                               [sum(numel[k] for k in sliced_mine)] * self.world, device)  # fmt: skip

        # The owner's matrices, whole: slices joined in rank order, orthogonalized, cut again.
        results: dict[int, list[torch.Tensor]] = {}
        block = sum(numel[k] for k in sliced_mine)
        at = 0
        for k in mine:
            t, s = tasks[k], cut[k]
            if s is None:
                results[k] = [orthogonalized(t.direction, t.shape, t.steps, t.method)] * self.world
                continue
            parts = [inbox[r * block + at : r * block + at + numel[k]].view(t.shape) for r in range(self.world)]
            at += numel[k]
            done = orthogonalized(join_slices(parts, s.dim, s.fused), whole[k], t.steps, t.method).view(whole[k])
            results[k] = [take_slice(done, TensorSlice(s.dim, self.world, r, s.fused)).reshape(-1)
                          for r in range(self.world)]  # fmt: skip

        # Back: each rank its slice (or the whole, where not sliced) of every matrix, by owner.
        back = self._exchange([results[k][r] for r in range(self.world) for k in mine],
                              [sum(numel[k] for k in mine)] * self.world,
                              [sum(numel[k] for k in range(len(tasks)) if owners[k] == r) for r in range(self.world)],
                              device)  # fmt: skip
        out: list[torch.Tensor | None] = [None] * len(tasks)
        at = 0
        for r in range(self.world):
            for k in range(len(tasks)):
                if owners[k] == r:
                    out[k] = back[at : at + numel[k]]
                    at += numel[k]
        return out  # type: ignore[return-value]

    def _exchange(self, pieces: list[torch.Tensor], send_sizes: list[int], recv_sizes: list[int],
                  device: torch.device) -> torch.Tensor:  # fmt: skip
        """``pieces`` (flat, in send order) to the ranks by ``send_sizes``; what came in."""
        outbox = torch.cat([p.reshape(-1) for p in pieces]) if pieces else torch.empty(0, device=device)
        inbox = torch.empty(sum(recv_sizes), dtype=torch.float32, device=device)
        ops.all_to_all_single(inbox, outbox.to(torch.float32), recv_sizes, send_sizes, group=self.group)
        return inbox
