"""Build optimizers and LR schedules from a DeepSpeed config's ``optimizer`` and
``scheduler`` sections (``type`` + ``params``), with DeepSpeed's names and defaults.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from terascale.optim.compact import CompactAdam
from terascale.optim.cyclic import LRRangeTest, OneCycle
from terascale.optim.lamb import Lamb
from terascale.optim.lion import Lion
from terascale.optim.muon import ADAM_DEFAULTS, MUON_DEFAULTS, Muon
from terascale.optim.onebit import OneBitAdam
from terascale.optim.onebit_lamb import OneBitLamb
from terascale.optim.zoadam import ZeroOneAdam
from terascale.optim.schedulers import LRSchedule
from terascale.optim.warmup import WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["SUPPORTED_OPTIMIZERS", "SUPPORTED_SCHEDULERS", "build_optimizer", "build_scheduler"]

SUPPORTED_OPTIMIZERS = ("Adam", "AdamW", "Adam8bit", "AdamW8bit", "Lamb", "Lion", "Muon", "SGD", "OneBitAdam",
                        "ZeroOneAdam", "OneBitLamb")

# DeepSpeed optimizers that terascale deliberately does not provide (extension-bound);
# named in the error so users know it is not a typo.
_DEEPSPEED_ONLY_OPTIMIZERS = ("Adagrad", "MuAdam", "MuAdamW", "MuSGD")

# The 1-bit optimizers ([Note: optimizers that reduce their own gradients]): DeepSpeed's
# names (its config also accepts the spelling "OnebitAdam"; names are case-insensitive).
_ONEBIT_CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "onebitadam": OneBitAdam, "zerooneadam": ZeroOneAdam, "onebitlamb": OneBitLamb,
}

# Device types with a fused torch Adam/AdamW/SGD kernel for floating tensors.
_FUSED_DEVICE_TYPES = frozenset({"cpu", "cuda", "xpu", "mps", "hpu"})

_SCHEDULERS: dict[str, type[LRSchedule]] = {
    cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)
}
SUPPORTED_SCHEDULERS = tuple(_SCHEDULERS)


@dataclass(frozen=True)
class _Spec:
    """What one optimizer type accepts: its params with defaults, and no-op params."""

    defaults: Mapping[str, Any]
    ignored: frozenset[str] = frozenset()


_ADAM = _Spec(
    defaults={"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
              "amsgrad": False, "bias_correction": True, "adam_w_mode": True,
              "torch_adam": False},
    # FusedAdam's deprecated flag; zero_grad already sets grads to None by default.
    ignored=frozenset({"set_grad_none"}),
)
_COMPACT = _Spec(
    defaults={"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
              "adam_w_mode": True, "block_size": 256, "code": "power"},
)
# DeepSpeed's own defaults of the 1-bit optimizers; cuda_aware and comm_backend_name pick
# DeepSpeed's communication library, and terascale uses the process group's backend.
_ONEBIT_COMMON = {"lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8,
                  "eps_inside_sqrt": False, "weight_decay": 0.0, "amsgrad": False}
_ONEBIT_IGNORED = frozenset({"cuda_aware", "comm_backend_name"})
_SPECS: dict[str, _Spec] = {
    "adam": _ADAM,
    "adamw": _ADAM,
    "adam8bit": _COMPACT,
    "adamw8bit": _COMPACT,
    "lamb": _Spec(
        defaults={"lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8,
                  "eps_inside_sqrt": False, "weight_decay": 0.0, "max_coeff": 10.0,
                  "min_coeff": 0.01, "amsgrad": False},
    ),
    # DeepSpeed's FusedLion / DeepSpeedCPULion defaults; their kernel switches are no-ops here.
    "lion": _Spec(defaults={"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0},
                  ignored=frozenset({"set_grad_none", "fp32_optimizer_states"})),
    # DeepSpeed's MuonWithAuxAdam: lr (and weight_decay) for both kinds, muon_lr / adam_lr
    # over lr for one kind; None: that kind's own default (terascale.optim.muon).
    "muon": _Spec(defaults={"lr": None, "muon_lr": None, "adam_lr": None, "weight_decay": None, "momentum": None,
                            "ns_method": None, "nesterov": None, "ns_steps": None, "betas": None, "eps": None}),
    "sgd": _Spec(
        defaults={"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0,
                  "nesterov": False, "maximize": False},
    ),
    "onebitadam": _Spec(defaults={**_ONEBIT_COMMON, "freeze_step": 100000}, ignored=_ONEBIT_IGNORED),
    "zerooneadam": _Spec(
        defaults={**_ONEBIT_COMMON, "var_freeze_step": 100000, "var_update_scaler": 16,
                  "local_step_scaler": 32678, "local_step_clipper": 16},
        ignored=_ONEBIT_IGNORED,
    ),
    "onebitlamb": _Spec(
        defaults={**_ONEBIT_COMMON, "freeze_step": 100000, "max_coeff": 10.0, "min_coeff": 0.01,
                  "coeff_beta": 0.9, "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1},
        ignored=_ONEBIT_IGNORED,
    ),
}


def _nearest(name: str, choices: Iterable[str]) -> str | None:
    """The choice closest to ``name`` (case-insensitive), or None if nothing is close."""
    by_lower = {c.lower(): c for c in choices}
    match = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.4)
    return by_lower[match[0]] if match else None


def _suggest(name: str, choices: Iterable[str]) -> str:
    guess = _nearest(name, choices)
    return f" (did you mean {guess!r}?)" if guess else ""


def _check_params(kind: str, type_name: str, params: Mapping[str, Any],
                  valid: Iterable[str]) -> None:
    valid = sorted(valid)
    for key in params:
        if key not in valid:
            raise ValueError(
                f"{kind} {type_name!r} has no parameter {key!r}{_suggest(key, valid)}; "
                f"valid parameters: {', '.join(valid)}"
            )


def _materialize(parameters: Iterable[Any]) -> list[Any]:
    """List the tensors or param groups, with each group's ``params`` made a list.

    Both this module and the optimizer iterate them, so generators must be consumed once.
    """
    groups: list[Any] = []
    for item in parameters:
        if isinstance(item, Mapping):
            ps = item["params"]
            item = {**item, "params": [ps] if isinstance(ps, torch.Tensor) else list(ps)}
        groups.append(item)
    return groups


def _flat_params(groups: list[Any]) -> list[torch.Tensor]:
    """Every tensor in a materialized list of tensors or param-group dicts."""
    flat: list[torch.Tensor] = []
    for item in groups:
        flat.extend(item["params"] if isinstance(item, Mapping) else [item])
    return flat


def _fused_ok(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused kernel supports every tensor (floating, supported device)."""
    return bool(params) and all(
        type(p) in (torch.Tensor, torch.nn.Parameter)
        and torch.is_floating_point(p)
        and p.device.type in _FUSED_DEVICE_TYPES
        for p in params
    )


