"""Step time of terascale ZeRO 0-3 against DDP, FSDP2 and DeepSpeed, side by side.

    python bench/step_time.py                      # 2 ranks x 1 thread, 3 interleaved repeats
    python bench/step_time.py --repeats 5 --steps 30 --width 1024 --heads 16
    python bench/step_time.py --systems ddp,terascale-3,fsdp2,deepspeed-3

DeepSpeed runs from its own environment (``--peers-python``, default /tmp/peers, set up
as ../shared/BENCHMARKING.md says) with ``DS_ACCELERATOR=cpu`` off-GPU; it is left out
with a note when that environment is missing. Every system uses torch's fused AdamW.

The driver starts one ``torchrun`` job per (system, repeat), interleaving systems and
rotating their order so that the machine's drift and noise fall on all of them alike. Each
job trains the same GPT (``examples/gpt``) from the same seed on the same random tokens
and reports its per-step times, losses and peak memory per rank. The driver prints a
markdown table: median ms/step (and the spread of the per-repeat medians), the ratio to
DDP, peak memory per rank, and the largest loss difference from DDP, which must stay
within fp32 rounding (the run fails otherwise); every run's raw numbers go to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = (
    "ddp",
    "terascale-0",
    "terascale-1",
    "terascale-2",
    "terascale-3",
    "terascale-3-reshard",  # stage 3 that frees every block after forward, like FSDP2's default
    "fsdp2",  # fully_shard per block + root, reshard_after_forward=True
    "fsdp2-noreshard",  # reshard_after_forward=False
    "deepspeed-0",
    "deepspeed-1",
    "deepspeed-2",
    "deepspeed-3",
    # ZeRO-Infinity: optimizer state (and at stage 3 parameter shards) in swap files under --nvme-dir
    "terascale-2-nvme",
    "terascale-3-nvme",
    "deepspeed-2-nvme",  # DeepSpeed 0.19.8 runs this as cpu offload: it writes no swap file (see the table)
    "deepspeed-3-nvme",
    # The optimizer on the host (ZeRO-Offload), and 8-bit optimizer states (AdamW8bit,
    # [Note: compact optimizer states]) in memory, on the host and on NVMe
    "terascale-2-cpu",
    "terascale-3-cpu",
    "terascale-2-8bit",
    "terascale-3-8bit",
    "terascale-2-cpu-8bit",
    "terascale-3-cpu-8bit",
    "terascale-2-nvme-8bit",
    "terascale-3-nvme-8bit",
    # The host step behind the next window ([Note: the overlapped host step]): on the host, on NVMe
    "terascale-2-cpu-overlap",
    "terascale-3-cpu-overlap",
    "terascale-2-nvme-overlap",
    "terascale-3-nvme-overlap",
    # bf16 masters and optimizer states ([Note: bf16 masters and optimizer states]; needs --bf16):
    # in memory, and on NVMe synchronous and overlapped
    "terascale-3-bf16states",
    "terascale-3-nvme-bf16states",
    "terascale-3-nvme-bf16states-overlap",
    # Each rank's own share of a ZeRO step with no communication at all: its forward and
    # backward and the update of its 1/N of the parameters (see _compute_floor)
    "compute-floor",
)
NVME_SYSTEMS = tuple(s for s in SYSTEMS if "-nvme" in s)
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s not in NVME_SYSTEMS)
LR = 1e-3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma-separated subset of {SYSTEMS}")
    p.add_argument("--peers-python", default="/tmp/peers/bin/python",
                   help="python of the environment with DeepSpeed installed")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--bf16", action="store_true", help="terascale's systems compute in bf16 (fp32 masters unless "
                   "-bf16states); for the -bf16states systems")  # fmt: skip
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--nvme-dir", default="runs/bench/step_time_nvme",
                   help="nvme_path of the -nvme systems (each job's swap files are deleted when it ends)")
    p.add_argument("--json", default="runs/bench/step_time.json",
                   help="where to write every run's per-step times, losses and memory")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: system to run
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)  # internal: JSON path
    return p.parse_args(argv)


# -- one training job (runs under torchrun) ------------------------------------------------


def _model(args: argparse.Namespace):
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.width)
    return GPT(cfg)


def _torch_step(forward, opt):
    """One plain PyTorch training step (DDP and FSDP2 wrap the model; the loop is the same)."""

    def step(x, y):
        loss = forward(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def _engine_step(engine):
    """One step through a terascale or DeepSpeed engine (the same three calls)."""

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    return step


def _ddp(args: argparse.Namespace, model, device):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    model = model.to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    return _torch_step(ddp, opt)


def _terascale(args: argparse.Namespace, model, device, stage: int = 0, optimizer: str = "AdamW",
               bf16_states: bool = False, **zero):  # fmt: skip
    import terascale

    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": optimizer, "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, **zero},
    }
    if args.bf16:
        config["bf16"] = {"enabled": True}
        if bf16_states:
            config["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    engine, *_ = terascale.initialize(model=model, config=config)
    return _engine_step(engine)


def _fsdp2(args: argparse.Namespace, model, device, reshard: bool = True):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = model.to(device)
    mesh = init_device_mesh(device.type, (int(os.environ["WORLD_SIZE"]),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    return _torch_step(model, opt)


def _compute_floor(args: argparse.Namespace, model, device):
    """The compute-only floor of a ZeRO step: what one rank computes, with nothing sent.

    Every parameter and gradient is a view of one flat buffer (so backward accumulates
    into it in place and nothing is copied), and torch's fused AdamW updates only this
    rank's contiguous 1/N of the elements, as a ZeRO rank does. The ranks run concurrently
    on the same cores but never communicate during a step, so the time is the per-rank
    compute under the same CPU sharing, without the collectives and their copies.
    Its parameters drift apart across ranks (no gradient is averaged): its losses are
    not compared."""
    import torch

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    model = model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    flat, flat_grad = torch.empty(total, device=device), torch.zeros(total, device=device)
    offset = 0
    for p in params:
        view = flat[offset : offset + p.numel()]
        view.copy_(p.detach().reshape(-1))
        p.data = view.view_as(p)
        p.grad = flat_grad[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    per_rank = -(-total // world)
    lo, hi = rank * per_rank, min(total, (rank + 1) * per_rank)
    shard = flat[lo:hi]
    shard.grad = flat_grad[lo:hi]
    opt = torch.optim.AdamW([shard], lr=LR, weight_decay=0.0, fused=True)

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        flat_grad.zero_()
        return loss

    return step


def _nvme_offload(args: argparse.Namespace, stage: int) -> dict:
    """The ``zero_optimization`` keys of the -nvme systems, the same for both libraries:
    optimizer state on NVMe, and at stage 3 every parameter shard too (``max_in_cpu: 0``;
    both libraries would otherwise keep this small model's shards in host memory). No
    ``aio`` section: each library's I/O engine runs at its defaults."""
    path = str(Path(args.nvme_dir).resolve() / f"rank{os.environ.get('RANK', '0')}")
    Path(path).mkdir(parents=True, exist_ok=True)
    zero = {"offload_optimizer": {"device": "nvme", "nvme_path": path}}
    if stage == 3:
        # DeepSpeed swaps each parameter through a buffer of its own and prefetches up to
        # stage3_prefetch_bucket_size elements (5e7: the whole of the default model): with
        # its default 5 buffers it stops ("Not enough buffers 0 for swapping 1"). A buffer
        # per parameter, up to 64 (four 1024-wide blocks and the embedding), each as large
        # as the largest parameter, is what it needs to run. terascale gets the same keys.
        params = list(_model(args).parameters())
        zero["offload_param"] = {"device": "nvme", "nvme_path": path, "max_in_cpu": 0,
                                 "buffer_count": min(len(params), 64), "buffer_size": max(p.numel() for p in params)}
    return zero


def _deepspeed(args: argparse.Namespace, model, device, stage: int = 0, **zero):
    import deepspeed
    import torch

    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage, **zero},
        # torch's fused AdamW, as every other system; DeepSpeed would insist on its CPUAdam.
        "zero_force_ds_cpu_optimizer": False,
    }
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return _engine_step(engine)


