"""Pipeline schedules: the order in which one stage runs its forwards, backwards and transfers.

[Note: pipeline schedules]
A schedule is a pure function of ``(stages p, stage s, micro-batches m, chunks v)`` that
returns this stage's instruction list. With ``v`` chunks per stage (Megatron's
interleaving) chunk ``c`` of stage ``s`` is *virtual stage* ``c * p + s``; data flows
through the virtual stages in order, so stage ``p - 1`` hands chunk ``c``'s output to
stage ``0`` chunk ``c + 1`` (the pipeline group is a ring). Virtual stage 0 reads the
micro-batch's inputs, the last one computes the loss.

Compute instructions come in the order of the schedule. Transfers are placed by
*rounds*, as Megatron's schedules do: the computes are grouped into units (one forward
or one backward; in the interleaved steady state a forward and a backward together),
and in round ``r`` every stage runs its next unit if the messages it needs were sent in
an earlier round, then posts one batch: the sends of what that unit produced and the
receives of everything its neighbours produced in round ``r``. Each batch becomes one
``batch_isend_irecv`` (one NCCL group) that the runner waits for, so a stage never
waits on a send whose receive its peer posts later: sends and their receives are
always in the same round. Inside a batch messages are sorted the same way on both
sides; every ordered pair of stages therefore exchanges its messages in the same order
(NCCL and gloo match point-to-point operations by order). Received tensors wait in the
runner until their compute. :mod:`terascale.pipe.simulate` checks the order, runs the
lists under rendezvous semantics (a send completes only when its receive is posted) to
show no schedule deadlocks, and measures the bubbles.

- :func:`one_f_one_b`: ``min(p - s - 1, m)`` warm-up forwards, then one forward and one
  backward alternately, then the remaining backwards (PipeDream-flush / Megatron 1F1B).
  At most ``p - s`` micro-batches' activations are alive on stage ``s``. When every
  stage takes the same forward and backward times (any ratio of the two) the idle
  fraction is ``(p - 1) / (m + p - 1)``.
- :func:`interleaved_one_f_one_b`: Megatron's interleaved order. Forwards go over chunks
  in groups of ``p`` micro-batches (micro-batches ``0..p-1`` on chunk 0, the same on chunk
  1, ..., then micro-batches ``p..2p-1``), backwards the same with the chunks reversed;
  ``2 (p - s - 1) + (v - 1) p`` warm-up forwards. It needs ``m`` to be a multiple of
  ``p`` (the groups are whole); the bubble shrinks to ``(p - 1) / (v m + p - 1)``.
- :func:`forward_only`: every forward in the training order, for evaluation.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass


class Op(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    RECV_ACT = "recv_act"  # this chunk's inputs from the previous virtual stage
    SEND_ACT = "send_act"  # this chunk's outputs to the next virtual stage
    RECV_GRAD = "recv_grad"  # the gradients of this chunk's outputs from the next virtual stage
    SEND_GRAD = "send_grad"  # the gradients of this chunk's inputs to the previous virtual stage


COMPUTE = (Op.FORWARD, Op.BACKWARD)


@dataclass(frozen=True)
class Instr:
    """One step of a stage's schedule: ``op`` for micro-batch ``mb`` on local chunk ``chunk``."""

    op: Op
    mb: int
    chunk: int = 0

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE

    def __repr__(self) -> str:
        return f"{self.op.value}{self.mb}.{self.chunk}"


@dataclass(frozen=True)
class StageGrid:
    """``stages`` pipeline stages with ``chunks`` model chunks each (virtual stages)."""

    stages: int
    chunks: int = 1

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    def virtual(self, stage: int, chunk: int) -> int:
        """The virtual stage of ``chunk`` on ``stage`` (Megatron's interleaving)."""
        return chunk * self.stages + stage

    def place(self, virtual: int) -> tuple[int, int]:
        """``(stage, chunk)`` of virtual stage ``virtual``."""
        return virtual % self.stages, virtual // self.stages

    def is_first(self, stage: int, chunk: int) -> bool:
        return self.virtual(stage, chunk) == 0

    def is_last(self, stage: int, chunk: int) -> bool:
        return self.virtual(stage, chunk) == self.virtual_stages - 1


def _check(stages: int, stage: int, micro_batches: int, chunks: int) -> None:
    if stages < 1 or chunks < 1:
        raise ValueError(f"a pipeline needs at least one stage and one chunk per stage, got {stages} and {chunks}")
    assert 0 <= stage < stages, (stage, stages)
    if micro_batches < 1:
        raise ValueError(f"a pipeline schedule needs at least one micro-batch, got {micro_batches}")
    if chunks > 1 and micro_batches % stages:
        raise ValueError(
            f"the interleaved schedule ({chunks} chunks per stage) runs micro-batches in groups of the "
            f"{stages} stages, so gradient_accumulation_steps ({micro_batches}) must be a multiple of {stages}"
        )


Unit = tuple[Instr, ...]  # computes run back to back, followed by one batch of transfers


def _transfer(grid: StageGrid, stage: int, ins: Instr) -> tuple[tuple | None, tuple | None]:
    """``(needs, sends)`` of compute ``ins`` on ``stage``: the message it waits for and the
    message it produces, each ``(kind, micro-batch, sending virtual stage)`` or None."""
    v = grid.virtual(stage, ins.chunk)
    first, last = v == 0, v == grid.virtual_stages - 1
    if ins.op is Op.FORWARD:
        return (None if first else ("act", ins.mb, v - 1)), (None if last else ("act", ins.mb, v))
    return (None if last else ("grad", ins.mb, v + 1)), (None if first else ("grad", ins.mb, v))


