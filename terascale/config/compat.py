"""What DeepSpeed accepts that a strict schema would refuse, rewritten before validation.

[Note: DeepSpeed compatibility]
Published ``ds_config.json`` files were written for many DeepSpeed versions. Before the
typed schema sees a config, :func:`upgrade` rewrites it to today's keys and returns one
note per change (the engine logs each once, at start-up):

- legacy spellings with one meaning today are moved to today's key (``max_grad_norm`` in
  the optimizer's params of DeepSpeed's own slides -> ``gradient_clipping``,
  ``"zero_optimization": true`` -> stage 1, ``fp32_allreduce`` -> ``communication_data_type``,
  ``"bfp16"`` -> ``"bf16"``, ...). A legacy key that disagrees with its replacement is an
  error naming both;
- keys DeepSpeed reads and ignores, and keys of DeepSpeed's loosely read sections (the top
  level, ``activation_checkpointing``, ``flops_profiler``, ``aio``, ``checkpoint``,
  ``data_types``) that are no setting at all (``"_comment"``, ``"cuda_visible_devices"``)
  are dropped with a note naming them. A key that is nearly the spelling of a setting
  (``"gradient_cliping"``) is kept, so validation refuses it and suggests the setting: a
  typo is an error, a foreign key is not;
- offload sections at a stage that cannot use them (parameters below stage 3, optimizer
  state at stage 0) are dropped with a note, as DeepSpeed ignores them.

Sections DeepSpeed validates strictly (``zero_optimization``, ``fp16``, ``bf16``, the
monitors) stay strict here: an unknown key there is an error.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from terascale.config.errors import ConfigError
from terascale.config.paths import MISSING as _MISSING
from terascale.config.paths import get as _get
from terascale.config.paths import put as _put
# A foreign key this close to a setting's name is taken for a typo of it (an error).
_TYPO_CUTOFF = 0.85


@dataclass(frozen=True)
class _Move:
    """``old`` (a dotted key path) now lives at ``new``; ``convert`` maps its value
    (``_MISSING``: the old value asks for nothing)."""

    old: str
    new: str
    meaning: str
    convert: Callable[[Any], Any] = lambda value: value


def _pop(data: dict[str, Any], path: str) -> None:
    _put(data, path, _MISSING)


def _fp32_if_true(value: Any) -> Any:
    # Only ``true`` asks for something; ``false`` meant "reduce in the gradients' dtype",
    # which is what an absent communication_data_type means.
    return "fp32" if value is True else _MISSING


_MOVES: tuple[_Move, ...] = (
    _Move(
        "optimizer.params.max_grad_norm",
        "gradient_clipping",
        "clip the global gradient norm (DeepSpeed's engine does it, not the optimizer)",
    ),
    _Move("fp32_allreduce", "communication_data_type", "reduce gradients in fp32", _fp32_if_true),
    _Move("allreduce_always_fp32", "communication_data_type", "reduce gradients in fp32", _fp32_if_true),
    _Move("zero_reduce_scatter", "zero_optimization.reduce_scatter", "reduce gradients with reduce-scatter"),
)

# Keys DeepSpeed no longer reads and that change nothing here: (path, why it is safe to drop).
_DROPPED: tuple[tuple[str, str], ...] = (
    ("fp16.opt_level", "Apex AMP's option level; fp16 here is DeepSpeed's own"),
    ("fp16.fp16_scale_tolerance", "an old loss-scaler option DeepSpeed no longer reads"),
    ("fp16.fp16", "a duplicate of fp16.enabled written by old autotuning configs"),
    *(
        (f"{section}.{key}", "bf16 needs no loss scaling")
        for section in ("bf16", "bfloat16")
        for key in ("loss_scale", "loss_scale_window", "hysteresis", "consecutive_hysteresis", "min_loss_scale",
                    "initial_scale_power")  # fmt: skip
    ),
)


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


def upgrade(
    data: dict[str, Any], lenient: Mapping[str, Sequence[str]] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """``data`` rewritten as ``[Note: DeepSpeed compatibility]`` says (a copy; ``data`` is
    not changed), and one note per change.

    ``lenient`` maps each loosely read section ("" for the top level) to its valid keys;
    other keys there are dropped unless they look like a typo of a valid one.
    Raises ConfigError naming both keys when a legacy key and its replacement disagree.
    """
    out = copy.deepcopy(data)
    notes: list[str] = []
    problems: list[str] = []
    _legacy_zero_bool(out, notes)
    for move in _MOVES:
        old = _get(out, move.old)
        if old is _MISSING:
            continue
        _pop(out, move.old)
        value = move.convert(old)
        if value is _MISSING:
            notes.append(f"{move.old}: {_fmt(old)} is a legacy key; it asks for nothing and is ignored")
            continue
        given = _get(out, move.new)
        if given is not _MISSING and given != value:
            problems.append(
                f"{move.old} {_fmt(old)} (legacy: {move.meaning}) and {move.new} {_fmt(given)} disagree; "
                f"remove {move.old} and keep {move.new}"
            )
            continue
        _put(out, move.new, value)
        notes.append(f"{move.old}: {_fmt(old)} is a legacy key; read as {move.new}: {_fmt(value)} ({move.meaning})")
    for path, why in _DROPPED:
        value = _get(out, path)
        if value is not _MISSING:
            _pop(out, path)
            notes.append(f"{path}: {_fmt(value)} is ignored ({why})")
    _legacy_fp16_type(out, notes, problems)
    if "bfloat16" in out and "bf16" not in out:
        out["bf16"] = out.pop("bfloat16")
        notes.append("bfloat16: DeepSpeed's old name of the bf16 section; read as bf16")
    if out.get("communication_data_type") == "bfp16":
        out["communication_data_type"] = "bf16"
        notes.append("communication_data_type: 'bfp16' is DeepSpeed's old spelling of 'bf16'; read as that")
    _offload_the_stage_cannot_use(out, notes)
    for section, valid in (lenient or {}).items():
        _drop_foreign_keys(out, section, valid, notes)
    if problems:
        raise ConfigError(problems)
    return out, notes


def _legacy_zero_bool(out: dict[str, Any], notes: list[str]) -> None:
    """DeepSpeed's first format: ``"zero_optimization": true`` (stage 1, with the top-level
    ``allgather_size`` as its all-gather bucket) or ``false`` (stage 0)."""
    zero = out.get("zero_optimization", _MISSING)
    size = out.pop("allgather_size", _MISSING)
    if isinstance(zero, bool):
        out["zero_optimization"] = {"stage": 1 if zero else 0}
        notes.append(
            f"zero_optimization: {_fmt(zero)} is DeepSpeed's legacy spelling of zero_optimization.stage "
            f"{1 if zero else 0}; read as that"
        )
        if zero and size is not _MISSING:
            out["zero_optimization"]["allgather_bucket_size"] = size
            notes.append(f"allgather_size: {_fmt(size)} is a legacy key; read as zero_optimization.allgather_bucket_size")
            return
    if size is not _MISSING:
        notes.append(f"allgather_size: {_fmt(size)} is read by DeepSpeed only with \"zero_optimization\": true; ignored")


def _legacy_fp16_type(out: dict[str, Any], notes: list[str], problems: list[str]) -> None:
    """GPT-NeoX writes ``"fp16": {"type": ...}``, which DeepSpeed read as plain fp16."""
    value = _get(out, "fp16.type")
    if value is _MISSING:
        return
    _pop(out, "fp16.type")
    if str(value).lower() in ("fp16", "float16", "half"):
        notes.append(f"fp16.type: {_fmt(value)} is ignored (fp16.enabled says whether fp16 is on)")
    else:
        problems.append(f"fp16.type: {_fmt(value)} is not an fp16 setting; for bf16 write \"bf16\": {{\"enabled\": true}}")


def _stage_of(out: dict[str, Any]) -> int | None:
    stage = _get(out, "zero_optimization.stage")
    if stage is _MISSING:
        return 0
    try:
        return int(stage)
    except (TypeError, ValueError):
        return None  # "auto" or invalid: decided (or refused) later


def _offload_the_stage_cannot_use(out: dict[str, Any], notes: list[str]) -> None:
    stage = _stage_of(out)
    if stage is None:
        return
    for section, needs in (("offload_param", 3), ("offload_optimizer", 1)):
        device = _get(out, f"zero_optimization.{section}.device")
        if device in ("cpu", "nvme") and stage < needs:
            _pop(out, f"zero_optimization.{section}")
            what = "parameters" if section == "offload_param" else "optimizer state"
            notes.append(
                f"zero_optimization.{section}: device {device!r} is ignored at stage {stage}, as DeepSpeed ignores "
                f"it (only stage {needs}{'' if needs == 3 else '-3'} partitions {what}); set stage to offload"
            )


def _drop_foreign_keys(out: dict[str, Any], section: str, valid: Sequence[str], notes: list[str]) -> None:
    node = out if not section else out.get(section)
    if not isinstance(node, dict):
        return
    for key in [k for k in node if k not in valid]:
        if difflib.get_close_matches(key, valid, n=1, cutoff=_TYPO_CUTOFF):
            continue  # a typo of a setting: validation refuses it and names the setting
        del node[key]
        where = f"{section}.{key}" if section else key
        nearest = difflib.get_close_matches(key, valid, n=1, cutoff=0.8)
        hint = f" (the nearest setting is {nearest[0]!r})" if nearest else ""
        notes.append(f"{where}: not a DeepSpeed setting; ignored, as DeepSpeed ignores it{hint}")
