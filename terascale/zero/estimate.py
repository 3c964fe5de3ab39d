"""Memory each rank needs for model states, per ZeRO stage and offload choice.

[Note: memory formulas]
With Ψ parameters, N data-parallel ranks, mixed precision (2-byte parameters and
gradients) and Adam (fp32 master, momentum and variance: 12 bytes per parameter),
ZeRO's model states per rank are

    stage 1: 4Ψ + 12Ψ/N    (full params and grads; optimizer state sharded)
    stage 2: 2Ψ + 14Ψ/N    (gradients sharded too)
    stage 3: 16Ψ/N         (everything sharded)

terascale holds exactly these (``engine.memory_breakdown()``; a test checks them within
5%). Stage 0 keeps gradients in an fp32 accumulation buffer: 2Ψ + 4Ψ + 12Ψ = 18Ψ.
Offloading the optimizer moves the fp32 master, moments and an fp32 gradient copy
(16Ψ/N) from the device to host memory (or NVMe); offloading parameters (stage 3) moves
the 2-byte parameter shards too. Working set on top: at stage 3 the gathered groups
(about two of the largest group: the one in use and the one prefetched), at every stage
the gradient buckets in flight.

The 12 bytes of optimizer state are Adam's: the fp32 master (4) and two fp32 moments (8).
Other optimizers keep other state (:func:`optimizer_state_bytes`): 8-bit Adam's moments
are one byte each plus an fp32 scale per block of 256 (2.03 bytes), SGD with momentum
keeps one fp32 buffer (4), plain SGD none, Lion one momentum (4); Muon one momentum for the
share of elements it steps (the hidden matrices) and AdamW's two for the rest, so
4·f + 8·(1 - f) with f that share of the model's. ``estimate_memory(optimizer=...)`` and the
planner (``terascale.plan``) put K = 4 + that in place of 12: stage 1 is 4Ψ + KΨ/N, and
so on; an offloaded optimizer adds its fp32 gradient copy (4Ψ/N) as above.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from terascale.optim.muon import muon_share
from terascale.zero.gather import full_shape

_GIB = 2**30
MASTER_BYTES = 4  # the fp32 master copy of each parameter the optimizer steps

# Bytes of state per parameter, besides the master, by optimizer type (lower case).
_STATE_BYTES: dict[str, float] = {
    "adam": 8.0, "adamw": 8.0, "lamb": 8.0, "onebitadam": 8.0, "zerooneadam": 8.0, "onebitlamb": 8.0,
    "adagrad": 4.0, "lion": 4.0, "musgd": 4.0, "muadam": 8.0, "muadamw": 8.0,
}
_COMPACT = ("adam8bit", "adamw8bit")


def optimizer_state_bytes(optimizer_type: str | None = "Adam", params: Mapping[str, Any] | None = None,
                          model: nn.Module | None = None) -> float:  # fmt: skip
    """Bytes of optimizer state per parameter besides the fp32 master, for the optimizer
    ``optimizer_type`` (a config's ``optimizer.type``, or a torch optimizer's class name)
    with ``params`` (its config ``params``): Adam 8, 8-bit Adam 2 + 8/block_size (2.03),
    SGD 4 with momentum and 0 without, Muon 4 on the share of ``model``'s elements it
    steps and 8 (AdamW's) on the rest (``terascale.optim.muon.muon_share``; all of them
    without a model). An unknown or missing type counts as Adam."""
    key = (optimizer_type or "adam").lower()
    params = params or {}
    if key == "muon":
        share = 1.0 if model is None else muon_share(model, full_shape)
        return 4.0 * share + 8.0 * (1.0 - share)
    if key in _COMPACT:
        block = int(params.get("block_size", 256) or 256)
        return 2.0 + 2 * 4.0 / block  # one byte per moment, an fp32 absmax per block of each
    if key == "sgd":
        return 4.0 if float(params.get("momentum", 0.0) or 0.0) > 0 else 0.0
    return _STATE_BYTES.get(key, 8.0)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank for one stage and offload choice."""

    stage: int
    offload_optimizer: str  # none | cpu | nvme
    offload_param: str  # none | cpu | nvme
    device: float  # model states on the accelerator
    host: float  # model states in host memory
    nvme: float  # model states on NVMe
    working: float  # gathered parameters at stage 3 (largest group, x2 for prefetch)

    def row(self) -> str:
        return (
            f"{self.stage:>5}  {self.offload_optimizer:>9}  {self.offload_param:>9}  "
            f"{self.device / _GIB:>10.2f}  {self.host / _GIB:>10.2f}  {self.nvme / _GIB:>10.2f}  "
            f"{self.working / _GIB:>10.2f}"
        )


