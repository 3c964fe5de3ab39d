"""terascale's async I/O engine (both backends) against DeepSpeed's aio op and fio.

    python bench/aio.py --peers-python /tmp/peers/bin/python                 # defaults vs defaults
    python bench/aio.py --sweep --peers-python /tmp/peers/bin/python         # the curves
    python bench/aio.py --peers-python ... --tuned-from runs/bench/aio_sweep.json

Every system moves the same bytes (``--size-gib`` in one file, O_DIRECT) in the same
directory, writing then reading; systems are interleaved with their order rotated each
repeat, and the median GB/s is reported. Writes are timed in two file states: ``fresh``
(a new file that the writes extend) and ``overwrite`` (rewriting a file written before:
what a swap file sees every step after the first). DeepSpeed's op runs in
``--peers-python`` (it needs ``libaio-dev`` to build; see ../shared/BENCHMARKING.md) with
its own page-locked buffer; fio (libaio) gives the device's figure.

The default run compares each system at its defaults (terascale ``AioOptions()``,
DeepSpeed's ``aio`` defaults: 1 MiB blocks, queue depth 8, one thread; fio 4 jobs x
queue depth 32) and, with ``--tuned-from`` a sweep's JSON, each at the best setting the
sweep found for it; ``terascale-auto`` is the engine with the settings ``aio: "auto"``
probes (see [Note: the aio probe]). Ratios are to DeepSpeed at its defaults and to the
best figure any system reached in the run.

``--sweep`` measures the curves: block size (128 KiB-16 MiB) x pieces in flight (1-64) for
terascale on worker threads (``terascale``, its default backend) and on the kernel's AIO
queue (``terascale-kernel``, ``aio.backend: "kernel"``), DeepSpeed and fio; threads (1-8) at
1 MiB x 8; aligned vs unaligned buffers; and terascale's buffers on huge vs 4 KiB pages.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from aio_peers import deepspeed_rw, engine_rw, fio_rw  # noqa: E402

from terascale.offload import AioOptions  # noqa: E402
from terascale.offload.host_buffers import ALIGNMENT, aligned_empty  # noqa: E402
from terascale.offload.probe import probe_options  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
DS_DEFAULT = {"block": MiB, "qd": 8, "threads": 1}
FIO_DEFAULT = {"block": MiB, "qd": 32, "threads": 4}
SWEEP_BLOCKS = (128 * KiB, 512 * KiB, MiB, 4 * MiB, 16 * MiB)
SWEEP_DEPTHS = (1, 4, 8, 16, 32, 64)
SWEEP_THREADS = (1, 2, 4, 8)


class Buffers:
    """The host buffers the in-process systems move: on huge pages (terascale's
    ``aligned_empty``), on 4 KiB pages but aligned, and not aligned at all."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._made: dict[str, torch.Tensor] = {}

    def get(self, kind: str) -> torch.Tensor:
        if kind not in self._made:
            if kind == "huge":
                buf = aligned_empty(self.nbytes, torch.uint8)
            else:
                raw = torch.empty(self.nbytes + ALIGNMENT, dtype=torch.uint8)
                shift = (-raw.data_ptr()) % ALIGNMENT + (64 if kind == "unaligned" else 0)
                buf = raw[shift : shift + self.nbytes]
            self._made[kind] = buf.fill_(7)
        return self._made[kind]


def _options(point: dict, backend: str) -> AioOptions:
    """A point's settings as terascale's options: ``qd`` pieces in flight per thread."""
    return AioOptions(block_size=point["block"], queue_depth=point["qd"], thread_count=point["threads"], backend=backend)


def run_points(system: str, points: list[dict], path: Path, buffers: Buffers, peers: str | None) -> list[dict]:
    """``system`` at each point; DeepSpeed in one process for all of them."""
    n = buffers.nbytes
    if system == "deepspeed":
        return deepspeed_rw(peers, path, n, points)
    out = []
    for p in points:
        if system.startswith("terascale"):
            backend = "kernel" if system == "terascale-kernel" else "threads"
            out.append(engine_rw(path, n, p["state"], _options(p, backend), buffers.get(p.get("pages", "huge"))))
        elif system == "fio":
            out.append(fio_rw(path, n, p["block"], p["qd"], p["threads"], p["state"]))
        else:
            raise AssertionError(system)
        path.unlink(missing_ok=True)
    return out


def measure(plan: dict[str, list[dict]], args: argparse.Namespace, buffers: Buffers) -> dict[str, list[list[dict]]]:
    """Every system's points ``args.repeats`` times, systems rotated each repeat; per
    system, per point, the list of repeats' results."""
    directory = Path(args.dir)
    results = {name: [[] for _ in points] for name, points in plan.items()}
    names = list(plan)
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            system = name.split(":")[0]
            res = run_points(system, plan[name], directory / f"{system}.bin", buffers, args.peers_python)
            for i, x in enumerate(res):
                results[name][i].append(x)
            print(f"repeat {r} {name}: {len(res)} point(s)", file=sys.stderr, flush=True)
    return results


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(x[key] for x in runs)


