"""Host Adam step time: terascale's chunked step vs torch's AdamW and DeepSpeed's CPUAdam.

Two jobs over ``--numel`` fp32 master elements (default 100M), each system in its own
process, interleaved and repeated; medians of ``--steps`` timed steps:

- ``fp32``: fp32 gradients in, fp32 masters updated (the optimizer kernel alone);
- ``bf16``: the ZeRO-Offload host step: a bf16 gradient shard in, fp32 masters and
  moments updated, the bf16 parameter shard written. torch and DeepSpeed widen the
  gradient before and narrow the master after their kernel (what DeepSpeed's ZeRO-Offload
  does around CPUAdam); terascale does the three per cached chunk ([Note: host Adam]).

Effective GB/s counts the traffic a step cannot avoid: fp32 job 28 bytes per element
(read master, moments, gradient; write master, moments), bf16 job 28 (2 + 24 + 2).
``terascale-8bit`` (not in the default list) is ``AdamW8bit``'s step on the same job
([Note: compact optimizer states]); its GB/s column counts the same 28 bytes, so it reads
as the fp32 step's equivalent, not as its own traffic (16 bytes an element).
``terascale-bf16`` (not in the default list) keeps the masters and moments in bf16
([Note: bf16 masters and optimizer states]; 14 bytes an element of traffic), read likewise.

    python bench/cpu_adam.py --threads 2 --repeats 3 --peers-python /tmp/peers/bin/python
    python bench/cpu_adam.py --threads 1 --numel 3e7 --jobs bf16 --systems terascale,terascale-8bit,torch-fused
    python bench/cpu_adam.py --threads 1 --numel 3e7 --jobs bf16 --systems terascale,terascale-bf16,torch-fused
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("terascale", "torch-fused", "torch-foreach", "deepspeed-cpuadam")
BYTES_PER_ELEMENT = 28


def run_one(system: str, job: str, numel: int, steps: int, threads: int) -> list[float]:
    """Time ``steps`` steps of ``system`` on ``job``; returns seconds per step (in-process)."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    master = torch.nn.Parameter(torch.randn(numel) * 0.02)
    lowp = torch.bfloat16 if job == "bf16" else torch.float32
    grad = (torch.randn(numel) * 1e-3).to(lowp)
    param_out = master.detach().to(torch.bfloat16) if job == "bf16" else None
    one = torch.ones(())
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    if system == "terascale":
        sys.path.insert(0, str(ROOT))
        from terascale.offload import host_adam

        opt = torch.optim.AdamW([master], fused=True, **kw)

        def step() -> None:
            host_adam.step(opt, [master], [grad], one, [param_out])

    elif system == "terascale-bf16":
        sys.path.insert(0, str(ROOT))
        from terascale.offload import host_adam
        from terascale.optim.rounding import StochasticRounding

        # bf16 masters (the bf16 parameter shard itself) and bf16 moments, rounded stochastically.
        master = torch.nn.Parameter(master.detach().bfloat16())
        opt = torch.optim.AdamW([master], fused=True, **kw)
        rounding = StochasticRounding(host_adam.CHUNK_NUMEL)

        def step() -> None:
            host_adam.step(opt, [master], [grad.bfloat16()], one, state_dtype=torch.bfloat16, rounding=rounding,
                           positions=[0])  # fmt: skip

    elif system == "terascale-8bit":
        sys.path.insert(0, str(ROOT))
        from terascale.optim.compact import CompactAdam

        compact = CompactAdam([master], **kw)

        def step() -> None:
            compact.step_with([master], [grad], one, [param_out])

    else:
        if system == "deepspeed-cpuadam":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            opt = DeepSpeedCPUAdam([master], adamw_mode=True, **kw)
        else:
            opt = torch.optim.AdamW([master], fused=system == "torch-fused", foreach=system == "torch-foreach", **kw)

        def step() -> None:
            master.grad = grad if job == "fp32" else grad.float()  # widen
            opt.step()
            if param_out is not None:
                param_out.copy_(master.detach())  # narrow
            master.grad = None

    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=float, default=1e8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--jobs", default="bf16,fp32")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--peers-python", default=None, help="python with DeepSpeed (CPUAdam builds on first use)")
    ap.add_argument("--json", default=str(ROOT / "runs" / "bench" / "cpu_adam.json"))
    ap.add_argument("--worker", nargs=2, metavar=("SYSTEM", "JOB"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    numel = int(args.numel)
    if args.worker:
        print(json.dumps(run_one(args.worker[0], args.worker[1], numel, args.steps, args.threads)))
        return

    systems = [s for s in args.systems.split(",") if s != "deepspeed-cpuadam" or args.peers_python]
    jobs = args.jobs.split(",")
    results: dict[str, dict[str, list[float]]] = {j: {s: [] for s in systems} for j in jobs}
    failed: dict[str, str] = {}
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), DS_ACCELERATOR="cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/peers-ext")
    for r in range(args.repeats):
        for job in jobs:
            order = systems[r % len(systems) :] + systems[: r % len(systems)]
            for system in order:
                if system in failed:
                    continue
                python = args.peers_python if system == "deepspeed-cpuadam" else sys.executable
                cmd = [python, __file__, "--numel", str(numel), "--steps", str(args.steps),
                       "--threads", str(args.threads), "--worker", system, job]  # fmt: skip
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if proc.returncode != 0:
                    failed[system] = (proc.stderr.strip().splitlines() or ["failed"])[-1]
                    print(f"{system}: failed: {failed[system]}", flush=True)
                    continue
                times = json.loads(proc.stdout.strip().splitlines()[-1])
                results[job][system].extend(times)
                print(f"repeat {r} {job} {system:18s} {statistics.median(times) * 1e3:8.1f} ms/step", flush=True)

    print(f"\nAdamW over {numel / 1e6:.0f}M elements, {args.threads} thread(s), {args.repeats} interleaved repeats x {args.steps} steps, medians\n")
    print("| job | system | ms/step | effective GB/s | terascale speed-up |")
    print("| --- | --- | --- | --- | --- |")
    for job in jobs:
        med = {s: statistics.median(t) for s, t in results[job].items() if t}
        for s, m in med.items():
            speedup = f"{m / med['terascale']:.2f}x" if "terascale" in med else "-"
            print(f"| {job} | {s} | {m * 1e3:.1f} | {BYTES_PER_ELEMENT * numel / m / 1e9:.1f} | {speedup} |")
    for s, why in failed.items():
        print(f"\n{s} did not run: {why}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"numel": numel, "results": results, "failed": failed}, indent=1))


if __name__ == "__main__":
    main()
