"""The memory planner on emulated machines: does the chosen plan run, hold its predicted
peak, and keep up with the best hand-written config of the README's examples?

    python bench/planner.py                          # every case
    python bench/planner.py --cases 109m-cap2.6 --steps 4

Each case is a model (the GPT of ``examples/gpt``), a number of ranks, a global batch and
a machine limit: a config cap (``planner.host_memory``), a memory cgroup (a child of this
process's own, v1 or v2) or an address-space limit (``ulimit -v``). For each case:

- the planner's run: the config says ``"auto"`` for the stage, both offload devices, the
  micro-batch and the checkpointing policy; ``terascale.initialize`` plans (measuring one
  sample of ``training_data``) and trains ``--steps`` steps. The predicted peak is the
  plan's (``terascale.plan.apply.last_plan()``); the measured peak is the kernel's
  high-water mark of each rank's resident memory (``VmHWM``), reset right before
  ``initialize`` (the model is built in bf16 beforehand, as a user loading bf16 weights
  would, so the mark covers the engine and training, not the user's fp32 construction);
- the README's examples adapted to the case (its global batch, micro-batch 8 or less):
  ZeRO stages 0-3 in memory (the ZeRO section's table), the demo (stage 3, ``blocks``
  checkpointing), the ZeRO-Infinity example (stage 3, optimizer and parameters on NVMe,
  ``sub_group_size`` 1e8) and the NVMe demo (the same with ``sub_group_size`` 1e6), each
  under the same limit. One fits when it ran and, under a config cap, its measured peak
  is within the limit (a config cap or a cgroup) less the planner's 10% margin, the test
  the planner's own plan passes (the kernel enforces a ulimit itself; the planner's check
  refuses some before they allocate); the best is the fastest of those. The NVMe examples
  run only where no in-memory one fits (they would be slower).

The table gives per case the chosen plan, predicted / measured peak per rank (worst rank),
their ratio, the chosen plan's step time and the best hand-written one's, and their ratio.
A run's step time is the median of its steps after the first; the planner's run and the
two fastest hand-written ones that fit are repeated (``--repeats`` rounds, rotating order,
so that the machine's drift falls on all alike) and the table gives the median over the
rounds. Raw numbers go to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30


@dataclass(frozen=True)
class Case:
    name: str
    layers: int
    width: int
    heads: int
    world: int
    batch: int  # global batch (sequences)
    limit: str  # "none", "config", "cgroup" or "ulimit"
    node_bytes: int = 0  # the limit for the node's ranks together
    seq: int = 64
    vocab: int = 8192
    extra: dict = field(default_factory=dict)  # the case's own settings (both sides)
    nvme: bool = True  # whether the config names an NVMe path


CASES = [
    Case("17m-2ranks-free", 4, 512, 8, 2, 16, "none"),
    Case("109m-cap2.6", 8, 1024, 16, 1, 8, "config", int(2.6 * GIB)),
    Case("109m-cap1.6-nvme", 8, 1024, 16, 1, 8, "config", int(1.6 * GIB), extra={"sub_group_size": 4_000_000}),
    Case("109m-2ranks-cgroup3.5", 8, 1024, 16, 2, 8, "cgroup", int(3.5 * GIB)),
    Case("17m-seq512-cap1.1", 4, 512, 8, 1, 16, "config", int(1.1 * GIB), seq=512),
    Case("17m-ulimit0.55", 4, 512, 8, 1, 16, "ulimit", int(0.55 * GIB), nvme=False),
    Case("180m-2ranks-cap3", 6, 1536, 16, 2, 4, "config", 3 * GIB, extra={"sub_group_size": 4_000_000}),
]
HAND_WRITTEN = ("zero-0", "zero-1", "zero-2", "zero-3", "demo", "infinity", "demo-nvme")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma-separated case names")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is not timed)")
    p.add_argument("--repeats", type=int, default=2, help="rounds of the planner's and the two best hand-written runs")
    p.add_argument("--threads", type=int, default=2, help="torch threads per process (split over the ranks)")
    p.add_argument("--nvme-dir", default=str(ROOT / "runs" / "bench" / "planner_nvme"))
    p.add_argument("--json", default=str(ROOT / "runs" / "bench" / "planner.json"))
    p.add_argument("--skip-hand-written", action="store_true", help="run the planner's plans only")
    p.add_argument("--report", nargs="+", default=None, metavar="JSON",
                   help="print the table of earlier runs' --json files (cases in order)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- configs ---------------------------------------------------------------------------------


def _base(case: Case) -> dict:
    return {"train_batch_size": case.batch, "steps_per_print": 10**9, "bf16": {"enabled": True},
            "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}}}  # fmt: skip


def _planner_section(case: Case) -> dict:
    return {"planner": {"host_memory": case.node_bytes}} if case.limit == "config" else {}


def planned_config(case: Case, nvme: str) -> dict:
    path = {"nvme_path": nvme} if case.nvme else {}
    zero = {"stage": "auto", "offload_optimizer": {"device": "auto", **path},
            "offload_param": {"device": "auto", **path}, **case.extra}  # fmt: skip
    return {**_base(case), "train_micro_batch_size_per_gpu": "auto", "zero_optimization": zero,
            "activation_checkpointing": {"policy": "auto"}, **_planner_section(case)}  # fmt: skip


def hand_written_config(case: Case, name: str, nvme: str) -> dict:
    micro = min(8, case.batch // case.world)
    cfg = {**_base(case), "train_micro_batch_size_per_gpu": micro, **_planner_section(case)}
    if name.startswith("zero-"):
        cfg["zero_optimization"] = {"stage": int(name[-1])}
    elif name == "demo":
        cfg["zero_optimization"] = {"stage": 3}
        cfg["activation_checkpointing"] = {"policy": "blocks"}
    else:
        sub = 100_000_000 if name == "infinity" else 1_000_000
        cfg["zero_optimization"] = {
            "stage": 3, "sub_group_size": sub,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 4},
            "offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0},
        }  # fmt: skip
    return cfg


# -- one run (a worker under torchrun) -------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "examples"))
    import terascale
    from gpt import GPT, GPTConfig
    from terascale.plan.apply import last_plan

    job = json.loads(Path(args.worker).read_text())
    case = Case(**job["case"])
    torch.set_num_threads(max(1, args.threads // case.world))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=case.vocab, block_size=case.seq, n_layer=case.layers, n_head=case.heads,
                          n_embd=case.width)).bfloat16()  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    data = [(ids, ids) for ids in torch.randint(0, case.vocab, (4 * case.batch, case.seq), generator=gen)]
    if case.limit == "ulimit":  # as `ulimit -v` would: the address space may grow by the limit from here
        import resource

        import psutil

        room = psutil.Process().memory_info().vms + case.node_bytes // case.world
        resource.setrlimit(resource.RLIMIT_AS, (room, resource.RLIM_INFINITY))
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts here
    out: dict = {"rank": int(os.environ.get("RANK", "0"))}
    try:
        engine, _, loader, _ = terascale.initialize(model=model, config=job["config"], training_data=data)
    except ValueError as err:
        out["refused"] = str(err)
        _write(job, out)
        return
    plan = last_plan()
    batches = iter(loader)
    times, cpu = [], []
    for _ in range(args.steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(engine.gradient_accumulation_steps()):
            ids, labels = next(batches)
            engine.backward(engine(ids, labels))
            engine.step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    status = Path("/proc/self/status").read_text()
    peak = int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024
    cfg = engine.config
    out.update(
        times=times, cpu_times=cpu, peak=peak, predicted=plan.peak(), plan=plan.chosen.label(),
        parts=[(p.category, p.tier, p.bytes) for p in plan.chosen.parts],
        resolved=[str(r) for r in cfg.resolved], micro=cfg.train_micro_batch_size_per_gpu,
        stage=cfg.zero_optimization.stage, host_limit=plan.machine.host.bytes, host_source=plan.machine.host.source,
    )  # fmt: skip
    engine.destroy()
    if dist.is_initialized():
        dist.barrier()
    _write(job, out)


def _write(job: dict, out: dict) -> None:
    Path(f"{job['result']}.{out['rank']}").write_text(json.dumps(out))


# -- the driver ------------------------------------------------------------------------------


def _cgroup_dir() -> Path | None:
    """A fresh child of this process's memory cgroup (v1 or v2), or None where there is none to make."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            limit_file = "memory.limit_in_bytes"
            break
        if hid == "0" and controllers == "":
            base, limit_file = Path("/sys/fs/cgroup") / path.lstrip("/"), "memory.max"
    else:
        return None
    child = base / f"terascale_bench_{os.getpid()}"
    try:
        child.mkdir()
        return child if (child / limit_file).exists() else None
    except OSError:
        return None