def _score(runs: list[dict]) -> float:
    """GB/s of a write plus a read of the same bytes (the harmonic mean)."""
    return 2 / (1 / _median(runs, "write") + 1 / _median(runs, "read"))


# -- the default comparison ----------------------------------------------------------------


def comparison(args: argparse.Namespace, buffers: Buffers) -> dict:
    defaults = AioOptions()
    ts = {"block": defaults.block_size, "qd": defaults.queue_depth, "threads": defaults.thread_count}
    started = time.perf_counter()
    auto = probe_options(args.dir, {})
    probe_s = time.perf_counter() - started
    tuned = _tuned(args.tuned_from) if args.tuned_from else {}
    systems: dict[str, tuple[str, dict]] = {
        "terascale (defaults)": ("terascale", ts),
        "terascale, kernel AIO backend": ("terascale-kernel", ts),
        "terascale (aio: auto)": ("terascale-kernel" if auto["backend"] == "kernel" else "terascale",
                                  {"block": auto["block_size"], "qd": auto["queue_depth"], "threads": auto["thread_count"]}),
        "deepspeed-aio (defaults)": ("deepspeed", DS_DEFAULT),
        "fio (4 jobs x qd 32)": ("fio", FIO_DEFAULT),
    }
    for system, point in tuned.items():
        systems[f"{system} (tuned: {point['block'] // KiB} KiB x {point['qd']} x {point['threads']})"] = (system, point)
    if not args.peers_python:
        systems = {k: v for k, v in systems.items() if v[0] != "deepspeed"}
    if not shutil.which("fio"):
        systems = {k: v for k, v in systems.items() if v[0] != "fio"}
    plan = {f"{system}:{label}": [{**point, "state": s} for s in ("fresh", "overwrite")]
            for label, (system, point) in systems.items()}  # fmt: skip
    results = measure(plan, args, buffers)
    rows = []
    for name, per_point in results.items():
        fresh, over = per_point
        rows.append({"system": name.split(":", 1)[1], "fresh_write": _median(fresh, "write"),
                     "overwrite_write": _median(over, "write"), "read": _median(fresh + over, "read"),
                     "spread": [(min(x["write"] for x in runs), max(x["write"] for x in runs)) for runs in per_point]})  # fmt: skip
    ds = next((r for r in rows if r["system"].startswith("deepspeed-aio (defaults)")), None)
    best = {k: max(r[k] for r in rows) for k in ("fresh_write", "overwrite_write", "read")}
    print(f"\n{buffers.nbytes / 2**30:.2f} GiB file, O_DIRECT; {args.repeats} interleaved repeats, medians (GB/s); "
          f"terascale defaults {ts['block'] // KiB} KiB x {ts['qd']} in flight; aio: auto picked "
          f"{auto['block_size'] // KiB} KiB x {auto['queue_depth']} x {auto['thread_count']} thread(s), "
          f"{auto['backend']} (probe: {probe_s:.1f} s, or cached)\n")
    head = "| system | write, new file | write, rewrite | read |"
    sep = "| --- | --- | --- | --- |"
    if ds:
        head += " vs DeepSpeed defaults (new / rewrite / read) |"
        sep += " --- |"
    head += " vs best of any system (new / rewrite / read) |"
    sep += " --- |"
    print(head + "\n" + sep)
    for r in rows:
        keys = ("fresh_write", "overwrite_write", "read")
        line = f"| {r['system']} | {r['fresh_write']:.2f} | {r['overwrite_write']:.2f} | {r['read']:.2f} |"
        if ds:
            line += " " + " / ".join(f"{r[k] / ds[k]:.2f}" for k in keys) + " |"
        line += " " + " / ".join(f"{r[k] / best[k]:.2f}" for k in keys) + " |"
        print(line)
    return {"rows": rows, "auto": auto, "probe_s": probe_s, "raw": results}


def _tuned(sweep_json: str) -> dict[str, dict]:
    """Each system's best block x in-flight point of a sweep (by write + read time)."""
    data = json.loads(Path(sweep_json).read_text())
    out = {}
    for system, points in data["grid"].items():
        best = max(points, key=lambda p: p["score"])
        out[system] = {"block": best["block"], "qd": best["qd"], "threads": best["threads"]}
    return out


# -- the sweep -----------------------------------------------------------------------------


