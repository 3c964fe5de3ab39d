"""Muon on ZeRO's flat shards: each matrix orthogonalized whole, by one owner rank.

[Note: whole matrices on shards]
At ZeRO stages 1-3 a rank holds flat pieces of its shards ([Note: master pieces]): a
matrix may lie in parts on several ranks, and a rank's pieces hold parts of many
matrices. Muon's update of a matrix is a function of the whole matrix (its momentum,
orthogonalized), so the step goes in three parts:

1. *Directions*, run by run (each run's masters and state swapped in where they are on
   NVMe): every piece's momentum is updated and its update direction written into this
   rank's *outbox*; AdamW's pieces (embeddings, head, vectors) are stepped whole here.
   A run of Muon's pieces only needs its momentum in this pass, not its masters; with
   ``save_muon_momentum_buffer_in_memory`` the momentum stays in host memory out of the
   swap files (as DeepSpeed's switch keeps it), and such a run is not read at all here.
2. *Orthogonalization*: each matrix has one owner rank, chosen once so that every rank's
   share of the work (``rows·cols·min(rows, cols)`` a matrix) is about even; the layout
   gives every rank every other rank's range of every matrix, so one ``all_to_all`` sends
   each part of each direction to its matrix's owner, the owner orthogonalizes its whole
   matrices, and a second ``all_to_all`` sends the results back the way the parts came.
   No rank computes more than its share, and each moves about twice its shard of the
   matrices: less than the step's own all-gather.
3. *Updates*, run by run: ``w ← w·(1 - lr·wd) - lr·O`` on the pieces from the returned
   parts (the runs are swapped in a second time on NVMe: their masters change only now).
   So on NVMe a run of Muon's is read once a step with its momentum in memory, twice
   without: the switch trades 4 bytes of host memory per Muon element for a read.

The outbox is laid out by owner rank, then by matrix, then by element: a rank's part of
a matrix is one contiguous range of the matrix's elements (a parameter is contiguous in
its group's flat buffer, and so is a shard), so each part is a slice of the outbox and,
at the owner, of its matrix. The exchange runs over each ZeRO group's process group
(experts' groups shard over their expert-data-parallel groups: [Note: expert
parameters]); ranks that hold none of a group's matrices still take part.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from terascale.comm import ops
from terascale.optim.muon import MatrixTask, Muon, Orthogonalize, balanced_owners, matrix_cost
from terascale.zero.flat_group import FlatParamGroup
from terascale.zero.masters import ShardedMasters
from terascale.zero.wrap import GroupPlan


@dataclass(frozen=True)
class Matrix:
    """One Muon parameter: its ZeRO group, its slot there, its owner rank (in the group)."""

    group: int
    slot: int
    shape: torch.Size
    owner: int


@dataclass(frozen=True)
class Part:
    """Elements ``[start, end)`` of piece ``piece`` are elements ``[at, at + end - start)``
    of this rank's outbox."""

    piece: int
    start: int
    end: int
    at: int


class MatrixExchange:
    """The matrices of the ZeRO groups over one process group, and where their parts go."""

    def __init__(self, groups: Sequence[FlatParamGroup], numbers: Sequence[int], is_muon: Callable[[int, int], bool],
                 masters: ShardedMasters, optimizer: Muon) -> None:  # fmt: skip
        """``numbers``: the indices of ``groups`` over this process group; ``is_muon(g,
        slot)``: whether that parameter is Muon's."""
        first = groups[numbers[0]]
        self.process_group = first.group
        self.world = first.layout.world_size
        self.rank = first.rank
        found = [(g, s, slot) for g in numbers for s, slot in enumerate(groups[g].layout.slots) if is_muon(g, s)]
        owners = balanced_owners([matrix_cost(slot.shape) for _, _, slot in found], self.world)
        self.matrices = [Matrix(g, s, slot.shape, o) for (g, s, slot), o in zip(found, owners)]
        self._groups = groups
        # held[r][k]: rank r's range of matrix k's elements.
        self.held = [[self._range(m, r) for m in self.matrices] for r in range(self.world)]
        self.send_sizes = [sum(b - a for (a, b), m in zip(self.held[self.rank], self.matrices) if m.owner == r)
                           for r in range(self.world)]  # fmt: skip
        self.recv_sizes = [sum(b - a for (a, b), m in zip(self.held[r], self.matrices) if m.owner == self.rank)
                           for r in range(self.world)]  # fmt: skip
        self.parts = self._parts(masters)
        self.options = optimizer.matrix_options()
        # The matrices this rank owns, and where each source rank's part of each starts in
        # the inbox (by source rank, then by matrix): fixed by the layout.
        self._mine = [k for k, m in enumerate(self.matrices) if m.owner == self.rank]
        self._starts: dict[tuple[int, int], int] = {}
        at = 0
        for r in range(self.world):
            for k in self._mine:
                a, b = self.held[r][k]
                self._starts[r, k] = at
                at += b - a
        self.seconds = 0.0  # the last step's orthogonalizations here (wall clock)

    def _range(self, m: Matrix, rank: int) -> tuple[int, int]:
        layout = self._groups[m.group].layout
        slot = layout.slots[m.slot]
        lo, hi = layout.shard_range(rank)
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        return (a - slot.offset, b - slot.offset) if a < b else (0, 0)

    def _parts(self, masters: ShardedMasters) -> list[Part]:
        base, at = {}, 0
        for r in range(self.world):  # the outbox: by owner, by matrix
            for k, m in enumerate(self.matrices):
                if m.owner == r:
                    base[k] = at
                    at += self.held[self.rank][k][1] - self.held[self.rank][k][0]
        of_slot = {(m.group, m.slot): k for k, m in enumerate(self.matrices)}
        parts = []
        for i, piece in enumerate(masters.pieces):
            fg = self._groups[piece.group]
            if fg.group is not self.process_group:
                continue
            lo = fg.layout.shard_range(fg.rank)[0] + piece.lo
            hi = lo + piece.hi - piece.lo
            for s, slot in enumerate(fg.layout.slots):
                k = of_slot.get((piece.group, s))
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if k is None or a >= b:
                    continue
                first = self.held[self.rank][k][0]
                parts.append(Part(i, a - lo, b - lo, base[k] + (a - slot.offset) - first))
        return parts

    @property
    def outbox_numel(self) -> int:
        return sum(self.send_sizes)

    def orthogonalize(self, outbox: torch.Tensor, orthogonalize: Orthogonalize) -> None:
        """Replace every direction in ``outbox`` with its part of its whole matrix's
        orthogonalized direction (collective over the process group; ``orthogonalize``
        runs this rank's whole matrices, collective over the tensor-parallel group where
        they are slices: [Note: whole matrices across tensor-parallel slices])."""
        inbox = torch.empty(sum(self.recv_sizes), dtype=outbox.dtype, device=outbox.device)
        if self.world > 1:
            ops.all_to_all_single(inbox, outbox, self.recv_sizes, self.send_sizes, group=self.process_group)
        else:
            inbox.copy_(outbox)
        starts = self._starts
        steps, method = self.options
        started = time.perf_counter()
        tasks = []
        for k in self._mine:
            m = self.matrices[k]
            whole = torch.empty(m.shape.numel(), dtype=torch.float32, device=outbox.device)
            for r in range(self.world):
                a, b = self.held[r][k]
                whole[a:b] = inbox[starts[r, k] : starts[r, k] + b - a]
            tasks.append(MatrixTask(self._groups[m.group].params[m.slot], m.shape, whole, steps, method))
        for k, done in zip(self._mine, orthogonalize(tasks)):
            for r in range(self.world):
                a, b = self.held[r][k]
                inbox[starts[r, k] : starts[r, k] + b - a] = done[a:b]
        if outbox.device.type != "cpu":
            torch.accelerator.synchronize(outbox.device)
        self.seconds = time.perf_counter() - started  # this rank's share, for the balance benchmark
        if self.world > 1:
            ops.all_to_all_single(outbox, inbox, self.send_sizes, self.recv_sizes, group=self.process_group)
        else:
            outbox.copy_(inbox)


