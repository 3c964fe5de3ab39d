"""The flops profiler's text report: a summary, the heaviest modules per depth, the tree;
and :class:`ModuleProfile`, the per-module record the profiler fills and the report reads.

Numbers print in human units (K, M, G, T; parameters with B for billions; durations in
s, ms, us) with at most two decimals, as DeepSpeed's profiler prints them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

@dataclass(frozen=True)
class ModuleProfile:
    """One module's numbers over the profiled window (inclusive of its submodules).

    ``name`` is the qualified name in the profiled module ("" for the root), ``depth`` its
    depth in the module tree (root 0). ``params`` are full parameter elements; ``fwd_flops``
    and ``bwd_flops`` are as measured (backward includes recomputes); ``fwd_latency_s``
    sums every forward call; ``calls`` counts them.
    """

    name: str
    class_name: str
    depth: int
    params: int
    fwd_flops: int
    bwd_flops: int
    fwd_latency_s: float
    calls: int

    @property
    def flops(self) -> int:
        return self.fwd_flops + self.bwd_flops

    @property
    def fwd_macs(self) -> int:
        return self.fwd_flops // 2

    @property
    def bwd_macs(self) -> int:
        return self.bwd_flops // 2

    @property
    def macs(self) -> int:
        return self.flops // 2

    @property
    def fwd_flops_per_s(self) -> float:
        """Achieved forward FLOP/s: forward FLOPs over forward latency (0 if not timed)."""
        return self.fwd_flops / self.fwd_latency_s if self.fwd_latency_s > 0 else 0.0


_WIDTH = 88


def human(value: float, unit: str = "", precision: int = 2) -> str:
    """``value`` scaled to K/M/G/T with ``unit`` after the prefix: ``human(2.1e9, "FLOPs")``
    is ``"2.1 GFLOPs"``."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{round(value / scale, precision):g} {prefix}{unit}"
    return f"{round(value, precision):g} {unit}".rstrip()


def format_params(count: int) -> str:
    """A parameter count: ``"1.2 M"``, ``"7 B"`` (billions as B, the usual model-size spelling)."""
    return human(count).replace(" G", " B")


def format_macs(macs: int) -> str:
    return human(macs, "MACs")


def format_seconds(seconds: float) -> str:
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if seconds >= scale:
            return f"{round(seconds / scale, 2):g} {unit}"
    return f"{round(seconds / 1e-6, 2):g} us" if seconds else "0 s"


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "0.00%"


def _rule(title: str) -> str:
    return f" {title} ".center(_WIDTH, "-")


def render_report(
    profiles: Sequence[ModuleProfile],
    module_depth: int,
    top_modules: int,
    detailed: bool,
    step_time_s: float | None,
) -> str:
    """The report over ``profiles`` (tree order, root first), as one string."""
    root = profiles[0]
    lines = [_rule("terascale flops profiler")]
    lines += _summary(root, step_time_s)
    max_depth = max(p.depth for p in profiles)
    depth = max_depth if module_depth == -1 else min(module_depth, max_depth)
    lines.append("")
    lines.append(_rule("aggregated profile per module"))
    lines += _aggregated(profiles, depth, top_modules)
    if detailed:
        lines.append("")
        lines.append(_rule("detailed profile per module"))
        lines.append("each module: params (share), forward + backward FLOPs = total (share), MACs,")
        lines.append("forward latency (share), forward FLOP/s. A module's numbers include its submodules';")
        lines.append("what a parent computes outside its submodules makes up the difference. Latencies are")
        lines.append("measured while counting, which adds a cost to every operation (most on small ones).")
        lines.append("")
        lines += _tree(profiles, root, depth)
    lines.append("-" * _WIDTH)
    return "\n".join(lines)


def _summary(root: ModuleProfile, step_time_s: float | None) -> list[str]:
    rows = [
        ("params", format_params(root.params)),
        ("forward FLOPs", human(root.fwd_flops, "FLOPs")),
        ("backward FLOPs (as measured, recompute included)", human(root.bwd_flops, "FLOPs")),
        ("total FLOPs", human(root.flops, "FLOPs")),
        ("forward MACs", format_macs(root.fwd_macs)),
        ("backward MACs", format_macs(root.bwd_macs)),
        ("total MACs", format_macs(root.macs)),
        ("forward latency", format_seconds(root.fwd_latency_s)),
        ("forward FLOP/s = forward FLOPs / forward latency", human(root.fwd_flops_per_s, "FLOP/s")),
    ]
    if step_time_s is not None:
        rows.append(("step time", format_seconds(step_time_s)))
        rows.append(("achieved FLOP/s = total FLOPs / step time", human(root.flops / step_time_s, "FLOP/s")))
    lines = [f"summary of {root.class_name} (MACs = FLOPs / 2; element-wise operations count zero)"]
    lines += [f"{label + ':':<60}{value}" for label, value in rows]
    return lines


def _aggregated(profiles: Sequence[ModuleProfile], depth: int, top_modules: int) -> list[str]:
    """Per depth, the module classes that hold the most params, FLOPs and forward latency
    (modules of one class at one depth summed)."""
    lines = [f"top {top_modules} module class(es) per depth by params, FLOPs (fwd + bwd) and forward latency:"]
    for d in range(depth + 1):
        by_class: dict[str, list[float]] = {}  # class -> [params, FLOPs, latency]
        for p in profiles:
            if p.depth == d:
                acc = by_class.setdefault(p.class_name, [0, 0, 0.0])
                acc[0] += p.params
                acc[1] += p.flops
                acc[2] += p.fwd_latency_s
        if not by_class:
            continue

        def top(k: int, fmt: Callable[[float], str]) -> str:
            ranked = sorted(by_class.items(), key=lambda item: item[1][k], reverse=True)[:top_modules]
            return ", ".join(f"{name}: {fmt(v[k])}" for name, v in ranked)

        lines.append(f"depth {d}:")
        lines.append(f"    params      - {top(0, format_params)}")
        lines.append(f"    FLOPs       - {top(1, lambda v: human(v, 'FLOPs'))}")
        lines.append(f"    fwd latency - {top(2, format_seconds)}")
    return lines


def _tree(profiles: Sequence[ModuleProfile], root: ModuleProfile, depth: int) -> list[str]:
    lines = []
    for p in profiles:
        if p.depth > depth:
            continue
        label = p.class_name if not p.name else f"({p.name.rsplit('.', 1)[-1]}) {p.class_name}"
        numbers = ", ".join(
            [
                f"{format_params(p.params)} params ({_share(p.params, root.params)})",
                f"{human(p.fwd_flops)} + {human(p.bwd_flops)} = {human(p.flops, 'FLOPs')}"
                f" ({_share(p.flops, root.flops)})",
                format_macs(p.macs),
                f"fwd {format_seconds(p.fwd_latency_s)} ({_share(p.fwd_latency_s, root.fwd_latency_s)})",
                human(p.fwd_flops_per_s, "FLOP/s"),
            ]
        )
        lines.append(f"{'  ' * p.depth}{label}: {numbers}")
    return lines
