"""The pure side of ``terascale check``: its options, the metrics, and the verdict.

Every rank of a pre-flight check (:mod:`terascale.health.preflight`) fills one
:class:`RankReport`; rank 0 gathers them and this module turns the list into a table,
medians, outliers and an exit code. Nothing here imports torch or starts processes, so
the verdict is testable on made-up reports and the command line stays fast.

Outliers are judged per metric against the median over the ranks that measured it: a
rank below ``tolerance x median`` is named. Ranks with a failed measurement are named
too; both make the check fail (exit code 1), and the last line of the report names the
hosts to look at.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "COLLECTIVE_OPS",
    "GROUP_KINDS",
    "LOCAL_METRICS",
    "CheckOptions",
    "Metric",
    "Outlier",
    "RankReport",
    "bus_factor",
    "collective_metric",
    "exit_code",
    "failing_nodes",
    "find_outliers",
    "format_report",
    "format_table",
    "format_value",
    "medians",
    "metric_info",
    "ordered_metrics",
    "summary",
]


@dataclass(frozen=True)
class Metric:
    """A measured quantity: ``name`` (JSON key), ``label`` (table header), ``unit``, and
    ``description`` (how outlier lines name it)."""

    name: str
    label: str
    unit: str
    description: str


LOCAL_METRICS: tuple[Metric, ...] = (
    Metric("matmul_fp32", "fp32", "TFLOP/s", "fp32 matmul throughput"),
    Metric("matmul_bf16", "bf16", "TFLOP/s", "bf16 matmul throughput"),
    Metric("memory", "mem", "GB/s", "memory bandwidth"),
    Metric("h2d", "h2d", "GB/s", "host-to-device copy bandwidth"),
    Metric("d2h", "d2h", "GB/s", "device-to-host copy bandwidth"),
    Metric("nvme_write", "nvme w", "GB/s", "NVMe write bandwidth"),
    Metric("nvme_read", "nvme r", "GB/s", "NVMe read bandwidth"),
)
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter")
# world: every rank; node: the ranks of one node; cross: one rank per node (same local index).
GROUP_KINDS = ("world", "node", "cross")
_OP_LABELS = {"all_reduce": "ar", "all_gather": "ag", "reduce_scatter": "rs"}
_KIND_WORDS = {"world": "", "node": " within the node", "cross": " across nodes"}


def collective_metric(op: str, kind: str) -> str:
    """The metric name of collective ``op`` over groups of ``kind``, e.g. ``all_reduce_node``."""
    if op not in COLLECTIVE_OPS or kind not in GROUP_KINDS:
        raise ValueError(f"unknown collective {op!r} or group kind {kind!r}")
    return f"{op}_{kind}"


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth / algorithm bandwidth for ``op`` over ``n`` ranks:
    2(n-1)/n for all-reduce, (n-1)/n for all-gather and reduce-scatter (algorithm
    bandwidth = bytes of the full tensor / time), so every op reads as link speed."""
    if op not in COLLECTIVE_OPS or n < 1:
        raise ValueError(f"unknown collective {op!r} or group size {n}")
    return (2 if op == "all_reduce" else 1) * (n - 1) / n


def _all_metrics() -> dict[str, Metric]:
    out = {m.name: m for m in LOCAL_METRICS}
    for kind in GROUP_KINDS:
        for op in COLLECTIVE_OPS:
            name = collective_metric(op, kind)
            out[name] = Metric(name, f"{_OP_LABELS[op]} {kind}", "GB/s", f"{op} bus bandwidth{_KIND_WORDS[kind]}")
    return out


_METRICS = _all_metrics()


def metric_info(name: str) -> Metric:
    """The :class:`Metric` called ``name``; ``ValueError`` for an unknown name."""
    try:
        return _METRICS[name]
    except KeyError:
        raise ValueError(f"unknown metric {name!r}") from None


@dataclass
class RankReport:
    """What one rank measured: ``values`` (metric -> number), ``errors`` (metric -> the
    exception as text), ``skipped`` (metric -> why it was not measured) and free ``notes``."""

    rank: int
    host: str
    device: str = "cpu"
    node: str = ""
    values: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> RankReport:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


@dataclass(frozen=True)
class Outlier:
    """Rank ``rank`` on ``host`` measured ``value`` of ``metric``: ``fraction`` of the median."""

    rank: int
    host: str
    metric: str
    value: float
    median: float

    @property
    def fraction(self) -> float:
        return self.value / self.median

    def describe(self) -> str:
        m = metric_info(self.metric)
        return (f"rank {self.rank} (host {self.host}): {m.description} {format_value(self.value)} {m.unit}, "
                f"{self.fraction:.0%} of the median {format_value(self.median)} {m.unit}")


# ---------------------------------------------------------------------------
# options


