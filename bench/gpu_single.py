"""Single-GPU headline figures: ZeRO-Offload at 1.3B, the largest model, MFU in memory.

    python bench/gpu_single.py --json runs/bench/gpu_single.json             # on a GPU
    python bench/gpu_single.py --quick --json /tmp/q.json                    # code paths, CPU

Three measurements on one device (world size 1), terascale and DeepSpeed side by side
when DeepSpeed imports (its CUDA ops build on first use: ``--ds-extensions`` keeps them):

- ``offload``: a GPT of ~1.3B parameters (24 layers, width 2048, GPT-3 XL's shape), bf16,
  ZeRO-3 with the optimizer state and the AdamW step on the host (ZeRO-Offload's headline
  case). Both libraries get the same DeepSpeed config and the same tokens; tokens/s and
  TFLOP/s per system, with each step's loss (the first must agree to bf16 rounding). Then
  the same with ``bf16_master_weights_and_grads`` and ``bf16_optimizer_states``; then terascale
  with ``offload_optimizer.overlap_step`` ([Note: the overlapped host step]), fp32 and bf16
  states. Every job reports the seconds a step spent at its boundary (``engine.step()`` of
  the window's last micro-step: the synchronous host step, or the wait for the overlapped
  one) and terascale's waits by cause (``wait_breakdown()``: gathers, reductions, the host
  step, swap I/O).
- ``largest``: the largest GPT that trains with parameters and optimizer state on the host
  (ZeRO-3, ``offload_param`` and ``offload_optimizer`` to cpu, built inside ``zero.Init``).
  Width 4096 (32 heads), the number of layers searched upwards from an estimate of what the
  host memory holds, one step a probe (its time includes creating the optimizer state), until
  a probe fails or the time the budget leaves is spent; a job
  that drives available host memory under ``--host-floor-gib`` is stopped and counts as not
  fitting (instead of waking the kernel's OOM killer). The search is the same for both.
  One more terascale job with ``wall_clock_breakdown`` logs where its step spends the time.
- ``inmem``: MFU of the 1.3B model with everything on the device (terascale stage 0 and
  stage 3): model FLOPs (Megatron's count without the recomputed forward) per second over
  the device's dense bf16 peak.

Every job is its own process (world size 1, ``nccl``/``gloo`` from the device). Results,
every job's raw numbers and the errors of failed jobs go to ``--json``; a markdown table
goes to stdout. ``--quick`` shrinks every model to a few layers and runs the same code on
whatever device there is, so the script can be checked on a CPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 50304
# Dense bf16 peak of the data sheet, by a substring of the device name (SXM parts).
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="offload,inmem,largest", help="comma-separated: offload, inmem, largest")
    p.add_argument("--systems", default="terascale,deepspeed")
    p.add_argument("--budget-s", type=float, default=330.0, help="wall-clock budget of the whole run")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--gas", type=int, default=2, help="gradient accumulation steps of the offload run")
    p.add_argument("--steps", type=int, default=4, help="steps per timed job; the first is left out")
    p.add_argument("--host-floor-gib", type=float, default=4.0)
    p.add_argument("--ds-extensions", default="/tmp/ds-ext", help="TORCH_EXTENSIONS_DIR for DeepSpeed's ops")
    p.add_argument("--ds-python", default=sys.executable, help="the python that imports deepspeed")
    p.add_argument("--largest-probes", type=int, default=6, help="most probes per system in the search")
    p.add_argument("--quick", action="store_true", help="tiny models on any device: checks the code paths")
    p.add_argument("--json", default=str(ROOT / "runs" / "bench" / "gpu_single.json"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: the job's JSON spec
    return p.parse_args(argv)


def gpt_params(layers: int, width: int, seq: int, vocab: int = VOCAB) -> int:
    """Parameters of ``examples/gpt``'s GPT (tied head): blocks, embeddings, final norm."""
    per_block = 12 * width * width + 13 * width
    return layers * per_block + (vocab + seq) * width + 2 * width


def model_flops_per_token(layers: int, width: int, seq: int, vocab: int = VOCAB) -> float:
    """Training FLOPs per token, forward + backward, no recompute (3/4 of Megatron's count)."""
    return 72.0 * layers * width * width * (1.0 + seq / (6.0 * width) + vocab / (16.0 * layers * width))


# -- one job (its own process, world size 1) -----------------------------------------------