def run(case: Case, config: dict, args: argparse.Namespace, label: str) -> list[dict]:
    """One job of ``case`` with ``config`` under the case's limit; each rank's report."""
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        result = Path(tmp) / "result"
        job.write_text(json.dumps({"case": case.__dict__, "config": config, "result": str(result)}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={case.world}",
               __file__, f"--worker={job}", f"--steps={args.steps}", f"--threads={args.threads}"]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // case.world)),
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        cgroup = None
        preexec = None
        if case.limit == "cgroup":
            cgroup = _cgroup_dir()
            if cgroup is None:
                raise SystemExit(f"{case.name}: cannot make a memory cgroup here")
            name = "memory.limit_in_bytes" if (cgroup / "memory.limit_in_bytes").exists() else "memory.max"
            (cgroup / name).write_text(str(case.node_bytes))
            procs = cgroup / "cgroup.procs"
            preexec = lambda: procs.write_text(str(os.getpid()))  # noqa: E731
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, preexec_fn=preexec)
        finally:
            if cgroup is not None:
                for _ in range(50):
                    try:
                        cgroup.rmdir()
                        break
                    except OSError:
                        time.sleep(0.1)
        reports = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("result.*"))]
        if len(reports) < case.world:
            tail = (proc.stderr or "")[-800:].strip().splitlines()
            return [{"failed": f"exit {proc.returncode}: {tail[-1] if tail else ''}"}]
        return reports