def _betas(value: Any, type_name: str) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"optimizer {type_name!r} betas must be a list of two numbers, "
                         f"got {value!r}")
    return float(value[0]), float(value[1])


def build_optimizer(name: str, params: Mapping[str, Any] | None,
                    parameters: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
                    *, group: ProcessGroup | None = None) -> Optimizer:
    """Create the optimizer a DeepSpeed config's ``optimizer`` section describes.

    ``name`` is ``optimizer.type`` (case-insensitive): ``Adam`` gives AdamW (decoupled
    weight decay) unless ``adam_w_mode`` is false, which gives classic Adam with L2
    weight decay added to the gradient; ``AdamW`` always gives AdamW; ``Lamb`` gives
    :class:`~terascale.optim.lamb.Lamb`; ``SGD`` gives ``torch.optim.SGD``; ``Adam8bit`` and
    ``AdamW8bit`` give :class:`~terascale.optim.compact.CompactAdam` (8-bit moments, with
    ``block_size`` and ``code``); ``OneBitAdam``, ``ZeroOneAdam`` and ``OneBitLamb`` give
    terascale's 1-bit optimizers (:mod:`terascale.optim.onebit`), which average over
    ``group`` (the data-parallel group; None: the default group). ``params``
    is ``optimizer.params``; omitted values take DeepSpeed's defaults (lr 1e-3, betas
    (0.9, 0.999), eps 1e-8, weight_decay 0). ``torch_adam: true`` selects torch's own
    defaults as DeepSpeed does (AdamW then decays by 0.01 unless weight_decay is given).
    Adam/AdamW/SGD use torch's fused kernel when every tensor in ``parameters`` (the
    fp32 master params, as tensors or param-group dicts) is floating point on a device
    that has one, else the multi-tensor (foreach) implementation.

    Raises:
        ValueError: unknown ``name`` (lists the supported names and the nearest one),
            an unknown or invalid param, ``max_grad_norm`` (DeepSpeed's
            ``gradient_clipping`` does that), or ``bias_correction: false`` for Adam.
    """
    type_name = str(name)
    key = type_name.lower()
    if key not in _SPECS:
        deepspeed_only = {n.lower() for n in _DEEPSPEED_ONLY_OPTIMIZERS}
        what = ("is a DeepSpeed optimizer that terascale does not provide"
                if key in deepspeed_only else "is not a known optimizer")
        guess = _nearest(type_name, SUPPORTED_OPTIMIZERS)
        hint = f"; nearest: {guess!r}" if guess else ""
        raise ValueError(f"optimizer type {type_name!r} {what}; supported: "
                         f"{', '.join(SUPPORTED_OPTIMIZERS)}{hint}")
    params = dict(params or {})
    if "max_grad_norm" in params:
        raise ValueError(
            f"optimizer {type_name!r}: 'max_grad_norm' is not an optimizer parameter in "
            f"DeepSpeed configs; remove it and set the top-level 'gradient_clipping' instead"
        )
    spec = _SPECS[key]
    _check_params("optimizer", type_name, params, [*spec.defaults, *spec.ignored])
    for ignored in spec.ignored:
        params.pop(ignored, None)
    options = {**spec.defaults, **params}

    groups = _materialize(parameters)
    use_fused = _fused_ok(_flat_params(groups))
    impl = {"fused": True} if use_fused else {"foreach": True}

    if key == "lamb":
        options["betas"] = _betas(options["betas"], type_name)
        return Lamb(groups, **options)
    if key in _ONEBIT_CLASSES:
        options["betas"] = _betas(options["betas"], type_name)
        return _ONEBIT_CLASSES[key](groups, **options, group=group)
    if key == "sgd":
        return torch.optim.SGD(groups, **options, **impl)
    if key == "lion":
        return Lion(groups, lr=options["lr"], betas=_betas(options["betas"], type_name),
                    weight_decay=options["weight_decay"])  # fmt: skip
    if key == "muon":
        return _muon(groups, options, group)
    if key in ("adam8bit", "adamw8bit"):
        # [Note: compact optimizer states]; Adam8bit follows Adam's adam_w_mode (default on).
        decoupled = key == "adamw8bit" or bool(options.pop("adam_w_mode"))
        options.pop("adam_w_mode", None)
        options["betas"] = _betas(options["betas"], type_name)
        return CompactAdam(groups, decoupled_weight_decay=decoupled, **options)

    if not options.pop("bias_correction"):
        raise ValueError(
            f"optimizer {type_name!r}: bias_correction=false is not supported for Adam "
            f"(torch's Adam always bias-corrects); remove it or set it to true"
        )
    adam_w_mode = bool(options.pop("adam_w_mode"))
    decoupled = key == "adamw" or adam_w_mode  # DeepSpeed: the AdamW name always decouples
    if options.pop("torch_adam") and "weight_decay" not in params:
        # DeepSpeed passes the params straight to torch.optim.AdamW/Adam then, so
        # torch's own default decay applies.
        options["weight_decay"] = 1e-2 if decoupled else 0.0
    options["betas"] = _betas(options["betas"], type_name)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls(groups, **options, **impl)


