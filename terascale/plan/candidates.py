"""The plans the planner weighs: what a config leaves open, and each plan's memory and time.

[Note: planned values]
The planner owns five ``"auto"`` values: ``zero_optimization.stage``,
``zero_optimization.offload_optimizer.device``, ``zero_optimization.offload_param.device``,
``train_micro_batch_size_per_gpu`` and ``activation_checkpointing.policy`` (see
``PLANNED``, ``terascale.config.auto.PLANNED_KEYS``). Every other setting is fixed by the
config (or its default) and sizes the plans (:class:`~terascale.plan.memory.Knobs`). A value written explicitly is one
choice; an ``"auto"`` one ranges over:

- stage: 0-3;
- offload_optimizer: none, nvme (with an ``nvme_path``) and, on a machine with an
  accelerator, cpu; only from stage 1, as in DeepSpeed;
- offload_param: none, nvme (with a path) and cpu (with an accelerator); only at stage 3
  and with the optimizer offloaded, as in DeepSpeed;
- the micro-batch: the divisors of ``train_batch_size`` / data-parallel ranks, when the
  config gives ``train_batch_size`` and leaves the accumulation steps to follow (absent
  or ``"auto"``); the accumulation steps are then the quotient;
- activation checkpointing: none, or every block (when the model has blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product
from typing import Any

from torch import nn

from terascale.config.auto import PLANNED_KEYS
from terascale.plan.machine import Machine
from terascale.plan.memory import Knobs, Part, Shape, predict, totals
from terascale.plan.profile import ModelProfile
from terascale.plan.timing import StepTime, step_time
from terascale.zero.estimate import optimizer_state_bytes

PLANNED = PLANNED_KEYS
OFFLOAD_ORDER = {("none", "none"): 0, ("cpu", "none"): 1, ("cpu", "cpu"): 2, ("nvme", "none"): 3,
                 ("nvme", "cpu"): 4, ("nvme", "nvme"): 5}  # fmt: skip


@dataclass(frozen=True)
class Choices:
    """The values each planned setting may take (one value: fixed by the config)."""

    stages: tuple[int, ...]
    offload_optimizer: tuple[str, ...]
    offload_param: tuple[str, ...]
    micro_batches: tuple[int, ...]
    policies: tuple[str, ...]
    global_batch: int | None = None  # train_batch_size when the micro-batch is chosen
    grad_accum: int | None = None  # fixed accumulation steps (None: the quotient)

    @property
    def open(self) -> list[str]:
        """The planned settings with more than one choice."""
        names = ("stage", "offload_optimizer", "offload_param", "micro_batch", "checkpointing")
        values = (self.stages, self.offload_optimizer, self.offload_param, self.micro_batches, self.policies)
        return [name for name, v in zip(names, values) if len(v) > 1]


@dataclass(frozen=True)
class Candidate:
    """One plan: its choices, accumulation steps, memory parts per rank and step time."""

    shape: Shape
    grad_accum: int
    parts: tuple[Part, ...]
    time: StepTime

    @property
    def offload_rank(self) -> int:
        return OFFLOAD_ORDER.get((self.shape.offload_optimizer, self.shape.offload_param), 9)

    def need(self, tier: str) -> float:
        return totals(list(self.parts))[tier]

    def label(self) -> str:
        s = self.shape
        off = "memory" if s.offload_optimizer == "none" else s.offload_optimizer
        par = "" if s.offload_param == "none" else f", parameters on {s.offload_param}"
        return (f"stage {s.stage}, optimizer in {off}{par}, micro-batch {s.micro_batch} x {self.grad_accum} "
                f"accumulation, checkpointing {s.policy}")  # fmt: skip


def knobs_from_config(cfg: Any, model: nn.Module | None = None) -> Knobs:
    """The :class:`Knobs` of a loaded :class:`terascale.config.Config` (and of ``model``,
    where the optimizer's state depends on which parameters it steps how: Muon's)."""
    zero = cfg.zero_optimization
    opt = cfg.optimizer
    name = opt.type if opt is not None else "Adam"
    accum = cfg.data_types.grad_accum_dtype
    overlap = cfg.written("zero_optimization.overlap_comm")
    bf16 = cfg.bf16  # [Note: bf16 masters and optimizer states]
    return Knobs(
        reduce_bucket=int(zero.reduce_bucket_size),
        overlap_comm=overlap if isinstance(overlap, bool) else None,
        prefetch=int(zero.prefetch_bucket_size),
        max_live=int(zero.max_live_parameters),
        max_reuse=int(zero.max_reuse_distance),
        persistence=int(zero.param_persistence_threshold),
        sub_group=int(zero.sub_group_size),
        opt_buffers=zero.offload_optimizer.buffer_count if zero.offload_optimizer else 4,
        param_buffers=zero.offload_param.buffer_count if zero.offload_param else 5,
        max_in_cpu=_max_in_cpu(cfg),
        accum_bytes=None if accum is None else {"fp32": 4, "fp16": 2, "bf16": 2}[accum],
        state_bytes=optimizer_state_bytes(name, opt.params if opt is not None else None, model)
        / (2 if bf16.states_in_bf16 else 1),
        master_bytes=2 if bf16.masters_in_bf16 else 4,
        optimizer=name,
        early_step=_early_step(cfg, name),
        overlap_step=bool(zero.offload_optimizer and zero.offload_optimizer.overlap_step),
        hpz=max(1, int(zero.zero_hpz_partition_size)),
        mirror_copies=_mirror_copies(cfg),
    )


def _mirror_copies(cfg: Any) -> int:
    """Copies of a rank's masters and optimizer state a live elastic job keeps in host
    memory ([Note: in-memory redundancy]): two own snapshots and two of a peer's; none
    unless a live elastic agent started this process, or with ``mirror_interval_steps`` 0."""
    from terascale.elastic.world import started_live

    return 4 if started_live() and cfg.elasticity.mirror_interval_steps > 0 else 0


def _early_step(cfg: Any, optimizer: str) -> bool:
    """Whether nothing in the config keeps an NVMe optimizer from stepping under backward
    (the checks of ``terascale.engine.optimizer.step_in_backward`` that the config decides),
    with one micro-step a window (more accumulate their gradients on disk first)."""
    offload = cfg.zero_optimization.offload_optimizer
    wanted = "auto" if offload is None else offload.step_in_backward
    gas = cfg.gradient_accumulation_steps
    if offload is not None and offload.overlap_step:  # the step runs behind the next window instead
        return False
    return (wanted is not False and not cfg.gradient_clipping and not cfg.fp16.enabled
            and optimizer.lower() != "lamb" and isinstance(gas, int) and gas == 1)  # fmt: skip


def _max_in_cpu(cfg: Any) -> int:
    """``offload_param.max_in_cpu``; 0 where the planner chooses the device and the config
    leaves it out (NVMe parameters the planner chooses keep nothing in host memory)."""
    section = cfg.zero_optimization.offload_param
    if cfg.written("zero_optimization.offload_param.device") == "auto":
        written = cfg.written("zero_optimization.offload_param.max_in_cpu")
        return 0 if written is None else section.max_in_cpu
    return section.max_in_cpu if section is not None else 1_000_000_000


def nvme_path(cfg: Any) -> str | None:
    """The NVMe directory the config names for offload (optimizer's first), else None."""
    zero = cfg.zero_optimization
    for section in (zero.offload_optimizer, zero.offload_param):
        if section is not None and section.nvme_path is not None:
            return str(section.nvme_path)
    return None


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(n, 0, -1) if n % d == 0)


