"""Which plan: the fastest that fits with a margin, preferring less offload; and refusals.

[Note: choosing a plan]
A plan fits when on every tier its predicted peak per rank is at most ``1 - margin`` of
the limit ([Note: machine limits]). Among the plans that fit the planner takes the one
with the least offload (in memory, then the optimizer on the host, then on NVMe, then
the parameters too), then the shortest predicted step ([Note: step-time shape]); plans
within ``TIE`` of that step are taken as equal, and among them the lowest stage (less
communication and machinery), then no checkpointing, then the largest micro-batch win.

Nothing fits: a ValueError that names the smallest plan (the least memory on the tier
that is most over its limit) and what it needs. An explicit setting is checked without
the margin (it is the user's choice): first its model states and the runtime, naming the
category that overflows, by how much, and what would make it fit; then, where one sample
was measured ([Note: the model's profile]) so that the activations are known, its whole
predicted peak, naming what forward and backward add on top of the states. Without a
measurement the activations are unknown and only the states are held to the limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from terascale.plan.candidates import Candidate
from terascale.plan.machine import Limit, Machine
from terascale.plan.memory import TIERS, by_category

TIE = 0.03  # step times within 3% are equal
_GIB = 2**30
_STATES = ("runtime", "parameters", "gradients", "optimizer states")


@dataclass(frozen=True)
class Decision:
    """The chosen plan, every candidate, and why."""

    chosen: Candidate
    candidates: tuple[Candidate, ...]
    reason: str


def limit_of(machine: Machine, tier: str) -> Limit | None:
    return {"host": machine.host, "device": machine.device, "nvme": machine.disk}[tier]


def overflow(candidate: Candidate, machine: Machine, margin: float) -> dict[str, float]:
    """Tier -> bytes over ``1 - margin`` of its limit (tiers that fit are left out)."""
    out = {}
    for tier in TIERS:
        need = candidate.need(tier)
        if need <= 0:
            continue
        limit = limit_of(machine, tier)
        if limit is None:
            out[tier] = need  # an NVMe plan without an NVMe path (cannot happen for planned ones)
        elif need > (1 - margin) * limit.bytes:
            out[tier] = need - (1 - margin) * limit.bytes
    return out


def fits(candidate: Candidate, machine: Machine, margin: float) -> bool:
    return not overflow(candidate, machine, margin)


def ratio(candidate: Candidate, machine: Machine) -> float:
    """The largest need/limit over the tiers."""
    worst = 0.0
    for tier in TIERS:
        limit = limit_of(machine, tier)
        need = candidate.need(tier)
        if need > 0:
            worst = max(worst, need / limit.bytes if limit is not None and limit.bytes > 0 else float("inf"))
    return worst


def choose(candidates: Sequence[Candidate], machine: Machine, margin: float) -> Decision:
    """The plan of [Note: choosing a plan]; ValueError when none fits."""
    if not candidates:
        raise ValueError("the planner found no plan to weigh (no valid combination of the config's settings)")
    fitting = [c for c in candidates if fits(c, machine, margin)]
    if not fitting:
        smallest = min(candidates, key=lambda c: ratio(c, machine))
        raise ValueError(f"no plan fits this machine: the smallest, {smallest.label()}, needs "
                         f"{describe_need(smallest, machine, margin)}{_advice(machine)}")  # fmt: skip
    least = min(c.offload_rank for c in fitting)
    pool = [c for c in fitting if c.offload_rank == least]
    best = min(c.time.total for c in pool)
    near = [c for c in pool if c.time.total <= best * (1 + TIE)]
    chosen = min(near, key=lambda c: (c.shape.stage, c.shape.policy != "none", -c.shape.micro_batch, c.time.total))
    host = chosen.need("device" if machine.has_device else "host")
    tier = "device" if machine.has_device else "host"
    limit = limit_of(machine, tier)
    offload = "no offload" if least == 0 else "the least offload"
    among = "" if len(pool) == 1 else "; the shortest step"
    if len(near) > 1:
        among = f"; of the {len(near)} within {TIE:.0%} of the shortest step, the lowest stage, then no checkpointing"
    why = (f"{chosen.label()}: predicted peak {host / _GIB:.2f} GiB of {tier} memory per rank of "
           f"{limit.bytes / _GIB:.2f} ({limit.source}, margin {margin:.0%}), step ~{chosen.time.total:.3g} s; "
           f"{len(fitting)} of {len(candidates)} plans fit, {len(pool)} with {offload}{among}")  # fmt: skip
    return Decision(chosen, tuple(candidates), why)


def describe_need(candidate: Candidate, machine: Machine, margin: float) -> str:
    """'5.10 GiB of host memory per rank, 3.00 available (planner.host_memory), ...' for every tier over."""
    out = []
    for tier, _ in overflow(candidate, machine, margin).items():
        limit = limit_of(machine, tier)
        have = "no NVMe path" if limit is None else f"{(1 - margin) * limit.bytes / _GIB:.2f} GiB usable ({limit.source})"
        out.append(f"{candidate.need(tier) / _GIB:.2f} GiB of {_tier_name(tier)} per rank, {have}")
    return "; ".join(out) or "nothing over"


def _tier_name(tier: str) -> str:
    return {"host": "host memory", "device": "device memory", "nvme": "NVMe space"}[tier]


def _advice(machine: Machine) -> str:
    tips = []
    if machine.disk is None:
        tips.append('write "device": "auto" with an nvme_path in offload_optimizer and offload_param, so that '
                    "optimizer states and parameters can go to NVMe")  # fmt: skip
    tips.append("use more ranks, a smaller model or global batch, or a machine with more memory")
    return ": " + "; ".join(tips)


def check_explicit(candidate: Candidate, machine: Machine, whole_peak: bool = False) -> None:
    """Refuse ``candidate`` (an explicit setting) when its runtime and model states alone
    exceed a tier's limit, naming the overflowing category, or with ``whole_peak`` (the
    activations were measured) when its predicted peak does (see [Note: choosing a plan])."""
    _check_states(candidate, machine)
    if whole_peak:
        _check_peak(candidate, machine)


def _check_peak(candidate: Candidate, machine: Machine) -> None:
    for tier in TIERS:
        limit, need = limit_of(machine, tier), candidate.need(tier)
        if need <= 0 or limit is None or need <= limit.bytes:
            continue
        cats = by_category(list(candidate.parts), tier)
        states = sum(cats[k] for k in _STATES)
        extra = ", ".join(f"{k} {v / _GIB:.2f}" for k, v in cats.items() if k not in _STATES and v > 0)
        s = candidate.shape
        raise ValueError(
            f"the predicted peak is {need / _GIB:.2f} GiB of {_tier_name(tier)} per rank, {(need - limit.bytes) / _GIB:.2f} "
            f"GiB over its {limit.bytes / _GIB:.2f} GiB ({limit.source}): the runtime and model states take "
            f"{states / _GIB:.2f} GiB and training adds {extra} GiB (micro-batch {s.micro_batch}, checkpointing "
            f"{s.policy}). Lower train_micro_batch_size_per_gpu (raising gradient_accumulation_steps), checkpoint "
            f"activations (activation_checkpointing.policy \"blocks\"), or write \"auto\" and let the planner choose"
        )  # fmt: skip


def _check_states(candidate: Candidate, machine: Machine) -> None:
    for tier in TIERS:
        limit = limit_of(machine, tier)
        cats = by_category(list(candidate.parts), tier)
        states = {k: cats[k] for k in _STATES if cats[k] > 0}
        need = sum(states.values())
        if need <= 0:
            continue
        if limit is None:
            raise ValueError(f"{_tier_name(tier)}: the config puts {need / _GIB:.2f} GiB per rank on NVMe "
                             "but names no nvme_path")  # fmt: skip
        if need <= limit.bytes:
            continue
        # The category that overflows: the one whose addition (largest last) crosses the limit.
        order = sorted((k for k in states if k != "runtime"), key=lambda k: states[k])
        used = states.get("runtime", 0.0)
        culprit = order[-1] if order else "runtime"
        for k in order:
            if used + states[k] > limit.bytes:
                culprit = k
                break
            used += states[k]
        left = max(0.0, limit.bytes - (need - states[culprit]))
        others = ", ".join(f"{k} {v / _GIB:.2f}" for k, v in states.items() if k != culprit)
        raise ValueError(
            f"{culprit} need {states[culprit] / _GIB:.2f} GiB of {_tier_name(tier)} per rank, "
            f"{left / _GIB:.2f} GiB available after the rest ({others} GiB) of {limit.bytes / _GIB:.2f} GiB "
            f"({limit.source}): {(need - limit.bytes) / _GIB:.2f} GiB over. {_fix(culprit, candidate, tier)}"
        )


def _fix(category: str, candidate: Candidate, tier: str) -> str:
    """What would make ``category`` fit."""
    s = candidate.shape
    if category == "optimizer states":
        if s.offload_optimizer != "nvme":
            return ("Offload the optimizer to NVMe (zero_optimization.offload_optimizer: {\"device\": \"nvme\", "
                    "\"nvme_path\": ...}), shard it over more ranks (stage >= 1), use an 8-bit optimizer "
                    "(optimizer.type Adam8bit), or write \"auto\" and let the planner choose")  # fmt: skip
        return ("Use more ranks, a smaller model or a larger disk; or an 8-bit optimizer (optimizer.type "
                "Adam8bit) if it is not one")
    if category == "parameters":
        if s.stage < 3:
            return "Shard the parameters (zero_optimization.stage 3), or write \"auto\" and let the planner choose"
        return "Offload the parameters (zero_optimization.offload_param: {\"device\": \"nvme\", ...}) or use more ranks"
    if category == "gradients":
        return "Shard the gradients (zero_optimization.stage 2 or 3), or write \"auto\" and let the planner choose"
    return f"The process already holds that much; free {_tier_name(tier)} or raise the limit"
