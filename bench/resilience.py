"""Resilience costs: recovery after a rank dies, work lost vs checkpoint interval, the
pre-flight check's duration and the health monitors' step-time overhead.

    python bench/resilience.py                 # the full run (about 8 minutes on 2 quiet CPU cores)
    python bench/resilience.py --quick         # about 2.5 minutes, fewer repeats and steps
    python bench/resilience.py --parts recovery,monitors --repeats 5

Every job runs 2 ranks (gloo, ``OMP_NUM_THREADS=1``) under ``terascale run --nproc 2``
(torchrun underneath), this file being the worker (``python bench/resilience.py worker
...``). The worker trains an MLP of ``--width`` x ``--layers`` (about 34M fp32 parameters
by default) at ZeRO stage 2 with AdamW on synthetic batches derived from the step number,
and appends one JSON line per event to ``OUT/rank<R>.jsonl``: its start (process creation
time, see ``process_start_time``; the end of ``terascale.initialize``, which includes the
auto-resume load; ``engine.resumed_in_s`` and the step resumed at), every
optimizer step's end (``time.time()``: all ranks are on this machine, so the clocks
agree), the kill, and the surviving rank's error.

1. ``recovery``: ``checkpoint.interval_steps`` saves, rank 1 SIGKILLs itself before the
   forward of ``--kill-step`` in the first attempt (its last line is the time of the kill),
   ``--max-restarts 1``. Breakdown: kill -> the new worker processes exist (torchrun's
   detection, tear-down of the surviving rank, restart; split with the times in
   torchrun's log), process start -> end of initialize minus the load, the load, the
   first optimizer step; their sum is the recovery, and recovery / (load + start-up) is
   the target ratio (<= 2). Each repeat runs the default configuration and one with
   ``checkpoint.save_on_signal`` off: torchrun ends the surviving rank with SIGTERM,
   which the save-on-signal handler catches.
2. ``interval``: for each interval in ``--intervals``, a 24-step job killed at step 19:
   steps run again after the restart (kill step - step resumed at) and the wall time they
   took; plus the save overhead: the mean (amortized: every interval-th step pays a save)
   and median step time over steps 9..18 of the first attempt (10 steps: 10/interval saves
   fall in it) against a job without saves, all interleaved.
3. ``check``: wall time of ``terascale check --nproc 2`` and a summary of its ``--json``.
4. ``monitors``: median step time with ``health`` on (watchdog, straggler every 10 steps,
   non_finite "skip") against off, interleaved A/B runs, the first steps discarded; then
   one job holding an engine per configuration (off, on, each monitor alone) that steps
   them in turn, so that the machine's drift falls on all alike, for the ratio per step
   and the cost of each monitor.

The machine is shared and has 2 cores, which the 2 ranks fill: other people's work
running meanwhile slows a job by up to 2x. The driver measures it (the machine's busy CPU
time outside the job, in cores) for every job and prints it under each table; it waits
for a quiet moment before each job and runs a job again when other work still kept more
than ``--max-others`` cores busy during it, within ``--wait-budget`` / ``--rerun-budget``
seconds in all (then it keeps what it got and says so).

Prints markdown tables, writes JSON (``--json``); every checkpoint lives in a temporary
directory that is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("recovery", "interval", "check", "monitors")


# -- the worker (one rank of a job under terascale run) -------------------------------------


def worker(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="resilience.py worker")
    p.add_argument("--out", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--kill-step", type=int, default=0, help="rank 1 SIGKILLs itself before this step's forward")
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--batch", type=int, required=True, help="samples per rank per step")
    p.add_argument("--probe-engine", type=int, default=None,
                   help="time the non-finite check's own work on this engine (0: --config) after the steps")
    p.add_argument("--more-configs", default=None,
                   help="comma-separated further configs: one engine per config, stepped in turn")
    a = p.parse_args(argv)

    import torch
    from torch import nn

    import terascale

    imported = time.time()
    proc_start = process_start_time()
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = open(Path(a.out) / f"rank{rank}.jsonl", "a", buffering=1)

    def record(**fields: object) -> None:
        log.write(json.dumps({"attempt": attempt, **fields}) + "\n")

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(a.layers):
            layers += [nn.Linear(a.width, a.width), nn.GELU()]
        return nn.Sequential(*layers, nn.Linear(a.width, a.width))

    mse = nn.MSELoss()

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step * 1000 + rank)
        return torch.randn(a.batch, a.width, generator=g), torch.randn(a.batch, a.width, generator=g)

    def train_step(engine: object, step: int) -> float:
        x, y = batch(step)
        loss = mse(engine(x), y)
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    if a.more_configs:
        # One engine per config in one process, each step of each in turn, the order rotated
        # every step: whatever else the machine does falls on all of them alike.
        configs = [a.config, *a.more_configs.split(",")]
        engines = {}
        for i, cfg in enumerate(configs):
            engines[i], _, _, _ = terascale.initialize(model=mlp(), config=cfg)
        for step in range(1, a.steps + 1):
            k = step % len(configs)
            order = list(range(len(configs)))[k:] + list(range(len(configs)))[:k]
            for name in order if step % 2 else order[::-1]:
                t0, c0 = time.perf_counter(), time.process_time()
                train_step(engines[name], step)
                record(event="ab", engine=name, step=step, s=time.perf_counter() - t0, cpu=time.process_time() - c0)
        if a.probe_engine is not None:
            probe_non_finite(engines[a.probe_engine], batch(1), mse, record)
        record(event="end", t=time.time())
        log.close()
        for e in engines.values():
            e.destroy()
        return

    model = mlp()
    built = time.time()
    engine, _, _, _ = terascale.initialize(model=model, config=a.config)
    init_end = time.time()
    resumed_step = engine.global_steps
    record(event="start", proc_start=proc_start, imported=imported, built=built, init_end=init_end,
           load_s=engine.resumed_in_s, resumed_step=resumed_step,
           params=sum(p.numel() for p in model.parameters()))
    while engine.global_steps < a.steps:
        step = engine.global_steps + 1
        if a.kill_step and step == a.kill_step and rank == 1 and attempt == 0:
            record(event="kill", t=time.time(), step=step)
            log.flush()
            os.fsync(log.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            loss = train_step(engine, step)
        except BaseException as exc:
            # The surviving rank's collective fails once the peer is gone (gloo: connection reset).
            record(event="error", t=time.time(), step=step, error=repr(exc)[:300])
            raise
        # time.process_time(): CPU seconds of every thread of this rank (the background
        # checkpoint writer's and the watchdog's included), less sensitive than wall time
        # to other work sharing the cores.
        record(event="step", step=engine.global_steps, t=time.time(), cpu=time.process_time(), loss=loss)
    engine.wait_for_checkpoint()
    record(event="end", t=time.time())
    log.close()
    engine.destroy()


def process_start_time() -> float:
    """This process's creation as a ``time.time()`` value, to the kernel's 10 ms tick.

    ``psutil.Process().create_time()`` adds the boot time from /proc/stat, which is whole
    seconds: its values are off from ``time.time()`` by up to a second (0.31 s on the
    machine of bench/RESULTS.md), enough to make kill -> restart negative. The start in
    ticks since boot (/proc/self/stat) against CLOCK_BOOTTIME now has no such offset."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, AttributeError, ValueError, IndexError):  # not Linux
        import psutil

        return psutil.Process().create_time()


