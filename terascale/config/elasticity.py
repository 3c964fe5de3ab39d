"""DeepSpeed's ``elasticity`` section: one global batch size that many world sizes can run.

[Note: elastic batch sizes]
An elastic job may be rescheduled onto a different number of GPUs. Convergence is
unchanged only if the global batch (samples per optimizer step) stays the same, so the
global batch must split exactly as micro-batch × accumulation steps × data-parallel world
size for every world size the job may get. Given ``max_train_batch_size`` and the
acceptable ``micro_batch_sizes``, :func:`plan_elastic` picks the global batch the way
DeepSpeed does:

1. candidates: each micro batch, and their least common multiple, scaled by the largest
   highly composite number that keeps it ≤ ``max_train_batch_size`` (highly composite
   multipliers have many divisors, so the product divides into many world sizes);
2. a world size W is valid for a candidate B when B / W is a whole multiple of some micro
   batch and ``min_gpus`` ≤ W ≤ ``max_gpus``;
3. the candidate with the most valid world sizes wins; ties go to the larger candidate
   (``prefer_larger_batch``, the default) or the smaller.

Version 0.2 does this per node: a node holds ``num_gpus_per_node`` GPUs, i.e.
``num_gpus_per_node / model_parallel_size`` data-parallel ranks, the search runs over node
counts with the per-node share of ``max_train_batch_size``, and the result is scaled back
to ranks. At start-up, :func:`elastic_batch_sizes` takes the actual data-parallel world
size and picks the largest micro batch that divides its share, and the accumulation steps
that keep the global batch fixed.

Where this differs from DeepSpeed, on purpose: a world size outside the valid list is an
error here in both versions (DeepSpeed's 0.2 silently picks a different global batch for
it, which defeats the point of elasticity); the global batch never exceeds
``max_train_batch_size`` (released DeepSpeed versions could return the micro batches' least
common multiple when it was larger, fixed in DeepSpeed's main branch); ``max_gpus`` below
``num_gpus_per_node`` is an error (DeepSpeed then ignores the bound); a search that finds no
valid world size at all is an error (DeepSpeed returns an empty list).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import Field, PositiveInt, TypeAdapter, ValidationError, field_validator, model_validator

from terascale.config.batch import BatchSizes
from terascale.config.errors import ConfigError
from terascale.config.section import Section

VERSIONS = (0.1, 0.2)

# The highly composite numbers up to 720720 (OEIS A002182): each has more divisors than any
# smaller number. DeepSpeed scales with this same list and stops at 720720, so the
# multiplier stops there too (it matters only beyond a global batch of 720720 × micro).
HIGHLY_COMPOSITE = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040,
    7560, 10080, 15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320,
    221760, 277200, 332640, 498960, 554400, 665280, 720720,
)  # fmt: skip

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class ElasticityConfig(Section):
    """``elasticity``: a global batch size fixed across the world sizes a job may run on.

    ``max_train_batch_size`` and ``micro_batch_sizes`` are required when ``enabled``.
    ``min_time`` (minutes) is for the resource scheduler and changes no batch size.
    """

    enabled: bool = False
    max_train_batch_size: int | None = Field(None, gt=0)
    micro_batch_sizes: list[PositiveInt] | None = None
    min_gpus: int = Field(1, ge=1)
    max_gpus: int = Field(10000, ge=1)
    min_time: int | float = Field(0, ge=0)
    version: float = 0.2
    prefer_larger_batch: bool = True
    ignore_non_elastic_batch_info: bool = False
    num_gpus_per_node: int = Field(1, ge=1)
    model_parallel_size: int = Field(1, ge=1)
    # terascale's: a live elastic job ([Note: in-memory redundancy]) copies each rank's
    # state to a peer every this many optimizer steps (0: no copies; a lost node then
    # costs a return to the last checkpoint). Read whenever the live agent runs the job.
    mirror_interval_steps: int = Field(1, ge=0)

    @field_validator("version")
    @classmethod
    def _known_version(cls, value: float) -> float:
        if value not in VERSIONS:
            raise ValueError(f"expected 0.1 or 0.2 (the elasticity versions), got {value!r}")
        return value

    @model_validator(mode="after")
    def _consistent_when_enabled(self) -> ElasticityConfig:
        # A disabled section is inert, as in DeepSpeed, so only its value types are checked.
        if not self.enabled:
            return self
        problems = _problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def data_parallel_per_node(self) -> int:
        """Data-parallel ranks on one node (version 0.2): ``num_gpus_per_node / model_parallel_size``."""
        return self.num_gpus_per_node // self.model_parallel_size


def _problems(section: ElasticityConfig) -> list[str]:
    """What makes an enabled section unusable, one line each, naming the keys."""
    if section.max_train_batch_size is None or not section.micro_batch_sizes:
        missing = [
            key
            for key, value in (("max_train_batch_size", section.max_train_batch_size),
                               ("micro_batch_sizes", section.micro_batch_sizes))
            if not value
        ]  # fmt: skip
        return [f"elasticity.{key} is required (a non-empty value) when elasticity.enabled is true" for key in missing]
    problems = []
    if section.min_gpus > section.max_gpus:
        problems.append(
            f"elasticity.min_gpus {section.min_gpus} is greater than elasticity.max_gpus {section.max_gpus}"
        )
    mp, gpus = section.model_parallel_size, section.num_gpus_per_node
    if section.version == 0.1:
        if mp > 1:
            problems.append(
                f"elasticity.model_parallel_size {mp} needs elasticity.version 0.2 "
                "(version 0.1 has no model parallelism)"
            )
        cap, share = section.max_train_batch_size, ""
    else:
        if gpus % mp:
            problems.append(
                f"elasticity.num_gpus_per_node {gpus} is not divisible by elasticity.model_parallel_size {mp}"
            )
            return problems
        if section.max_gpus < gpus:
            problems.append(
                f"elasticity.max_gpus {section.max_gpus} is less than elasticity.num_gpus_per_node {gpus}: "
                "version 0.2 scales by whole nodes, and not one fits"
            )
        cap = section.max_train_batch_size // section.data_parallel_per_node
        share = (
            f" (its share per node: {section.max_train_batch_size} / {section.data_parallel_per_node} "
            f"data-parallel ranks per node = {cap})"
        )
    too_big = sorted({m for m in section.micro_batch_sizes if m > cap})
    if too_big:
        problems.append(
            f"elasticity.max_train_batch_size {section.max_train_batch_size} is too small{share} for "
            f"elasticity.micro_batch_sizes {too_big}; raise it or remove those micro batch sizes"
        )
    return problems


@dataclass(frozen=True)
class ElasticPlan:
    """The outcome of :func:`plan_elastic`: the global batch and where it can run.

    ``valid_world_sizes`` are data-parallel world sizes; the GPU counts are those times
    ``model_parallel_size`` (:attr:`valid_gpu_counts`). ``valid_node_counts`` is set for
    version 0.2 only (nodes of ``num_gpus_per_node`` GPUs).
    """

    train_batch_size: int
    valid_world_sizes: tuple[int, ...]
    micro_batch_sizes: tuple[int, ...]
    version: float
    model_parallel_size: int = 1
    num_gpus_per_node: int = 1
    valid_node_counts: tuple[int, ...] = ()

    @property
    def valid_gpu_counts(self) -> tuple[int, ...]:
        """GPU counts the job may run on: each valid world size × ``model_parallel_size``."""
        return tuple(w * self.model_parallel_size for w in self.valid_world_sizes)


def elasticity_requested(section: Any) -> bool:
    """Whether a raw (not yet validated) ``elasticity`` value has ``enabled`` true.

    ``"auto"`` resolution runs before validation and needs to know; a value that does not
    validate as a boolean counts as false here (validation reports it).
    """
    if not isinstance(section, Mapping):
        return False
    try:
        return TypeAdapter(bool).validate_python(section.get("enabled", False)) is True
    except ValidationError:
        return False


def plan_elastic(section: ElasticityConfig) -> ElasticPlan:
    """The global batch size and valid world sizes for an enabled ``elasticity`` section.

    See [Note: elastic batch sizes]. Raises ConfigError when the section is disabled or no
    world size in ``min_gpus``..``max_gpus`` can run any candidate batch.
    """
    if not section.enabled:
        raise ConfigError("elasticity.enabled is false; enable it to compute an elastic batch size")
    assert section.max_train_batch_size is not None and section.micro_batch_sizes  # the validator ensures it
    micros = tuple(sorted(set(section.micro_batch_sizes)))
    prefer_larger = section.prefer_larger_batch
    if section.version == 0.1:
        lo, hi = section.min_gpus, section.max_gpus
        found = _best_batch(micros, section.max_train_batch_size, lo, hi, prefer_larger)
        if found is None:
            raise _nothing_fits(str(section.max_train_batch_size), micros, "data-parallel ranks", lo, hi)
        return ElasticPlan(found[0], found[1], micros, 0.1)
    # Version 0.2 searches over nodes: each node carries `per_node` data-parallel ranks and
    # so `per_node` times the batch of one "node rank". DeepSpeed rounds the GPU bounds down
    # to whole nodes and never goes below one node; we do the same.
    per_node = section.data_parallel_per_node
    lo = max(1, section.min_gpus // section.num_gpus_per_node)
    hi = section.max_gpus // section.num_gpus_per_node
    cap = section.max_train_batch_size // per_node
    found = _best_batch(micros, cap, lo, hi, prefer_larger)
    if found is None:
        share = f"{cap} (the per-node share of max_train_batch_size)"
        raise _nothing_fits(share, micros, f"nodes of {section.num_gpus_per_node} GPUs", lo, hi)
    node_batch, nodes = found
    return ElasticPlan(
        train_batch_size=node_batch * per_node,
        valid_world_sizes=tuple(n * per_node for n in nodes),
        micro_batch_sizes=micros,
        version=0.2,
        model_parallel_size=section.model_parallel_size,
        num_gpus_per_node=section.num_gpus_per_node,
        valid_node_counts=nodes,
    )


def elastic_batch_sizes(plan: ElasticPlan, world_size: int) -> BatchSizes:
    """Micro-batch and accumulation steps that keep ``plan.train_batch_size`` on ``world_size``
    data-parallel ranks: the largest micro batch that divides each rank's share (DeepSpeed's
    choice: fewest accumulation steps).

    Raises ConfigError naming ``world_size`` and listing the valid ones when it is not valid.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"data-parallel world size must be a positive integer, got {world_size!r}")
    batch = plan.train_batch_size
    if world_size not in plan.valid_world_sizes:
        raise ConfigError(_invalid_world(plan, world_size))
    per_rank = batch // world_size
    micro = max(m for m in plan.micro_batch_sizes if per_rank % m == 0)
    steps = per_rank // micro
    assert micro * steps * world_size == batch, (plan, world_size)
    return BatchSizes(batch, micro, steps)