def sweep(args: argparse.Namespace, buffers: Buffers) -> dict:
    systems = ["terascale", "terascale-kernel", "fio"] + (["deepspeed"] if args.peers_python else [])
    if not shutil.which("fio"):
        systems.remove("fio")
    grid = [{"block": b, "qd": q, "threads": 1, "state": "overwrite"} for b in SWEEP_BLOCKS for q in SWEEP_DEPTHS
            if b * q <= buffers.nbytes]  # fmt: skip
    threads = [{"block": MiB, "qd": 8, "threads": t, "state": "overwrite"} for t in SWEEP_THREADS]
    plan: dict[str, list[dict]] = {}
    for s in systems:
        plan[f"{s}:grid"] = grid
        plan[f"{s}:threads"] = threads
    for s in ("terascale", "deepspeed"):  # aligned vs not, at DeepSpeed's default setting
        if s in systems:
            plan[f"{s}:alignment"] = [{**DS_DEFAULT, "state": "overwrite", "aligned": a, "pages": "huge" if a else "unaligned"}
                                      for a in (True, False)]  # fmt: skip
    plan["terascale:pages"] = [{"block": b, "qd": 8, "threads": 1, "state": "overwrite", "pages": pages}
                               for b in (MiB, 4 * MiB) for pages in ("huge", "small")]  # fmt: skip
    results = measure(plan, args, buffers)
    out: dict[str, dict] = {"grid": {}, "threads": {}, "alignment": {}, "pages": {}}
    for name, per_point in results.items():
        system, part = name.split(":")
        out[part][system] = [{**p, "write": _median(runs, "write"), "read": _median(runs, "read"), "score": _score(runs)}
                             for p, runs in zip(plan[name], per_point)]  # fmt: skip
    _print_sweep(out, buffers.nbytes, args.repeats)
    return out


def _print_sweep(out: dict, nbytes: int, repeats: int) -> None:
    print(f"\n{nbytes / 2**30:.2f} GiB file, O_DIRECT, rewrite then read; {repeats} interleaved repeats, "
          "medians in GB/s as write / read\n")
    systems = list(out["grid"])
    print("Block size x pieces in flight (terascale: that many worker threads; terascale-kernel and "
          "DeepSpeed: one thread with that queue depth in the kernel's AIO queue; fio: one job with that iodepth):\n")
    print("| block | in flight | " + " | ".join(systems) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in systems) + " |")
    for i, p in enumerate(out["grid"][systems[0]]):
        cells = [f"{out['grid'][s][i]['write']:.2f} / {out['grid'][s][i]['read']:.2f}" for s in systems]
        print(f"| {_size(p['block'])} | {p['qd']} | " + " | ".join(cells) + " |")
    for s in systems:
        best = max(out["grid"][s], key=lambda p: p["score"])
        print(f"\nbest {s}: {_size(best['block'])} x {best['qd']}: write {best['write']:.2f}, read {best['read']:.2f}")
    _print_part(out["threads"], "Threads at 1 MiB x 8 (terascale: thread_count x 8 workers; terascale-kernel, "
                "DeepSpeed: thread_count / intra_op_parallelism threads of queue depth 8; fio: numjobs, each iodepth 8)",
                lambda p: f"{p['threads']} thread(s)")
    _print_part(out["alignment"], "Aligned vs unaligned buffer at 1 MiB x 8 (terascale falls back to buffered "
                "I/O, i.e. the page cache; DeepSpeed copies through a page-locked bounce buffer)",
                lambda p: "aligned" if p.get("aligned", True) else "unaligned")
    _print_part(out["pages"], "terascale's buffer on 2 MiB huge pages vs 4 KiB pages",
                lambda p: f"{_size(p['block'])} x 8, {p['pages']} pages")


def _print_part(part: dict[str, list[dict]], title: str, label: Callable[[dict], str]) -> None:
    if not part:
        return
    systems = list(part)
    print(f"\n{title}:\n")
    print("| setting | " + " | ".join(systems) + " |")
    print("| --- | " + " | ".join("---" for _ in systems) + " |")
    for i, p in enumerate(part[systems[0]]):
        cells = [f"{part[s][i]['write']:.2f} / {part[s][i]['read']:.2f}" if i < len(part[s]) else "-" for s in systems]
        print(f"| {label(p)} | " + " | ".join(cells) + " |")


def _size(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=str(ROOT / "runs" / "bench" / "aio"))
    ap.add_argument("--size-gib", type=float, default=None, help="file size (default 1, sweep 0.5)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="measure the curves instead of the comparison")
    ap.add_argument("--tuned-from", default=None, help="a --sweep JSON: also compare each system at its best point")
    ap.add_argument("--peers-python", default=None, help="python with DeepSpeed (and libaio-dev) for its aio op")
    ap.add_argument("--json", default=None, help="default runs/bench/aio.json (aio_sweep.json with --sweep)")
    args = ap.parse_args()

    size = args.size_gib if args.size_gib is not None else (0.5 if args.sweep else 1.0)
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    nbytes = int(size * (1 << 30)) // (16 * MiB) * (16 * MiB)
    free = shutil.disk_usage(directory).free
    if free < 3 * nbytes:
        raise SystemExit(f"{directory} has {free / 2**30:.1f} GiB free; need {3 * nbytes / 2**30:.1f}")
    buffers = Buffers(nbytes)
    try:
        out = sweep(args, buffers) if args.sweep else comparison(args, buffers)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    default_json = "aio_sweep.json" if args.sweep else "aio.json"
    path = Path(args.json or ROOT / "runs" / "bench" / default_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"bytes": nbytes, "repeats": args.repeats, **out}, indent=1, default=str))
    print(f"\nwrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