@dataclass(frozen=True)
class CheckOptions:
    """The measurement options of ``terascale check``, shared by the command line and the
    per-rank program. ``size_mb=None`` lets each rank pick (32 on a CPU, 256 on a GPU)."""

    size_mb: float | None = None
    io_mb: int = 64
    repeats: int = 5
    tolerance: float = 0.7
    nvme_path: str | None = None
    json_path: str | None = None
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.size_mb is not None and not self.size_mb > 0:
            raise ValueError(f"--size-mb {self.size_mb}: must be positive")
        if self.io_mb < 1:
            raise ValueError(f"--io-mb {self.io_mb}: must be at least 1")
        if self.repeats < 1:
            raise ValueError(f"--repeats {self.repeats}: must be at least 1")
        if not 0.0 <= self.tolerance <= 1.0:
            raise ValueError(f"--tolerance {self.tolerance}: must be in [0, 1] (0 reports no outliers)")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout {self.timeout_s}: must be positive")

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Add ``--size-mb``, ``--io-mb``, ``--repeats``, ``--tolerance``, ``--nvme-path``,
        ``--json`` and ``--timeout`` to ``parser``."""
        p = parser.add_argument_group("measurements")
        p.add_argument("--size-mb", type=float, default=None, metavar="MB",
                       help="MiB per collective and memory-copy buffer (default: 32 on a CPU, 256 on a GPU)")
        p.add_argument("--io-mb", type=int, default=64, metavar="MB", help="MiB written and read per rank (default 64)")
        p.add_argument("--repeats", type=int, default=5, metavar="K",
                       help="timed repeats of each measurement; the best counts (default 5)")
        p.add_argument("--tolerance", type=float, default=0.7, metavar="F",
                       help="name ranks below F x the median of a metric (default 0.7; 0: never)")
        p.add_argument("--nvme-path", default=None, metavar="DIR",
                       help="directory whose disk the I/O test uses (default: a temporary directory "
                       "under the system temp dir); its test files are removed afterwards")
        p.add_argument("--json", dest="json_path", default=None, metavar="FILE", help="write all numbers to FILE")
        p.add_argument("--timeout", dest="timeout_s", type=float, default=120.0, metavar="S",
                       help="seconds a rank waits for the others in a collective (default 120)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CheckOptions:
        """From parsed arguments; paths are made absolute (ranks may run elsewhere)."""
        json_path = os.path.abspath(args.json_path) if args.json_path else None
        nvme = os.path.abspath(args.nvme_path) if args.nvme_path else None
        return cls(size_mb=args.size_mb, io_mb=args.io_mb, repeats=args.repeats, tolerance=args.tolerance,
                   nvme_path=nvme, json_path=json_path, timeout_s=args.timeout_s)

    def to_argv(self) -> list[str]:
        """The arguments that give these options to ``python -m terascale.health.preflight``."""
        argv = ["--io-mb", str(self.io_mb), "--repeats", str(self.repeats),
                "--tolerance", repr(self.tolerance), "--timeout", repr(self.timeout_s)]
        if self.size_mb is not None:
            argv += ["--size-mb", repr(self.size_mb)]
        if self.nvme_path is not None:
            argv += ["--nvme-path", self.nvme_path]
        if self.json_path is not None:
            argv += ["--json", self.json_path]
        return argv


# ---------------------------------------------------------------------------
# verdict


def ordered_metrics(reports: Sequence[RankReport]) -> list[str]:
    """Every metric any rank measured, failed or skipped, in the canonical order."""
    seen = {name for r in reports for name in (*r.values, *r.errors, *r.skipped)}
    return [name for name in _METRICS if name in seen]


def medians(reports: Sequence[RankReport]) -> dict[str, float]:
    """Metric -> the median of its values over the ranks that measured it."""
    out = {}
    for name in ordered_metrics(reports):
        values = [r.values[name] for r in reports if name in r.values]
        if values:
            out[name] = statistics.median(values)
    return out


def find_outliers(reports: Sequence[RankReport], tolerance: float) -> list[Outlier]:
    """Every (rank, metric) whose value is below ``tolerance x`` the metric's median, by rank."""
    meds = medians(reports)
    found = []
    for r in sorted(reports, key=lambda r: r.rank):
        for name, med in meds.items():
            value = r.values.get(name)
            if value is not None and med > 0 and value < tolerance * med:
                found.append(Outlier(r.rank, r.host, name, value, med))
    return found


def failing_nodes(reports: Sequence[RankReport], outliers: Sequence[Outlier]) -> dict[str, list[int]]:
    """Host -> its ranks that failed a measurement or were an outlier (hosts in rank order)."""
    bad = {r.rank: r.host for r in reports if r.errors}
    bad.update({o.rank: o.host for o in outliers})
    out: dict[str, list[int]] = {}
    for rank in sorted(bad):
        out.setdefault(bad[rank], []).append(rank)
    return out