def resolve_elastic_batch(
    section: ElasticityConfig, batch_keys: Mapping[str, int | None], world_size: int
) -> BatchSizes:
    """The batch triplet an enabled ``elasticity`` section decides for ``world_size``
    data-parallel ranks (what ``Config.resolve_batch`` returns when elasticity is on).

    ``batch_keys`` are the config's own ``train_batch_size``, ``train_micro_batch_size_per_gpu``
    and ``gradient_accumulation_steps`` (None: not set). Set ones are an error unless
    ``ignore_non_elastic_batch_info`` is true, in which case the elastic values win.
    """
    check_batch_keys(section, batch_keys)
    return elastic_batch_sizes(plan_elastic(section), world_size)


def check_batch_keys(section: ElasticityConfig, batch_keys: Mapping[str, int | None]) -> None:
    """Raise ConfigError when the config sets batch sizes that an enabled elasticity section
    would override and ``ignore_non_elastic_batch_info`` is false (DeepSpeed's rule)."""
    if not section.enabled or section.ignore_non_elastic_batch_info:
        return
    given = [key for key in BATCH_KEYS if batch_keys.get(key) is not None]
    if given:
        raise ConfigError(
            f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} set (in the config, or by an integration "
            'for "auto"), but elasticity.enabled is true and elasticity decides the batch sizes; remove '
            f"{'it' if len(given) == 1 else 'them'}, or set elasticity.ignore_non_elastic_batch_info: true "
            "to let the elastic values win"
        )


