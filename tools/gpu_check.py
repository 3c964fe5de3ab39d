"""The GPU check: every CUDA test and the single-GPU benchmarks, one summary, in one command.

    make gpu-check GPU_OUT=/some/folder          # = python3 tools/gpu_check.py --out /some/folder

On a machine with a CUDA device it (1) installs the wheels ``make gpu-wheels`` prepared in
``.whl/`` (pydantic, hjson, DeepSpeed as a pure-Python wheel, terascale itself) into a
folder of their own, without any index; (2) builds DeepSpeed's CPU Adam op in the
background and times it; (3) runs ``tests/test_cuda.py``; (4) runs ``bench/gpu_single.py``
(ZeRO-Offload at 1.3B against DeepSpeed, MFU in memory, the largest model); (5) with the
time left, the rest of the suite, whose one-rank tests take the GPU (``tests/distributed.py``
gives each rank a GPU when there are enough). It writes ``summary.json``, ``summary.md``
(device, driver and library versions, pass/fail per test, every figure, what did not run),
``failures.txt`` (each failed test's traceback, written as it fails) and ``log.txt`` into
``--out``. Each phase has a time cap, so the whole stays inside
``--budget-s`` and a hung phase costs its cap, not the lease.

Without a CUDA device (or without torch) it prints that it skipped and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE = Path("/tmp/terascale-site")  # where the carried wheels are installed
DS_EXTENSIONS = "/tmp/ds-ext"
# Paths no single GPU can run: they need one GPU per rank.
UNVERIFIED = [
    "NCCL collectives across ranks (reduce-scatter/all-gather at world > 1, point-to-point between pipeline stages)",
    "tests/test_cuda.py::test_tensor_parallel_on_cuda_matches_plain_pytorch (2 GPUs)",
    "tests/test_cuda.py::test_pipeline_and_tensor_parallel_on_cuda_match_plain_pytorch (4 GPUs)",
]
_WORDS = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
# "[gw0] [ 6%] PASSED tests/x.py::t" (xdist, and -rA's summary) or "tests/x.py::t PASSED [ 6%]"
_OUTCOME = re.compile(rf"\b({_WORDS})\b\s+(tests/\S+::\S+)|(tests/\S+::\S+)\s+({_WORDS})\b")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for summary.json, summary.md and log.txt")
    p.add_argument("--budget-s", type=float, default=450.0, help="wall-clock budget of the whole check")
    p.add_argument("--wheels", default=str(ROOT / ".whl"), help="folder of wheels to install first")
    p.add_argument("--tests-cap-s", type=float, default=170.0, help="cap of the test phase")
    p.add_argument("--bench-budget-s", type=float, default=250.0)
    p.add_argument("--skip-suite", action="store_true", help="leave out the rest of the suite")
    p.add_argument("--bench-args", default="", help="extra arguments for bench/gpu_single.py (e.g. --quick)")
    p.add_argument("--force", action="store_true", help="run the phases without a CUDA device (checks the driver)")
    return p.parse_args(argv)


def has_cuda() -> bool:
    """Whether this python has torch and sees a CUDA device (checked in a child process, so
    that the driver itself never creates a CUDA context)."""
    probe = [sys.executable, "-c", "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def parse_outcomes(log: str) -> dict[str, str]:
    """``{test id: outcome}`` from pytest output run with ``-v`` or ``-rA`` (the last word wins)."""
    outcomes: dict[str, str] = {}
    for before, test, test_first, after in _OUTCOME.findall(log):
        outcomes[(test or test_first).rstrip(":,")] = before or after
    return outcomes


def write_summary(out: Path, facts: dict, phases: list[dict], tests: dict[str, str], bench: dict | None) -> dict:
    """Write ``summary.json`` and ``summary.md`` into ``out``; return the summary."""
    counts: dict[str, int] = {}
    for outcome in tests.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    summary = {"facts": facts, "phases": phases, "counts": counts, "tests": tests,
               "failed": sorted(t for t, o in tests.items() if o in ("FAILED", "ERROR")),
               "bench": bench, "unverified": UNVERIFIED}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = ["# GPU check", ""]
    lines += [f"- {k}: {v}" for k, v in facts.items()]
    lines += ["", "| phase | seconds | result |", "| --- | --- | --- |"]
    lines += [f"| {p['name']} | {p['seconds']:.0f} | {p['result']} |" for p in phases]
    lines += ["", "tests: " + (", ".join(f"{n} {o.lower()}" for o, n in sorted(counts.items())) or "none ran")]
    lines += [f"- FAILED {t}" for t in summary["failed"]]
    if bench is not None:
        sys.path.insert(0, str(ROOT / "bench"))
        from gpu_single import markdown

        lines += ["", markdown(bench)]
    lines += ["", "Not exercised on one GPU:"] + [f"- {u}" for u in UNVERIFIED]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return summary


class Check:
    """Runs the phases, each under a time cap, appending their output to ``log.txt``."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = open(self.out / "log.txt", "a")
        self.start = time.monotonic()
        self.phases: list[dict] = []
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.start)

    def run(self, name: str, cmd: list[str], cap: float) -> str:
        """Run ``cmd`` for at most ``cap`` seconds (and no longer than the budget); its output."""
        return self.run_together([(name, cmd, cap)])[0]

    def run_together(self, jobs: list[tuple[str, list[str], float]]) -> list[str]:
        """Start every ``(name, cmd, cap)`` at once, stop each at its cap; their outputs in order.

        Each runs in a session of its own, so that one stopped at its cap takes its pytest
        workers and ranks with it instead of leaving them to load the phases that follow."""
        t0 = time.monotonic()
        running = []
        for name, cmd, cap in jobs:
            sink = tempfile.TemporaryFile("w+")
            proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=sink, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
            running.append((name, cmd, max(5.0, min(cap, self.left())), proc, sink))
        outputs = []
        for name, cmd, cap, proc, sink in running:
            try:
                proc.wait(timeout=max(0.0, t0 + cap - time.monotonic()))
                result = f"exit {proc.returncode}"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                result = f"stopped at its cap of {cap:.0f} s"
            sink.seek(0)
            text = sink.read()
            self.log.write(f"\n===== {name}: {' '.join(cmd)} (cap {cap:.0f} s): {result}\n{text}")
            self.log.flush()
            self.phases.append({"name": name, "seconds": time.monotonic() - t0, "result": result})
            print(f"[{time.monotonic() - self.start:5.0f} s] {name}: {result}", flush=True)
            outputs.append(text)
        return outputs