def _build(system: str, args: argparse.Namespace, model, device):
    if system == "ddp":
        return _ddp(args, model, device)
    if system == "compute-floor":
        return _compute_floor(args, model, device)
    if system.startswith("terascale-") and system.endswith(("-cpu", "-8bit", "-overlap", "-bf16states")):
        # terascale-<stage>[-cpu|-nvme][-8bit|-bf16states][-overlap]
        parts = system.split("-")
        stage, tier = int(parts[1]), parts[2] if parts[2] in ("cpu", "nvme") else None
        zero = {"cpu": {"offload_optimizer": {"device": "cpu"}}, "nvme": _nvme_offload(args, stage)}.get(tier, {})
        if parts[-1] == "overlap":
            # From the first step: these runs are shorter than the default warm-up.
            zero["offload_optimizer"].update(overlap_step=True, overlap_step_warmup=0)
        if "bf16states" in parts and not args.bf16:
            raise SystemExit(f"{system}: bf16 masters and states need --bf16")
        return _terascale(args, model, device, stage, optimizer="AdamW8bit" if "8bit" in parts else "AdamW",
                          bf16_states="bf16states" in parts, **zero)  # fmt: skip
    if system.endswith("-nvme"):
        stage = int(system.split("-")[1])
        build = _terascale if system.startswith("terascale") else _deepspeed
        return build(args, model, device, stage, **_nvme_offload(args, stage))
    if system == "terascale-3-reshard":
        return _terascale(args, model, device, 3, stage3_max_reuse_distance=0)
    if system.startswith("terascale-"):
        return _terascale(args, model, device, int(system[-1]))
    if system.startswith("fsdp2"):
        return _fsdp2(args, model, device, reshard=system == "fsdp2")
    if system.startswith("deepspeed-"):
        return _deepspeed(args, model, device, int(system[-1]))
    raise AssertionError(system)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from terascale.comm import init_distributed

    torch.set_num_threads(args.threads)
    if args.worker.startswith("deepspeed"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    else:
        ctx = init_distributed()  # the same group set-up for every other system
        device, rank, world = ctx.device, ctx.rank, ctx.world_size
    model = _model(args)
    step = _build(args.worker, args, model, device)

    # Real text (stdlib source bytes, ids < 256 of the vocabulary) so the loss falls and the
    # loss-agreement check compares learning curves, not noise around a random-token plateau.
    from gpt import load_stdlib_corpus

    rows_needed = args.steps * world * args.micro_batch
    budget = rows_needed * (args.seq + 1) * 2
    text = load_stdlib_corpus(max_bytes=budget, seed=1).train.long()
    if text.numel() < rows_needed * (args.seq + 1):  # whole files are sampled: a small budget can come back short
        text = load_stdlib_corpus(max_bytes=max(budget, 1 << 20), seed=1).train.long()
    tokens = text[: rows_needed * (args.seq + 1)].view(args.steps, world * args.micro_batch, args.seq + 1)
    times, losses = [], []
    for s in range(args.steps):
        rows = tokens[s, rank * args.micro_batch : (rank + 1) * args.micro_batch].to(device)
        seconds, loss = timed_step(step, rows, device)
        times.append(seconds)
        losses.append(loss)
    if device.type == "cuda":
        peak_mib = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    peaks = [None] * world
    dist.all_gather_object(peaks, peak_mib)
    # What the -nvme systems really keep on disk: the bytes of this rank's swap files.
    swap = Path(args.nvme_dir).resolve() / f"rank{rank}"
    swap_mib = sum(f.stat().st_size for f in swap.rglob("*") if f.is_file()) / 2**20 if swap.exists() else 0.0
    swaps = [None] * world
    dist.all_gather_object(swaps, swap_mib)
    if rank == 0:
        Path(args.result).write_text(json.dumps({"times": times, "losses": losses, "peak_mib": peaks,
                                                 "swap_mib": swaps, "device": device.type}))
    shutil.rmtree(swap, ignore_errors=True)
    # Every rank leaves its last collective before any rank tears the group down: gloo can
    # abort a rank whose peer closes its sockets first.
    dist.barrier()
    dist.destroy_process_group()


def timed_step(step, rows, device) -> tuple[float, float]:
    """Run ``step`` on next-token ``rows``; (seconds it took, loss averaged over ranks)."""
    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    loss = step(rows[:, :-1], rows[:, 1:])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    mean = loss.detach().float().clone()
    dist.all_reduce(mean)
    return seconds, mean.item() / dist.get_world_size()


# -- the driver -----------------------------------------------------------------------------


def run_job(args: argparse.Namespace, system: str, result: Path, script: str = __file__) -> dict:
    """Run ``script --worker=system`` under torchrun (DeepSpeed's systems from the peers'
    python) with the driver's options; return the JSON its rank 0 wrote to ``result``."""
    forwarded = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}"
                 for k, v in vars(args).items()
                 if k not in ("systems", "nproc", "repeats", "worker", "result", "json", "peers_python") and v is not False]
    python = args.peers_python if system.startswith("deepspeed") else sys.executable
    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           script, f"--worker={system}", f"--result={result}", *forwarded]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if system.startswith("deepspeed"):
        env.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/peers-ext")
        if not _has_cuda():
            env["DS_ACCELERATOR"] = "cpu"
    for attempt in range(2):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode == 0:
            return json.loads(result.read_text())
        if result.exists():
            # Rank 0 wrote the results, then a rank died tearing gloo down ("terminate
            # called without an active exception", a known gloo race): the run is whole.
            print(f"{system}: exited {proc.returncode} after writing its results (teardown)", file=sys.stderr)
            return json.loads(result.read_text())
        print(f"{system}: failed (attempt {attempt + 1}):\n{proc.stderr[-1500:]}", file=sys.stderr)
    raise SystemExit(f"{system} failed twice:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def run_interleaved(args: argparse.Namespace, systems: list[str], script: str = __file__) -> dict[str, list[dict]]:
    """Every system ``args.repeats`` times, the order rotated each repeat so the machine's
    drift falls on all alike; each run's results by system, also written to ``args.json``."""
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            order = systems[r % len(systems):] + systems[: r % len(systems)]
            for system in order:
                res = run_job(args, system, Path(tmp) / f"{system}-{r}.json", script)
                runs[system].append(res)
                med = statistics.median(res["times"][args.warmup:]) * 1e3
                print(f"repeat {r} {system:12s} median {med:8.1f} ms/step", file=sys.stderr, flush=True)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return runs


def _params(args: argparse.Namespace) -> int:
    return sum(p.numel() for p in _model(args).parameters())


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def chosen_systems(args: argparse.Namespace, known: Iterable[str]) -> list[str]:
    """``--systems`` as a list, checked against ``known``, and ``--steps`` against ``--warmup``."""
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(known))
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {tuple(known)}")
    if args.steps <= args.warmup:
        raise SystemExit("--steps must exceed --warmup")
    return systems


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    systems = chosen_systems(args, SYSTEMS)
    if any(s.startswith("deepspeed") for s in systems) and not Path(args.peers_python).exists():
        print(f"DeepSpeed left out: {args.peers_python} not found (see ../shared/BENCHMARKING.md)", file=sys.stderr)
        systems = [s for s in systems if not s.startswith("deepspeed")]
    runs = run_interleaved(args, systems)

    base = "ddp" if "ddp" in runs else systems[0]
    base_ms = statistics.median(t for res in runs[base] for t in res["times"][args.warmup:]) * 1e3
    base_losses = runs[base][0]["losses"]
    print(f"\nGPT {args.layers} layers x {args.width}, vocab {args.vocab}, micro-batch {args.micro_batch} x "
          f"{args.seq} tokens, {args.nproc} ranks x {args.threads} thread(s), {_params(args) / 1e6:.1f}M params, {'bf16' if args.bf16 else 'fp32'}, {runs[base][0]['device']}, "
          f"{args.repeats} interleaved repeats x {args.steps - args.warmup} timed steps\n")
    nvme = any("-nvme" in s for s in systems)
    print("| system | ms/step (median) | per-repeat medians | ratio to " + base + " | per-repeat ratios (median)"
          + " | peak memory/rank (MiB) | loss step 1 → last | max Δloss vs " + base + " |"
          + (" swap files/rank (MiB) |" if nvme else ""))
    print("| --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if nvme else ""))
    base_rep = [statistics.median(res["times"][args.warmup:]) * 1e3 for res in runs[base]]
    worst = 0.0
    for system in systems:
        all_times = [t for res in runs[system] for t in res["times"][args.warmup:]]
        ms = statistics.median(all_times) * 1e3
        per_rep = [statistics.median(res["times"][args.warmup:]) * 1e3 for res in runs[system]]
        peaks = max((res["peak_mib"] for res in runs[system]), key=max)
        losses = runs[system][0]["losses"]
        diff = max(abs(a - b) for res in runs[system] for a, b in zip(res["losses"], base_losses))
        if not system.startswith("deepspeed") and not system.endswith(("-8bit", "-overlap", "-bf16states")) and system != "compute-floor":
            # 8-bit moments round the optimizer's state, and the overlapped step updates with
            # a one-step-old gradient: their curves are compared with fp32's synchronous one
            # in bench/compact_states.py, not held to fp32 rounding here.
            # [Note: DeepSpeed's losses] DeepSpeed's step differs from torch's AdamW on the same
            # gradients (identical after its all-reduce) where gradients are near Adam's eps,
            # so its curve drifts from step 2 on; it is reported, not held to fp32 rounding.
            worst = max(worst, diff)
        # Each repeat's ratio to the baseline's run of the same repeat: the machine's slow
        # spells hit both sides of a ratio taken close in time, so their median is steadier.
        ratios = [a / b for a, b in zip(per_rep, base_rep)]
        print(f"| {system} | {ms:.1f} | {min(per_rep):.1f}–{max(per_rep):.1f} | {ms / base_ms:.3f} | "
              f"{statistics.median(ratios):.3f} | "
              f"{' / '.join(f'{p:.0f}' for p in peaks)} | {losses[0]:.5f} → {losses[-1]:.5f} | {diff:.1e} |"
              + (f" {' / '.join(f'{m:.0f}' for m in runs[system][0].get('swap_mib', []))} |" if nvme else ""))
    if "compute-floor" in runs:
        floor_rep = [statistics.median(res["times"][args.warmup:]) * 1e3 for res in runs["compute-floor"]]
        print("\nstep / compute-only floor (median of per-repeat ratios): " + ", ".join(
            f"{s} {statistics.median(statistics.median(r['times'][args.warmup:]) * 1e3 / f for r, f in zip(runs[s], floor_rep)):.3f}"
            for s in systems if s != "compute-floor"))  # fmt: skip
    if worst > 1e-4:
        raise SystemExit(f"loss curves disagree by {worst:.2e} (> 1e-4): a system trains differently")


if __name__ == "__main__":
    main()
