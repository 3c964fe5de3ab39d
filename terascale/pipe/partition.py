"""Stage partitioning: which contiguous run of layers each (virtual) stage holds.

Every rank computes the same partition from the layer list alone, before any layer is
built. The result is a list of ``parts + 1`` boundaries: part ``j`` holds layers
``bounds[j]`` to ``bounds[j + 1] - 1`` and is never empty. DeepSpeed's methods:

- ``uniform``: equal layer counts, the first parts one more when they do not divide;
- ``parameters``: balanced trainable-parameter counts (the largest part as small as
  possible), counted without building the layers (:func:`~terascale.pipe.layers.count_parameters`);
- ``type:REGEX``: balanced counts of the layers whose class name matches ``REGEX``
  (case-insensitive search), e.g. ``type:TransformerBlock``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from terascale.pipe.layers import Layer, count_parameters, layer_type_name

METHODS = ("parameters", "uniform", "type:REGEX")


def partition_uniform(num_items: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` runs of nearly equal length over ``num_items`` items."""
    base, extra = divmod(num_items, parts)
    bounds = [0]
    for j in range(parts):
        bounds.append(bounds[-1] + base + (1 if j < extra else 0))
    return bounds


def min_max_split(n: int, parts: int, cost: Callable[[int, int], float]) -> tuple[float, list[int]]:
    """Split ``n`` items into ``parts`` non-empty runs minimising the largest
    ``cost(lo, hi)`` of a run (inf: not allowed); exact dynamic programming over split
    points, the later boundary winning ties. Returns (that cost, the boundaries)."""
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]  # best[k][i]: first i items in k runs
    split = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = -inf  # no run yet: no floor under the costs (they may be negative)
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], cost(j, i))
                if value <= best[k][i]:
                    best[k][i], split[k][i] = value, j
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(split[k][bounds[-1]])
    return best[parts][n], bounds[::-1]


def partition_balanced(weights: Sequence[int], parts: int) -> list[int]:
    """Boundaries of ``parts`` non-empty contiguous runs whose largest weight sum is as
    small as possible; among those, the one whose longest run is shortest (weightless
    layers - activations, norms without parameters - spread out instead of piling up)."""
    n = len(weights)
    assert 1 <= parts <= n, (parts, n)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    heaviest, _ = min_max_split(n, parts, lambda lo, hi: prefix[hi] - prefix[lo])
    inf = float("inf")
    _, bounds = min_max_split(n, parts, lambda lo, hi: hi - lo if prefix[hi] - prefix[lo] <= heaviest else inf)
    return bounds


def partition_layers(layers: Sequence[Layer], parts: int, method: str) -> list[int]:
    """The boundaries of ``parts`` parts of ``layers`` by ``method`` (see the module docstring)."""
    lowered = method.lower()
    if lowered == "uniform":
        return partition_uniform(len(layers), parts)
    if lowered == "parameters":
        return partition_balanced([count_parameters(layer) for layer in layers], parts)
    if lowered.startswith("type:"):
        pattern = method[len("type:") :]
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as e:
            raise ValueError(f"partition_method {method!r}: not a regular expression: {e}") from None
        weights = [1 if (name := layer_type_name(layer)) is not None and regex.search(name) else 0 for layer in layers]
        if not any(weights):
            names = sorted({n for n in map(layer_type_name, layers) if n is not None})
            raise ValueError(f"partition_method {method!r} matches no layer; the layer classes are {names}")
        return partition_balanced(weights, parts)
    raise ValueError(f"unknown partition_method {method!r}; use one of {', '.join(METHODS)}")
