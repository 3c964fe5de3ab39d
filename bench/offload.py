"""NVMe-offloaded training: step time against the disk-traffic floor, and the largest model.

    python bench/offload.py --layers 8 --width 2048 --repeats 3 --steps 4      # the floor
    python bench/offload.py --layers 20 --width 4096 --repeats 1 --steps 2     # ~4B params
    python bench/offload.py ... --step-in-backward false,auto                  # both, interleaved

A GPT (``examples/gpt``) trains at ZeRO stage 3 in bf16 with its parameter shards
(``offload_param``) and its fp32 masters and AdamW state (``offload_optimizer``) on
NVMe under ``--dir``, built inside ``zero.Init`` straight to NVMe, so host memory never
holds the model. Each job runs under ``torchrun`` and reports, per step, the time, the
bytes its swap files moved (``engine.offload_io()``) and the peak RSS.

The floor of a step is the time the disk needs for those bytes at its raw speed:
``read bytes / read GB/s + write bytes / write GB/s``, with the raw speed the best of fio
(O_DIRECT, sequential, 1 MiB blocks, 4 jobs x queue depth 32) and terascale's engine at
its defaults, rewriting and reading ``--fio-gib`` in the same directory right before each
job (``bench/aio_peers.disk_speed``), so the floor and the step see the same disk (this
machine's disk speed drifts by 2x over minutes). The first step is left out: it creates
the optimizer state and moves different bytes. The largest-model figure is the same
measurement on a model whose states exceed host memory. After the table, a timeline of
rank 0's steps says how much of the I/O ran under compute (``bench/io_timeline.py``).
``--step-in-backward`` sets ``offload_optimizer.step_in_backward`` ([Note: the optimizer
step under backward]), or with ``overlap`` runs the step behind the next window instead
(``overlap_step``, [Note: the overlapped host step]); several values run one job each per
repeat, in turn.
``--bf16-states`` keeps the masters and Adam's moments in bf16 ([Note: bf16 masters and
optimizer states]): 2 + 4 bytes an element in the optimizer's files instead of 4 + 8.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=str(ROOT / "runs" / "bench" / "offload"), help="the NVMe directory")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--threads", type=int, default=2, help="torch threads per rank")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="steps per job; the first is left out")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--sub-group-size", type=int, default=50_000_000)
    p.add_argument("--opt-buffers", type=int, default=4, help="offload_optimizer.buffer_count")
    p.add_argument("--param-buffers", type=int, default=5, help="offload_param.buffer_count")
    p.add_argument("--fio-gib", type=float, default=2.0)
    p.add_argument("--aio", default="", help='the aio section: JSON, or "auto" (default: none, the engine\'s defaults)')
    p.add_argument("--step-in-backward", default="auto",
                   help="offload_optimizer.step_in_backward: auto, true or false; a comma list (false,auto) runs "
                        "each in turn every repeat")
    p.add_argument("--optimizer", default="AdamW", help="optimizer.type: AdamW, or AdamW8bit for 8-bit moments")
    p.add_argument("--bf16-states", action="store_true",
                   help="bf16 masters and moments (bf16.bf16_master_weights_and_grads, bf16_optimizer_states)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=0, help="WarmupLR steps, linear from 0 to --lr (0: constant --lr)")
    p.add_argument("--data", choices=("random", "corpus"), default="random",
                   help="random token ids, or the demo's text corpus as bytes (a loss that can fall; vocab 256)")
    p.add_argument("--json", default=str(ROOT / "runs" / "bench" / "offload.json"))
    p.add_argument("--plot", default=None, help="a PNG of the loss per step (repeat 0 of each mode)")
    p.add_argument("--report", default=None, metavar="JSON", help="print the tables (and --plot) of an earlier --json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _config(args: argparse.Namespace, nvme: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True, **({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
                                     if args.bf16_states else {})},
        "optimizer": {"type": args.optimizer, "params": {"lr": args.lr, "weight_decay": 0.0}},
        **({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                                         "warmup_num_steps": args.warmup,
                                                         "warmup_type": "linear"}}} if args.warmup else {}),
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": args.sub_group_size,
            # Free each block after its forward (it is fetched again for backward): the
            # working set stays a few blocks, not the whole model.
            "stage3_max_reuse_distance": 0,
            # The sizes Hugging Face's "auto" gives for this width: each block's gradient
            # is reduced (and swapped out) alone, one block is fetched ahead.
            "reduce_bucket_size": args.width * args.width,
            "stage3_prefetch_bucket_size": int(0.9 * args.width * args.width),
            "offload_param": {"device": "nvme", "nvme_path": nvme, "buffer_count": args.param_buffers,
                              "buffer_size": 1_000_000_000, "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": args.opt_buffers,
                                  **({"overlap_step": True, "overlap_step_warmup": 0} if args.step_in_backward == "overlap"
                                     else {"step_in_backward": _mode(args.step_in_backward)})},
        },
        **({"aio": json.loads(args.aio) if args.aio.startswith("{") else args.aio} if args.aio else {}),
        # The largest models here fill the disk to its last few GiB: keep 3% free, not 10%.
        "planner": {"margin": 0.03},
    }  # fmt: skip


def _mode(value: str) -> str | bool:
    """``offload_optimizer.step_in_backward`` of a mode; "overlap" is the step behind the
    next window instead ([Note: the overlapped host step])."""
    if value not in ("auto", "true", "false", "overlap"):
        raise SystemExit(f"--step-in-backward: expected auto, true, false or overlap, got {value!r}")
    return value if value in ("auto", "overlap") else value == "true"


# -- one training job (runs under torchrun) ------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import threading

    import psutil
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "examples"))
    sys.path.insert(0, str(ROOT / "bench"))
    import terascale
    from gpt import GPT, GPTConfig
    from io_timeline import render, step_summary
    from terascale.zero import Init
    from terascale.zero.gather import full_numel

    torch.set_num_threads(args.threads)
    proc = psutil.Process()
    start_rss = proc.memory_info().rss
    peak = [start_rss]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            done.wait(0.02)

    def phase_peak() -> int:
        """The peak RSS since the last call (sampled), and restart the watch."""
        high = max(peak[0], proc.memory_info().rss)
        phases.append(high)
        peak[0] = proc.memory_info().rss
        return high

    phases: list[int] = []

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    nvme = str(Path(args.dir) / "swap")
    Path(nvme).mkdir(parents=True, exist_ok=True)
    config = _config(args, nvme)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.width)
    t0 = time.perf_counter()
    with Init(config=config):  # remote_device: offload_param.device (nvme)
        torch.manual_seed(0)
        model = GPT(cfg)
    built = time.perf_counter() - t0
    # Full sizes: a parameter zero.Init partitioned has numel() 0 on every rank.
    params = sum(full_numel(p) for p in model.parameters())
    engine, *_ = terascale.initialize(model=model, config=config)
    construct = time.perf_counter() - t0
    construct_peak = phase_peak()
    print(f"rank {dist.get_rank()}: {params:,} params built in {construct:.0f} s, peak RSS "
          f"{construct_peak / 2**30:.2f} GiB, optimizer step under backward: {engine.steps_in_backward}",
          file=sys.stderr, flush=True)
    gen = torch.Generator().manual_seed(dist.get_rank())
    if args.data == "corpus":
        from gpt import ByteBlocks, load_stdlib_corpus

        if args.vocab != 256:
            raise SystemExit("--data corpus reads bytes: use --vocab 256")
        blocks = ByteBlocks(load_stdlib_corpus(max_bytes=4_000_000, seed=0).train, args.seq)
    activity = engine.offload_activity()
    activity.recording = True  # the spans the timeline is drawn from
    steps = []
    for _ in range(args.steps):
        if args.data == "corpus":
            rows = torch.randint(0, len(blocks), (args.micro_batch,), generator=gen).tolist()
            x, y = (torch.stack(t) for t in zip(*(blocks[i] for i in rows)))
        else:
            x = y = torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=gen)
        io0 = engine.offload_io()
        t = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        t_fb = time.perf_counter()
        peak_fb = phase_peak()
        engine.step()
        t_end = time.perf_counter()
        peak_step = phase_peak()
        io1 = engine.offload_io()
        spans = [s for s in activity.spans if s[1] > t]
        steps.append({
            "time": t_end - t, "fwd_bwd": t_fb - t, "step": t_end - t_fb, "loss": loss.item(),
            "read": io1["read"] - io0["read"], "written": io1["written"] - io0["written"],
            "rss": proc.memory_info().rss, "peak_fwd_bwd": peak_fb, "peak_step": peak_step,
            "timeline": step_summary(spans, t, t_fb, t_end), "render": render(spans, t, t_fb, t_end),
        })  # fmt: skip
        print(f"rank {dist.get_rank()} step {len(steps)}: {steps[-1]['time']:.1f} s "
              f"(fwd+bwd {t_fb - t:.1f}), loss {loss.item():.4f}, peak RSS GiB fwd+bwd "
              f"{peak_fb / 2**30:.2f} step {peak_step / 2**30:.2f}", file=sys.stderr, flush=True)
    mem = engine.memory_breakdown()
    engine.destroy()
    done.set()
    sampler.join()
    peak[0] = max([peak[0], proc.memory_info().rss, *phases])
    # ru_maxrss catches peaks between samples (it counts from process start, imports included).
    import resource

    peak_rss = max(peak[0], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    out = {
        "rank": dist.get_rank(), "params": params, "construct_s": construct, "build_s": built,
        "steps": steps, "nvme_bytes": mem["nvme"], "start_rss": start_rss, "peak_rss": peak_rss,
        "construct_peak": construct_peak, "step_in_backward": engine.steps_in_backward,
        "swap_left": sorted(str(p) for p in Path(nvme).rglob("*.swp")),
    }  # fmt: skip
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, out)
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


# -- the driver -----------------------------------------------------------------------------


def _disk_speed():
    sys.path.insert(0, str(ROOT / "bench"))
    from aio_peers import disk_speed

    return disk_speed


def run_job(args: argparse.Namespace, result: Path) -> list[dict]:
    keep = ("dir", "threads", "steps", "micro_batch", "seq", "vocab", "width", "layers", "heads",
            "sub_group_size", "opt_buffers", "param_buffers", "aio", "step_in_backward", "optimizer", "lr", "warmup", "data")
    forwarded = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keep] + (["--bf16-states"] if args.bf16_states else [])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           __file__, "--worker", f"--result={result}", *forwarded]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=None, text=True)
    if proc.returncode != 0 and not result.exists():
        raise SystemExit(f"training job failed ({proc.returncode})")
    return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        report(argparse.Namespace(**{**saved["args"], "plot": args.plot}), saved["repeats"])
        return
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2 (the first step is left out)")
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    disk_speed = _disk_speed()
    fio_bytes = int(args.fio_gib * 2**30) // 2**20 * 2**20
    print(f"disk: {shutil.disk_usage(directory).free / 2**30:.1f} GiB free in {directory}", file=sys.stderr)
    modes = args.step_in_backward.split(",")
    for mode in modes:
        _mode(mode)
    repeats = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.repeats):
                for mode in modes:  # interleaved: each mode once per repeat, on the disk of the moment
                    probe = directory / "raw.bin"
                    speeds = disk_speed(probe, fio_bytes, "overwrite")  # swap files are rewritten every step
                    disk = speeds["best"]
                    print(f"repeat {r}: raw disk (best of {', '.join(k for k in speeds if k != 'best')}) write "
                          f"{disk['write']:.2f} GB/s read {disk['read']:.2f} GB/s", file=sys.stderr, flush=True)
                    job = argparse.Namespace(**{**vars(args), "step_in_backward": mode})
                    ranks = run_job(job, Path(tmp) / f"job{r}_{mode}.json")
                    repeats.append({"repeat": r, "mode": mode, "disk": disk, "ranks": ranks})
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "repeats": repeats}, indent=1) + "\n")
    report(args, repeats)


def report(args: argparse.Namespace, repeats: list[dict]) -> None:
    first = repeats[0]["ranks"][0]
    params = first["params"]
    states = 16 * params  # bf16 params and grads, fp32 masters and two Adam moments
    print(f"\nGPT {args.layers} layers x {args.width}, {params / 1e9:.3f}B params (model states "
          f"{states / 1e9:.1f} GB), micro-batch {args.micro_batch} x {args.seq} tokens, {args.nproc} rank(s) x "
          f"{args.threads} thread(s), bf16, ZeRO-3, params and optimizer on NVMe; "
          f"{args.repeats} repeat(s) x {args.steps - 1} timed steps\n")
    print("| repeat | step in backward | step s (median) | fwd+bwd s | optimizer s | read GB/step | written GB/step | "
          "raw read / write GB/s | floor s | step / floor | peak RSS GiB (growth) | build s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ratios: dict[str, list[float]] = {}
    for rep in repeats:
        ranks, disk = rep["ranks"], rep["disk"]
        timed = [rk["steps"][1:] for rk in ranks]
        # All ranks share the disk: the floor counts every rank's bytes.
        steps = [max(rk[i]["time"] for rk in timed) for i in range(len(timed[0]))]
        read = statistics.median(sum(rk[i]["read"] for rk in timed) for i in range(len(timed[0])))
        written = statistics.median(sum(rk[i]["written"] for rk in timed) for i in range(len(timed[0])))
        floor = read / (disk["read"] * 1e9) + written / (disk["write"] * 1e9)
        step = statistics.median(steps)
        ratios.setdefault(rep["mode"], []).append(step / floor)
        fwd = statistics.median(s["fwd_bwd"] for s in timed[0])
        opt = statistics.median(s["step"] for s in timed[0])
        peak = max(rk["peak_rss"] for rk in ranks)
        growth = max(rk["peak_rss"] - rk["start_rss"] for rk in ranks)
        left = sum(len(rk["swap_left"]) for rk in ranks)
        mode = f"{rep['mode']} ({'on' if ranks[0]['step_in_backward'] else 'off'})"
        print(f"| {rep['repeat']} | {mode} | {step:.1f} | {fwd:.1f} | {opt:.1f} | {read / 1e9:.2f} | "
              f"{written / 1e9:.2f} | {disk['read']:.2f} / {disk['write']:.2f} | {floor:.1f} | {step / floor:.2f} | "
              f"{peak / 2**30:.2f} ({growth / 2**30:.2f}) | {ranks[0]['construct_s']:.0f} |"
              + ("" if not left else f" {left} swap files left!"))
    for mode, values in ratios.items():
        print(f"\nstep / floor, median over repeats ({mode}): {statistics.median(values):.2f}")
    for mode in ratios:
        rep = next(rep for rep in repeats if rep["mode"] == mode)
        losses = [s["loss"] for s in rep["ranks"][0]["steps"]]
        print(f"losses ({mode}, repeat 0, rank 0): " + ", ".join(f"{x:.4f}" for x in losses))
    if getattr(args, "plot", None):
        plot_losses(args, repeats, args.plot)
    for mode in ratios:
        print(f"\n### step_in_backward {mode}")
        print_timeline([rep for rep in repeats if rep["mode"] == mode][-1]["ranks"][0]["steps"])


def plot_losses(args: argparse.Namespace, repeats: list[dict], path: str) -> None:
    """The training loss of each step (rank 0, repeat 0 of each mode) and the learning
    rate's warm-up, to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in dict.fromkeys(rep["mode"] for rep in repeats):
        steps = next(rep for rep in repeats if rep["mode"] == mode)["ranks"][0]["steps"]
        ax.plot(range(1, len(steps) + 1), [s["loss"] for s in steps], marker="o", ms=3, lw=1,
                label=f"step_in_backward {mode}")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    params = repeats[0]["ranks"][0]["params"]
    ax.set_title(f"{params / 1e9:.2f}B GPT ({args.layers} x {args.width}), {args.optimizer}, ZeRO-3 on NVMe")
    if args.warmup:
        lr = ax.twinx()
        n = len(repeats[0]["ranks"][0]["steps"])
        # DeepSpeed's WarmupLR: 0 before its first step (step 1), then iteration k - 2 at step k.
        lr.plot(range(1, n + 1), [args.lr * min(1.0, max(0, i - 2) / args.warmup) for i in range(1, n + 1)],
                color="grey", ls=":")  # fmt: skip
        lr.set_ylabel("learning rate (dotted)")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