def probe_non_finite(engine: object, xy: tuple, mse: object, record: object, repeats: int = 20) -> None:
    """Time what ``health.non_finite`` adds to a step, on a window with gradients: the global
    gradient norm (computed only for it when clipping and fp16 are off; every rank's loss flag
    rides on its all-reduce) and the verdict (for a finite norm: the finiteness test and the
    policy's verdict, no collective; ``terascale.health.non_finite``). Medians of ``repeats``,
    each on a fresh window (the engine computes the norm once per window)."""
    import torch

    from terascale.health.non_finite import NonFinitePolicy

    policy = NonFinitePolicy("skip", 3)
    x, y = xy
    norm_s, check_s = [], []
    for _ in range(repeats):
        engine.zero_grad()
        engine.backward(mse(engine(x), y))
        t0 = time.perf_counter()
        norm = engine.window_grad_norm()
        float(norm)
        t1 = time.perf_counter()
        assert bool(torch.isfinite(norm)) and policy.verdict(None) == "ok"
        norm_s.append(t1 - t0)
        check_s.append(time.perf_counter() - t1)
    torch.distributed.barrier()
    engine.zero_grad()
    record(event="probe", norm_s=statistics.median(norm_s), check_s=statistics.median(check_s))


# -- the driver -----------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="about 2.5 minutes: fewer repeats, intervals and steps")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    p.add_argument("--repeats", type=int, default=None,
                   help="recovery runs (of each configuration) and A/B pairs (default 3; quick 1)")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=7, help="hidden layers (the MLP has layers + 1 Linear)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--recovery-interval", type=int, default=5)
    p.add_argument("--recovery-kill-step", type=int, default=8)
    p.add_argument("--intervals", default=None, help="checkpoint intervals in steps (default 1,2,5,10; quick 1,10)")
    p.add_argument("--interval-rounds", type=int, default=None,
                   help="interleaved rounds of part 2 (default 2; quick 1)")
    p.add_argument("--monitor-steps", type=int, default=None, help="steps per A/B run (default 40; quick 20)")
    p.add_argument("--monitor-warmup", type=int, default=5)
    p.add_argument("--turn-steps", type=int, default=None,
                   help="steps of each engine in the one-process run of every configuration in turn "
                   "(default 80; quick 20)")
    p.add_argument("--monitor-width", type=int, default=1536, help="MLP width of part 4")
    p.add_argument("--check-repeats", type=int, default=None, help="runs of terascale check (default 2; quick 1)")
    p.add_argument("--max-others", type=float, default=0.25,
                   help="run a job again when other work kept more than this many cores busy during it")
    p.add_argument("--rerun-budget", type=float, default=None,
                   help="seconds of such reruns at most (default 240; quick 60)")
    p.add_argument("--wait-budget", type=float, default=None,
                   help="seconds in all to wait for other work to stop before jobs (default 300; quick 60)")
    p.add_argument("--dir", default=None,
                   help="where the temporary folder of checkpoints goes (default: the system's); removed at the end")
    p.add_argument("--json", default="runs/bench/resilience.json")
    a = p.parse_args(argv)
    a.repeats = a.repeats or (1 if a.quick else 3)
    a.intervals = [int(i) for i in (a.intervals or ("1,10" if a.quick else "1,2,5,10")).split(",")]
    a.interval_rounds = a.interval_rounds or (1 if a.quick else 2)
    a.monitor_steps = a.monitor_steps or (20 if a.quick else 40)
    a.check_repeats = a.check_repeats or (1 if a.quick else 2)
    a.turn_steps = a.turn_steps or (20 if a.quick else 80)
    a.rerun_budget = a.rerun_budget if a.rerun_budget is not None else (60.0 if a.quick else 240.0)
    a.wait_budget = a.wait_budget if a.wait_budget is not None else (60.0 if a.quick else 300.0)
    a.parts = [s.strip() for s in a.parts.split(",") if s.strip()]
    unknown = set(a.parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    if a.monitor_steps <= a.monitor_warmup:
        raise SystemExit("--monitor-steps must exceed --monitor-warmup")
    return a


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _config(tmp: Path, name: str, *, batch: int, checkpoint: dict | None = None, health: dict | None = None) -> Path:
    cfg: dict = {
        "train_batch_size": 2 * batch,
        "train_micro_batch_size_per_gpu": batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 100000,
    }
    if checkpoint is not None:
        cfg["checkpoint"] = checkpoint
    if health is not None:
        cfg["health"] = health
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path


# A job during which other work kept more than ``max_others`` cores busy measured the
# machine's contention more than terascale: it runs again, up to ``retries`` times while the
# total time spent on such reruns stays under ``budget_s`` (set from the command line).
# Before each job the driver also waits (within ``wait_budget_s`` in all) for 2 s in a row
# in which other work kept fewer than ``max_others`` cores busy.
RERUN = {"max_others": 0.25, "retries": 2, "budget_s": 240.0, "spent_s": 0.0, "wait_budget_s": 300.0,
         "waited_s": 0.0}


def wait_for_quiet() -> None:
    quiet, started = 0, time.time()
    while quiet < 2 and RERUN["waited_s"] + (time.time() - started) < RERUN["wait_budget_s"]:
        busy0 = _busy_cpu()
        time.sleep(1.0)
        quiet = quiet + 1 if _busy_cpu() - busy0 < RERUN["max_others"] else 0
    RERUN["waited_s"] += max(0.0, time.time() - started - 2.0)


def run_job(tmp: Path, name: str, config: Path, *, clean: Path | None = None, **kwargs: object) -> dict:
    """:func:`run_job_once`, run again (see RERUN) while other work disturbed it; ``clean``
    (the job's checkpoint folder) is removed before every attempt. The result has
    ``reruns`` (how many attempts were dropped) and ``others`` of the one kept."""
    dropped = []
    while True:
        if clean is not None:
            shutil.rmtree(clean, ignore_errors=True)
        wait_for_quiet()
        job = run_job_once(tmp, name, config, **kwargs)
        busy = job["others"] > RERUN["max_others"]
        if not busy or len(dropped) >= RERUN["retries"] or RERUN["spent_s"] + job["wall_s"] > RERUN["budget_s"]:
            job["reruns"] = len(dropped)
            job["dropped_others"] = dropped
            if busy:
                print(f"{name}: other work used {job['others']:.2f} cores during it; kept (reruns spent)",
                      file=sys.stderr, flush=True)
            return job
        dropped.append(job["others"])
        RERUN["spent_s"] += job["wall_s"]
        print(f"{name}: other work used {job['others']:.2f} cores during it; running it again", file=sys.stderr,
              flush=True)


def run_job_once(tmp: Path, name: str, config: Path, *, steps: int, width: int, layers: int, batch: int,
                 kill_step: int = 0, restarts: int = 0, more_configs: list[Path] | None = None,
                 probe: int | None = None, timeout: float = 600.0) -> dict:
    """One ``terascale run --nproc 2`` job of the worker; its events per rank, the exit code
    and the wall time of the whole launch."""
    out = tmp / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "terascale", "run", "--nproc", "2", "--max-restarts", str(restarts),
           "--no_local_rank", __file__,
           "worker", "--out", str(out), "--config", str(config), "--steps", str(steps), "--kill-step", str(kill_step),
           "--width", str(width), "--layers", str(layers), "--batch", str(batch)]
    if more_configs:
        cmd += ["--more-configs", ",".join(str(c) for c in more_configs)]
    if probe is not None:
        cmd += ["--probe-engine", str(probe)]
    busy0, tree0 = _busy_cpu(), _children_cpu()
    started = time.time()
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        raise SystemExit(f"{name}: did not finish in {timeout:.0f} s:\n{text[-4000:]}")
    wall = time.time() - started
    others = max(0.0, (_busy_cpu() - busy0) - (_children_cpu() - tree0)) / wall
    events = {r: [json.loads(line) for line in (out / f"rank{r}.jsonl").read_text().splitlines()]
              if (out / f"rank{r}.jsonl").exists() else [] for r in range(2)}
    done = all(any(e["event"] == "end" for e in events[r]) for r in range(2))
    if not done:
        raise SystemExit(f"{name}: the job did not finish (exit code {proc.returncode}):\n{text[-4000:]}")
    if proc.returncode != 0:
        # Both ranks logged their end: a failure in gloo's tear-down after the work (see bench/step_time.py).
        print(f"{name}: exited {proc.returncode} after finishing (teardown)", file=sys.stderr)
    # ``others``: CPU cores busy with work outside this job (the machine's busy CPU time less
    # the job's own, over its wall time): near 0 on a quiet machine; other people's jobs
    # sharing the 2 cores show here and in the 1-minute load average.
    return {"events": events, "rc": proc.returncode, "wall_s": wall, "load_avg": os.getloadavg()[0],
            "others": others, "agent": _agent_times(text), "output_tail": text[-1500:]}


