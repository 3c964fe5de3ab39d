"""The planner's entry points: ``plan`` (a model and a config, anywhere) and the check
``terascale.initialize`` runs before anything big is allocated.

[Note: the planner at initialize]
``initialize`` calls :func:`plan_for_initialize` after joining the process group and
before ``prepare_model``. With ``planner.enabled`` (the default):

- a config with ``"auto"`` in a planned key ([Note: planned values]) is planned: the
  model is profiled (its first ``training_data`` sample measured, collated by the
  ``collate_fn`` given to ``initialize`` as a batch of one), the machine measured,
  every plan weighed, and the chosen values are *given* to the config's resolution
  ([Note: auto values]), so ``engine.config`` holds them and ``engine.config.resolved``
  says why. Rank 0 logs the choice once (the whole table at debug level);
- a config without any is checked: its runtime and model states per rank must fit each
  tier's limit, and where ``training_data`` gives a sample to measure, its whole predicted
  peak too, else ``ValueError`` ([Note: choosing a plan]).

Every rank must decide alike (a rank that refuses while the others go on would leave them
waiting in a collective): the ranks exchange their machines and their plans
(``all_gather_object`` over the world; the plans are the same list on every rank, their
numbers differ where the ranks hold different layers or runtimes) and all decide from the
smallest limits and, for each plan, the rank it fits worst. Planning on one process
(``terascale plan``, tests) skips the exchange. The explicit check measures no disk: it
runs the forwards of one sample where there is one (the bytes autograd keeps, so that the
peak holds for explicit configs as for planned ones), and that collective.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from terascale.config import Config, Given
from terascale.plan.candidates import PLANNED, Candidate, Choices, choices_from_config, enumerate_candidates
from terascale.plan.candidates import knobs_from_config, nvme_path
from terascale.plan.choose import Decision, check_explicit, choose, ratio
from terascale.plan.machine import Limit, Machine, emulated, measure_machine
from terascale.plan.profile import ModelProfile, profile_model
from terascale.plan.table import format_plan
from terascale.plan.timing import host_adam_rate
from terascale.zero import WrapPolicy
from terascale.zero.wrap import wrapped_modules

logger = logging.getLogger("terascale")
_MAX_IN_CPU = "zero_optimization.offload_param.max_in_cpu"


@dataclass(frozen=True)
class PlanResult:
    """A plan for one model, config and machine: the decision and what it came from."""

    decision: Decision
    profile: ModelProfile
    machine: Machine
    choices: Choices
    autos: tuple[str, ...]  # the planned keys that were "auto"
    margin: float

    @property
    def chosen(self) -> Candidate:
        return self.decision.chosen

    def values(self) -> dict[str, Any]:
        """Planned key path -> chosen value, for the keys that were ``"auto"``."""
        s = self.chosen.shape
        every = dict(zip(PLANNED, (s.stage, s.offload_optimizer, s.offload_param, s.micro_batch, s.policy)))
        return {path: every[path] for path in self.autos}

    def given(self) -> dict[str, Given]:
        """The chosen values as an integration's would be given ([Note: auto values])."""
        why = f"the planner: {self.chosen.label()} (predicted peak {self.peak_gib():.2f} GiB per rank)"
        given = {path: Given(value, why, match=False) for path, value in self.values().items()}
        if self.values().get("zero_optimization.offload_param.device") == "nvme":
            # NVMe means NVMe: DeepSpeed's default keeps the first 1e9 elements in host memory.
            given[_MAX_IN_CPU] = Given(0, "the planner: parameters on NVMe keep no shard in host memory",
                                       match=False, absent=True)  # fmt: skip
        return given

    def peak(self, tier: str | None = None) -> float:
        """Predicted peak bytes per rank on ``tier`` (default: the device's, the host without one)."""
        return self.chosen.need(tier or ("device" if self.machine.has_device else "host"))

    def peak_gib(self) -> float:
        return self.peak() / 2**30

    def table(self) -> str:
        return format_plan(self.decision, self.machine, self.profile, self.margin, _notes(self))


def _notes(result: PlanResult) -> list[str]:
    knobs = "; ".join(f"{p} = auto" for p in result.autos) or "no \"auto\": the config's own plan"
    return [f"planned: {knobs}"]