def _place_transfers(grid: StageGrid, units: list[list[Unit]]) -> tuple[tuple[Instr, ...], ...]:
    """Every stage's units with the transfers placed by rounds (see [Note: pipeline schedules])."""
    p = grid.stages
    out: list[list[Instr]] = [[] for _ in range(p)]
    nxt = [0] * p
    sent_in: dict[tuple, int] = {}  # message -> round it was sent in
    rnd = 0
    while any(nxt[s] < len(units[s]) for s in range(p)):
        batches: list[list[tuple[tuple, Instr]]] = [[] for _ in range(p)]
        for s in range(p):
            if nxt[s] == len(units[s]):
                continue
            unit = units[s][nxt[s]]
            needs = [_transfer(grid, s, ins)[0] for ins in unit]
            if any(n is not None and sent_in.get(n, rnd) >= rnd for n in needs):
                continue  # idle this round: an input is not there yet
            nxt[s] += 1
            for ins in unit:
                out[s].append(ins)
                msg = _transfer(grid, s, ins)[1]
                if msg is None:
                    continue
                sent_in[msg] = rnd
                kind, mb, v = msg
                dst, dst_chunk = grid.place(v + 1 if kind == "act" else v - 1)
                send, recv = (Op.SEND_ACT, Op.RECV_ACT) if kind == "act" else (Op.SEND_GRAD, Op.RECV_GRAD)
                batches[s].append((msg, Instr(send, mb, ins.chunk)))
                batches[dst].append((msg, Instr(recv, mb, dst_chunk)))
        for s in range(p):
            out[s] += [ins for _, ins in sorted(batches[s], key=lambda item: item[0])]
        rnd += 1
        assert rnd <= 4 * sum(len(u) for u in units) + 4, "schedule makes no progress"
    return tuple(tuple(o) for o in out)


def _one_f_one_b_order(stages: int, stage: int, micro_batches: int) -> list[Instr]:
    warmup = min(stages - stage - 1, micro_batches)
    order = [Instr(Op.FORWARD, k) for k in range(warmup)]
    for k in range(micro_batches - warmup):
        order += [Instr(Op.FORWARD, warmup + k), Instr(Op.BACKWARD, k)]
    return order + [Instr(Op.BACKWARD, k) for k in range(micro_batches - warmup, micro_batches)]


def _interleaved_unit(stages: int, chunks: int, k: int, forward: bool) -> Instr:
    """The ``k``-th forward (or backward) of a stage in Megatron's interleaved order."""
    group, within = divmod(k, stages * chunks)
    chunk, offset = divmod(within, stages)
    if not forward:
        chunk = chunks - 1 - chunk
    return Instr(Op.FORWARD if forward else Op.BACKWARD, group * stages + offset, chunk)


def _interleaved_units(stages: int, stage: int, micro_batches: int, chunks: int) -> list[Unit]:
    total = micro_batches * chunks
    warmup = min(2 * (stages - stage - 1) + (chunks - 1) * stages, total)
    units: list[Unit] = [(_interleaved_unit(stages, chunks, k, True),) for k in range(warmup)]
    for k in range(total - warmup):  # steady state: a forward and a backward per round
        units.append((_interleaved_unit(stages, chunks, warmup + k, True), _interleaved_unit(stages, chunks, k, False)))
    return units + [(_interleaved_unit(stages, chunks, k, False),) for k in range(total - warmup, total)]


@functools.lru_cache(maxsize=64)
def _schedules(kind: str, stages: int, micro_batches: int, chunks: int) -> tuple[tuple[Instr, ...], ...]:
    grid = StageGrid(stages, chunks)
    if kind == "forward":
        units = [[(_interleaved_unit(stages, chunks, k, True),) for k in range(micro_batches * chunks)]] * stages
    elif chunks == 1:
        units = [[(ins,) for ins in _one_f_one_b_order(stages, s, micro_batches)] for s in range(stages)]
    else:
        units = [_interleaved_units(stages, s, micro_batches, chunks) for s in range(stages)]
    return _place_transfers(grid, units)


def one_f_one_b(stages: int, stage: int, micro_batches: int) -> list[Instr]:
    """The 1F1B schedule of ``stage`` (see [Note: pipeline schedules])."""
    _check(stages, stage, micro_batches, 1)
    return list(_schedules("train", stages, micro_batches, 1)[stage])


def interleaved_one_f_one_b(stages: int, stage: int, micro_batches: int, chunks: int) -> list[Instr]:
    """Megatron's interleaved 1F1B schedule of ``stage`` with ``chunks`` chunks per stage
    (1F1B when ``chunks`` is 1)."""
    _check(stages, stage, micro_batches, chunks)
    return list(_schedules("train", stages, micro_batches, chunks)[stage])


def forward_only(stages: int, stage: int, micro_batches: int, chunks: int = 1) -> list[Instr]:
    """Every forward of ``stage`` in the training order, with its transfers (evaluation)."""
    _check(stages, stage, micro_batches, chunks)
    return list(_schedules("forward", stages, micro_batches, chunks)[stage])


def train_schedule(stages: int, stage: int, micro_batches: int, chunks: int = 1) -> list[Instr]:
    """The training schedule: 1F1B, interleaved when ``chunks > 1``."""
    return interleaved_one_f_one_b(stages, stage, micro_batches, chunks)


def last_backward(schedule: list[Instr]) -> int:
    """Index of the last backward in ``schedule`` (-1 if none): the one that ends the
    accumulation window on this stage and so reduces the gradients."""
    for i in range(len(schedule) - 1, -1, -1):
        if schedule[i].op is Op.BACKWARD:
            return i
    return -1