_AGENT_LINE = re.compile(r"^[IWE](\d{4}) (\d\d:\d\d:\d\d\.\d+) \d+ \S+\] "
                         r"(Sending process \d+ closing signal SIGTERM|failed \(exitcode)")


def _agent_times(text: str) -> dict[str, float]:
    """From torchrun's log (glog style, local time): when the agent SIGTERMed the surviving
    worker ("sigterm"; absent when it had already exited) and when it had seen every
    worker exit ("failed"), as time.time() values; the first of each."""
    found: dict[str, float] = {}
    year = time.localtime().tm_year
    for line in text.splitlines():
        m = _AGENT_LINE.match(line)
        if m:
            day, clock, what = m.groups()
            hms, frac = clock.split(".")
            when = time.mktime(time.strptime(f"{year}{day} {hms}", "%Y%m%d %H:%M:%S")) + float("0." + frac)
            found.setdefault("sigterm" if what.startswith("Sending") else "failed", when)
    return found


def _busy_cpu() -> float:
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + t.steal


def _children_cpu() -> float:
    # Every finished descendant that was waited for: terascale -> torchrun -> the ranks.
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _starts(events: dict, attempt: int) -> list[dict]:
    return [next(e for e in events[r] if e["event"] == "start" and e["attempt"] == attempt) for r in range(2)]


