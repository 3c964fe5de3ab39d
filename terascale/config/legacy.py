"""Legacy spellings of DeepSpeed settings, rewritten to today's keys before validation.

Configs copied from older DeepSpeed tutorials and projects use keys that DeepSpeed has
since renamed or refuses (the BERT and GPT-2 configs of DeepSpeed's own slides put
``max_grad_norm`` in the optimizer's params). Where an old spelling has exactly one
meaning today, :func:`upgrade_legacy` rewrites it and returns one note per rewrite (the
engine logs each once); where the old and the new key are both given and disagree, it is
an error naming both, since either could be the one the user meant.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from terascale.config.errors import ConfigError

_MISSING = object()


@dataclass(frozen=True)
class _Move:
    """``old`` (a dotted key path) now lives at ``new``; ``convert`` maps its value."""

    old: str
    new: str
    meaning: str
    convert: Callable[[Any], Any] = lambda value: value


def _get(data: dict[str, Any], path: str) -> Any:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _pop(data: dict[str, Any], path: str) -> None:
    *parents, last = path.split(".")
    node: Any = data
    for part in parents:
        node = node[part]
    del node[last]


def _put(data: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


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
)


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


def upgrade_legacy(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``data`` with legacy keys rewritten (a copy; ``data`` is not changed), and one note
    per rewrite saying what became what.

    Raises ConfigError naming both keys when a legacy key and its replacement are both
    given with different values.
    """
    out = copy.deepcopy(data)
    notes: list[str] = []
    problems: list[str] = []
    zero = out.get("zero_optimization", _MISSING)
    if isinstance(zero, bool):
        out["zero_optimization"] = {"stage": 1 if zero else 0}
        notes.append(
            f"zero_optimization: {_fmt(zero)} is DeepSpeed's legacy spelling of "
            f"zero_optimization.stage {1 if zero else 0}; read as that"
        )
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
    if problems:
        raise ConfigError(problems)
    return out, notes
