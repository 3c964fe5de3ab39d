"""A training step's timeline: when the NVMe tier's I/O ran against when the rank computed.

The benches record, per step, the phase boundaries (forward+backward, optimizer step) and
the swap engine's activity (``engine.offload_activity()`` with ``recording`` on): spans
with reads in flight, spans with writes in flight, and spans the training thread waited
for I/O. :func:`step_summary` reduces them to seconds; :func:`render` draws one step as
text, one column per ``width``-th of it:

    phase   FFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBSSSSSSS
    reads   ###   ##   ##    ##   #        ###  ##   ##   ##   ###########  ####
    writes  ######                                    #    #    #   #  ########
    waits   w                                                          ww    w

``F`` forward and backward, ``S`` the optimizer step; a ``#`` in reads/writes means that
kind of I/O was in flight for part of that column; ``w`` that the training thread was
blocked on I/O (the rest of the phase row is compute, communication or Python).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def _clip(spans: Iterable[tuple[float, float, str]], kind: str, t0: float, t1: float) -> list[tuple[float, float]]:
    """The spans of ``kind`` within ``[t0, t1)``, merged where they overlap."""
    out: list[tuple[float, float]] = []
    for a, b, k in sorted(s for s in spans if s[2] == kind):
        a, b = max(a, t0), min(b, t1)
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _total(spans: Sequence[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _intersect(x: Sequence[tuple[float, float]], y: Sequence[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def _union(x: Sequence[tuple[float, float]], y: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    return _clip([(a, b, "u") for a, b in [*x, *y]], "u", float("-inf"), float("inf"))


def step_summary(spans: Iterable[tuple[float, float, str]], t0: float, t_mid: float, t1: float) -> dict[str, float]:
    """Seconds of one step ``[t0, t1)`` (forward+backward until ``t_mid``): I/O busy
    (``io``; ``read``, ``write``), the training thread waiting for I/O (``wait``), and I/O
    that ran while the thread was not waiting for it (``hidden``), per phase and whole."""
    spans = list(spans)
    out: dict[str, float] = {}
    for phase, (a, b) in (("fwd_bwd", (t0, t_mid)), ("opt", (t_mid, t1)), ("step", (t0, t1))):
        reads, writes, waits = (_clip(spans, k, a, b) for k in ("read", "write", "wait"))
        io = _union(reads, writes)
        out[f"{phase}_s"] = b - a
        out[f"{phase}_read"] = _total(reads)
        out[f"{phase}_write"] = _total(writes)
        out[f"{phase}_io"] = _total(io)
        out[f"{phase}_wait"] = _total(waits)
        out[f"{phase}_hidden"] = _total(io) - _intersect(io, waits)
    return out


def render(spans: Iterable[tuple[float, float, str]], t0: float, t_mid: float, t1: float, width: int = 100) -> str:
    """One step as four text rows (see the module docstring)."""
    spans = list(spans)
    col = (t1 - t0) / width
    rows = {"phase": [], "reads": [], "writes": [], "waits": []}
    marks = {"reads": ("read", "#"), "writes": ("write", "#"), "waits": ("wait", "w")}
    for i in range(width):
        a, b = t0 + i * col, t0 + (i + 1) * col
        rows["phase"].append("F" if a < t_mid else "S")
        for row, (kind, mark) in marks.items():
            rows[row].append(mark if _clip(spans, kind, a, b) else " ")
    return "\n".join(f"{name:7s} {''.join(cells)}" for name, cells in rows.items())