@dataclass(frozen=True)
class StateBytes:
    """Bytes per rank of the three model states (see [Note: memory formulas])."""

    params: float
    grads: float
    optimizer: float  # the fp32 master and the optimizer's state

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def model_state_bytes(
    psi: float,
    world: int,
    stage: int,
    *,
    state_bytes: float = 8.0,
    param_bytes: int = 2,
    grad_bytes: int | None = None,
    master_bytes: int = MASTER_BYTES,
    trainable: float | None = None,
) -> StateBytes:
    """ZeRO's model states per rank ([Note: memory formulas]) for ``psi`` parameters
    (``trainable`` of them with gradients and optimizer state; default all) on ``world``
    data-parallel ranks: parameters in ``param_bytes``, gradients in ``grad_bytes``
    (default: the parameters'; stage 0 accumulates in fp32), the fp32 master and
    ``state_bytes`` of optimizer state per parameter. Stage 3's parameters are counted as
    even shards (the persistent small ones, which every rank holds whole, are the
    caller's to add)."""
    n = max(1, world)
    t = psi if trainable is None else trainable
    grads = t * (4 if stage == 0 and grad_bytes is None else grad_bytes or param_bytes)
    return StateBytes(
        params=psi * param_bytes / (n if stage == 3 else 1),
        grads=grads / (n if stage >= 2 else 1),
        optimizer=t * (master_bytes + state_bytes) / (n if stage >= 1 else 1),
    )


def _count(model_or_num_params: nn.Module | int | float) -> tuple[int, int]:
    """(parameters, elements of the largest child module) of a model or a count."""
    if isinstance(model_or_num_params, nn.Module):
        params = sum(p.numel() for p in model_or_num_params.parameters())
        largest = max(
            (sum(p.numel() for p in m.parameters()) for m in model_or_num_params.children()), default=params
        )
        return params, largest
    return int(model_or_num_params), 0


def estimate_memory(
    model_or_num_params: nn.Module | int | float,
    world: int = 1,
    *,
    largest_layer_params: int | None = None,
    offload: tuple[str, ...] = ("none", "cpu", "nvme"),
    optimizer: str | None = "Adam",
    optimizer_params: Mapping[str, Any] | None = None,
) -> list[MemoryEstimate]:
    """Per-rank memory for stages 0-3 and every offload choice in ``offload``.

    ``largest_layer_params`` (default: the largest child of a model, else Ψ/10) sizes
    the stage-3 working set. Optimizer offload applies to stages 1-3, parameter offload
    to stage 3 only, as in DeepSpeed. ``optimizer`` (a config's ``optimizer.type``, with
    its ``optimizer_params``) sizes the optimizer state (:func:`optimizer_state_bytes`;
    Muon's by the share of a model's elements it steps, all of them for a bare count).
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    psi, largest = _count(model_or_num_params)
    if psi <= 0:
        raise ValueError(f"the number of parameters must be positive, got {psi}")
    largest = largest_layer_params or largest or psi // 10
    n = world
    model = model_or_num_params if isinstance(model_or_num_params, nn.Module) else None
    state = optimizer_state_bytes(optimizer, optimizer_params, model)
    zero = model_state_bytes(psi, n, 0, state_bytes=state)
    out = [MemoryEstimate(0, "none", "none", zero.total, 0, 0, 0)]
    for stage in (1, 2, 3):
        working = 2 * 2 * largest if stage == 3 else 0
        for opt in offload:
            # Offloaded optimizer: fp32 master, its state and an fp32 gradient copy (16 bytes for Adam).
            parts = model_state_bytes(psi, n, stage, state_bytes=state + (4 if opt != "none" else 0))
            for par in offload if stage == 3 else ("none",):
                if par != "none" and opt == "none":
                    continue  # DeepSpeed offloads parameters only with the optimizer
                tiers = {"device": 0.0, "cpu": 0.0, "nvme": 0.0}
                tiers["device"] += parts.grads
                tiers["device" if par == "none" else par] += parts.params
                tiers["device" if opt == "none" else opt] += parts.optimizer
                out.append(MemoryEstimate(stage, opt, par, tiers["device"], tiers["cpu"], tiers["nvme"], working))
    return out


def format_estimates(estimates: list[MemoryEstimate], num_params: int, world: int, optimizer: str = "Adam") -> str:
    """A table of ``estimates`` in GiB per rank."""
    lines = [
        f"model states per rank for {num_params / 1e9:.3g}B parameters on {world} rank(s) "
        f"(bf16/fp16 params and grads, {optimizer}; GiB):",
        "stage  offload_o  offload_p      device        host        nvme  +working",
    ]
    lines += [e.row() for e in estimates]
    return "\n".join(lines)