def exchanges(plans: Sequence[GroupPlan], groups: Sequence[FlatParamGroup], masters: ShardedMasters,
              optimizer: Muon) -> list[MatrixExchange]:  # fmt: skip
    """One :class:`MatrixExchange` per process group the ZeRO groups shard over, in the
    order the groups first use them (the same on every rank)."""
    opt_groups = optimizer.param_groups

    def is_muon(g: int, slot: int) -> bool:
        k = plans[g].opt_group[slot]
        return k >= 0 and bool(opt_groups[k].get("use_muon"))

    by_group: dict[int, list[int]] = {}
    for g, fg in enumerate(groups):
        by_group.setdefault(id(fg.group), []).append(g)
    return [MatrixExchange(groups, numbers, is_muon, masters, optimizer) for numbers in by_group.values()]


def step_muon(
    optimizer: Muon,
    masters: ShardedMasters,
    plans: Sequence[MatrixExchange],
    runs: Sequence[list[int]],
    step_runs: Callable[[Callable[[list[int]], None], Sequence[list[int]], Callable[[list[int]], bool]], None],
    grads: Callable[[list[int]], list[torch.Tensor]],
    device: torch.device,
    orthogonalize: Orthogonalize,
) -> None:
    """The three parts of the note. ``step_runs(fn, runs, masters_change)`` calls
    ``fn(run)`` for each of ``runs`` in order with its optimizer state in memory, and its
    masters too where ``masters_change(run)`` (then written to the shards after);
    ``grads(run)``: the run's fp32 gradients, unscaled and clipped; ``orthogonalize`` runs
    an owner's whole matrices."""
    tensors = masters.masters
    group_of = optimizer.group_of()  # once a step: every run's pass looks its pieces up
    boxes = [torch.zeros(plan.outbox_numel, dtype=torch.float32, device=device) for plan in plans]
    parts_of: dict[int, list[tuple[int, Part]]] = {}
    for b, plan in enumerate(plans):
        for part in plan.parts:
            parts_of.setdefault(part.piece, []).append((b, part))

    def directions(run: list[int]) -> None:
        found = optimizer.directions([tensors[i] for i in run], grads(run), group_of)
        for i, d in zip(run, found):
            for b, part in parts_of.get(i, ()) if d is not None else ():
                boxes[b][part.at : part.at + part.end - part.start].copy_(d[part.start : part.end])

    # A run of Muon's pieces only changes no master in this pass: its momentum is all it needs.
    step_runs(directions, runs, lambda run: not all(group_of[id(tensors[i])]["use_muon"] for i in run))
    for plan, box in zip(plans, boxes):
        plan.orthogonalize(box, orthogonalize)

    def updates(run: list[int]) -> None:
        todo = [i for i in run if i in parts_of]
        done = []
        for i in todo:
            d = torch.empty(tensors[i].numel(), dtype=torch.float32, device=device)
            for b, part in parts_of[i]:
                d[part.start : part.end] = boxes[b][part.at : part.at + part.end - part.start]
            done.append(d)
        optimizer.apply_directions([tensors[i] for i in todo], done, group_of)

    step_runs(updates, [run for run in runs if any(i in parts_of for i in run)], lambda run: True)