def _step_ends(events: dict, attempt: int) -> dict[int, float]:
    """Step -> the latest end time over the ranks, in ``attempt``."""
    ends: dict[int, float] = {}
    for r in range(2):
        for e in events[r]:
            if e["event"] == "step" and e["attempt"] == attempt:
                ends[e["step"]] = max(ends.get(e["step"], 0.0), e["t"])
    return ends


def _step_cpu(events: dict, attempt: int, steps: range) -> list[float]:
    """CPU seconds of each step in ``steps``, summed over the ranks (every thread)."""
    cpu = [{e["step"]: e["cpu"] for e in events[r] if e["event"] == "step" and e["attempt"] == attempt}
           for r in range(2)]
    return [sum(c[s] - c[s - 1] for c in cpu) for s in steps]


def recovery_breakdown(job: dict) -> dict:
    """Seconds of each phase from the kill to the first step done after the restart."""
    ev = job["events"]
    kill = next(e for e in ev[1] if e["event"] == "kill")
    starts = _starts(ev, 1)
    proc_start = max(s["proc_start"] for s in starts)  # the job needs every rank back
    init_end = max(s["init_end"] for s in starts)
    load = max(s["load_s"] for s in starts)
    resumed = starts[0]["resumed_step"]
    ends = _step_ends(ev, 1)
    first = ends[resumed + 1]
    startup = init_end - proc_start - load
    total = first - kill["t"]
    before = _step_ends(ev, 0)
    steady = [before[s] - before[s - 1] for s in sorted(before) if s - 1 in before and s > 2]
    return {
        "kill_step": kill["step"], "resumed_step": resumed,
        "detect_restart_s": proc_start - kill["t"], "startup_s": startup, "load_s": load,
        "first_step_s": first - init_end, "recovery_s": total, "ratio": total / (load + startup),
        "imports_s": max(s["imported"] for s in starts) - proc_start,
        "model_s": max(s["built"] - s["imported"] for s in starts),
        "initialize_s": init_end - max(s["built"] for s in starts) - load,
        "steady_step_s": statistics.median(steady) if steady else None,
        **_survivor(job, kill, proc_start),
        "proc_start_spread_s": max(s["proc_start"] for s in starts) - min(s["proc_start"] for s in starts),
        "redo_s": ends[kill["step"]] - init_end if kill["step"] in ends else None,
        "back_at_kill_step_s": ends[kill["step"]] - kill["t"] if kill["step"] in ends else None,
    }


def _survivor(job: dict, kill: dict, proc_start: float) -> dict:
    """How detect + restart divides: kill -> the surviving rank's collective fails (its
    own log) and -> torchrun SIGTERMs it (torchrun's log); -> torchrun has seen it exit;
    -> the new worker processes exist (torchrun's next rendezvous and the spawn)."""
    out = {}
    err = next((e for e in job["events"][0] if e["event"] == "error" and e["attempt"] == 0), None)
    if err is not None:
        out["survivor_error_s"] = err["t"] - kill["t"]
    agent = job.get("agent", {})
    if "failed" in agent:
        if "sigterm" in agent:
            out["agent_sigterm_s"] = agent["sigterm"] - kill["t"]
            out["survivor_exit_s"] = agent["failed"] - agent["sigterm"]
        out["agent_failed_s"] = agent["failed"] - kill["t"]
        out["respawn_s"] = proc_start - agent["failed"]
    return out


