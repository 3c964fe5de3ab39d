"""Run schedules on paper: check their transfers match, find deadlocks, measure the bubble.

[Note: schedule simulation]
:func:`simulate` executes every stage's instruction list the way the runner does: compute
takes ``forward_time``/``backward_time``, consecutive transfers form one batch that the
stage posts in order and waits for as a whole. A transfer completes only when both its
send and its receive are posted (rendezvous: the strictest semantics, NCCL's for large
messages; gloo and small NCCL messages are more lenient, so a schedule that completes
here completes there). The first activation a chunk receives in a run waits for the
sender's shape header first ([Note: shape negotiation]), modelled as a receive that
blocks the rest of its batch. If no stage can move and some are unfinished the
schedule deadlocks and :func:`simulate` raises, naming where each stage is stuck.

:func:`check_transfers` is the static half: between each ordered pair of ranks, the
messages one sends must be the messages the other receives, in the same order (NCCL
matches point-to-point operations by order, not by tag).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from terascale.pipe.schedule import Instr, Op, StageGrid

Message = tuple[str, int, int]  # (kind "act"/"grad", micro-batch, sending virtual stage)

_SENDS = (Op.SEND_ACT, Op.SEND_GRAD)


def _route(grid: StageGrid, stage: int, ins: Instr) -> tuple[int, Message]:
    """The peer rank (stage) of transfer ``ins`` on ``stage`` and the message it carries."""
    v = grid.virtual(stage, ins.chunk)
    if ins.op is Op.SEND_ACT:
        return grid.place(v + 1)[0], ("act", ins.mb, v)
    if ins.op is Op.SEND_GRAD:
        return grid.place(v - 1)[0], ("grad", ins.mb, v)
    if ins.op is Op.RECV_ACT:
        return grid.place(v - 1)[0], ("act", ins.mb, v - 1)
    assert ins.op is Op.RECV_GRAD, ins
    return grid.place(v + 1)[0], ("grad", ins.mb, v + 1)


def check_transfers(grid: StageGrid, schedules: Sequence[Sequence[Instr]]) -> None:
    """Raise ValueError unless, for every ordered pair of stages, the sender's messages
    are the receiver's, in the same order."""
    sent: dict[tuple[int, int], list[Message]] = {}
    received: dict[tuple[int, int], list[Message]] = {}
    for stage, schedule in enumerate(schedules):
        for ins in schedule:
            if ins.is_compute:
                continue
            peer, msg = _route(grid, stage, ins)
            if ins.op in _SENDS:
                sent.setdefault((stage, peer), []).append(msg)
            else:
                received.setdefault((peer, stage), []).append(msg)
    for pair in sorted(set(sent) | set(received)):
        if sent.get(pair, []) != received.get(pair, []):
            raise ValueError(
                f"stage {pair[0]} sends {sent.get(pair, [])} to stage {pair[1]}, which receives "
                f"{received.get(pair, [])}"
            )


@dataclass(frozen=True)
class Timeline:
    """What :func:`simulate` found: the time the last stage finished and each stage's
    busy (compute) time."""

    makespan: float
    busy: tuple[float, ...]

    def bubble(self, stage: int | None = None) -> float:
        """The idle fraction of ``stage`` (None: of all stages together)."""
        if stage is None:
            return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)
        return 1.0 - self.busy[stage] / self.makespan


def _items(schedule: Sequence[Instr]) -> list[Instr | list[Instr]]:
    """Compute instructions alone, runs of transfers as one batch."""
    out: list[Instr | list[Instr]] = []
    for ins in schedule:
        if ins.is_compute:
            out.append(ins)
        elif out and isinstance(out[-1], list):
            out[-1].append(ins)
        else:
            out.append([ins])
    return out


def simulate(
    grid: StageGrid,
    schedules: Sequence[Sequence[Instr]],
    forward_time: float = 1.0,
    backward_time: float = 2.0,
) -> Timeline:
    """Execute ``schedules`` (one per stage) as [Note: schedule simulation] says; raise
    RuntimeError on a deadlock."""
    check_transfers(grid, schedules)
    p = len(schedules)
    items = [_items(s) for s in schedules]
    pos = [0] * p  # next item
    posted_in_item = [0] * p  # transfers of the current batch posted so far
    clock = [0.0] * p
    busy = [0.0] * p
    posted: dict[tuple[str, Message], float] = {}  # ("send"/"recv", message) -> time posted
    headed: set[tuple[int, int]] = set()  # (stage, chunk) that received their first activation
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while pos[s] < len(items[s]):
                item = items[s][pos[s]]
                if isinstance(item, Instr):
                    took = forward_time if item.op is Op.FORWARD else backward_time
                    clock[s] += took
                    busy[s] += took
                    pos[s] += 1
                    progress = True
                    continue
                # Post the batch's transfers in order; a first activation waits for its header.
                while posted_in_item[s] < len(item):
                    ins = item[posted_in_item[s]]
                    _, msg = _route(grid, s, ins)
                    side = "send" if ins.op in _SENDS else "recv"
                    if ins.op is Op.RECV_ACT and (s, ins.chunk) not in headed:
                        if ("send", msg) not in posted:
                            break
                        headed.add((s, ins.chunk))
                        clock[s] = max(clock[s], posted[("send", msg)])
                    posted[(side, msg)] = clock[s]
                    posted_in_item[s] += 1
                    progress = True
                if posted_in_item[s] < len(item):
                    break
                other = {"send": "recv", "recv": "send"}
                times = []
                for ins in item:
                    _, msg = _route(grid, s, ins)
                    side = "send" if ins.op in _SENDS else "recv"
                    times.append(posted.get((other[side], msg)))
                if any(t is None for t in times):
                    break  # wait for the peers to post their halves
                clock[s] = max([clock[s], *times])  # type: ignore[list-item]
                pos[s] += 1
                posted_in_item[s] = 0
                progress = True
    stuck = [s for s in range(p) if pos[s] < len(items[s])]
    if stuck:
        where = "; ".join(f"stage {s} at {items[s][pos[s]]}" for s in stuck)
        raise RuntimeError(f"the schedules deadlock: {where}")
    return Timeline(max(clock), tuple(busy))
