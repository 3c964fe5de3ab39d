"""DeepSpeed's per-parameter state access: ``safe_get_full_fp32_param(param)``,
``safe_get_full_grad``, ``safe_get_full_optimizer_state``, their ``local`` forms and the
``safe_set_full_*`` setters (``deepspeed.utils``).

They take a bare parameter, find the live engine that trains it (engines enter
themselves in ``terascale.engine.deepspeed_api``'s weak set) and read or write the
engine's model state through the same logical spans its checkpoints use
(``[Note: logical checkpoints]``), so they work alike at every ZeRO stage, with offloaded
optimizer state and under model parallelism (a tensor-parallel rank sees its own slice):

- ``full``: every data-parallel rank contributes the spans it saves (disjoint, together
  the whole parameter) to one all-reduce. Collective over the data-parallel group: every
  rank calls it with the same parameter, as in DeepSpeed.
- ``local``: the elements this rank holds, flattened in order (all of them at stage 0).
  Not collective.
- ``set_full``: the value's spans are written where this rank holds them and pushed
  into the model (collective, like loading a checkpoint).

Gradients are the window's reduced, averaged gradients divided by the fp16 loss scale,
read after the window's last ``engine.backward`` and before ``engine.step``.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from terascale.checkpoint.spans import GRAD, MASTER, OPTIM, PARAM, OptimKey, Slice, SliceMode
from terascale.comm import ops
from terascale.engine.deepspeed_api import live_engines
from terascale.engine.train_state import WindowState

if TYPE_CHECKING:
    from terascale.engine import Engine

_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> {id(param): (name, shape)}


def _find(param: nn.Parameter) -> tuple[Engine, str, torch.Size]:
    """The live engine training ``param``, the name its state is kept under and its full
    shape (a ZeRO-3 parameter holds an empty tensor between uses)."""
    for engine in live_engines():
        names = _NAMES.get(engine)
        if names is None:
            shapes = engine.model_state.checkpoint_params()
            names = _NAMES[engine] = {
                id(p): (n, torch.Size(shapes[n].shape) if n in shapes else p.shape)
                for n, p in engine.module.named_parameters()
            }
        if id(param) in names:
            return engine, *names[id(param)]
    raise ValueError(
        "this parameter belongs to no live terascale engine: pass a parameter of the model given to "
        "terascale.initialize (or deepspeed.initialize)"
    )


def _group(engine: Engine) -> dist.ProcessGroup | None:
    group = engine.dist.zero_group  # the ranks that shard the parameters
    return group if dist.is_initialized() and dist.get_world_size(group) > 1 else None


@torch.no_grad()
def _assemble(engine: Engine, name: str, keys: Iterable[str], slices: Iterable[Slice], shape: torch.Size,
              scale: float = 1.0) -> torch.Tensor | None:  # fmt: skip
    """The full fp32 tensor ``name`` of span kind ``keys`` from every rank's disjoint
    ``slices`` (collective over the data-parallel group); None if no rank holds it."""
    keys = set(keys)
    numel = math.prod(shape)
    full = torch.zeros(numel + 2, dtype=torch.float32, device=engine.device)  # + [found, scalar]
    for span, t in slices:
        if span.name == name and span.key in keys:
            if t.dim() == 0:
                full[0] = t.float()
                full[numel + 1] = 1.0
            else:
                full[span.start : span.end].copy_(t.reshape(-1))
            full[numel] = 1.0
    group = _group(engine)
    if group is not None:
        flags = full[numel:].clone()
        ops.all_reduce(full, group=group)
        ops.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        full[numel:] = flags
    if not full[numel]:
        return None
    if full[numel + 1]:
        return full[0].clone()
    out = full[:numel].view(shape)
    return out.div_(scale) if scale != 1.0 else out


@torch.no_grad()
def _local(
    name: str, keys: Iterable[str], slices: Iterable[Slice], device: torch.device, held: bool = False
) -> torch.Tensor | None:
    """This rank's part of ``name``'s tensor ``keys``, flattened; ``held``: the tensor exists
    (a trained parameter's), so a rank holding none of its elements gets an empty tensor,
    as DeepSpeed's partitions are, and None stays for what does not exist."""
    keys = set(keys)
    parts = sorted(((s.start, t) for s, t in slices if s.name == name and s.key in keys), key=lambda x: x[0])
    if not parts:
        return torch.empty(0, device=device) if held else None
    if parts[0][1].dim() == 0:
        return parts[0][1].detach().float().clone()
    return torch.cat([t.reshape(-1).float() for _, t in parts]).to(device)


def _state_slices(engine: Engine, mode: SliceMode) -> list[Slice]:
    return [s for chunk in engine.model_state.state_slices(engine.optimizer, mode) for s in chunk]


def _grad_slices(engine: Engine, mode: SliceMode) -> list[Slice]:
    train = engine.train_state
    if train.window is WindowState.EMPTY or not (train.window is WindowState.FINAL or train.is_boundary()):
        raise ValueError(
            "the gradients are complete only after the last engine.backward of an accumulation window "
            "(is_gradient_accumulation_boundary()) and before engine.step()"
        )
    return engine.model_state.grad_slices(mode)


# -- full (collective) -------------------------------------------------------------------------------


def safe_get_full_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """The whole fp32 master of ``param``, on the engine's device; None for a frozen
    parameter, which has no master (as in DeepSpeed: programs test for None)."""
    engine, name, shape = _find(param)
    if not param.requires_grad:
        return None
    return _assemble(engine, name, (MASTER, PARAM), _state_slices(engine, SliceMode.SAVE), shape)


def safe_get_full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The whole reduced gradient of ``param`` (None: frozen, or unused in this window)."""
    engine, name, shape = _find(param)
    slices = _grad_slices(engine, SliceMode.SAVE)
    return _assemble(engine, name, (GRAD,), slices, shape, scale=engine.loss_scaler.scale)


def safe_get_full_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The whole optimizer state ``optim_state_key`` (``"exp_avg"``, ``"exp_avg_sq"``, ``"step"``)
    of ``param``; None before the optimizer created it."""
    engine, name, shape = _find(param)
    key = OPTIM + optim_state_key
    return _assemble(engine, name, (key,), _state_slices(engine, SliceMode.SAVE), shape)


# -- local (this rank's part, flattened) -----------------------------------------------------------------


def safe_get_local_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    engine, name, shape = _find(param)
    if not param.requires_grad:  # no master, as safe_get_full_fp32_param
        return None
    return _local(name, (MASTER, PARAM), _state_slices(engine, SliceMode.HELD), engine.device, param.requires_grad)


def safe_get_local_grad(param: nn.Parameter) -> torch.Tensor | None:
    engine, name, shape = _find(param)
    local = _local(name, (GRAD,), _grad_slices(engine, SliceMode.HELD), engine.device, param.requires_grad)
    return None if local is None else local.div_(engine.loss_scaler.scale)


def safe_get_local_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    engine, name, shape = _find(param)
    stepped = param.requires_grad and engine.global_steps > 0  # the optimizer made its state
    return _local(name, (OPTIM + optim_state_key,), _state_slices(engine, SliceMode.HELD), engine.device, stepped)


# -- setters (collective) ---------------------------------------------------------------------------


def _check_value(shape: torch.Size, value: torch.Tensor) -> torch.Tensor:
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"value of shape {tuple(value.shape)} for a parameter of shape {tuple(shape)}")
    return value.detach().reshape(-1)