RECOVERY_VARIANTS = {"default": {}, "no_signal_save": {"save_on_signal": False}}


def part_recovery(a: argparse.Namespace, tmp: Path) -> dict:
    """Each repeat runs the job as configured by default and with ``checkpoint.save_on_signal``
    off (in alternating order): torchrun ends the surviving rank with SIGTERM, which the
    save-on-signal handler catches (see the report)."""
    runs: dict[str, list[dict]] = {v: [] for v in RECOVERY_VARIANTS}
    for r in range(a.repeats):
        for variant in list(RECOVERY_VARIANTS)[:: 1 if r % 2 == 0 else -1]:
            ckpt = tmp / "ckpt-recovery"
            shutil.rmtree(ckpt, ignore_errors=True)
            cfg = _config(tmp, f"recovery-{variant}", batch=a.batch, checkpoint={
                "save_dir": str(ckpt), "interval_steps": a.recovery_interval, "auto_resume": True, "keep_last_n": 2,
                **RECOVERY_VARIANTS[variant]})
            job = run_job(tmp, f"recovery-{variant}-{r}", cfg, clean=ckpt, steps=a.recovery_kill_step + 2,
                          width=a.width, layers=a.layers, batch=a.batch, kill_step=a.recovery_kill_step, restarts=1)
            b = recovery_breakdown(job)
            b.update(params=job["events"][0][0]["params"], ckpt_bytes=_dir_bytes(ckpt), job_wall_s=job["wall_s"],
                     load_avg=job["load_avg"], others=job["others"], reruns=job["reruns"])
            shutil.rmtree(ckpt, ignore_errors=True)
            runs[variant].append(b)
            print(f"recovery {variant} {r}: kill->proc {b['detect_restart_s']:.2f} s, start-up {b['startup_s']:.2f} s, "
                  f"load {b['load_s']:.2f} s, first step {b['first_step_s']:.2f} s, recovery {b['recovery_s']:.2f} s, "
                  f"ratio {b['ratio']:.2f} (others' CPU {b['others']:.2f} cores)", file=sys.stderr, flush=True)
    return {"runs": runs}


def _dir_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


INTERVAL_STEPS, INTERVAL_KILL = 24, 19
WINDOW = range(9, 19)  # steps 9..18: 10 steps, 10/interval saves (at steps 8..17) stall in them


def part_interval(a: argparse.Namespace, tmp: Path) -> dict:
    configs: list[int | None] = [None, *a.intervals]
    runs: dict[str, list[dict]] = {str(c): [] for c in configs}
    for rnd in range(a.interval_rounds):
        order = configs[rnd % len(configs):] + configs[: rnd % len(configs)]
        for every in order:
            ckpt = tmp / "ckpt-interval"
            shutil.rmtree(ckpt, ignore_errors=True)
            section = {"save_dir": str(ckpt), "auto_resume": True, "keep_last_n": 2}
            if every is not None:
                section["interval_steps"] = every
            cfg = _config(tmp, f"interval-{every}", batch=a.batch, checkpoint=section)
            kill = INTERVAL_KILL if every is not None else 0
            job = run_job(tmp, f"interval-{every}-{rnd}", cfg, clean=ckpt,
                          steps=INTERVAL_STEPS if kill else WINDOW[-1] + 1, width=a.width, layers=a.layers,
                          batch=a.batch, kill_step=kill, restarts=1 if kill else 0)
            shutil.rmtree(ckpt, ignore_errors=True)
            ends = _step_ends(job["events"], 0)
            times = [ends[s] - ends[s - 1] for s in WINDOW]
            cpu = _step_cpu(job["events"], 0, WINDOW)
            res = {"step_times": times, "mean_s": statistics.fmean(times), "median_s": statistics.median(times),
                   "cpu_s": cpu, "mean_cpu_s": statistics.fmean(cpu), "load_avg": job["load_avg"],
                   "others": job["others"], "reruns": job["reruns"]}
            if kill:
                b = recovery_breakdown(job)
                res.update(lost_steps=b["kill_step"] - b["resumed_step"], resumed_step=b["resumed_step"],
                           redo_s=b["redo_s"], back_at_kill_step_s=b["back_at_kill_step_s"], breakdown=b)
            runs[str(every)].append(res)
            lost = (f", resumed at {res['resumed_step']}, {res['lost_steps']} steps redone in {res['redo_s']:.2f} s"
                    if kill else "")
            print(f"interval {every} round {rnd}: mean step {res['mean_s'] * 1e3:.0f} ms (CPU "
                  f"{res['mean_cpu_s'] * 1e3:.0f} ms), median {res['median_s'] * 1e3:.0f} ms{lost} "
                  f"(others' CPU {res['others']:.2f} cores)", file=sys.stderr, flush=True)
    return {"runs": runs}


