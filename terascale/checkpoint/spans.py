"""Logical coordinates of checkpointed state: which elements of which named tensor.

[Note: logical checkpoints]
A checkpoint never records how a rank held its state (groups, flat buffers, padding,
swap files); it records *spans*: elements ``[start, end)`` of the flattened tensor
``name`` of one kind (``key``): ``master`` (the fp32 master of a trainable parameter),
``param`` (a frozen parameter in the compute dtype), ``buffer`` (a module buffer) and
``optim/<state>`` (one optimizer state tensor per trainable parameter, e.g.
``optim/exp_avg``). A 0-d optimizer value (Adam's step count) is the span ``[0, 1)`` of
its parameter under its key. Each rank saves the spans it owns: at ZeRO stages 1-3 the
parameter parts of its flat shards; at stage 0 an even split of all parameters. Loading
on any layout asks, for every local tensor, for the spans it covers and reads those
byte ranges from whichever files hold them. Low-precision parameters are casts of their
masters (the step writes them so), so they are not stored twice.

The model states expose their tensors to the checkpoint as lists of
``(Span, local tensor)`` through ``state_slices`` (see ``[Note: model state]``), one
list per *chunk* that is resident at once: an optimizer run swapped in from NVMe is
one chunk, so saving and loading never hold more of the state in memory than a step does.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from terascale.checkpoint.order import SliceOrder
from terascale.optim.compact import is_compact

MASTER = "master"
PARAM = "param"
BUFFER = "buffer"
OPTIM = "optim/"
GRAD = "grad"  # a window's reduced gradient (read by DeepSpeed's safe_get_*_grad; never saved)
RANK_LOCAL = "local/"  # state that differs between ranks: [Note: rank-local checkpoint state]


@dataclass(frozen=True)
class Span:
    """Elements ``[start, end)`` of the flattened tensor ``name`` of kind ``key``."""

    key: str
    name: str
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def tensor_key(self) -> str:
        """The key of this span's tensor in a shard file."""
        return f"{self.key}/{self.name}/{self.start}"


Slice = tuple[Span, torch.Tensor]  # a span and the local tensor holding its elements


class SliceMode(enum.Enum):
    """What ``state_slices`` is iterated for.

    DESCRIBE: the spans this rank saves, with tensors that may be ``meta`` (only dtype
    and shape are read: the file header is written before any data). SAVE: the same
    spans with their values. LOAD: every span this rank holds, to be filled in place;
    state written back to its tier after each chunk and pushed into the model at the end.
    HELD: every span this rank holds, with its values, to be read only (stage 0 holds
    everything; SAVE splits it over the ranks).
    """

    DESCRIBE = "describe"
    SAVE = "save"
    LOAD = "load"
    HELD = "held"


@dataclass(frozen=True)
class OptimKey:
    """An optimizer state entry to create on load: elementwise like the master, or 0-d."""

    dtype: torch.dtype
    scalar: bool


def rank_local_key(world: int, rank: int) -> str:
    """The span key of rank ``rank``'s own state in a run of ``world`` ranks."""
    return f"{RANK_LOCAL}{world}/{rank}"


def optim_span_key(state_key: str) -> str:
    return OPTIM + state_key


def state_tensor(value: object) -> bool:
    """Whether an optimizer state value is checkpointed as a span (any tensor is)."""
    return isinstance(value, torch.Tensor)


def optimizer_slices(
    state: dict[str, object], name: str, start: int, end: int, offset: int, *, with_scalars: bool
) -> list[Slice]:
    """The spans of one master's optimizer ``state`` for parameter ``name`` elements
    ``[start, end)``, which sit at ``[offset, offset + end - start)`` of the master.

    0-d values (step counts) come as span ``[0, 1)`` when ``with_scalars``.
    """
    out: list[Slice] = []
    for key, value in sorted(state.items()):
        if not state_tensor(value):
            continue
        if value.dim() == 0:
            if with_scalars:
                out.append((Span(optim_span_key(key), name, 0, 1), value))
        else:
            out.append((Span(optim_span_key(key), name, start, end), value.reshape(-1)[offset : offset + end - start]))
    return out


def create_optimizer_state(
    optimizer: torch.optim.Optimizer,
    master: torch.Tensor,
    keys: dict[str, OptimKey],
    state_dtype: torch.dtype = torch.float32,
) -> None:
    """Give ``master`` the optimizer state entries ``keys`` it lacks (values to be loaded).

    Elementwise entries are made like the master, floating ones in ``state_dtype`` (what
    this run keeps, whatever the checkpoint holds: fp32 and bf16 moments load into each
    other, [Note: bf16 masters and optimizer states]); 0-d ones on the CPU, as torch's
    optimizers keep step counts unless the group is ``fused`` or ``capturable``.
    """
    state = optimizer.state[master]
    group = next((g for g in optimizer.param_groups if any(p is master for p in g["params"])), {})
    on_device = bool(group.get("fused") or group.get("capturable"))
    for key, spec in keys.items():
        have = state.get(key)
        if spec.scalar:
            if not (isinstance(have, torch.Tensor) and have.dim() == 0):
                state[key] = torch.zeros((), dtype=spec.dtype, device=master.device if on_device else "cpu")
        elif not (isinstance(have, torch.Tensor) and have.shape == master.shape):
            dtype = state_dtype if spec.dtype.is_floating_point else spec.dtype
            state[key] = torch.zeros(master.shape, dtype=dtype, device=master.device)


def optimizer_state_view(
    optimizer: torch.optim.Optimizer, master: torch.Tensor, state: dict[str, object] | None = None
) -> dict[str, object]:
    """``master``'s optimizer state (default: ``optimizer.state[master]``) as a checkpoint
    stores it: by value, so 8-bit moments appear as the fp32 ``exp_avg`` / ``exp_avg_sq``
    Adam keeps ([Note: compact optimizer states]); other optimizers' state as it is."""
    if is_compact(optimizer):
        return optimizer.logical_state(master, state)
    return optimizer.state.get(master, {}) if state is None else state


def settle_loaded_state(optimizer: torch.optim.Optimizer, masters: Iterable[torch.Tensor]) -> None:
    """After state was loaded by value into entries :func:`create_optimizer_state` made,
    give it the optimizer's own form (8-bit moments encode it again)."""
    if is_compact(optimizer):
        for master in masters:
            optimizer.set_logical_state(master)


@dataclass(frozen=True)
class ParamInfo:
    """A parameter as a checkpoint records it: full shape, the dtype the model computes
    in, its optimizer param group (-1: frozen, stored as a ``param`` span) and, for a
    tensor-parallel slice saved part after part, that order ([Note: sliced tensors in
    checkpoints]; None: row-major)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    opt_group: int
    order: SliceOrder | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)