def exit_code(reports: Sequence[RankReport], outliers: Sequence[Outlier]) -> int:
    """0 when no rank failed a measurement and none was an outlier, else 1."""
    return 1 if any(r.errors for r in reports) or outliers else 0


def format_value(value: float | None) -> str:
    """A number with about three significant digits, without exponents; ``-`` for none."""
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def format_table(reports: Sequence[RankReport]) -> str:
    """One row per rank (rank, host, every metric) and the medians at the bottom.

    A failed measurement shows ``ERR``, one not taken ``-``. The rank's own metrics always
    have a column; a collective only where some rank measured it or failed.
    """
    local = {m.name for m in LOCAL_METRICS}
    names = [n for n in ordered_metrics(reports) if n in local or any(n in r.values or n in r.errors for r in reports)]
    meds = medians(reports)
    header = ["rank", "host", *(metric_info(n).label for n in names)]
    rows = []
    for r in sorted(reports, key=lambda r: r.rank):
        cells = ["ERR" if n in r.errors else format_value(r.values.get(n)) for n in names]
        rows.append([str(r.rank), r.host, *cells])
    rows.append(["median", "", *(format_value(meds.get(n)) for n in names)])
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(row: list[str]) -> str:
        # text columns to the left, numbers to the right
        return "  ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    legend = ("TFLOP/s: fp32, bf16 matmul; GB/s: the rest. ar/ag/rs: all-reduce/all-gather/reduce-scatter "
              "bus bandwidth over the world, within a node, across nodes")
    rule = "-" * len(line(header))
    return "\n".join([line(header), rule, *(line(r) for r in rows[:-1]), rule, line(rows[-1]), legend])


def _rank_list(ranks: Sequence[int], world: int | None = None) -> str:
    if world is not None and world > 1 and len(ranks) == world:
        return "all ranks"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def format_report(reports: Sequence[RankReport], tolerance: float) -> tuple[str, int]:
    """The text rank 0 prints (table, skips, notes, failures, outliers, a last line naming the
    failing nodes) and the exit code."""
    outliers = find_outliers(reports, tolerance)
    lines = [format_table(reports)]
    world = len(reports)
    ranks_of: dict[tuple[str, str], list[int]] = {}
    for r in sorted(reports, key=lambda r: r.rank):
        for name, why in r.skipped.items():
            ranks_of.setdefault((name, why), []).append(r.rank)
    # One line per reason and set of ranks, naming all the metrics it skipped.
    skips: dict[tuple[str, tuple[int, ...]], list[str]] = {}
    for (name, why), ranks in ranks_of.items():
        skips.setdefault((why, tuple(ranks)), []).append(metric_info(name).label)
    if skips:
        lines.append("skipped:")
        lines += [f"  {', '.join(labels)} on {_rank_list(ranks, world)}: {why}" for (why, ranks), labels in skips.items()]
    notes: dict[str, list[int]] = {}
    for r in sorted(reports, key=lambda r: r.rank):
        for note in r.notes:
            notes.setdefault(note, []).append(r.rank)
    if notes:
        lines.append("notes:")
        lines += [f"  {_rank_list(rs, world)}: {note}" for note, rs in notes.items()]
    errors = [(r, n, e) for r in sorted(reports, key=lambda r: r.rank) for n, e in r.errors.items()]
    if errors:
        lines.append("failed measurements:")
        lines += [f"  rank {r.rank} (host {r.host}): {metric_info(n).description}: {e}" for r, n, e in errors]
    if outliers:
        lines.append(f"outliers (below {tolerance:.0%} of the median):")
        lines += [f"  {o.describe()}" for o in outliers]
    code = exit_code(reports, outliers)
    if code == 0:
        lines.append(f"terascale check: all {len(reports)} ranks healthy")
    else:
        bad = failing_nodes(reports, outliers)
        named = "; ".join(f"{host} ({_rank_list(ranks)})" for host, ranks in bad.items())
        lines.append(f"terascale check: FAILED on {len(bad)} node(s): {named}")
    return "\n".join(lines), code


def summary(reports: Sequence[RankReport], tolerance: float) -> dict:
    """Everything as JSON-ready data: per-rank reports, medians, outliers, failing nodes,
    the exit code, and each metric's unit."""
    outliers = find_outliers(reports, tolerance)
    names = ordered_metrics(reports)
    return {
        "world_size": len(reports),
        "tolerance": tolerance,
        "metrics": {n: {"unit": metric_info(n).unit, "description": metric_info(n).description} for n in names},
        "ranks": [r.to_dict() for r in sorted(reports, key=lambda r: r.rank)],
        "medians": medians(reports),
        "outliers": [{**dataclasses.asdict(o), "fraction": o.fraction} for o in outliers],
        "failing_nodes": failing_nodes(reports, outliers),
        "exit_code": exit_code(reports, outliers),
    }
