"""A rank's state as spans in one host buffer, and moving spans between ranks.

[Note: state moves as spans]
A resize moves the training state the way a checkpoint load reshards it ([Note: logical
checkpoints]): as spans ``(key, name, [start, end))`` of named tensors, never as flat
shards, so the old and the new layout need not agree on anything but the parameter names.
A :class:`PackedState` is one rank's spans copied into one contiguous host buffer (what
the mirror holds and what a resize reads from). :func:`exchange` runs one collective
over the new world: every rank says which spans it holds (``supply``) and which it must
fill (``demand``), every rank computes the same transfer plan from the two lists (each
element from the first holder that has it), and one ``all_to_all`` moves exactly those
bytes, so a rank receives just the state it will hold.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from terascale.checkpoint.spans import Span
from terascale.comm import ops


@dataclass(frozen=True)
class Piece:
    """Where one saved span's bytes sit in a packed buffer."""

    span: Span
    dtype: torch.dtype
    offset: int  # bytes

    @property
    def nbytes(self) -> int:
        return self.span.numel * self.dtype.itemsize


class PackedState:
    """Spans of one rank's state at one step, copied into ``buffer`` (uint8, host)."""

    def __init__(self, pieces: Sequence[Piece], buffer: torch.Tensor) -> None:
        self.pieces = list(pieces)
        self.buffer = buffer

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @staticmethod
    def layout(slices: Iterable[tuple[Span, torch.Tensor]]) -> list[Piece]:
        """The pieces ``slices`` pack into, in order, each 16-byte aligned."""
        pieces, offset = [], 0
        for span, t in slices:
            pieces.append(Piece(span, t.dtype, offset))
            offset += -(-span.numel * t.dtype.itemsize // 16) * 16
        return pieces

    @classmethod
    def empty(cls, pieces: Sequence[Piece], pin: bool = False) -> PackedState:
        size = max((p.offset + p.nbytes for p in pieces), default=0)
        return cls(pieces, torch.empty(size, dtype=torch.uint8, pin_memory=pin))

    def view(self, piece: Piece) -> torch.Tensor:
        return self.buffer[piece.offset : piece.offset + piece.nbytes].view(piece.dtype)

    @torch.no_grad()
    def fill(self, slices: Iterable[tuple[Span, torch.Tensor]]) -> None:
        """Copy ``slices`` (the ones :meth:`layout` was given, in the same order) in."""
        for piece, (span, t) in zip(self.pieces, slices, strict=True):
            assert piece.span == span and piece.dtype == t.dtype, (piece, span, t.dtype)
            self.view(piece).copy_(t.detach().reshape(-1), non_blocking=False)


@dataclass(frozen=True)
class _Move:
    src: int  # rank that sends
    dst: int  # rank that receives
    key: str
    name: str
    lo: int
    hi: int
    dtype: torch.dtype
    src_offset: int  # bytes into the sender's packed state (of ``src_state``)
    src_state: int  # which of the sender's packed states
    demand: int  # index of the receiver's demand


def _plan(supplies: Sequence[Sequence[tuple[int, Piece]]], demands: Sequence[Sequence[Span]]) -> list[_Move]:
    """Every element of every demand from the first supply (by rank, then order) holding it."""
    index: dict[tuple[str, str], list[tuple[int, int, int, int, Piece]]] = {}
    for rank, pieces in enumerate(supplies):
        for state, piece in pieces:
            s = piece.span
            index.setdefault((s.key, s.name), []).append((s.start, s.end, rank, state, piece))
    for spans in index.values():
        spans.sort(key=lambda t: (t[0], t[2]))
    starts = {k: [t[0] for t in v] for k, v in index.items()}
    moves: list[_Move] = []
    for dst, wanted in enumerate(demands):
        for d, span in enumerate(wanted):
            have = index.get((span.key, span.name), [])
            covered = span.start
            # Saved spans may overlap (replicated values: stage 0, step counts); take each element once.
            k = max(0, bisect.bisect_right(starts.get((span.key, span.name), []), span.start) - 1)
            for start, end, rank, state, piece in have[k:]:
                if covered >= span.end or start >= span.end:
                    break
                if end <= covered:
                    continue
                if start > covered:
                    raise RuntimeError(f"no rank holds elements [{covered}, {start}) of {span.key} '{span.name}'")
                hi = min(end, span.end)
                moves.append(_Move(rank, dst, span.key, span.name, covered, hi, piece.dtype,
                                   piece.offset + (covered - start) * piece.dtype.itemsize, state, d))  # fmt: skip
                covered = hi
            if covered < span.end:
                raise RuntimeError(f"no rank holds elements [{covered}, {span.end}) of {span.key} '{span.name}'")
    return moves


def _nbytes(m: _Move) -> int:
    return (m.hi - m.lo) * m.dtype.itemsize


@torch.no_grad()
def exchange(
    states: Sequence[PackedState],
    demand: Sequence[tuple[Span, torch.Tensor]],
    group: dist.ProcessGroup,
) -> None:
    """Fill every ``(span, tensor)`` of ``demand`` from the ranks' ``states`` (collective
    over ``group``, a gloo group: the bytes travel through host memory).

    ``states``: what this rank holds (its own state, mirrors of others'); a rank that
    joins holds none. Raises RuntimeError on every rank if some demanded element is held
    by no rank.
    """
    world, me = dist.get_world_size(group), dist.get_rank(group)
    supply = [(k, p) for k, st in enumerate(states) for p in st.pieces]
    wanted = [span for span, _ in demand]
    supplies: list = [None] * world
    demands: list = [None] * world
    ops.all_gather_object(supplies, supply, group=group)
    ops.all_gather_object(demands, wanted, group=group)
    moves = _plan(supplies, demands)
    out_moves = [m for m in moves if m.src == me]  # plan order: by receiver, then its demands
    in_moves = [m for m in moves if m.dst == me]  # by sender below, in the sender's order
    in_moves.sort(key=lambda m: m.src)
    send_sizes = [0] * world
    for m in out_moves:
        send_sizes[m.dst] += _nbytes(m)
    recv_sizes = [0] * world
    for m in in_moves:
        recv_sizes[m.src] += _nbytes(m)
    send = torch.empty(sum(send_sizes), dtype=torch.uint8)
    at = 0
    for m in out_moves:
        n = _nbytes(m)
        send[at : at + n].copy_(states[m.src_state].buffer[m.src_offset : m.src_offset + n])
        at += n
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8)
    if world > 1:
        ops.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    else:
        recv.copy_(send)
    at = 0
    for m in in_moves:
        n = _nbytes(m)
        span, target = demand[m.demand]
        flat = target.reshape(-1)
        flat[m.lo - span.start : m.hi - span.start].copy_(recv[at : at + n].view(m.dtype))
        at += n