def plan(
    model: nn.Module,
    config: Config | Mapping[str, Any] | str | os.PathLike,
    *,
    world: int = 1,
    local_ranks: int | None = None,
    sample: Any = None,
    call: Callable[[nn.Module, Any], Any] | None = None,
    wrap_policy: WrapPolicy | None = None,
    device_type: str | None = None,
    given: Sequence[str] = (),
    host_memory: int | None = None,
    device_memory: int | None = None,
    disk_space: int | None = None,
    runtime: float | None = None,
    cast: bool = True,
) -> PlanResult:
    """Plan ``model`` under ``config`` for ``world`` data-parallel ranks (``local_ranks`` of
    them on this node; default all) without launching them.

    ``sample``: one batch of one sample to measure activations on (see [Note: the model's
    profile]). ``given``: planned keys an integration fills (not planned). ``host_memory``,
    ``device_memory``, ``disk_space``: per-rank limits lower than the machine's (as
    ``planner``'s caps, which count per node). ``runtime``: the process's bytes without the
    model (default: this process's RSS now less the model's tensors). A config without
    ``"auto"`` gives its own plan as the only candidate. Raises ValueError when
    ``"auto"`` leaves no plan that fits.
    """
    cfg = Config.load(config)
    autos = tuple(p for p in cfg.auto_keys if p in PLANNED and p not in given)
    profile, machine = _measure(model, cfg, world, local_ranks or world, sample, call, wrap_policy, device_type, cast,
                                timed=bool(autos) or sample is not None)  # fmt: skip
    machine = emulated(machine, host=host_memory, device=device_memory, disk=disk_space)
    run = runtime if runtime is not None else machine.rss - profile.resident_bytes
    return _decide(profile, machine, cfg, autos, run, wrap_policy, model)


def _measure(model: nn.Module, cfg: Config, world: int, local_ranks: int, sample: Any, call: Any,
             wrap: WrapPolicy | None, device_type: str | None, cast: bool,
             timed: bool) -> tuple[ModelProfile, Machine]:  # fmt: skip
    """The model's profile (activations measured on ``sample`` where there is one) and the
    machine; ``timed``: also the disk's speed (only a choice between plans needs it).

    Where a sample is measured, the same forwards and the optimizer's warm-up run for a
    check as for a choice: what they leave in the heap (kernels loaded, the allocator's
    first arenas) is part of the runtime the prediction starts from, and the memory
    model's constants were fitted with it there."""
    planner = cfg.planner
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    measured = sample is not None
    profile = profile_model(
        model, wrap=wrap, compute_dtype=cfg.compute_dtype, buffer_dtype=cfg.buffer_dtype, sample=sample, call=call,
        cast=cast and measured, timing=measured,
        batch_timing=measured and "train_micro_batch_size_per_gpu" in cfg.auto_keys,
    )  # fmt: skip
    if timed or measured:
        host_adam_rate()  # the optimizer's first step loads its kernels: part of the runtime, measured below
    machine = measure_machine(
        device_type=device_type, world=world, local_ranks=local_ranks, local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        nvme_path=nvme_path(cfg), host_cap=planner.host_memory, device_cap=planner.device_memory,
        disk_cap=planner.disk_space, disk_bandwidth=planner.disk_bandwidth, measure_disk=timed,
    )  # fmt: skip
    return profile, machine


def _candidates(
    profile: ModelProfile, machine: Machine, cfg: Config, autos: tuple[str, ...], runtime: float,
    wrap: WrapPolicy | None, model: nn.Module, timed: bool = True,
) -> tuple[Choices, list[Candidate]]:  # fmt: skip
    has_blocks = any(name for name in wrapped_modules(model, wrap or WrapPolicy()))
    choices = choices_from_config(cfg, autos, machine.world, has_device=machine.has_device, has_blocks=has_blocks)
    return choices, enumerate_candidates(profile, machine, knobs_from_config(cfg, model), choices, runtime, timed=timed)


def _decision(choices: Choices, candidates: list[Candidate], machine: Machine, margin: float) -> Decision:
    if choices.open:
        return choose(candidates, machine, margin)
    return Decision(candidates[0], tuple(candidates), f"{candidates[0].label()}: the config's own settings")


def _decide(profile: ModelProfile, machine: Machine, cfg: Config, autos: tuple[str, ...], runtime: float,
            wrap: WrapPolicy | None, model: nn.Module) -> PlanResult:  # fmt: skip
    choices, candidates = _candidates(profile, machine, cfg, autos, runtime, wrap, model)
    decision = _decision(choices, candidates, machine, cfg.planner.margin)
    return PlanResult(decision, profile, machine, choices, autos, cfg.planner.margin)


# -- terascale.initialize ------------------------------------------------------------------