def format_plan(plan: ElasticPlan, world_size: int | None = None) -> str:
    """The plan as the lines ``terascale elastic-config`` prints; with ``world_size`` (data-parallel
    ranks) also the micro-batch × accumulation split there. Raises ConfigError like
    :func:`elastic_batch_sizes` for a world size that is not valid."""
    lines = [
        f"elasticity version {plan.version}",
        f"global batch size (train_batch_size): {plan.train_batch_size}",
        f"micro batch sizes: {_join(plan.micro_batch_sizes)}",
        f"valid data-parallel world sizes: {_join(plan.valid_world_sizes)}",
    ]
    if plan.model_parallel_size > 1:
        gpus = _join(plan.valid_gpu_counts)
        lines.append(f"valid GPU counts (× model_parallel_size {plan.model_parallel_size}): {gpus}")
    if plan.version == 0.2:
        lines.append(f"valid node counts ({plan.num_gpus_per_node} GPUs per node): {_join(plan.valid_node_counts)}")
    if world_size is not None:
        batch = elastic_batch_sizes(plan, world_size)
        lines.append(
            f"data-parallel world size {world_size}: micro batch {batch.micro_batch_size} × gradient accumulation "
            f"steps {batch.gradient_accumulation_steps} × {world_size} ranks = {batch.train_batch_size}"
        )
    return "\n".join(lines)