def part_check(a: argparse.Namespace, tmp: Path) -> dict:
    runs = []
    for r in range(a.check_repeats):
        out = tmp / f"check-{r}.json"
        # The checkpoints written before (GBs in part 2) may still be on their way to the
        # disk; the check's I/O test would measure that writeback too.
        os.sync()
        wait_for_quiet()
        busy0, tree0 = _busy_cpu(), _children_cpu()
        started = time.time()
        proc = subprocess.run([sys.executable, "-m", "terascale", "check", "--nproc", "2", "--json", str(out)],
                              env=_env(), capture_output=True, text=True, timeout=600)
        wall = time.time() - started
        others = max(0.0, (_busy_cpu() - busy0) - (_children_cpu() - tree0)) / wall
        data = json.loads(out.read_text()) if out.exists() else {}
        runs.append({"wall_s": wall, "rc": proc.returncode, "others": others, "medians": data.get("medians", {}),
                     "units": {k: v["unit"] for k, v in data.get("metrics", {}).items()},
                     "exit_code": data.get("exit_code"), "outliers": data.get("outliers"),
                     "report": proc.stdout[-3000:]})
        print(f"check {r}: {wall:.1f} s, exit code {proc.returncode} (others' CPU {others:.2f} cores)",
              file=sys.stderr, flush=True)
    return {"runs": runs}


MONITORS_ON = {"watchdog": {"enabled": True}, "straggler": {"enabled": True, "every_n_steps": 10},
               "non_finite": {"policy": "skip"}}
MONITORS_OFF = {"watchdog": {"enabled": False}, "straggler": {"enabled": False}, "non_finite": {"policy": "none"}}
ALONE = {name: {**MONITORS_OFF, name: MONITORS_ON[name]} for name in MONITORS_ON}  # one monitor on


def part_monitors(a: argparse.Namespace, tmp: Path) -> dict:
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    on = _config(tmp, "monitors-on", batch=a.batch, health=MONITORS_ON)
    off = _config(tmp, "monitors-off", batch=a.batch, health=MONITORS_OFF)
    steps = range(a.monitor_warmup + 1, a.monitor_steps + 1)
    for r in range(a.repeats):
        for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
            job = run_job(tmp, f"monitors-{name}-{r}", on if name == "on" else off, steps=a.monitor_steps,
                          width=a.monitor_width, layers=a.layers, batch=a.batch)
            ends = _step_ends(job["events"], 0)
            times = [ends[s] - ends[s - 1] for s in steps]
            cpu = _step_cpu(job["events"], 0, steps)
            runs[name].append({"step_times": times, "median_s": statistics.median(times), "cpu_s": cpu,
                               "median_cpu_s": statistics.median(cpu), "load_avg": job["load_avg"],
                               "others": job["others"], "reruns": job["reruns"]})
            print(f"monitors {name} repeat {r}: median {statistics.median(times) * 1e3:.1f} ms/step, CPU "
                  f"{statistics.median(cpu) * 1e3:.1f} ms/step (others' CPU {job['others']:.2f} cores)",
                  file=sys.stderr, flush=True)
    params = job["events"][0][0]["params"]
    # Every configuration in one process, stepped in turn (see the worker): off, on, and each
    # monitor alone.
    names = list(ALONE)
    alone = [_config(tmp, f"monitors-{n}", batch=a.batch, health=ALONE[n]) for n in names]
    job = run_job(tmp, "monitors-alternating", off, more_configs=[on, *alone], steps=a.turn_steps,
                  width=a.monitor_width, layers=a.layers, batch=a.batch, probe=2 + names.index("non_finite"))
    labels = ["off", "on", *names]
    per: dict[str, dict[int, float]] = {n: {} for n in labels}
    for r in range(2):
        for e in job["events"][r]:
            if e["event"] == "ab" and e["step"] > a.monitor_warmup:
                d = per[labels[e["engine"]]]
                d[e["step"]] = max(d.get(e["step"], 0.0), e["s"])
    alt = {n: [per[n][s] for s in sorted(per[n])] for n in labels}
    alt.update(load_avg=job["load_avg"], others=job["others"], reruns=job["reruns"])
    probes = [e for r in range(2) for e in job["events"][r] if e["event"] == "probe"]
    alt["probe"] = {"norm_s": max(p["norm_s"] for p in probes), "check_s": max(p["check_s"] for p in probes)}
    print("monitors in turn in one process: " + ", ".join(f"{n} {statistics.median(alt[n]) * 1e3:.1f}" for n in labels)
          + f" ms/step (others' CPU {job['others']:.2f} cores)", file=sys.stderr, flush=True)
    return {"runs": runs, "alternating": alt, "params": params}


# -- the report -----------------------------------------------------------------------------


def _med(values: list[float]) -> float:
    return statistics.median(values)


def _span(values: list[float], scale: float = 1.0, fmt: str = ".2f") -> str:
    return f"{min(values) * scale:{fmt}}–{max(values) * scale:{fmt}}"


def _others(values: list[float], reruns: int = 0) -> None:
    print(f"\nOther work on the machine during these jobs (busy CPU outside them): median {_med(values):.2f} cores, "
          f"range {_span(values)} (of 2)" + (f"; {reruns} job(s) run again because of it" if reruns else ""))


