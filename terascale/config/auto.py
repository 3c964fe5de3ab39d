"""``"auto"`` config values, resolved by terascale with the meaning DeepSpeed users know.

[Note: auto values]
Configs written for the Hugging Face Trainer (and Lightning, accelerate) say ``"auto"``
for values the integration fills in: the batch triplet, clipping, optimizer and scheduler
parameters, precision, and three ZeRO sizes derived from the model's hidden size.
terascale resolves them in three layers, so that a config means the same everywhere:

1. an integration *gives* values (:class:`Given`: the Trainer's ``learning_rate`` for
   ``optimizer.params.lr``, ...). A given value fills an ``"auto"``; an explicit value
   that disagrees with a given one marked ``match`` is an error naming both (what the
   Trainer's DeepSpeed integration does). A key absent from the config stays absent
   (``"auto"`` is how a config asks for the integration's value), unless the value is
   marked ``absent`` (Lightning's DeepSpeed strategy fills absent keys).
2. what the config and the run determine by themselves: the batch triplet from its other
   members and the world size; ``reduce_bucket_size`` = hidden²,
   ``stage3_prefetch_bucket_size`` = 0.9·hidden², ``stage3_param_persistence_threshold``
   = 10·hidden (hidden from the model's config, else its largest square weight);
   ``warmup_min_lr`` = 0 and ``warmup_max_lr`` = the optimizer's lr; ``betas``, ``eps``
   and ``weight_decay`` = the optimizer's defaults.
3. anything else is an error naming the key and what would set it.

``Config.load`` keeps the positions of ``"auto"`` (reading them as absent, so a config
that is only inspected still validates); ``Config.resolve`` (here: :func:`resolve_autos`)
gives the values, and the engine refuses a config with unresolved ones.

The memory planner owns five keys (``PLANNED_KEYS``; [Note: planned values] in
``terascale.plan``): ``terascale.initialize`` chooses them from the model and the
machine and gives them as in layer 1. An integration that resolves a config before
``initialize`` (the Trainer, Lightning) passes them in ``AutoContext.defer``: they stay
``"auto"`` for the planner. Resolved without the planner (``planner.enabled: false``, or
``Config.resolve`` alone), ``"auto"`` in ``zero_optimization`` is DeepSpeed's default as
below, and a planned key elsewhere is derived as below or is an error.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from terascale.config.batch import resolve_batch_sizes
from terascale.config.elasticity import elasticity_requested
from terascale.config.errors import ConfigError
from terascale.config.paths import MISSING as _MISSING
from terascale.config.paths import get as _get
from terascale.config.paths import put as _set

AUTO = "auto"
# The "auto" values terascale.initialize's memory planner chooses ([Note: planned values]).
PLANNED_KEYS = (
    "zero_optimization.stage",
    "zero_optimization.offload_optimizer.device",
    "zero_optimization.offload_param.device",
    "train_micro_batch_size_per_gpu",
    "activation_checkpointing.policy",
)

_TRIPLET = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# Both spellings DeepSpeed accepts (JSON alias and field name) of the hidden-size keys.
_HIDDEN_RULES: dict[str, tuple[float, int, str]] = {
    "zero_optimization.reduce_bucket_size": (1.0, 2, "hidden²"),
    "zero_optimization.stage3_prefetch_bucket_size": (0.9, 2, "0.9·hidden²"),
    "zero_optimization.prefetch_bucket_size": (0.9, 2, "0.9·hidden²"),
    "zero_optimization.stage3_param_persistence_threshold": (10.0, 1, "10·hidden"),
    "zero_optimization.param_persistence_threshold": (10.0, 1, "10·hidden"),
}
# "auto" here means "what the key's absence means": the optimizer's own default.
_OPTIMIZER_DEFAULTS = ("optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay")

# What sets each key in the integrations, for the error when nothing here can.
_SET_BY = {
    "train_batch_size": "per_device_train_batch_size × gradient_accumulation_steps × data-parallel size",
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size (Lightning: the DataLoader's batch_size)",
    "gradient_accumulation_steps": "gradient_accumulation_steps (Lightning: accumulate_grad_batches)",
    "gradient_clipping": "max_grad_norm (Lightning: gradient_clip_val)",
    "optimizer.params.lr": "learning_rate",
    "scheduler.params.warmup_max_lr": "learning_rate",
    "scheduler.params.warmup_num_steps": "warmup_steps / warmup_ratio",
    "scheduler.params.total_num_steps": "max_steps / num_train_epochs",
    "fp16.enabled": "fp16 (Lightning: precision='16-mixed')",
    "bf16.enabled": "bf16 (Lightning: precision='bf16-mixed')",
}


@dataclass(frozen=True)
class Given:
    """A value an integration supplies for one key path, and what it comes from."""

    value: Any
    source: str  # e.g. "TrainingArguments.learning_rate"
    match: bool = True  # an explicit config value must equal it
    absent: bool = False  # also fill the key where the config leaves it out (Lightning's way)


@dataclass(frozen=True)
class AutoContext:
    """What ``"auto"`` values are derived from: the data-parallel world size, the model
    (for its hidden size) and the values an integration gives (key path -> Given).
    ``defer``: key paths whose ``"auto"`` stays for a later resolution if nothing given
    fills it (the planner's keys, deferred to ``initialize``)."""

    world_size: int
    model: nn.Module | None = None
    given: Mapping[str, Given] = field(default_factory=dict)
    defer: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Resolved:
    """One ``"auto"`` that got a value, and why that value."""

    path: str
    value: Any
    why: str

    def __str__(self) -> str:
        shown = "<the default>" if self.value is _MISSING else repr(self.value)
        return f"{self.path}={shown} ({self.why})"


def find_autos(data: Mapping[str, Any], skip: Iterable[str] = (), prefix: str = "") -> list[str]:
    """Dotted paths of every ``"auto"`` value in ``data`` (nested objects included), except
    under the paths ``skip`` (sections kept as plain dicts, where "auto" is data, such as
    ``pipeline.stages``)."""
    skipped = set(skip)
    out = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if path in skipped:
            continue
        if isinstance(value, str) and value == AUTO:
            out.append(path)
        elif isinstance(value, Mapping):
            out.extend(find_autos(value, skipped, f"{path}."))
    return out


def without(data: Mapping[str, Any], paths: Iterable[str]) -> dict[str, Any]:
    """A deep copy of ``data`` with the keys at ``paths`` removed."""
    out = copy.deepcopy(dict(data))
    for path in paths:
        _set(out, path, _MISSING)
    return out


def hidden_size(model: nn.Module | None) -> int | None:
    """The model's hidden size as the Trainer's DeepSpeed integration reads it (the config's
    ``hidden_size``, the largest of ``hidden_sizes``, or ``d_model`` / ``n_embd``, also
    inside ``text_config``), else the side of the model's largest square weight."""
    if model is None:
        return None
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        sizes = getattr(cfg, "hidden_sizes", None)
        if isinstance(sizes, (list, tuple)) and sizes:
            return int(max(sizes))
        for name in ("hidden_size", "d_model", "n_embd"):
            value = getattr(cfg, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    square = [p.shape[0] for p in model.parameters() if p.dim() == 2 and p.shape[0] == p.shape[1]]
    return int(max(square)) if square else None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def resolve_autos(data: dict[str, Any], autos: Sequence[str], ctx: AutoContext) -> tuple[dict[str, Any], list[Resolved]]:
    """``data`` (a raw config dict whose ``"auto"`` values are at ``autos``) with every
    ``"auto"`` replaced by its value (see ``[Note: auto values]``), and what was resolved.

    Raises ConfigError listing every ``"auto"`` that cannot be derived and every explicit
    value that disagrees with one the integration gives.
    """
    r = _Resolution(copy.deepcopy(data), autos)
    # 1. What the integration gives.
    for path, given in ctx.given.items():
        current = _get(r.out, path)
        if current is _MISSING:
            if given.absent:
                _set(r.out, path, given.value)
                r.done.append(Resolved(path, given.value, f"{given.source} (not in the config)"))
            continue
        if path in r.pending:
            r.fill(path, given.value, given.source)
        elif given.match and not _same(current, given.value):
            r.problems.append(
                f"{path}: the config says {current!r} but {given.source} is {given.value!r}; "
                'make them agree or write "auto"'
            )
    # Deferred keys stay "auto" for a later resolution (the planner's, at initialize).
    for path in [p for p in r.pending if p in ctx.defer]:
        r.pending.remove(path)
    # 2. What the config and the run determine.
    r.triplet(ctx.world_size)
    hidden: int | None = None
    for path in [p for p in r.pending if p in _HIDDEN_RULES]:
        factor, power, formula = _HIDDEN_RULES[path]
        hidden = hidden if hidden is not None else hidden_size(ctx.model)
        if hidden is None:
            r.fail(path, f'"auto" is {formula}, but the model\'s hidden size is unknown (its config has no '
                         "hidden_size, d_model or n_embd and it has no square weight); give a number")
        else:
            r.fill(path, int(factor * hidden**power), f"{formula}, hidden size {hidden}")
    for path in [p for p in r.pending if p in _OPTIMIZER_DEFAULTS]:
        r.fill(path, _MISSING, "the optimizer's default")
    if "scheduler.params.warmup_min_lr" in r.pending:
        r.fill("scheduler.params.warmup_min_lr", 0, "as the Trainer sets it")
    lr = _get(r.out, "optimizer.params.lr")
    if "scheduler.params.warmup_max_lr" in r.pending and _is_number(lr):
        r.fill("scheduler.params.warmup_max_lr", lr, "optimizer.params.lr")
    if "steps_per_print" in r.pending:
        r.fill("steps_per_print", None, "never, as accelerate sets it: the training loop reports progress")
    # DeepSpeed reads "auto" in its zero_optimization section as the setting's default.
    for path in [p for p in r.pending if p.startswith("zero_optimization.")]:
        r.fill(path, _MISSING, "DeepSpeed's default: DeepSpeed reads \"auto\" in zero_optimization as that")
    # 3. The rest cannot be derived.
    for path in list(r.pending):
        if path in _SET_BY:
            r.fail(path, f'"auto" cannot be derived here; give a value (the Hugging Face Trainer integration '
                         f"fills it from {_SET_BY[path]})")
        elif path in PLANNED_KEYS:
            r.fail(path, '"auto" is chosen by the memory planner in terascale.initialize (planner.enabled); '
                         "without it, give a value")
        else:
            r.fail(path, '"auto" is not a value terascale can resolve for this key; give a value')
    if r.problems:
        raise ConfigError(r.problems)
    return r.out, r.done


class _Resolution:
    """The state of one :func:`resolve_autos`: the dict being filled, the ``"auto"``
    paths still open, what was resolved and what could not be."""

    def __init__(self, out: dict[str, Any], autos: Sequence[str]) -> None:
        self.out = out
        self.pending = list(dict.fromkeys(autos))
        self.done: list[Resolved] = []
        self.problems: list[str] = []

    def fill(self, path: str, value: Any, why: str) -> None:
        _set(self.out, path, value)
        self.done.append(Resolved(path, value, why))
        self.pending.remove(path)

    def fail(self, path: str, why: str) -> None:
        self.problems.append(f"{path}: {why}")
        self.pending.remove(path)

    def triplet(self, world: int) -> None:
        """Derive the batch triplet's ``"auto"`` members from the others (DeepSpeed's rules)."""
        autos = [p for p in _TRIPLET if p in self.pending]
        if not autos:
            return
        if elasticity_requested(_get(self.out, "elasticity")):
            # "auto" asks the system to decide, and with elasticity on it decides at start-up
            # for the actual world size (Config.resolve_batch): leave the keys absent.
            for path in autos:
                self.fill(path, _MISSING, "decided by elasticity for the data-parallel world size")
            return
        known = {key: None if key in autos else _get(self.out, key) for key in _TRIPLET}
        known = {key: None if v is _MISSING else v for key, v in known.items()}
        if known["train_batch_size"] is None and known["train_micro_batch_size_per_gpu"] is None:
            for path in autos:
                self.fail(path, '"auto" cannot be derived: give train_batch_size or train_micro_batch_size_per_gpu '
                                f"(the Hugging Face Trainer integration fills it from {_SET_BY[path]})")
            return
        try:
            sizes = resolve_batch_sizes(
                known["train_batch_size"], known["train_micro_batch_size_per_gpu"],
                known["gradient_accumulation_steps"], world,
            )  # fmt: skip
        except ConfigError as err:
            for path in autos:
                self.fail(path, f'"auto" cannot be derived: {"; ".join(err.problems)}')
            return
        derived = dict(zip(_TRIPLET, (sizes.train_batch_size, sizes.micro_batch_size, sizes.gradient_accumulation_steps)))
        for path in autos:
            self.fill(path, derived[path], f"from the other batch sizes and data-parallel world size {world}")


def _same(a: Any, b: Any) -> bool:
    """Equal as config values: numbers by value (1 == 1.0), lists element by element."""
    if _is_number(a) and _is_number(b):
        return float(a) == float(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b
