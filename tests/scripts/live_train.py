"""A small language model trained by a live elastic job, for the elasticity tests and benchmark.

Run under ``terascale run --nnodes MIN:MAX`` (the live agent): trains a byte-level model
(embedding, one hidden layer, output layer) on the token dataset ``--data`` (prepared
by ``terascale.data.prepare``) with packed samples, so the data runtime orders the
samples globally ([Note: global batches]). Until ``engine.global_steps`` reaches
``--steps`` it trains; each rank appends to ``OUT/steps-<pid>.jsonl`` one line per
completed optimizer step: the step, the world size, its process id, the epoch, the
wall time, the window's loss, and a hash of every sample it trained on in that step (a
window a fault interrupted is dropped: it was not applied). At the end rank 0 writes
``OUT/final.pt`` (the full state dict) and every rank writes ``OUT/resizes-<pid>.json``
(the engine's resize records). ``--step-sleep`` slows each step down so that a driver's
fault lands inside a known stretch of steps. With ``--reference`` the same global
batches train in one process with plain PyTorch (the oracle).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

SEQ, VOCAB, WIDTH = 32, 256, 64


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **_: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.embed(input_ids)))
        return nn.functional.cross_entropy(self.out(h).reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


def model(kind: str = "tiny") -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":  # the benchmark's: examples/gpt's GPT, 4 layers of width 640 (20.1M parameters)
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
        from gpt.model import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=10, n_embd=640))
    return TinyLM()


def config(args: argparse.Namespace) -> dict:
    cfg = {
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 10**6,
        "elasticity": {"enabled": True, "max_train_batch_size": args.batch, "micro_batch_sizes": [2, 4], "min_gpus": 1,
                       "max_gpus": 4, "version": 0.1, "mirror_interval_steps": args.mirror_every},
    }  # fmt: skip
    if args.nvme:  # a layout the live path cannot resize: the restart path takes it
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": args.nvme}
    if args.save_dir:
        cfg["checkpoint"] = {"save_dir": args.save_dir, "interval_steps": args.save_every, "auto_resume": True}
    return cfg


def row_hash(row: torch.Tensor) -> str:
    return hashlib.blake2b(row.numpy().tobytes(), digest_size=6).hexdigest()


def train(args: argparse.Namespace) -> None:
    import terascale
    from terascale.data import PackedSamples

    out = Path(args.out)
    engine, _, loader, _ = terascale.initialize(model=model(args.model), config=config(args),
                                                training_data=PackedSamples(args.data, SEQ))  # fmt: skip
    pid = os.getpid()
    membership = engine.dist.elastic
    (out / f"start-{pid}.json").write_text(json.dumps({"registered": getattr(membership, "registered_at", None),
                                                        "steps": engine.global_steps}))  # fmt: skip
    log = open(out / f"steps-{pid}.jsonl", "a", buffering=1)
    hashes: list[str] = []
    losses: list[float] = []
    mirror_peak = 0

    def last_step() -> int:  # --stop-file: the driver writes the final step once, ahead of every rank
        stop = Path(args.stop_file) if args.stop_file else None
        return int(stop.read_text()) if stop is not None and stop.exists() else args.steps

    while engine.global_steps < last_step():
        for batch in loader:
            before = engine.global_steps
            hashes += [row_hash(r) for r in batch["input_ids"]]
            loss = engine(**batch)
            engine.backward(loss)
            losses.append(float(loss.detach()))
            engine.step()
            if engine.global_steps > before:  # a step was applied: its window is the hashes so far
                log.write(json.dumps({"step": engine.global_steps, "world": engine.dist.dp_world_size, "pid": pid,
                                      "epoch": loader.epoch, "membership": _membership_epoch(engine),
                                      "time": time.time(), "samples": hashes,
                                      "loss": sum(losses) / max(len(losses), 1)}) + "\n")  # fmt: skip
                hashes, losses = [], []
                mirror_peak = max(mirror_peak, engine.memory_breakdown()["elastic_mirror"])
                if args.step_sleep:
                    time.sleep(args.step_sleep)
            elif engine.micro_steps % engine.gradient_accumulation_steps() == 0:
                hashes, losses = [], []  # a window a fault interrupted (or restored): not applied
            if engine.global_steps >= last_step():
                break
    engine.wait_for_checkpoint()
    state = engine.full_state_dict()
    if engine.dist.rank == 0:
        torch.save(state, out / "final.pt")
    live = engine.live_elastic
    (out / f"resizes-{pid}.json").write_text(json.dumps(live.resizes if live is not None else []))
    (out / f"memory-{pid}.json").write_text(json.dumps({**engine.memory_breakdown(), "elastic_mirror_peak": mirror_peak}))
    engine.destroy()


def _membership_epoch(engine) -> int:  # noqa: ANN001
    """The membership epoch the step was trained in (0: not a live elastic rank)."""
    membership = engine.dist.elastic
    return 0 if membership is None or membership.epoch is None else membership.epoch.number


def reference(args: argparse.Namespace) -> None:
    """The same global batches, in order, in one process: plain PyTorch with AdamW."""
    from terascale.data import GlobalBatches, PackedSamples

    net = model(args.model)
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.0)
    loader = GlobalBatches(PackedSamples(args.data, SEQ), args.batch, num_workers=0)
    parts = args.batch // 4
    out = Path(args.out)
    log = open(out / "reference.jsonl", "w", buffering=1)
    step = 0
    while step < args.steps:
        for batch in loader:
            optimizer.zero_grad()
            # Micro-batches of 4, as the engine's windows hold them at the worlds the tests use.
            micro = [{k: v[i : i + 4] for k, v in batch.items()} for i in range(0, args.batch, 4)]
            losses = [net(**h) for h in micro]
            for part in losses:
                (part / parts).backward()
            loss = sum(float(part.detach()) for part in losses) / parts
            optimizer.step()
            step += 1
            log.write(json.dumps({"step": step, "samples": [row_hash(r) for r in batch["input_ids"]],
                                  "loss": float(loss)}) + "\n")  # fmt: skip
            if step >= args.steps:
                break
    torch.save({k: v.detach().clone() for k, v in net.state_dict().items()}, out / "final.pt")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8, help="the global batch (12 admits 3 ranks)")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--mirror-every", type=int, default=1)
    p.add_argument("--save-dir", default=None)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--stop-file", default=None, help="a file that, once written, holds the final step")
    p.add_argument("--model", choices=("tiny", "gpt"), default="tiny")
    p.add_argument("--nvme", default=None, help="offload the optimizer state to NVMe at this path")
    p.add_argument("--reference", action="store_true")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (reference if args.reference else train)(args)


if __name__ == "__main__":
    main()