def choices_from_config(cfg: Any, autos: Sequence[str], dp_world: int, *, has_device: bool, has_blocks: bool) -> Choices:
    """What each planned setting may be: the config's value, or the range of an ``"auto"``
    one in ``autos`` (see [Note: planned values])."""
    zero = cfg.zero_optimization
    path = nvme_path(cfg)
    tiers = ("none", *(("cpu",) if has_device else ()), *(("nvme",) if path else ()))
    stages = (0, 1, 2, 3) if "zero_optimization.stage" in autos else (zero.stage,)

    def device(key: str, section: Any) -> tuple[str, ...]:
        if f"zero_optimization.{key}.device" in autos:
            return tiers
        return (section.device if section is not None else "none",)

    micro = (cfg.train_micro_batch_size_per_gpu,) if cfg.train_micro_batch_size_per_gpu else (1,)
    global_batch = grad_accum = None
    if "train_micro_batch_size_per_gpu" in autos:
        tbs = cfg.train_batch_size
        gas = cfg.written("gradient_accumulation_steps")
        if isinstance(tbs, int) and tbs % dp_world == 0 and not isinstance(gas, int):
            micro, global_batch = _divisors(tbs // dp_world), tbs
    if global_batch is None:
        try:
            batch = cfg.resolve_batch(dp_world)
            micro, grad_accum = (batch.micro_batch_size,), batch.gradient_accumulation_steps
        except ValueError:
            grad_accum = cfg.gradient_accumulation_steps or 1
    policies = ("none", "blocks") if "activation_checkpointing.policy" in autos and has_blocks else None
    return Choices(
        stages=stages,
        offload_optimizer=device("offload_optimizer", zero.offload_optimizer),
        offload_param=device("offload_param", zero.offload_param),
        micro_batches=micro,
        policies=policies or (cfg.activation_checkpointing.policy,),
        global_batch=global_batch,
        grad_accum=grad_accum,
    )


def valid(shape: Shape) -> bool:
    """Whether DeepSpeed's rules allow the combination (offload needs a stage that shards it)."""
    if shape.offload_optimizer != "none" and shape.stage == 0:
        return False
    if shape.offload_param != "none" and (shape.stage != 3 or shape.offload_optimizer == "none"):
        return False
    return True


def enumerate_candidates(
    profile: ModelProfile, machine: Machine, knobs: Knobs, choices: Choices, runtime: float, *, timed: bool = True
) -> list[Candidate]:
    """Every valid plan of ``choices`` with its memory parts and step time (zeros without
    ``timed``: a check of memory only). A fixed (explicit) combination is kept even where
    DeepSpeed's rules would leave it out."""
    fixed = all(len(v) == 1 for v in (choices.stages, choices.offload_optimizer, choices.offload_param))
    out = []
    for stage, opt, par, micro, policy in product(choices.stages, choices.offload_optimizer, choices.offload_param,
                                                  choices.micro_batches, choices.policies):  # fmt: skip
        shape = Shape(stage, opt, par, micro, policy)
        if not fixed and not valid(shape):
            continue
        if choices.global_batch is not None:
            accum = choices.global_batch // (micro * machine.world)
        else:
            accum = choices.grad_accum or 1
        parts = predict(profile, shape, knobs, machine.world, runtime, machine.has_device)
        time = step_time(profile, shape, knobs, machine, parts, accum) if timed else StepTime(0.0, 0.0, 0.0, 0.0)
        out.append(Candidate(shape, accum, tuple(parts), time))
    return out