def report(a: argparse.Namespace, results: dict) -> None:
    if "recovery" in results:
        variants = results["recovery"]["runs"]
        runs = variants["default"]
        r0 = runs[0]
        print(f"\n### Recovery from a killed rank\n\nMLP {a.layers + 1} x Linear({a.width}, {a.width}), "
              f"{r0['params'] / 1e6:.1f}M params, fp32, ZeRO-2, AdamW, 2 ranks x 1 thread (gloo), {a.batch} samples "
              f"per rank per step; checkpoint every {a.recovery_interval} steps ({r0['ckpt_bytes'] / 1e6:.0f} MB on "
              f"disk), rank 1 SIGKILLed before step {r0['kill_step']}'s forward, `--max-restarts 1`; {len(runs)} "
              "runs of each configuration, interleaved: the default (`save_on_signal` on) and "
              "`checkpoint.save_on_signal: false`; medians (range)\n")
        print("| phase | default: s | range | save_on_signal off: s | range |")
        print("| --- | --- | --- | --- | --- |")
        rows = [("detect + restart (kill → new worker processes exist)", "detect_restart_s"),
                ("… kill → the surviving rank's collective fails (gloo: connection reset)", "survivor_error_s"),
                ("… kill → torchrun sees the dead rank, SIGTERMs the survivor", "agent_sigterm_s"),
                ("… SIGTERM → the survivor has exited (torchrun waits)", "survivor_exit_s"),
                ("… kill → torchrun has every worker's exit", "agent_failed_s"),
                ("… → new workers exist (torchrun's rendezvous + spawn)", "respawn_s"),
                ("process start-up (→ initialize done, less the load)", "startup_s"),
                ("… of which Python + imports (torch, terascale)", "imports_s"),
                ("… of which building the model", "model_s"),
                ("… of which terascale.initialize less the load (process group, engine)", "initialize_s"),
                ("checkpoint load (auto-resume)", "load_s"),
                ("first optimizer step after the restart", "first_step_s"),
                ("(a steady-state step before the kill, for scale)", "steady_step_s"),
                ("**total recovery** (kill → first step done)", "recovery_s"),
                ("**recovery / (load + start-up)** (target ≤ 2)", "ratio")]
        for label, key in rows:
            cells = []
            for variant in RECOVERY_VARIANTS:
                vals = [r[key] for r in variants[variant] if r.get(key) is not None]
                cells += [f"{_med(vals):.2f}", _span(vals)] if vals else ["–", "–"]
            if any(c != "–" for c in cells):
                bold = key in ("recovery_s", "ratio")
                cells[0] = f"**{cells[0]}**" if bold else cells[0]
                cells[2] = f"**{cells[2]}**" if bold else cells[2]
                print(f"| {label} | " + " | ".join(cells) + " |")
        every = [r for v in variants.values() for r in v]
        _others([r["others"] for r in every], sum(r["reruns"] for r in every))
    if "interval" in results:
        runs = results["interval"]["runs"]
        base_mean = _med([r["mean_s"] for r in runs["None"]])
        base_median = _med([t for r in runs["None"] for t in r["step_times"]])
        base_cpu = _med([r["mean_cpu_s"] for r in runs["None"]])
        rounds = len(runs["None"])
        print(f"\n### Work lost per failure vs checkpoint interval\n\nThe same job, {INTERVAL_STEPS} steps, rank 1 "
              f"SIGKILLed before step {INTERVAL_KILL}'s forward, `--max-restarts 1`; step times over steps "
              f"{WINDOW[0]}..{WINDOW[-1]} of the first attempt (no saving: an uninterrupted run of {WINDOW[-1]} "
              f"steps), {rounds} interleaved round(s), medians over rounds. CPU = seconds of CPU per step, both "
              f"ranks and all their threads (the background writer's included)\n")
        print(f"| interval (steps) | resumed at step | steps redone | redo wall s | kill → back at step "
              f"{INTERVAL_KILL} s | mean step ms (amortized) | median step ms | CPU ms/step | save cost per step vs "
              "none: wall | : CPU |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        print(f"| none | – | – | – | – | {base_mean * 1e3:.0f} | {base_median * 1e3:.0f} | {base_cpu * 1e3:.0f} "
              "| – | – |")
        for every in a.intervals:
            rs = runs[str(every)]
            mean = _med([r["mean_s"] for r in rs])
            median = _med([t for r in rs for t in r["step_times"]])
            cpu = _med([r["mean_cpu_s"] for r in rs])
            print(f"| {every} | {'/'.join(str(r['resumed_step']) for r in rs)} | "
                  f"{'/'.join(str(r['lost_steps']) for r in rs)} | {_med([r['redo_s'] for r in rs]):.2f} | "
                  f"{_med([r['back_at_kill_step_s'] for r in rs]):.2f} | {mean * 1e3:.0f} | {median * 1e3:.0f} | "
                  f"{cpu * 1e3:.0f} | {(mean / base_mean - 1) * 100:+.0f}% | {(cpu / base_cpu - 1) * 100:+.0f}% |")
        every_run = [r for rs in runs.values() for r in rs]
        _others([r["others"] for r in every_run], sum(r["reruns"] for r in every_run))
    if "check" in results:
        runs = results["check"]["runs"]
        walls = [r["wall_s"] for r in runs]
        print(f"\n### Pre-flight check\n\n`terascale check --nproc 2 --json FILE`, default options, {len(runs)} "
              f"run(s): wall time {_med(walls):.1f} s (median; range {_span(walls, fmt='.1f')}), exit codes "
              f"{'/'.join(str(r['rc']) for r in runs)}; its JSON's medians over the ranks, per run\n")
        names = list(runs[-1]["medians"])
        units = runs[-1]["units"]
        print("| metric | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " |")
        print("| --- | " + " | ".join("---" for _ in runs) + " |")
        for n in names:
            print(f"| {n} ({units.get(n, '')}) | "
                  + " | ".join(f"{r['medians'][n]:.3g}" if n in r["medians"] else "–" for r in runs) + " |")
        for i, r in enumerate(runs):
            if r["outliers"]:
                named = ", ".join(f"rank {o['rank']} {o['metric']} {o['fraction']:.2f} x median" for o in r["outliers"])
                print(f"\nRun {i + 1} named outliers: {named}")
        _others([r["others"] for r in runs])
    if "monitors" in results:
        m = results["monitors"]
        on = [r["median_s"] for r in m["runs"]["on"]]
        off = [r["median_s"] for r in m["runs"]["off"]]
        all_on = _med([t for r in m["runs"]["on"] for t in r["step_times"]])
        all_off = _med([t for r in m["runs"]["off"] for t in r["step_times"]])
        cpu_on = _med([t for r in m["runs"]["on"] for t in r["cpu_s"]])
        cpu_off = _med([t for r in m["runs"]["off"] for t in r["cpu_s"]])
        pair = [x / y for x, y in zip(on, off)]
        alt = m["alternating"]
        alone = [n for n in alt if n in ALONE]
        print(f"\n### Health monitors' step-time overhead\n\nMLP {a.layers + 1} x Linear({a.monitor_width}, "
              f"{a.monitor_width}), {m['params'] / 1e6:.1f}M params, ZeRO-2, 2 ranks; on = watchdog + straggler every "
              f"10 steps + non_finite 'skip', off = all three off. Separate runs: {len(on)} interleaved A/B pairs x "
              f"{a.monitor_steps - a.monitor_warmup} timed steps (first {a.monitor_warmup} dropped); one process: "
              f"an engine per configuration (off, on, each monitor alone), stepped in turn in a rotating order, "
              f"{len(alt['on'])} timed steps each\n")
        print("| measurement | off ms/step | on ms/step | **on / off** (target ≤ 1.02) | spread |")
        print("| --- | --- | --- | --- | --- |")
        print(f"| separate runs, wall (median of all steps) | {all_off * 1e3:.1f} | {all_on * 1e3:.1f} | "
              f"**{all_on / all_off:.3f}** | per-run medians off {' / '.join(f'{x * 1e3:.0f}' for x in off)}, on "
              f"{' / '.join(f'{x * 1e3:.0f}' for x in on)}; per pair {' / '.join(f'{x:.3f}' for x in pair)} |")
        print(f"| separate runs, CPU (both ranks, all threads) | {cpu_off * 1e3:.1f} | {cpu_on * 1e3:.1f} | "
              f"**{cpu_on / cpu_off:.3f}** | |")
        for n in ["on", *alone]:
            ratio = [x / y for x, y in zip(alt[n], alt["off"])]
            q = statistics.quantiles(ratio, n=4)
            what = "all on" if n == "on" else f"{n} alone"
            print(f"| one process in turn, wall: {what} | {_med(alt['off']) * 1e3:.1f} | {_med(alt[n]) * 1e3:.1f} | "
                  f"{'**' if n == 'on' else ''}{_med(alt[n]) / _med(alt['off']):.3f}{'**' if n == 'on' else ''} | "
                  f"per-step ratios: median {_med(ratio):.3f}, quartiles {q[0]:.3f}–{q[2]:.3f} |")
        pr = alt["probe"]
        print(f"\nnon_finite's own work, timed directly (median of 20, the slower rank): the global gradient norm "
              f"{pr['norm_s'] * 1e3:.2f} ms (computed only for the check when gradient clipping and fp16 are off) + "
              f"the verdict {pr['check_s'] * 1e3:.2f} ms = "
              f"{(pr['norm_s'] + pr['check_s']) / _med(alt['off']) * 100:.1f}% of the 'off' step")
        _others([r["others"] for rs in m["runs"].values() for r in rs] + [alt["others"]],
                sum(r["reruns"] for rs in m["runs"].values() for r in rs) + alt["reruns"])


def main(argv: list[str]) -> None:
    if argv[:1] == ["worker"]:
        worker(argv[1:])
        return
    a = parse_args(argv)
    RERUN.update(max_others=a.max_others, budget_s=a.rerun_budget, wait_budget_s=a.wait_budget)
    results: dict = {}
    tmp = Path(tempfile.mkdtemp(prefix="ts_resilience_bench_", dir=a.dir))
    started = time.time()
    try:
        free = shutil.disk_usage(tmp).free
        if free < 8 << 30:
            raise SystemExit(f"{tmp}: {free / 2**30:.1f} GiB free; the checkpoints need a few GiB")
        for part in PARTS:
            if part in a.parts:
                results[part] = globals()[f"part_{part}"](a, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results["wall_s"] = time.time() - started
    results["rerun_s"] = RERUN["spent_s"]
    results["waited_s"] = RERUN["waited_s"]
    report(a, results)
    print(f"\ntotal wall time {results['wall_s']:.0f} s, of which {results['waited_s']:.0f} s waiting for other work "
          f"to stop and {results['rerun_s']:.0f} s in runs dropped because other work shared the machine",
          file=sys.stderr)
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "results": results}, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