def print_timeline(steps: list[dict]) -> None:
    """Per step of rank 0 (the first left out): where its time went, I/O busy against
    compute, and the median step drawn (see bench/io_timeline.py)."""
    print("\nTimeline, rank 0 (seconds; I/O busy = reads or writes in flight; waited = the training "
          "thread blocked on I/O; hidden = I/O busy while the thread was not waiting):\n")
    print("| step | step s | fwd+bwd s | optimizer s | I/O busy s (reads / writes) | waited s (fwd+bwd / opt) | "
          "I/O hidden under compute | compute s (step − waited) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, s in enumerate(steps):
        t = s["timeline"]
        hidden = t["step_hidden"] / t["step_io"] if t["step_io"] else 0.0
        print(f"| {i + 1}{' (first)' if i == 0 else ''} | {t['step_s']:.2f} | {t['fwd_bwd_s']:.2f} | {t['opt_s']:.2f} | "
              f"{t['step_io']:.2f} ({t['step_read']:.2f} / {t['step_write']:.2f}) | {t['step_wait']:.2f} "
              f"({t['fwd_bwd_wait']:.2f} / {t['opt_wait']:.2f}) | {hidden:.0%} | {t['step_s'] - t['step_wait']:.2f} |")
    timed = steps[1:] or steps
    median = sorted(timed, key=lambda s: s["time"])[len(timed) // 2]
    print(f"\nThe median step ({median['time']:.2f} s), one column = {median['time'] / 100 * 1e3:.0f} ms; "
          "F forward+backward, S optimizer step, # I/O in flight, w waiting for I/O:\n")
    print("```\n" + median["render"] + "\n```")


if __name__ == "__main__":
    main()