def _config(spec: dict) -> dict:
    zero: dict = {"stage": spec["stage"]}
    if spec["offload_optimizer"]:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True,
                                     **({"overlap_step": True, "overlap_step_warmup": 0} if spec.get("overlap") else {})}
    if spec["offload_param"]:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": spec["micro_batch"],
        "gradient_accumulation_steps": spec["gas"],
        # The breakdown job logs the last step's phases (synchronised: not the timed jobs).
        "steps_per_print": spec["steps"] if spec.get("breakdown") else 10**9,
        "wall_clock_breakdown": bool(spec.get("breakdown")),
        # bf16 masters and Adam moments ([Note: bf16 masters and optimizer states]).
        "bf16": {"enabled": spec["bf16"], **({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
                                             if spec.get("bf16_states") else {})},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": zero,
    }


def _build_model(spec: dict, lib, config: dict, device):
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=spec["vocab"], block_size=spec["seq"], n_layer=spec["layers"],
                    n_head=spec["heads"], n_embd=spec["width"])
    if spec["offload_param"]:  # straight into host shards: the host never holds two copies
        if spec["system"] == "deepspeed":
            with lib.zero.Init(config_dict_or_path=config, remote_device="cpu", pin_memory=True):
                return GPT(cfg)
        with lib.zero.Init(config=config):
            return GPT(cfg)
    if spec.get("build_on_device") and device.type == "cuda":
        with torch.device(device):
            return GPT(cfg)
    return GPT(cfg)


def worker(spec: dict, result: Path) -> None:
    import torch

    torch.set_num_threads(spec["threads"])
    if spec.get("breakdown"):  # the engine's print line goes to the job's log
        import logging

        logging.basicConfig(level=logging.INFO, format="%(message)s")
    cuda = torch.cuda.is_available()
    if spec["system"] == "deepspeed":
        import deepspeed as lib

        lib.init_distributed(dist_backend="nccl" if cuda else "gloo")
    else:
        import terascale as lib
        from terascale.comm import init_distributed

        init_distributed()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    config = _config(spec)
    out: dict = {"spec": spec, "fits": False}
    try:
        t0 = time.perf_counter()
        model = _build_model(spec, lib, config, device)
        engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=config)
        out["init_s"] = time.perf_counter() - t0
        gen = torch.Generator().manual_seed(1)
        mb, seq, gas = spec["micro_batch"], spec["seq"], spec["gas"]
        times, losses, boundary = [], [], []
        for _ in range(spec["steps"]):
            batches = [torch.randint(0, spec["vocab"], (mb, seq + 1), generator=gen) for _ in range(gas)]
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            step_loss = 0.0
            for k, rows in enumerate(batches):
                rows = rows.to(device, non_blocking=True)
                loss = engine(rows[:, :-1], rows[:, 1:])
                engine.backward(loss)
                at = time.perf_counter()
                engine.step()
                if k == gas - 1:  # the boundary: the host step, or the wait for the one behind
                    boundary.append(time.perf_counter() - at)
                step_loss += loss.detach().float() / gas
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            losses.append(float(step_loss))
        out.update(fits=True, times=times, losses=losses, boundary_s=boundary)
        waits = getattr(getattr(engine, "model_state", None), "wait_breakdown", None)
        if waits is not None:  # terascale: seconds blocked, by cause, over all steps
            out["waits_s"] = waits()
    except torch.cuda.OutOfMemoryError as e:  # the device ran out: the probe does not fit
        out["error"] = f"device out of memory: {str(e).splitlines()[0]}"
    out["peak_device_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    result.write_text(json.dumps(out))


# -- the driver ------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(spec: dict, args: argparse.Namespace, timeout_s: float) -> dict:
    """Run one job in its own process; its result, or ``{"fits": False, "error": ...}`` when it
    failed, ran out of time or pushed host memory under the floor (then it is killed)."""
    import psutil

    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": str(spec["threads"]),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    python = sys.executable
    if spec["system"] == "deepspeed":
        env["TORCH_EXTENSIONS_DIR"] = args.ds_extensions
        python = args.ds_python
        if not _has_cuda():
            env["DS_ACCELERATOR"] = "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        log = Path(tmp) / "log"
        cmd = [python, __file__, f"--worker={json.dumps(spec)}", f"--json={result}"]
        with open(log, "w") as sink:
            proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)
            deadline, stopped = time.monotonic() + timeout_s, None
            while proc.poll() is None:
                if psutil.virtual_memory().available < args.host_floor_gib * 2**30:
                    stopped = f"stopped: available host memory under {args.host_floor_gib} GiB"
                elif time.monotonic() > deadline:
                    stopped = f"stopped: over its {timeout_s:.0f} s"
                if stopped:
                    for child in psutil.Process(proc.pid).children(recursive=True):
                        child.kill()
                    proc.kill()
                    proc.wait()
                    break
                time.sleep(0.25)
        if result.exists():
            return {**json.loads(result.read_text()), "log_tail": log.read_text()[-3000:]}
        tail = log.read_text()[-1500:]
        return {"spec": spec, "fits": False, "error": stopped or f"exit {proc.returncode}: {tail}"}