def _pytest_options(workers: int, timeout_s: int) -> list[str]:
    """Parallel workers and a per-test timeout where their plugins are installed."""
    import importlib.util

    options = ["-v", "-rA", "-p", "no:cacheprovider", "-p", "gpu_failures"]
    if importlib.util.find_spec("xdist"):
        options += ["-n", str(workers)]
    if importlib.util.find_spec("pytest_timeout"):
        options += ["--timeout", str(timeout_s)]
    return options


def _facts(env: dict) -> dict:
    code = ("import json, platform, sys, torch\n"
            "f = {'python': platform.python_version(), 'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
            "     'device_count': torch.cuda.device_count()}\n"
            "if torch.cuda.is_available():\n"
            "    f['device'] = torch.cuda.get_device_name(0)\n"
            "    f['device_memory_gib'] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)\n"
            "for m in ('transformers', 'lightning', 'deepspeed', 'terascale', 'pydantic'):\n"
            "    try: f[m] = __import__(m).__version__\n"
            "    except Exception as e: f[m] = f'missing ({type(e).__name__})'\n"
            "print(json.dumps(f))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    facts = json.loads(proc.stdout) if proc.returncode == 0 else {"facts_error": proc.stderr[-500:]}
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True)
        facts["driver"] = q.stdout.strip()
    facts["cpus"] = os.cpu_count()
    return facts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not has_cuda() and not args.force:
        print("gpu-check: no CUDA device (or no torch) here: skipped")
        return 0
    check = Check(args)
    wheels = sorted(Path(args.wheels).glob("*.whl")) if Path(args.wheels).is_dir() else []
    if wheels:
        check.run("install wheels", [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                     "--no-compile", "--upgrade", "--target", str(SITE), *map(str, wheels)], 120)
    # The tree first: the tests import the terascale being checked, not the wheel's copy.
    check.env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(SITE), str(ROOT / "tools"),
                                               os.environ.get("PYTHONPATH", "")])
    check.env["GPU_CHECK_FAILURES"] = str(check.out / "failures.txt")
    facts = _facts(check.env)
    builder = None
    if not str(facts.get("deepspeed", "missing")).startswith("missing"):
        build = ("import time; t = time.perf_counter()\n"
                 "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()\n"
                 "print(f'deepspeed cpu_adam built in {time.perf_counter() - t:.1f} s')")
        builder = subprocess.Popen([sys.executable, "-c", build], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT,
                                   env=dict(check.env, DS_ACCELERATOR="cuda", TORCH_EXTENSIONS_DIR=DS_EXTENSIONS))
    # The CUDA tests, and beside them the rest of the suite (its one-rank tests take the GPU
    # too) and DeepSpeed's op build; then the benchmarks alone on a quiet machine.
    jobs = [("tests/test_cuda.py", [sys.executable, "-m", "pytest", *_pytest_options(4, 200), "tests/test_cuda.py"],
             args.tests_cap_s)]
    if not args.skip_suite:
        jobs.append(("the rest of the suite", [sys.executable, "-m", "pytest", *_pytest_options(10, 150),
                                               "-m", "not slow", "tests", "--ignore=tests/test_cuda.py"],
                     args.tests_cap_s))
    tests: dict[str, str] = {}
    for text in check.run_together(jobs):
        tests.update(parse_outcomes(text))
    if builder is not None:
        try:
            built, _ = builder.communicate(timeout=max(5.0, min(120.0, check.left() - args.bench_budget_s)))
        except subprocess.TimeoutExpired:
            builder.kill()
            built, _ = builder.communicate()
        facts["deepspeed_op_build"] = built.strip().splitlines()[-1] if built.strip() else f"exit {builder.returncode}"
    bench_json = check.out / "bench.json"
    bench_budget = max(30.0, min(args.bench_budget_s, check.left() - 15))
    check.run("bench/gpu_single.py", [sys.executable, "bench/gpu_single.py", f"--json={bench_json}",
                                      f"--budget-s={bench_budget}", f"--ds-extensions={DS_EXTENSIONS}",
                                      *args.bench_args.split()], bench_budget + 10)
    bench = json.loads(bench_json.read_text()) if bench_json.exists() else None
    facts["elapsed_s"] = round(time.monotonic() - check.start)
    summary = write_summary(check.out, facts, check.phases, tests, bench)
    print((check.out / "summary.md").read_text())
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