# ---- the search ----------------------------------------------------------------------


def _candidates(micros: Sequence[int], cap: int) -> list[int]:
    """Each micro batch and their LCM, scaled by the largest highly composite multiplier that
    stays ≤ ``cap``; a base above ``cap`` only grows when scaled, so it yields nothing."""
    out = set()
    for base in (*micros, math.lcm(*micros)):
        if base <= cap:
            multiplier = max(h for h in HIGHLY_COMPOSITE if h <= cap // base)
            out.add(base * multiplier)
    return sorted(out)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _valid_worlds(batch: int, micros: Sequence[int], lo: int, hi: int) -> tuple[int, ...]:
    """World sizes W in [lo, hi] with ``batch`` / W a whole multiple of some micro batch."""
    return tuple(
        w for w in _divisors(batch) if lo <= w <= hi and any((batch // w) % m == 0 for m in micros)
    )


def _best_batch(
    micros: Sequence[int], cap: int, lo: int, hi: int, prefer_larger: bool
) -> tuple[int, tuple[int, ...]] | None:
    """The candidate batch with the most valid world sizes in [lo, hi] (ties: larger batch if
    ``prefer_larger`` else smaller), and those world sizes; None when no candidate has one."""
    best: tuple[int, tuple[int, ...]] | None = None
    for batch in _candidates(micros, cap):
        worlds = _valid_worlds(batch, micros, lo, hi)
        if not worlds:
            continue
        if best is None or len(worlds) > len(best[1]) or (
            len(worlds) == len(best[1]) and (batch > best[0] if prefer_larger else batch < best[0])
        ):
            best = (batch, worlds)
    return best


def _nothing_fits(cap: str, micros: Sequence[int], unit: str, lo: int, hi: int) -> ConfigError:
    return ConfigError(
        f"elasticity: no batch size ≤ {cap} made of elasticity.micro_batch_sizes {list(micros)} splits evenly "
        f"over any number of {unit} in {lo}..{hi}; raise elasticity.max_train_batch_size or widen "
        "elasticity.min_gpus..max_gpus"
    )


def _invalid_world(plan: ElasticPlan, world: int) -> str:
    batch = plan.train_batch_size
    per_node = plan.num_gpus_per_node // plan.model_parallel_size
    if plan.version == 0.2 and world % per_node:
        why = f"version 0.2 runs whole nodes of {per_node} data-parallel ranks"
    elif batch % world or not any((batch // world) % m == 0 for m in plan.micro_batch_sizes):
        why = (
            f"train_batch_size {batch} / {world} ranks is not a whole multiple of any of "
            f"elasticity.micro_batch_sizes {list(plan.micro_batch_sizes)}"
        )
    else:
        why = "it is outside elasticity.min_gpus..max_gpus"
    text = f"data-parallel world size {world} is not valid for elasticity ({why}); valid data-parallel world sizes: "
    text += _join(plan.valid_world_sizes)
    if plan.version == 0.2:
        text += f" (on {_join(plan.valid_node_counts)} nodes of {plan.num_gpus_per_node} GPUs"
        text += f" with model_parallel_size {plan.model_parallel_size})"
    return text


def _join(values: Sequence[int]) -> str:
    return ", ".join(str(v) for v in values)