def _spec(args: argparse.Namespace, system: str, **kw) -> dict:
    spec = {"system": system, "layers": 24, "width": 2048, "heads": 16, "seq": args.seq, "vocab": VOCAB,
            "micro_batch": args.micro_batch, "gas": 1, "steps": args.steps, "stage": 3, "bf16": True,
            "offload_optimizer": False, "offload_param": False, "threads": os.cpu_count() or 1}
    spec.update(kw)
    if args.quick:  # the same code on a few small layers: checks the paths on any machine
        args.largest_probes = min(args.largest_probes, 2)
        spec.update(layers=min(spec["layers"], 2), width=min(spec["width"], 128), heads=4, seq=32, vocab=512,
                    micro_batch=2, steps=min(spec["steps"], 2), threads=min(spec["threads"], 2))
    return spec


def _rates(res: dict) -> dict:
    """Median tokens/s and model TFLOP/s of a job's steps after the first."""
    import statistics

    s = res["spec"]
    step_s = statistics.median(res["times"][1:] or res["times"])
    tokens = s["micro_batch"] * s["gas"] * s["seq"]
    flops = tokens * model_flops_per_token(s["layers"], s["width"], s["seq"], s["vocab"])
    boundary = res.get("boundary_s", [])[1:]
    out = {"step_s": step_s, "tokens_per_s": tokens / step_s, "tflops": flops / step_s / 1e12,
           "params": gpt_params(s["layers"], s["width"], s["seq"], s["vocab"]),
           # the share of a step the training thread spent at the boundary (the device idles there)
           "boundary_share": statistics.median(boundary) / step_s if boundary else None}
    if "waits_s" in res:
        out["waits_s_per_step"] = {k: v / max(1, len(res["times"])) for k, v in res["waits_s"].items()}
    return out


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _device() -> tuple[str, float | None]:
    import torch

    if not _has_cuda():
        return "cpu", None
    name = torch.cuda.get_device_name(0)
    return name, next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def _available(system: str, args: argparse.Namespace) -> bool:
    if system != "deepspeed":
        return True
    probe = [args.ds_python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('deepspeed') is None)"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def largest_start_layers(host_available_bytes: int, width: int, seq: int, bytes_per_param: float = 18.0) -> int:
    """First probe of the search: the layers whose parameters, at ``bytes_per_param`` of host
    state each (fp32 master and two moments, the bf16 shard and its gradient), fill 80% of
    the available host memory."""
    per_layer = 12 * width * width + 13 * width
    return max(1, int(0.8 * host_available_bytes / bytes_per_param - (VOCAB + seq) * width) // per_layer)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker), Path(args.json))
        return {}
    import psutil

    start = time.monotonic()
    left = lambda: args.budget_s - (time.monotonic() - start)  # noqa: E731
    device, peak = _device()
    systems = [s for s in args.systems.split(",") if s]
    skipped = {s: "not installed" for s in systems if not _available(s, args)}
    systems = [s for s in systems if s not in skipped]
    parts = [p for p in args.parts.split(",") if p]
    report: dict = {"device": device, "peak_bf16_tflops": peak, "skipped": skipped, "jobs": [], "figures": {}}
    figures = report["figures"]

    def job(spec: dict, timeout: float) -> dict:
        res = run_job(spec, args, max(10.0, timeout))
        report["jobs"].append(res)
        status = "ok" if res.get("fits") else res.get("error", "failed")[:200]
        print(f"[{time.monotonic() - start:6.0f} s] {spec['system']} {spec['stage']} L{spec['layers']} "
              f"W{spec['width']}: {status}", file=sys.stderr, flush=True)
        return res

    if "offload" in parts:  # ZeRO-Offload at 1.3B, both systems, the same config and tokens
        for system in systems:
            res = job(_spec(args, system, gas=args.gas, offload_optimizer=True), min(150.0, left()))
            if res.get("fits"):
                figures[f"offload_1.3B_{system}"] = {**_rates(res), "losses": res["losses"],
                                                     "peak_device_gib": res["peak_device_gib"],
                                                     "peak_rss_gib": res["peak_rss_gib"]}
        for system in systems:  # the same with bf16 masters and moments on the host (half the host traffic)
            res = job(_spec(args, system, gas=args.gas, offload_optimizer=True, bf16_states=True), min(150.0, left()))
            if res.get("fits"):
                figures[f"offload_1.3B_{system}_bf16_states"] = {**_rates(res), "losses": res["losses"],
                                                                 "peak_device_gib": res["peak_device_gib"],
                                                                 "peak_rss_gib": res["peak_rss_gib"]}
        if "terascale" in systems:  # the host step behind the next window, fp32 and bf16 states
            for states in (False, True):
                res = job(_spec(args, "terascale", gas=args.gas, offload_optimizer=True, bf16_states=states,
                                overlap=True), min(150.0, left()))
                if res.get("fits"):
                    figures["offload_1.3B_terascale_overlap" + ("_bf16_states" if states else "")] = {
                        **_rates(res), "losses": res["losses"], "peak_device_gib": res["peak_device_gib"],
                        "peak_rss_gib": res["peak_rss_gib"]}
        if "terascale" in systems:  # where terascale's offload step spends its time (its own log line)
            res = job(_spec(args, "terascale", gas=args.gas, offload_optimizer=True, steps=2, breakdown=True),
                      min(120.0, left()))
            figures["offload_1.3B_terascale_breakdown"] = {"log": res.get("log_tail", res.get("error", ""))[-1500:]}
    if "inmem" in parts:  # everything on the device: MFU
        for stage in (0, 3):
            res = job(_spec(args, "terascale", stage=stage, build_on_device=True), min(120.0, left()))
            if res.get("fits"):
                rates = _rates(res)
                rates["mfu"] = rates["tflops"] / peak if peak else None
                figures[f"inmem_1.3B_terascale_stage{stage}"] = {**rates, "peak_device_gib": res["peak_device_gib"]}
    if "largest" in parts:  # upwards from the estimate while probes fit; downwards if the first does not
        width, heads = (4096, 32) if not args.quick else (128, 4)
        first = largest_start_layers(psutil.virtual_memory().available, width, args.seq) if not args.quick else 2
        per_system = max(0.0, left() - 5) / max(1, len(systems))
        for system in systems:
            system_end = time.monotonic() + per_system
            layers, best, tried, ceiling = first, None, [], None
            while (time.monotonic() < system_end - 10 and len(tried) < args.largest_probes and layers >= 1
                   and (ceiling is None or layers < ceiling)):
                spec = _spec(args, system, layers=layers, width=width, heads=heads, micro_batch=1, steps=1,
                             offload_optimizer=True, offload_param=True)
                res = job(spec, system_end - time.monotonic())
                tried.append({"layers": layers, "fits": res.get("fits", False), "error": res.get("error")})
                if res.get("fits"):
                    best = {**_rates(res), "layers": layers, "peak_rss_gib": res["peak_rss_gib"]}
                    layers += max(1, layers // 4)
                elif best is None:
                    ceiling, layers = layers, layers - max(1, layers // 4)
                else:
                    break
            stopped_by = "a probe that did not fit" if tried and not tried[-1]["fits"] and best else "budget"
            figures[f"largest_{system}"] = {"best": best, "tried": tried, "stopped_by": stopped_by}
    report["elapsed_s"] = time.monotonic() - start
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report))
    return report


def markdown(report: dict) -> str:
    """The figures as a markdown table (one row per measurement)."""
    rows = [f"device: {report['device']} (dense bf16 peak {report['peak_bf16_tflops']} TFLOP/s)", "",
            "| measurement | params | step s | tokens/s | TFLOP/s | MFU | peak device GiB | peak host RSS GiB | "
            "at the boundary | waits a step s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, f in report["figures"].items():
        if "log" in f:
            continue
        if name.startswith("largest_"):
            best = f["best"] or {}
            rows.append(f"| {name} ({f['stopped_by']}; tried layers {[t['layers'] for t in f['tried']]}) | "
                        f"{best.get('params', 0) / 1e9:.2f}B | {best.get('step_s', 0):.2f} | "
                        f"{best.get('tokens_per_s', 0):.0f} | {best.get('tflops', 0):.1f} | | | "
                        f"{best.get('peak_rss_gib', 0):.1f} |")
            continue
        mfu = f"{100 * f['mfu']:.1f}%" if f.get("mfu") else ""
        device = f"{f['peak_device_gib']:.1f}" if f.get("peak_device_gib") is not None else ""
        rss = f"{f['peak_rss_gib']:.1f}" if f.get("peak_rss_gib") is not None else ""
        share = f"{100 * f['boundary_share']:.0f}%" if f.get("boundary_share") is not None else ""
        waits = ", ".join(f"{k} {v:.2f}" for k, v in f.get("waits_s_per_step", {}).items())
        rows.append(f"| {name} | {f['params'] / 1e9:.2f}B | {f['step_s']:.3f} | {f['tokens_per_s']:.0f} | "
                    f"{f['tflops']:.1f} | {mfu} | {device} | {rss} | {share} | {waits} |")
    for name, f in report["figures"].items():
        if "log" in f:
            rows.append(f"\n{name}:\n```\n{f['log'].strip()}\n```")
    for system, why in report["skipped"].items():
        rows.append(f"\n{system}: skipped ({why})")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