MARGIN = 0.1  # the planner's default margin, held against every run alike


def cap_per_rank(case: Case) -> float:
    """The peak a run of ``case`` may reach per rank to fit: the same test the planner's
    plan passes, its share of the limit less the planner's margin, for a config cap and a
    memory cgroup alike (a hand-written config that ran within a few percent of a cgroup's
    limit is one longer batch from the OOM killer: it is not a config to hold a plan to).
    An address-space limit bounds virtual memory, not the resident peak: there a run that
    ended fits."""
    return case.node_bytes / case.world * (1 - MARGIN) if case.limit in ("config", "cgroup") else float("inf")


def refit(results: list[dict]) -> list[dict]:
    """``results`` (as written to ``--json``) with each run's fit and the best hand-written
    one decided again by :func:`cap_per_rank`."""
    for row in results:
        case = Case(**row["case"])
        for name, rs in row["runs"].items():
            for r in rs:
                if "peak" in r:
                    r["ok"] = r["peak"] <= cap_per_rank(case)
        fitting = [n for n, rs in row["runs"].items() if n != "planner" and rs[0].get("ok")]
        for name in row["hand_written"]:
            row["hand_written"][name]["ok"] = row["runs"][name][0].get("ok", False)
        row["best"] = min(fitting, key=lambda n: row["hand_written"][n]["step_s"]) if fitting else None
    return results


def summarize(reports: list[dict], case: Case) -> dict:
    """One run's outcome: whether it fits, its peak and prediction (worst rank), its step time."""
    if any("failed" in r or "refused" in r for r in reports):
        why = next(r.get("failed") or r.get("refused") for r in reports if "failed" in r or "refused" in r)
        return {"ok": False, "why": why[:300]}
    worst = max(reports, key=lambda r: r["peak"])
    fits = worst["peak"] <= cap_per_rank(case)
    return {"ok": fits, "why": "" if fits else "over the limit",
            "peak": worst["peak"], "predicted": worst["predicted"], "ratio": worst["predicted"] / worst["peak"],
            "step_s": statistics.median(reports[0]["times"][1:]), "plan": reports[0]["plan"],
            "step_cpu_s": max(statistics.median(r["cpu_times"][1:]) for r in reports),
            "host_source": reports[0]["host_source"], "resolved": reports[0]["resolved"]}  # fmt: skip


