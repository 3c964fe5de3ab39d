"""Dotted key paths (``"zero_optimization.offload_param.device"``) into a raw config dict."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MISSING: Any = object()  # what get() returns for a path the dict does not hold


def get(data: Mapping[str, Any], path: str) -> Any:
    """The value at ``path``, or :data:`MISSING`."""
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return MISSING
        node = node[part]
    return node


def put(data: dict[str, Any], path: str, value: Any) -> None:
    """Set ``path`` to ``value``, creating objects on the way; :data:`MISSING` removes it."""
    *parents, last = path.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    if value is MISSING:
        node.pop(last, None)
    else:
        node[last] = value
