"""Checkpoint save and load: terascale (sync, async) vs torch.save and torch.distributed.checkpoint.

    python bench/checkpoint.py --layers 4 --width 768 --repeats 3

A GPT (``examples/gpt``) trains one step at ZeRO stage 1 in bf16 on one rank, so it has
fp32 masters and AdamW moments (12 bytes per parameter: the state all four systems
save). Each repeat, in rotating order:

- ``terascale-sync``: ``engine.save_checkpoint`` (files flushed to the device), then
  ``engine.load_checkpoint``;
- ``terascale-async``: the same with ``checkpoint.async``; its *stall* is what training
  loses: the call, plus the next optimizer step's wait for the write (one training
  step of ``--batch`` x ``--seq`` tokens runs after the save, as in a training loop;
  its time is printed: a write that outlasts it shows as stall);
- ``torch.save``: the masters and ``optimizer.state_dict()`` in one file, plus ``fsync``
  (for the same durability), then ``torch.load`` and copying back;
- ``dcp``: ``torch.distributed.checkpoint.save`` / ``load`` of the same tensors.

One untimed round runs first (one-time costs: staging buffers, DCP's first plan). The page
cache is dropped (``posix_fadvise``) before each load. The raw disk's write speed is
measured on the same directory in each repeat, for a new preallocated file of the same
size (what a checkpoint shard is): the best of fio and terascale's I/O engine
(``bench/aio_peers.disk_speed``). Prints a table of median GB/s (bytes of model state /
seconds) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="sequences per training step")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder)")
    ap.add_argument("--json", default="runs/bench_checkpoint.json")
    args = ap.parse_args()

    import torch
    import torch.distributed.checkpoint as dcp

    sys.path.insert(0, str(ROOT / "examples"))
    import terascale
    from gpt import GPT, GPTConfig

    torch.set_num_threads(2)
    sys.path.insert(0, str(ROOT / "bench"))
    from aio_peers import disk_speed

    def drop_cache(folder: Path) -> None:
        for path in folder.rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)

    def engine_for(async_save: bool):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.width // 64, n_embd=args.width))
        config = {
            "train_batch_size": args.batch, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "checkpoint": {"async": async_save},
        }  # fmt: skip
        engine, *_ = terascale.initialize(model=model, config=config)
        return engine

    def train_step(engine) -> None:
        x = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()

    engines = {False: engine_for(False), True: engine_for(True)}
    for e in engines.values():
        train_step(e)
    t = time.perf_counter()
    for _ in range(3):
        train_step(engines[False])
    step_s = (time.perf_counter() - t) / 3
    eng = engines[False]
    masters = [p for g in eng.optimizer.param_groups for p in g["params"]]
    state_bytes = sum(p.numel() * 4 * 3 for p in masters)  # master + exp_avg + exp_avg_sq

    root = Path(args.dir or tempfile.mkdtemp(prefix="ts_ckpt_bench_"))
    root.mkdir(parents=True, exist_ok=True)
    systems = ["terascale-sync", "terascale-async", "torch.save", "dcp"]
    results: dict[str, dict[str, list[float]]] = {s: {"save": [], "load": [], "stall": []} for s in systems}
    raw: list[float] = []

    def run(system: str, r: int) -> None:
        folder = root / f"{system}-{r}"
        shutil.rmtree(folder, ignore_errors=True)
        if system.startswith("terascale"):
            engine = engines[system == "terascale-async"]
            t = time.perf_counter()
            engine.save_checkpoint(folder, tag="t")
            call = time.perf_counter() - t
            if system == "terascale-async":
                train_step(engine)  # the step waits for the write if it is still going
                engine.wait_for_checkpoint()
                results[system]["stall"].append(engine.last_checkpoint_stall_s)
                save = time.perf_counter() - t  # wall time until the files are complete
            else:
                save = call
            drop_cache(folder)
            t = time.perf_counter()
            engine.load_checkpoint(folder, tag="t")
            load = time.perf_counter() - t
        else:
            state = {"masters": {str(i): p.data for i, p in enumerate(masters)}, "optimizer": eng.optimizer.state_dict()}
            folder.mkdir(parents=True)
            t = time.perf_counter()
            if system == "torch.save":
                torch.save(state, folder / "state.pt")
            else:
                dcp.save(state, checkpoint_id=str(folder))
            _fsync_tree(folder)
            save = time.perf_counter() - t
            drop_cache(folder)
            t = time.perf_counter()
            if system == "torch.save":
                loaded = torch.load(folder / "state.pt", weights_only=True)
                for i, p in enumerate(masters):
                    p.data.copy_(loaded["masters"][str(i)])
                eng.optimizer.load_state_dict(loaded["optimizer"])
            else:
                dcp.load(state, checkpoint_id=str(folder))
            load = time.perf_counter() - t
        results[system]["save"].append(save)
        results[system]["load"].append(load)
        shutil.rmtree(folder, ignore_errors=True)

    # One untimed round: each system's first save pays one-time costs (terascale's staging
    # buffers are allocated once per engine and kept; DCP plans its first save).
    for system in systems:
        run(system, -1)
    for s in systems:
        results[s] = {"save": [], "load": [], "stall": []}
    for r in range(args.repeats):
        probe = root / "raw.bin"
        speeds = disk_speed(probe, max(state_bytes, 256 << 20) // 2**20 * 2**20, "preallocated")
        raw.append(speeds["best"]["write"])
        probe.unlink(missing_ok=True)
        order = systems[r % len(systems) :] + systems[: r % len(systems)]
        for system in order:
            run(system, r)
        print(f"repeat {r}: raw write {raw[-1]:.2f} GB/s (fio {speeds.get('fio', {}).get('write', 0):.2f}, "
              f"engine {speeds['engine']['write']:.2f}); " + ", ".join(
            f"{s} save {results[s]['save'][-1]:.2f} s load {results[s]['load'][-1]:.2f} s" for s in systems), flush=True)

    gb = state_bytes / 1e9
    raw_gbs = statistics.median(raw)
    sync_save = statistics.median(results["terascale-sync"]["save"])
    print(f"\nGPT {args.layers} layers x {args.width}: {len(masters)} master tensors, {gb:.3f} GB of fp32 masters + "
          f"AdamW moments; 1 rank; training step ({args.batch} x {args.seq} tokens) {step_s:.2f} s; raw disk write "
          f"(best of fio and the engine, new preallocated file, median) {raw_gbs:.2f} GB/s; {args.repeats} repeats\n")
    print("| system | save s | save GB/s | save / raw disk | load s | load GB/s | stall s | stall / sync save |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    table = {}
    for s in systems:
        save = statistics.median(results[s]["save"])
        load = statistics.median(results[s]["load"])
        stall = statistics.median(results[s]["stall"]) if results[s]["stall"] else save
        table[s] = {"save_s": save, "load_s": load, "stall_s": stall, "save_gbs": gb / save, "load_gbs": gb / load}
        if s == "terascale-async":  # its wall time includes the training step that ran alongside
            rate = f"({save:.3f} with the step) | - | -"
        else:
            rate = f"{save:.3f} | {gb / save:.2f} | {gb / save / raw_gbs:.2f}"
        print(f"| {s} | {rate} | {load:.3f} | {gb / load:.2f} | {stall:.3f} | {stall / sync_save:.2f} |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"state_bytes": state_bytes, "raw_write_gbs": raw, "results": results,
                                           "table": table}, indent=1))
    for e in engines.values():
        e.destroy()
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