@torch.no_grad()
def _write(engine: Engine, name: str, keys: set[str], flat: torch.Tensor,
           optim_keys: dict[str, OptimKey] | None) -> None:  # fmt: skip
    for chunk in engine.model_state.state_slices(engine.optimizer, SliceMode.LOAD, optim_keys):
        for span, t in chunk:
            if span.name == name and span.key in keys and t.dim() > 0:
                t.reshape(-1).copy_(flat[span.start : span.end].to(t.device, t.dtype))


def safe_set_full_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Set the whole fp32 value of ``param`` (its master, and the model's copy)."""
    engine, name, shape = _find(param)
    _write(engine, name, {MASTER, PARAM}, _check_value(shape, value), None)


def _optim_keys(engine: Engine, optim_state_key: str) -> dict[str, OptimKey]:
    """The optimizer state keys every rank's masters have (collective over data parallelism)."""
    held = _state_slices(engine, SliceMode.SAVE)
    mine = {s.key.removeprefix(OPTIM): OptimKey(t.dtype, t.dim() == 0) for s, t in held if s.key.startswith(OPTIM)}
    every: list[dict[str, OptimKey] | None] = [mine]
    group = _group(engine)
    if group is not None:
        every = [None] * dist.get_world_size(group)
        ops.all_gather_object(every, mine, group=group)
    keys = {k: v for d in every if d for k, v in d.items()}  # the same state for every master
    if optim_state_key not in keys:
        raise ValueError(
            f"the optimizer has no state {optim_state_key!r} (it has {sorted(keys) or 'none yet'}): "
            "optimizer state exists after the first engine.step()"
        )
    return keys


def safe_set_full_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set the whole optimizer state ``optim_state_key`` of ``param`` (it must exist: the
    optimizer creates its state at its first step)."""
    engine, name, shape = _find(param)
    flat = _check_value(shape, value)
    keys = _optim_keys(engine, optim_state_key)
    _write(engine, name, {OPTIM + optim_state_key}, flat, keys)


def _local_to_full(engine: Engine, name: str, keys: Iterable[str], shape: torch.Size, value: torch.Tensor) -> torch.Tensor:
    """``value`` (this rank's elements of ``name``, in the order the local getters give them)
    placed at their positions in a flat tensor of the whole parameter; the rest is never read:
    the writes fill the spans this rank holds, the same spans."""
    keys = set(keys)
    spans = sorted({(s.start, s.end) for s, t in _state_slices(engine, SliceMode.HELD)
                    if s.name == name and s.key in keys and t.dim() > 0})  # fmt: skip
    local = value.detach().reshape(-1)
    held = sum(end - start for start, end in spans)
    if local.numel() != held:
        raise ValueError(f"local value of {local.numel()} elements; this rank holds {held} of {name}")
    full = torch.zeros(math.prod(shape), dtype=local.dtype, device=local.device)
    offset = 0
    for start, end in spans:
        full[start:end] = local[offset : offset + end - start]
        offset += end - start
    return full


def safe_set_local_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Set this rank's elements of ``param``'s fp32 value (as :func:`safe_get_local_fp32_param`
    gives them). Not collective."""
    engine, name, shape = _find(param)
    _write(engine, name, {MASTER, PARAM}, _local_to_full(engine, name, (MASTER, PARAM), shape, value), None)


def safe_set_local_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's elements of the optimizer state ``optim_state_key`` of ``param``."""
    engine, name, shape = _find(param)
    keys = _optim_keys(engine, optim_state_key)
    key = OPTIM + optim_state_key
    _write(engine, name, {key}, _local_to_full(engine, name, (key,), shape, value), keys)


@torch.no_grad()
def _write_grad(engine: Engine, name: str, flat: torch.Tensor, local: bool, trained: bool) -> None:
    # The window's gradient spans are views of the reduced gradients this rank holds; they
    # carry the loss scale, which the getters divide out, so the setters multiply it in. A
    # rank may hold none of a trained parameter's gradient (its span is another rank's
    # partition): the full setter writes nothing there, the local one takes an empty value.
    offset = 0
    spans = sorted(((s, t) for s, t in _grad_slices(engine, SliceMode.HELD) if s.name == name and s.key == GRAD),
                   key=lambda st: st[0].start)  # fmt: skip
    held = torch.tensor([1.0 if spans else 0.0], device=engine.device)
    group = _group(engine)
    if not local and group is not None:  # collective, as in DeepSpeed: every rank decides alike
        ops.all_reduce(held, op=dist.ReduceOp.MAX, group=group)
    if not held.item() and not (local and flat.numel() == 0 and trained):
        raise ValueError(f"{name} has no gradient in this window (frozen, or unused by the loss)")
    for span, t in spans:
        n = span.end - span.start
        part = flat[offset : offset + n] if local else flat[span.start : span.end]
        t.copy_(part.to(t.device, t.dtype) * engine.loss_scaler.scale)
        offset += n
    if local and offset != flat.numel():
        raise ValueError(f"local gradient of {flat.numel()} elements; this rank holds {offset} of {name}")


def safe_set_full_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """Set the whole reduced gradient of ``param`` for the coming ``engine.step()`` (after the
    window's last backward). Collective, as in DeepSpeed: each rank writes its own part."""
    engine, name, shape = _find(param)
    _write_grad(engine, name, _check_value(shape, value), local=False, trained=param.requires_grad)


def safe_set_local_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """Set this rank's part of ``param``'s gradient (as :func:`safe_get_local_grad` returns it)."""
    engine, name, _ = _find(param)
    _write_grad(engine, name, value.detach().reshape(-1), local=True, trained=param.requires_grad)


def safe_update_full_grad_vectorized(param_list: list[nn.Parameter], update_func: Callable) -> None:
    """Replace each parameter's full gradient ``g`` by ``update_func(g, param)`` (collective,
    as :func:`safe_get_full_grad`); parameters without a gradient this window are skipped."""
    for p in param_list:
        if not p.requires_grad:
            continue
        old = safe_get_full_grad(p)
        if old is not None:
            safe_set_full_grad(p, update_func(old, p))


__all__ = [
    "safe_update_full_grad_vectorized", "safe_set_full_grad", "safe_set_local_grad", "safe_set_local_fp32_param", "safe_set_local_optimizer_state",
    "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state", "safe_get_local_fp32_param",
    "safe_get_local_grad", "safe_get_local_optimizer_state", "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
]  # fmt: skip