def _muon(groups: list[Any], options: dict[str, Any], group: ProcessGroup | None) -> Muon:
    """Muon's groups from the config's params, DeepSpeed's way: ``lr`` and ``weight_decay``
    reach both kinds, ``muon_lr`` / ``adam_lr`` override ``lr`` for theirs; a group's own
    options (from model_parameters) stand."""
    if groups and not isinstance(groups[0], Mapping):
        groups = [{"params": groups}]
    if any("use_muon" not in g for g in groups):
        raise ValueError(
            "optimizer 'Muon' needs param groups marked use_muon=True/False (terascale.initialize splits the "
            "model's parameters itself: pass model_parameters=None or groups without use_muon to it)"
        )
    given = {k: v for k, v in options.items() if v is not None}
    if "betas" in given:
        given["betas"] = _betas(given["betas"], "Muon")
    out = []
    for g in groups:
        base = MUON_DEFAULTS if g["use_muon"] else ADAM_DEFAULTS
        own_lr = given.get("muon_lr" if g["use_muon"] else "adam_lr", given.get("lr"))
        config = {k: v for k, v in given.items() if k in base}
        if own_lr is not None:
            config["lr"] = own_lr
        out.append({**config, **g})
    return Muon(out, group=group)


def build_scheduler(name: str, params: Mapping[str, Any] | None, optimizer: Any) -> LRSchedule:
    """Create the LR schedule a DeepSpeed config's ``scheduler`` section describes.

    ``name`` is ``scheduler.type`` (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle,
    LRRangeTest; case-insensitive) and ``params`` its ``params``, passed as keyword
    arguments after ``optimizer``. Constructing the schedule sets the starting LR in
    ``optimizer`` as DeepSpeed does.

    Raises:
        ValueError: unknown ``name`` or param (with the nearest valid one), or a
            required param (e.g. WarmupDecayLR's ``total_num_steps``) missing.
    """
    type_name = str(name)
    by_lower = {n.lower(): cls for n, cls in _SCHEDULERS.items()}
    cls = by_lower.get(type_name.lower())
    if cls is None:
        raise ValueError(f"scheduler type {type_name!r} is not supported"
                         f"{_suggest(type_name, SUPPORTED_SCHEDULERS)}; supported: "
                         f"{', '.join(SUPPORTED_SCHEDULERS)}")
    params = dict(params or {})
    signature = list(inspect.signature(cls.__init__).parameters.values())[2:]  # self, optimizer
    _check_params("scheduler", cls.__name__, params, [p.name for p in signature])
    missing = [p.name for p in signature
               if p.default is inspect.Parameter.empty and p.name not in params]
    if missing:
        raise ValueError(f"scheduler {cls.__name__!r} needs parameter(s) "
                         f"{', '.join(map(repr, missing))} in scheduler.params")
    return cls(optimizer, **params)
