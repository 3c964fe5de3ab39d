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
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

_GIB = 2**30


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
) -> list[MemoryEstimate]:
    """Per-rank memory for stages 0-3 and every offload choice in ``offload``.

    ``largest_layer_params`` (default: the largest child of a model, else Ψ/10) sizes
    the stage-3 working set. Optimizer offload applies to stages 1-3, parameter offload
    to stage 3 only, as in DeepSpeed.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    psi, largest = _count(model_or_num_params)
    if psi <= 0:
        raise ValueError(f"the number of parameters must be positive, got {psi}")
    largest = largest_layer_params or largest or psi // 10
    n = world
    out = [MemoryEstimate(0, "none", "none", 18 * psi, 0, 0, 0)]
    for stage in (1, 2, 3):
        params = 2 * psi if stage < 3 else 2 * psi / n
        grads = 2 * psi if stage == 1 else 2 * psi / n
        working = 2 * 2 * largest if stage == 3 else 0
        for opt in offload:
            # Offloaded optimizer: fp32 master, moments and an fp32 gradient copy, 16 bytes.
            optim = 12 * psi / n if opt == "none" else 16 * psi / n
            for par in offload if stage == 3 else ("none",):
                if par != "none" and opt == "none":
                    continue  # DeepSpeed offloads parameters only with the optimizer
                tiers = {"device": 0.0, "cpu": 0.0, "nvme": 0.0}
                tiers["device"] += grads
                tiers["device" if par == "none" else par] += params
                tiers["device" if opt == "none" else opt] += optim
                out.append(MemoryEstimate(stage, opt, par, tiers["device"], tiers["cpu"], tiers["nvme"], working))
    return out


def format_estimates(estimates: list[MemoryEstimate], num_params: int, world: int) -> str:
    """A table of ``estimates`` in GiB per rank."""
    lines = [
        f"model states per rank for {num_params / 1e9:.3g}B parameters on {world} rank(s) "
        "(bf16/fp16 params and grads, Adam; GiB):",
        "stage  offload_o  offload_p      device        host        nvme  +working",
    ]
    lines += [e.row() for e in estimates]
    return "\n".join(lines)
