"""The planner's table: every plan's memory per rank by category and tier, its step, the choice."""

from __future__ import annotations

from collections.abc import Sequence

from terascale.plan.candidates import Candidate
from terascale.plan.choose import Decision, fits, limit_of
from terascale.plan.machine import Machine
from terascale.plan.memory import CATEGORIES, TIERS, by_category
from terascale.plan.profile import ModelProfile

_GIB = 2**30
_SHORT = {"runtime": "runtime", "parameters": "params", "gradients": "grads", "optimizer states": "optim",
          "activations": "activ", "working set": "working"}  # fmt: skip


def pick_rows(decision: Decision, machine: Machine, margin: float, limit: int = 40) -> list[Candidate]:
    """Per (stage, offloads, checkpointing): the chosen plan, else the largest micro-batch
    that fits, else the smallest micro-batch."""
    groups: dict[tuple, list[Candidate]] = {}
    for c in decision.candidates:
        groups.setdefault((c.shape.stage, c.shape.offload_optimizer, c.shape.offload_param, c.shape.policy), []).append(c)
    rows = []
    for members in groups.values():
        if decision.chosen in members:
            rows.append(decision.chosen)
            continue
        ok = [c for c in members if fits(c, machine, margin)]
        rows.append(max(ok, key=lambda c: c.shape.micro_batch) if ok else min(members, key=lambda c: c.shape.micro_batch))
    return sorted(rows, key=lambda c: (c.offload_rank, c.shape.stage, c.shape.policy != "none"))[:limit]


def format_plan(decision: Decision, machine: Machine, profile: ModelProfile, margin: float,
                notes: Sequence[str] = ()) -> str:  # fmt: skip
    """The table ``terascale plan`` prints (GiB per rank; seconds per step)."""
    tiers = [t for t in TIERS if t != "device" or machine.has_device]
    lines = [_machine_line(machine, margin), _model_line(profile), *notes, ""]
    head = (f"{'':1} {'stage':>5} {'opt':>4} {'param':>5} {'mb':>3}x{'acc':<3} {'ckpt':>6} | "
            + " ".join(f"{_SHORT[c]:>7}" for c in CATEGORIES) + " | "
            + " ".join(f"{t:>7}" for t in tiers) + " | "
            + f"{'compute':>8} {'comm':>6} {'io':>6} {'optim':>6} {'step s':>7} | fits")  # fmt: skip
    lines += ["memory per rank (GiB) by category and tier; predicted step time (s) by term:", head, "-" * len(head)]
    for c in pick_rows(decision, machine, margin):
        s = c.shape
        cats = by_category(list(c.parts))
        t = c.time
        mark = "*" if c is decision.chosen else " "
        ok = "yes" if fits(c, machine, margin) else "no"
        lines.append(
            f"{mark} {s.stage:>5} {s.offload_optimizer:>4} {s.offload_param:>5} {s.micro_batch:>3}x{c.grad_accum:<3} "
            f"{s.policy:>6} | " + " ".join(f"{cats[k] / _GIB:>7.2f}" for k in CATEGORIES) + " | "
            + " ".join(f"{c.need(tier) / _GIB:>7.2f}" for tier in tiers) + " | "
            + f"{t.compute:>8.3f} {t.comm:>6.3f} {t.io:>6.3f} {t.optimizer:>6.3f} {t.total:>7.3f} | {ok}"
        )  # fmt: skip
    lines += ["", f"chosen (*): {decision.reason}"]
    return "\n".join(lines)


def _machine_line(machine: Machine, margin: float) -> str:
    parts = [f"host {machine.host.bytes / _GIB:.2f} GiB ({machine.host.source})"]
    if machine.device is not None:
        parts.append(f"device {machine.device.bytes / _GIB:.2f} GiB ({machine.device.source})")
    else:
        parts.append("no accelerator: the host is the device")
    disk = limit_of(machine, "nvme")
    if disk is not None:
        speed = f", {machine.disk_speed / 1e9:.2f} GB/s ({machine.disk_speed_source})" if machine.disk_speed else ""
        parts.append(f"NVMe {disk.bytes / _GIB:.1f} GiB{speed}")
    return (f"machine, per rank ({machine.world} data-parallel rank(s), {machine.local_ranks} on this node; "
            f"margin {margin:.0%}): " + "; ".join(parts))  # fmt: skip


def _model_line(profile: ModelProfile) -> str:
    a = profile.activations
    if a.source == "unknown":
        acts = f"activations unknown ({a.note})"
    else:
        acts = (f"activations {a.per_sample / 2**20:.2f} MiB per sample ({a.source}; blocks' inputs "
                f"{a.block_inputs / 2**20:.2f} MiB)")  # fmt: skip
    largest = max(profile.group_numels(), default=0)
    return (f"model: {profile.numel / 1e6:.2f}M parameters ({profile.trainable / 1e6:.2f}M trainable), "
            f"{len(profile.group_names)} groups (largest {largest / 1e6:.2f}M), {acts}")  # fmt: skip