def first_sample(training_data: Any, collate_fn: Callable | None = None) -> Any:
    """A batch of the first sample of ``training_data`` (None if there is none to take)."""
    if training_data is None:
        return None
    try:
        item = training_data[0] if hasattr(training_data, "__getitem__") else next(iter(training_data))
        return (collate_fn or torch.utils.data.default_collate)([item])
    except Exception:  # an odd dataset: plan without a measurement
        return None


def plan_for_initialize(
    model: nn.Module,
    cfg: Config,
    *,
    world: int,
    rank: int,
    training_data: Any = None,
    collate_fn: Callable | None = None,
    wrap_policy: WrapPolicy | None = None,
    given: Mapping[str, Given] | None = None,
) -> dict[str, Given]:
    """What ``initialize`` runs before ``prepare_model`` (see [Note: the planner at
    initialize]): the chosen values to give the config's resolution (empty when nothing is
    planned). Raises ValueError for a plan that cannot fit. Collective over the world when
    it has more than one rank."""
    if not cfg.planner.enabled:
        return {}
    autos = tuple(p for p in cfg.auto_keys if p in PLANNED and p not in (given or {}))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    # An explicit config that the check may refuse is measured too, so that its peak is known.
    # Not under sequence parallelism: the sample would run whole sequences on one rank (the
    # very thing that does not fit), and the engine's model runs slices of them.
    measure = (bool(autos) or cfg.planner.refuse_explicit) and cfg.sp_size == 1
    if cfg.sp_size > 1 and training_data is not None and rank == 0:
        logger.info("planner: activations are not measured under sequence parallelism; model states are checked")
    sample = first_sample(training_data, collate_fn) if measure else None
    if sample is not None:
        device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
        sample = _to(sample, device)
    profile, machine = _measure(model, cfg, world, local, sample, None, wrap_policy, None, True, bool(autos))
    runtime = machine.rss - profile.resident_bytes
    choices, candidates = _candidates(profile, machine, cfg, autos, runtime, wrap_policy, model, timed=bool(autos))
    machine, candidates, measured = _agree(machine, candidates, profile.activations.source == "measured")
    try:
        decision = _decision(choices, candidates, machine, cfg.planner.margin)
        if not autos and cfg.planner.refuse_explicit:
            check_explicit(decision.chosen, machine, whole_peak=measured)
    except ValueError as err:
        raise ValueError(f"the memory planner refuses this config: {err}") from None
    global _LAST
    _LAST = PlanResult(decision, profile, machine, choices, autos, cfg.planner.margin)
    if not autos:
        return {}
    if rank == 0:
        logger.info("planner: %s", decision.reason)
        logger.debug("planner:\n%s", _LAST.table())
    return _LAST.given()


def last_plan() -> PlanResult | None:
    """The plan (or check) the last ``initialize`` in this process made, for reports and
    benchmarks: its chosen candidate's parts are the predicted peak memory per rank."""
    return _LAST


_LAST: PlanResult | None = None


def _to(sample: Any, device: torch.device) -> Any:
    if isinstance(sample, torch.Tensor):
        return sample.to(device)
    if isinstance(sample, (list, tuple)):
        return type(sample)(_to(s, device) for s in sample) if not hasattr(sample, "_fields") else sample
    if isinstance(sample, dict):
        return {k: _to(v, device) for k, v in sample.items()}
    return sample


def _agree(machine: Machine, candidates: list[Candidate], measured: bool) -> tuple[Machine, list[Candidate], bool]:
    """What every rank decides from (see [Note: the planner at initialize]): the smallest
    limits of any rank, for each plan the version of the rank it fits worst (pipeline
    stages hold different layers), and whether every rank measured its activations (one
    rank's failed measurement leaves only the states checked); a no-op on one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return machine, candidates, measured
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (machine, candidates, measured))

    def smallest(limits: list[Limit | None]) -> Limit | None:
        present = [lim for lim in limits if lim is not None]
        return min(present, key=lambda lim: lim.bytes) if present else None

    machines = [m for m, _, _ in every]
    speeds = [m.disk_speed for m in machines if m.disk_speed is not None]
    agreed = dataclasses.replace(
        machine,
        host=smallest([m.host for m in machines]),
        device=smallest([m.device for m in machines]),
        disk=smallest([m.disk for m in machines]),
        disk_speed=min(speeds) if speeds else None,
    )
    merged = [max((c[i] for _, c, _ in every), key=lambda c: (ratio(c, agreed), c.time.total)) for i in range(len(candidates))]
    return agreed, merged, all(m for _, _, m in every)
