"""``terascale report RUN_DIR``: an HTML page of plots from what the CSV monitor wrote.

The CSV monitor (``csv_monitor: {enabled, output_path, job_name}``) writes one file per
metric, ``<output_path>/<job_name>/<name with "/" as "_">.csv``, a ``step,<name>`` header
and ``x,value`` rows where x is the global sample count. :func:`build_report` reads such a
folder (or its parent holding exactly one), draws loss, optimizer state, throughput, MFU,
memory per rank, the time breakdown per step, communication bandwidth and stragglers, and
writes ``report.html`` plus one PNG per plot. ``compare=`` overlays a second run on every
plot and adds its values and the ratio to the tables.

The page references its PNGs by relative path instead of embedding them as base64: the
PNGs are deliverables of their own (pasted into issues and slides), embedding would store
every image twice and make the HTML a third larger; the output folder is the
self-contained unit and can be moved or zipped as a whole.

A metric the run did not log is left out of its plot and listed under it, so a report of
an older run, or of a run without ``wall_clock_breakdown`` or the comms logger, still works.
"""

from __future__ import annotations

import csv
import datetime as _dt
import html
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Run", "Series", "build_report", "find_run_dir", "load_run"]

LOSS = "Train/Samples/train_loss"
OPTIM = ("Train/Samples/lr", "Train/Samples/grad_norm", "Train/Samples/loss_scale")
THROUGHPUT = ("Throughput/samples_per_s", "Throughput/tokens_per_s", "Throughput/tflops")
MFU = "Throughput/mfu"
PHASES = ("Time/forward_ms", "Time/backward_ms", "Time/step_ms")
WAITS = ("Time/grad_reduce_ms", "Time/param_gather_ms", "Time/offload_wait_ms")
STRAGGLER = "Health/straggler_max_ratio"
MEMORY_KINDS = {"device_allocated_gb": "device allocated", "device_peak_gb": "device peak", "host_rss_gb": "host RSS"}
_MEMORY = re.compile(r"^Memory/rank(\d+)/(device_allocated_gb|device_peak_gb|host_rss_gb)$")
_COMMS = re.compile(r"^Comms/(.+)/(busbw|algbw)_gbps$")
_RUN_STYLES = ("-", "--")  # line style tells the runs apart; colour tells the series apart
_MANY_RANKS = 8  # above this many ranks, memory is drawn as a min-max band and a median line