def bench_case(case: Case, args: argparse.Namespace) -> dict:
    """The planner's run and the hand-written ones, then ``--repeats`` - 1 more rounds of the
    planner's and the two fastest hand-written that fit, in rotating order; step times are
    the medians over the rounds."""
    nvme = str(Path(args.nvme_dir) / case.name)
    shutil.rmtree(nvme, ignore_errors=True)
    Path(nvme).mkdir(parents=True, exist_ok=True)
    configs = {"planner": planned_config(case, nvme)}
    runs: dict[str, list[dict]] = {"planner": [summarize(run(case, configs["planner"], args, "planner"), case)]}
    print(f"  {case.name} planner: {runs['planner'][0]}", file=sys.stderr, flush=True)
    if not args.skip_hand_written:
        for name in HAND_WRITTEN if case.nvme else HAND_WRITTEN[:5]:
            if name in ("infinity", "demo-nvme") and any(r[0]["ok"] for n, r in runs.items() if n != "planner"):
                continue  # an in-memory example fits: the NVMe ones would only be slower
            configs[name] = hand_written_config(case, name, nvme)
            runs[name] = [summarize(run(case, configs[name], args, name), case)]
            print(f"  {case.name} {name}: {runs[name][0]}", file=sys.stderr, flush=True)
    fitting = sorted((n for n in runs if n != "planner" and runs[n][0]["ok"]), key=lambda n: runs[n][0]["step_s"])
    contenders = ["planner", *fitting[:2]] if runs["planner"][0]["ok"] or runs["planner"][0].get("peak") else []
    for round_ in range(1, args.repeats if contenders else 1):
        for name in contenders[round_ % len(contenders):] + contenders[: round_ % len(contenders)]:
            runs[name].append(summarize(run(case, configs[name], args, name), case))
    step = {n: statistics.median(r["step_s"] for r in rs if "step_s" in r) for n, rs in runs.items()
            if any("step_s" in r for r in rs)}  # fmt: skip
    cpu = {n: statistics.median(r["step_cpu_s"] for r in rs if "step_cpu_s" in r) for n, rs in runs.items()
           if any("step_cpu_s" in r for r in rs)}  # fmt: skip
    best = min(fitting, key=lambda n: step[n]) if fitting else None
    return {"case": case.__dict__, "planned": runs["planner"][0], "planned_step_s": step.get("planner"),
            "planned_step_cpu_s": cpu.get("planner"),
            "hand_written": {n: {**rs[0], "step_s": step.get(n), "step_cpu_s": cpu.get(n)} for n, rs in runs.items()
                             if n != "planner"},
            "best": best, "runs": runs}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.report:
        print_table(refit([row for path in args.report for row in json.loads(Path(path).read_text())]))
        return
    results = []
    for case in [c for c in CASES if c.name in args.cases.split(",")]:
        results.append(bench_case(case, args))
        print(f"{case.name}: best hand-written {results[-1]['best']}", file=sys.stderr, flush=True)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    print_table(results)


def print_table(results: list[dict]) -> None:
    print("\n| case | limit (node) | ranks | chosen plan | predicted / measured peak per rank (MiB) | ratio | "
          "step wall / CPU (s) | best hand-written: wall / CPU (s) | chosen / best, wall / CPU |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in results:
        case, p = row["case"], row["planned"]
        limit = "none" if case["limit"] == "none" else f"{case['limit']} {case['node_bytes'] / GIB:.2f} GiB"
        if not p.get("peak"):
            print(f"| {case['name']} | {limit} | {case['world']} | failed: {p['why']} | | | | | |")
            continue
        best = row["best"]
        wall, cpu = row["planned_step_s"], row.get("planned_step_cpu_s")
        mine = f"{wall:.2f} / {cpu:.2f}" if cpu else f"{wall:.2f}"
        if best:
            h = row["hand_written"][best]
            hand = f"{best}: {h['step_s']:.2f}" + (f" / {h['step_cpu_s']:.2f}" if h.get("step_cpu_s") else "")
            vs = f"{wall / h['step_s']:.2f}" + (f" / {cpu / h['step_cpu_s']:.2f}" if cpu and h.get("step_cpu_s") else "")
        else:
            hand, vs = "none fits", "-"
        print(f"| {case['name']} | {limit} | {case['world']} | {p['plan']} | {p['predicted'] / 2**20:.0f} / "
              f"{p['peak'] / 2**20:.0f} | {p['ratio']:.3f} | {mine} | {hand} | {vs} |")


if __name__ == "__main__":
    main()
