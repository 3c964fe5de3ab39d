"""The predicted step-time shape of a plan: compute, communication, offload I/O, optimizer.

[Note: step-time shape]
The planner ranks plans that fit by a step time built from four terms, each from a
measurement or a stated constant:

- compute: forward and backward (3 forwards' worth; 4 when blocks are recomputed) of the
  samples a rank sees per step, at the measured forward time per sample ([Note: the
  model's profile]), else 6·Ψ·tokens FLOPs at a measured matmul rate; plus a fixed
  cost per micro-step and per group gathered or reduced in it (hooks, launches);
- communication: the bytes ZeRO sends per step over the data-parallel group
  ([Note: 3D layout estimates]) at the link's bandwidth;
- offload I/O: the bytes the NVMe tiers move per step (optimizer runs read and written,
  gradient shards written and read, stage-3 parameter shards read twice per micro-step
  and written once per step) at the disk's measured speed; the tiers overlap it with
  compute, so only what exceeds the compute counts;
- optimizer: the update of this rank's shard at a measured rate (torch's fused AdamW on
  the host); on an accelerator the update of device-resident state costs its memory
  traffic at 1 TB/s, and an offloaded one adds the host update and the copies of
  gradients and parameters over PCIe (20 GB/s).

It is a shape, not a promise: the terms say where a plan's time would go.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from terascale.parallel.estimate import dp_bytes
from terascale.plan.machine import Machine
from terascale.plan.memory import Knobs, Part, Shape
from terascale.plan.profile import ModelProfile

MICRO_STEP_S = 1e-3  # fixed cost of a micro-step (hooks, the loss, launches)
PER_GROUP_S = 1e-4  # per group gathered or reduced in a micro-step
DEVICE_BANDWIDTH = 1e12  # bytes/s of an accelerator's memory for the optimizer's traffic
PCIE_BANDWIDTH = 20e9  # bytes/s host <-> device


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by term (see [Note: step-time shape])."""

    compute: float
    comm: float
    io: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.compute + self.comm + max(0.0, self.io - self.compute) + self.optimizer


@functools.lru_cache(maxsize=4)
def matmul_rate(dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of a 512 x 1024 x 1024 matmul in ``dtype`` on the CPU (best of three)."""
    a, b = torch.randn(512, 1024).to(dtype), torch.randn(1024, 1024).to(dtype)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * 512 * 1024 * 1024 / max(best, 1e-9)


@functools.lru_cache(maxsize=1)
def host_adam_rate() -> float:
    """Seconds per element of torch's fused AdamW step on the host (1M fp32 elements, best of three)."""
    p = torch.zeros(1 << 20)
    p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    opt.step()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - start)
    return best / p.numel()


def step_time(profile: ModelProfile, shape: Shape, knobs: Knobs, machine: Machine, parts: list[Part],
              grad_accum: int) -> StepTime:  # fmt: skip
    """The :class:`StepTime` of ``shape`` (see [Note: step-time shape])."""
    n, c = max(1, machine.world), profile.compute_bytes
    a = profile.activations
    samples = shape.micro_batch * grad_accum
    passes = 4.0 if shape.policy in ("blocks", "every_n", "selective") else 3.0
    per_call = a.forward_call_s
    if a.forward_s is not None:
        per_sample = a.forward_s
    else:
        flops = profile.flops_per_sample()
        per_sample = 0.0 if flops is None else flops / 6.0 / matmul_rate()
    groups = len(profile.group_names)
    overhead = MICRO_STEP_S + (PER_GROUP_S * groups * (2 if shape.stage == 3 else 1) if shape.stage >= 2 else 0.0)
    compute = (samples * per_sample + grad_accum * per_call) * passes + grad_accum * overhead
    comm = 0.0 if n == 1 else dp_bytes(profile.numel * c, shape.stage, n, grad_accum) / machine.link_bandwidth
    nvme = {p.category: p.bytes for p in parts if p.tier == "nvme"}
    io_bytes = 2 * nvme.get("optimizer states", 0.0) + 2 * nvme.get("gradients", 0.0) * grad_accum
    io_bytes += nvme.get("parameters", 0.0) * (2 * grad_accum + 1)
    speed = machine.disk_speed or 1e9
    io = io_bytes / speed
    elements = profile.trainable / (n if shape.stage >= 1 else 1)
    host_update = elements * host_adam_rate()
    if not machine.has_device:
        optimizer = host_update
    elif shape.offload_optimizer == "none":
        optimizer = elements * (4 + knobs.state_bytes) * 2 / DEVICE_BANDWIDTH
    else:
        optimizer = host_update + 2 * elements * c / PCIE_BANDWIDTH
    return StepTime(compute, comm, io, optimizer)