@dataclass
class Series:
    """One metric: x (global samples, ascending, unique) and values (NaN where not finite,
    and for MFU where above 1: see :func:`load_run`)."""

    name: str
    x: list[float]
    y: list[float]

    def finite(self) -> list[float]:
        return [v for v in self.y if math.isfinite(v)]

    def last(self) -> float:
        """The last finite value (NaN when there is none)."""
        vals = self.finite()
        return vals[-1] if vals else math.nan

    def median_last_half(self) -> float:
        """Median over the second half of the points: steady state, after warm-up and compile."""
        vals = [v for v in self.y[len(self.y) // 2 :] if math.isfinite(v)]
        if not vals:
            return math.nan
        vals.sort()
        mid = len(vals) // 2
        return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


@dataclass
class Run:
    """A run's folder, its display name and its metrics by name."""

    name: str
    dir: Path
    metrics: dict[str, Series] = field(default_factory=dict)

    def get(self, name: str) -> Series | None:
        return self.metrics.get(name)

    def matching(self, pattern: re.Pattern[str]) -> dict[str, re.Match[str]]:
        return {n: m for n in sorted(self.metrics) if (m := pattern.match(n))}


def find_run_dir(path: str | Path) -> Path:
    """The folder holding the CSV files: ``path`` itself, or its only job folder."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"{root} is not a directory; give the csv_monitor's <output_path>/<job_name> folder")
    if any(root.glob("*.csv")):
        return root
    jobs = sorted(d for d in root.iterdir() if d.is_dir() and any(d.glob("*.csv")))
    if len(jobs) == 1:
        return jobs[0]
    if jobs:
        names = ", ".join(d.name for d in jobs)
        raise ValueError(f"{root} holds several runs ({names}); give one of them")
    raise ValueError(
        f"no CSV files in {root} (nor in a folder below it); give the folder the csv_monitor wrote, "
        "<output_path>/<job_name>, of a run with csv_monitor.enabled"
    )


def _read_csv(path: Path) -> Series | None:
    """A metric file; rows that do not parse are skipped (the last one may be half written
    while the run is still going), and a repeated x keeps its latest value (a resumed run
    logs again the samples after its checkpoint)."""
    by_x: dict[float, float] = {}
    name = path.stem
    with open(path, newline="") as f:
        for i, row in enumerate(csv.reader(f)):
            if i == 0 and len(row) >= 2 and row[0] == "step":
                name = row[1]  # the real name: the file name lost its "/"
                continue
            try:
                x, v = float(row[0]), float(row[1])
            except (IndexError, ValueError):
                continue
            by_x[x] = v if math.isfinite(v) else math.nan
    if not by_x:
        return None
    xs = sorted(by_x)
    return Series(name, xs, [by_x[x] for x in xs])


def load_run(path: str | Path, name: str | None = None) -> Run:
    """Every metric of the run at ``path`` (see :func:`find_run_dir`); MFU values above 1
    read as NaN (unknown)."""
    run_dir = find_run_dir(path)
    run = Run(name or run_dir.name, run_dir)
    for f in sorted(run_dir.glob("*.csv")):
        s = _read_csv(f)
        if s is not None:
            run.metrics[s.name] = s
    if (mfu := run.metrics.get(MFU)) is not None:
        # No device runs above its peak: an MFU over 1 (older runs logged 26 on CPUs whose
        # peak was timed on a slower matmul path than training's) is an unknown, not a figure.
        mfu.y = [math.nan if v > 1.0 else v for v in mfu.y]
    if not run.metrics:
        raise ValueError(f"the CSV files in {run_dir} hold no data rows yet")
    return run


# ----------------------------------------------------------------------------- formatting


def _fmt(v: float | None, unit: str = "") -> str:
    if v is None or not math.isfinite(v):
        return "–"
    if v == int(v) and 1e4 <= abs(v) < 1e15:  # sample counts: 1,280,000 rather than 1.28e+06
        return f"{int(v):,}{unit}"
    return f"{v:.4g}{unit}"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or b == 0:
        return "–"
    return f"{a / b:.3g}×"


def _smooth(y: Sequence[float]) -> list[float]:
    """Centred moving average over ~4% of the points, NaN-aware, shrinking at the ends, so
    the trend stays in place (an EMA would lag it) and the first and last points count."""
    n = len(y)
    half = max(1, n // 50)
    csum, ccount = [0.0], [0]
    for v in y:
        ok = math.isfinite(v)
        csum.append(csum[-1] + (v if ok else 0.0))
        ccount.append(ccount[-1] + ok)
    out = []
    for i in range(n):
        lo, hi = max(0, i - half), min(n, i + half + 1)
        c = ccount[hi] - ccount[lo]
        out.append((csum[hi] - csum[lo]) / c if c else math.nan)
    return out


# ----------------------------------------------------------------------------- plotting


def _matplotlib() -> tuple[Any, Any]:
    """matplotlib's Figure and EngFormatter. A Figure drawn on its own Agg canvas touches no
    pyplot state, so building a report inside a notebook or a training job changes nothing."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import EngFormatter
    except ImportError as e:
        raise ValueError(
            "terascale report draws with matplotlib, which is not installed: "
            "pip install 'terascale[examples]' (or pip install matplotlib)"
        ) from e
    return Figure, EngFormatter


@dataclass
class _Plot:
    """One section of the page: its title, PNG file, caption and what it could not show."""

    title: str
    png: str | None
    caption: str
    missing: list[str]


class _Drawer:
    """Draws the plots of one run (and the run it is compared with) into ``out``."""

    def __init__(self, runs: list[Run], out: Path) -> None:
        self.runs, self.out = runs, out
        self.Figure, self.EngFormatter = _matplotlib()

    def _label(self, run: Run, what: str) -> str:
        return f"{run.name}: {what}" if len(self.runs) > 1 else what

    def _figure(self, panels: int) -> tuple[Any, list[Any]]:
        fig = self.Figure(figsize=(10, 3.6 * panels if panels > 1 else 4.6), dpi=110, layout="constrained")
        axes = fig.subplots(panels, 1, sharex=True, squeeze=False)[:, 0]
        for ax in axes:
            ax.grid(True, alpha=0.3)
            ax.xaxis.set_major_formatter(self.EngFormatter())
        axes[-1].set_xlabel("global samples")
        return fig, list(axes)

    def _save(self, fig: Any, axes: list[Any], stem: str) -> str:
        for ax in axes:
            n = len(ax.get_legend_handles_labels()[0])
            if n > 4:  # a long legend goes to the right of the axes so that it hides no data
                ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
            elif n:
                ax.legend(fontsize=8, loc="best")
        fig.savefig(self.out / f"{stem}.png")
        return f"{stem}.png"

    def lines(self, stem: str, title: str, panels: list[tuple[str, str, list[str]]],
               scale: Callable[[float], float] = lambda v: v, caption: str = "",
               log2: set[str] | frozenset[str] = frozenset(), from_zero: bool = True,
               legend: Callable[[str], str] = lambda m: m.split("/")[-1]) -> _Plot:
        """One panel per (title, y label, metric names); each run one line style, and each metric
        one colour (a panel of one metric colours the runs instead). Metrics in ``log2`` get a
        log2 axis: the fp16 loss scale moves by powers of two. ``from_zero`` starts the y axis
        at 0, so that a 2% wobble of throughput does not look like a collapse. ``legend`` names a
        metric's line."""
        wanted = [m for _, _, names in panels for m in names]
        present = [p for p in panels if any(r.get(m) for r in self.runs for m in p[2])]
        missing = [m for m in wanted if self.runs[0].get(m) is None]
        if not present:
            return _Plot(title, None, caption, missing)
        fig, axes = self._figure(len(present))
        for ax, (sub, ylabel, names) in zip(axes, present):
            ax.set_title(sub, fontsize=10)
            ax.set_ylabel(ylabel)
            for i, m in enumerate(names):
                for k, (run, style) in enumerate(zip(self.runs, _RUN_STYLES)):
                    if (s := run.get(m)) is not None:
                        color = f"C{i}" if len(names) > 1 else f"C{3 * k}"
                        ax.plot(s.x, [scale(v) for v in s.y], style, color=color, lw=1.4,
                                marker="." if len(s.x) < 40 else None, label=self._label(run, legend(m)))
                if m in log2:
                    ax.set_yscale("log", base=2)
            if ax.get_yscale() != "log":
                if from_zero:
                    ax.set_ylim(bottom=0)
                if ax.get_ylim()[1] >= 1e4:  # 150 k, not 150000 or an offset the eye misses
                    ax.yaxis.set_major_formatter(self.EngFormatter())
        fig.suptitle(title)
        return _Plot(title, self._save(fig, axes, stem), caption, missing)

    def loss(self) -> _Plot:
        title = "Loss"
        missing = [] if self.runs[0].get(LOSS) else [LOSS]
        evals = [_eval_names(r) for r in self.runs]
        if not evals[0]:
            missing.append("Eval/... (held-out loss)")
        if not any(r.get(LOSS) or e for r, e in zip(self.runs, evals)):
            return _Plot(title, None, "", missing)
        fig, (ax,) = self._figure(1)
        ax.set_ylabel("loss")
        for k, run in enumerate(self.runs):
            color = f"C{3 * k}"  # blue for the run, red for the one it is compared with
            if (s := run.get(LOSS)) is not None:
                ax.plot(s.x, s.y, ".", color=color, alpha=0.25, ms=3)  # raw points, faint
                ax.plot(s.x, _smooth(s.y), "-", color=color, lw=1.8, label=self._label(run, "train (smoothed)"))
            for j, name in enumerate(evals[k]):
                e = run.metrics[name]
                ax.plot(e.x, e.y, _RUN_STYLES[k], marker="o", ms=4, color=f"C{3 * k + 1 + j}",
                        label=self._label(run, f"held-out: {name}"))
        fig.suptitle(title)
        caption = ("Training loss of the data-parallel rank 0 (mean over the accumulation window): raw points "
                   "faint, a centred moving average over ~4% of the run as the line; held-out loss as markers.")
        return _Plot(title, self._save(fig, [ax], "loss"), caption, missing)

    def memory(self) -> _Plot:
        title = "Memory per rank"
        found_in = [{m.group(2) for m in r.matching(_MEMORY).values()} for r in self.runs]
        kinds = [k for k in MEMORY_KINDS if any(k in f for f in found_in)]
        found = found_in[0]
        missing = [f"Memory/rank{{r}}/{k}" for k in MEMORY_KINDS if k not in found]
        if not kinds:
            return _Plot(title, None, "", missing)
        fig, axes = self._figure(len(kinds))
        for ax, kind in zip(axes, kinds):
            ax.set_title(MEMORY_KINDS[kind], fontsize=10)
            ax.set_ylabel("GB")
            for k, (run, style) in enumerate(zip(self.runs, _RUN_STYLES)):
                ranks = {int(m.group(1)): run.metrics[n]
                         for n, m in run.matching(_MEMORY).items() if m.group(2) == kind}
                if len(ranks) <= _MANY_RANKS:
                    for r in sorted(ranks):
                        ax.plot(ranks[r].x, ranks[r].y, style, color=f"C{r}", lw=1.3,
                                label=self._label(run, f"rank {r}"))
                else:  # dozens of lines are unreadable: the spread over ranks and its median
                    x, rows = _aligned(list(ranks.values()))
                    lo = [min(c) for c in zip(*rows)]
                    hi = [max(c) for c in zip(*rows)]
                    med = [sorted(c)[len(c) // 2] for c in zip(*rows)]
                    ax.fill_between(x, lo, hi, color=f"C{3 * k}", alpha=0.2,
                                    label=self._label(run, f"min–max of {len(ranks)} ranks"))
                    ax.plot(x, med, style, color=f"C{3 * k}", lw=1.5, label=self._label(run, "median rank"))
            ax.set_ylim(bottom=0)
        fig.suptitle(title)
        caption = (f"One line per rank (up to {_MANY_RANKS} ranks; beyond that the min–max band over ranks and "
                   "the median). Device peak is the allocator's high-water mark, as the engine logs it.")
        return _Plot(title, self._save(fig, axes, "memory"), caption, missing)

    def time(self) -> _Plot:
        title = "Time per step"
        main = self.runs[0]
        missing = [m for m in (*PHASES, *WAITS) if main.get(m) is None]
        if not any(r.get(m) for r in self.runs for m in (*PHASES, *WAITS)):
            return _Plot(title, None, "", missing)
        fig, (ax,) = self._figure(1)
        ax.set_ylabel("ms per optimizer step")
        colors = {m: f"C{i}" for i, m in enumerate((*PHASES, *WAITS))}
        for k, run in enumerate(self.runs):
            phases = [run.metrics[m] for m in PHASES if m in run.metrics]
            if phases:
                x, rows = _aligned(phases)
                if k == 0:  # the run itself as filled layers
                    ax.stackplot(x, rows, colors=[colors[s.name] for s in phases], alpha=0.55,
                                 labels=[self._label(run, s.name.split("/")[-1]) for s in phases])
                else:  # the compared run as the tops of its layers: two filled stacks would hide each other
                    top = [0.0] * len(x)
                    for s, row in zip(phases, rows):
                        top = [a + b for a, b in zip(top, row)]
                        ax.plot(x, top, "--", color=colors[s.name], lw=1.5,
                                label=self._label(run, f"top of {s.name.split('/')[-1]}"))
            for m in WAITS:
                if (s := run.get(m)) is not None:
                    ax.plot(s.x, s.y, _RUN_STYLES[k], color=colors[m], lw=1.6, marker="." if len(s.x) < 40 else None,
                            label=self._label(run, f"{m.split('/')[-1]} (inside the above)"))
        ax.set_ylim(bottom=0)
        fig.suptitle(title)
        caption = ("Forward, backward and optimizer step are stacked: they follow each other, so the top "
                   "of the stack is the time of a step. The waits (gradient reduce, parameter all-gather, "
                   "offload I/O) are drawn as lines, not stacked: they happen inside forward, backward or "
                   "step, so stacking them would count their time twice."
                   + (" The compared run is drawn as the dashed tops of its layers." if len(self.runs) > 1 else ""))
        return _Plot(title, self._save(fig, [ax], "time_breakdown"), caption, missing)

    def comms(self) -> _Plot:
        ops = sorted({m.group(1) for r in self.runs for m in r.matching(_COMMS).values()})
        panels = [(f"{label} bandwidth", "GB/s", [f"Comms/{op}/{kind}_gbps" for op in ops])
                  for kind, label in (("busbw", "bus"), ("algbw", "algorithmic"))]
        plot = self.lines("comms", "Communication bandwidth", panels, caption=(
            "Per collective: bus bandwidth (comparable with the link's peak, as nccl-tests reports it) "
            "and algorithmic bandwidth (message bytes / time)."), legend=lambda m: m.split("/")[1])
        if not ops:
            plot.missing = ["Comms/{op}/busbw_gbps", "Comms/{op}/algbw_gbps"]
        return plot


def _eval_names(run: Run) -> list[str]:
    """Held-out metrics: every ``Eval/...`` with "loss" in its name, else every ``Eval/...``."""
    evals = [n for n in sorted(run.metrics) if n.startswith("Eval/")]
    return [n for n in evals if "loss" in n.lower()] or evals


def _aligned(series: list[Series]) -> tuple[list[float], list[list[float]]]:
    """Values of ``series`` on the x of the longest one (linear interpolation, NaN as 0 for
    stacking), since metrics logged on different reports need not share their x."""
    import numpy as np  # a matplotlib dependency

    x = max(series, key=lambda s: len(s.x)).x
    rows = [np.nan_to_num(np.interp(x, s.x, s.y)).tolist() for s in series]
    return list(x), rows


# ----------------------------------------------------------------------------- page


def _peaks(run: Run) -> dict[str, dict[int, float]]:
    """Highest memory per rank: {"device": {rank: GB}, "host": {rank: GB}}. Device memory is
    the allocator's peak where the run logged it, else the highest allocated value seen."""
    found: dict[str, dict[int, float]] = {"device_peak_gb": {}, "device_allocated_gb": {}, "host_rss_gb": {}}
    for name, m in run.matching(_MEMORY).items():
        found[m.group(2)][int(m.group(1))] = max(run.metrics[name].finite(), default=math.nan)
    device = {**found["device_allocated_gb"], **found["device_peak_gb"]}
    return {"device": dict(sorted(device.items())), "host": dict(sorted(found["host_rss_gb"].items()))}


def _summary(run: Run) -> list[tuple[str, float | None, str]]:
    """The header's key figures, in page order: (label, value, unit)."""
    def med(name: str, scale: float = 1.0) -> float | None:
        s = run.get(name)
        return None if s is None else s.median_last_half() * scale

    loss = run.get(LOSS)
    rows: list[tuple[str, float | None, str]] = [
        ("points (train loss)", float(len(loss.x)) if loss else None, ""),
        ("samples", max((s.x[-1] for s in run.metrics.values()), default=None), ""),
        ("last train loss", loss.last() if loss else None, ""),
    ]
    rows += [(f"last {n}", run.metrics[n].last(), "") for n in _eval_names(run)]
    rows += [
        ("samples/s (median, last half)", med(THROUGHPUT[0]), ""),
        ("tokens/s (median, last half)", med(THROUGHPUT[1]), ""),
        ("TFLOP/s (median, last half)", med(THROUGHPUT[2]), ""),
        ("MFU (median, last half)", med(MFU, 100.0), "%"),
    ]
    for kind, by_rank in _peaks(run).items():
        what = "peak device memory" if kind == "device" else "peak host RSS"
        if len(by_rank) <= _MANY_RANKS:
            rows += [(f"{what}, rank {r}", v, " GB") for r, v in by_rank.items()]
        else:  # a row per rank of a 64-rank job would bury the rest of the header
            top = max(by_rank, key=lambda r: by_rank[r])
            rows += [(f"{what}, highest rank", by_rank[top], f" GB (rank {top})"),
                     (f"{what}, lowest rank", min(by_rank.values()), " GB")]
    return rows


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _summary_table(runs: list[Run]) -> str:
    sums = [{label: (v, unit) for label, v, unit in _summary(r)} for r in runs]
    labels = list(sums[0]) + [k for k in (sums[1] if len(sums) > 1 else {}) if k not in sums[0]]
    rows = []
    for label in labels:
        row = [label]
        for s in sums:
            v, unit = s.get(label, (None, ""))
            row.append(_fmt(v, unit))
        if len(runs) > 1:
            row.append(_ratio(sums[0].get(label, (None,))[0], sums[1].get(label, (None,))[0]))
        rows.append(row)
    header = [""] + [r.name for r in runs] + ([f"ratio {runs[0].name} / {runs[1].name}"] if len(runs) > 1 else [])
    return _table(header, rows)


def _final_table(runs: list[Run]) -> str:
    names = sorted(set(runs[0].metrics) | (set(runs[1].metrics) if len(runs) > 1 else set()),
                   key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)])
    rows = []
    for n in names:
        s = runs[0].get(n)
        row = [n, str(len(s.x)) if s else "–", _fmt(s.last() if s else None),
               _fmt(s.median_last_half() if s else None),
               _fmt(min(s.finite(), default=None) if s else None), _fmt(max(s.finite(), default=None) if s else None)]
        if len(runs) > 1:
            o = runs[1].get(n)
            row += [_fmt(o.last() if o else None), _ratio(s.last() if s else None, o.last() if o else None)]
        rows.append(row)
    header = ["metric", "points", "last", "median (last half)", "min", "max"]
    if len(runs) > 1:
        header += [f"last ({runs[1].name})", f"ratio {runs[0].name} / {runs[1].name} (last)"]
    return _table(header, rows)


_CSS = """body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;padding:0 1em;color:#222}
h1{margin-bottom:.2em} .sub{color:#666;margin-top:0} figure{margin:1.5em 0} img{max-width:100%}
figcaption,.missing{color:#555;font-size:.9em} .missing{background:#fff6e0;padding:.4em .7em;border-radius:4px}
table{border-collapse:collapse;font-size:.9em;margin:1em 0}
td,th{border-bottom:1px solid #ddd;padding:.25em .8em;text-align:right}
td:first-child,th:first-child{text-align:left;font-family:monospace}"""


def _section(plot: _Plot) -> str:
    parts = [f"<h2>{html.escape(plot.title)}</h2>"]
    names = ", ".join(f"<code>{html.escape(m)}</code>" for m in plot.missing)
    if plot.png:
        parts.append(f'<figure><img src="{plot.png}" alt="{html.escape(plot.title)}">'
                     f"<figcaption>{html.escape(plot.caption)}</figcaption></figure>")
        if names:
            parts.append(f'<p class="missing">Not in this run, left out of the plot: {names}.</p>')
    else:
        parts.append(f'<p class="missing">Not plotted: this run logged none of {names}.</p>')
    return "\n".join(parts)


def _display_names(runs: list[Run]) -> None:
    """Two runs both called ``DeepSpeedJobName`` (the config's default) need their parent
    folder in the name to be told apart in legends and column headers."""
    if len(runs) > 1 and runs[0].name == runs[1].name:
        for r in runs:
            r.name = f"{r.dir.parent.name}/{r.dir.name}"
        if runs[0].name == runs[1].name:
            runs[0].name, runs[1].name = str(runs[0].dir), str(runs[1].dir)


def build_report(run_dir: str | Path, out_dir: str | Path | None = None, compare: str | Path | None = None) -> Path:
    """Write ``report.html`` and its PNGs for the run at ``run_dir``; return the HTML's path.

    ``run_dir`` is the csv_monitor's ``<output_path>/<job_name>`` folder, or its parent
    when that holds exactly one. ``out_dir`` defaults to ``<run_dir>/report``. ``compare``,
    another run's folder, is overlaid on every plot and adds its values and the ratio
    (this run / the other) to the tables. Raises :class:`ValueError` when a folder has no
    CSV files or matplotlib is missing.
    """
    runs = [load_run(run_dir)]
    if compare is not None:
        runs.append(load_run(compare))
    _display_names(runs)
    out = Path(out_dir) if out_dir is not None else runs[0].dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    d = _Drawer(runs, out)
    plots = [
        d.loss(),
        d.lines("optimizer", "Optimizer", [
            ("learning rate", "lr", [OPTIM[0]]), ("gradient norm", "L2 norm (before clipping)", [OPTIM[1]]),
            ("fp16 loss scale (log axis)", "loss scale", [OPTIM[2]])], log2={OPTIM[2]},
            caption="Learning rate, global gradient norm "
            "and the dynamic loss scale (fp16 only; a drop is a skipped step after an overflow)."),
        d.lines("throughput", "Throughput", [
            ("samples per second", "samples/s", [THROUGHPUT[0]]), ("tokens per second", "tokens/s", [THROUGHPUT[1]]),
            ("achieved TFLOP/s", "TFLOP/s", [THROUGHPUT[2]])], caption="Training throughput as the engine logs it."),
        d.lines("mfu", "Model FLOPs utilisation", [("MFU", "% of peak", [MFU])], scale=lambda v: 100.0 * v,
                 caption="Model FLOPs per second as a percentage of the device's peak. A value above "
                 "100% is no utilisation (the peak was measured below what training achieved) and is "
                 "shown as unknown: a gap in the line, – in the tables."),
        d.memory(),
        d.time(),
        d.comms(),
        d.lines("stragglers", "Stragglers", [("slowest rank / median rank", "ratio", [STRAGGLER])],
                 caption="Step time of the slowest rank over the median's; 1 is a balanced job.", from_zero=False),
    ]
    names = " vs ".join(html.escape(r.name) for r in runs)
    sources = "<br>".join(f"{html.escape(r.name)}: <code>{html.escape(str(r.dir.resolve()))}</code>" for r in runs)
    when = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>terascale report: {names}</title><style>{_CSS}</style></head>
<body><h1>terascale report: {names}</h1>
<p class="sub">{sources}<br>{len(runs[0].metrics)} metrics, written {when}</p>
{_summary_table(runs)}
{chr(10).join(_section(p) for p in plots)}
<h2>Final values</h2>
{_final_table(runs)}
</body></html>
"""
    path = out / "report.html"
    path.write_text(page, encoding="utf-8")
    return path

