"""A small training job for the resilience tests, with deterministic fault injection.

Run under ``terascale run`` (torchrun): trains an MLP on a fixed regression set with the
config ``--config`` (its ``checkpoint`` section makes the job save and resume by
itself), appends one JSON line per optimizer step to ``OUT/steps.jsonl`` (reporting
rank: step, global mean loss, world size, restart count) and at the end writes
``OUT/final.pt`` (full state dict and the optimizer's step count).

Faults fire only in the first attempt (TORCHELASTIC_RESTART_COUNT 0), at a named point of
a named step on one rank, so they are the same on any machine:
  --fault kill:STEP:RANK:POINT   SIGKILL this rank (POINT: forward, backward, step, save)
  --fault leave:STEP:RANK        SIGKILL this rank's torchrun agent and itself (a node lost)
  --fault hang:STEP:RANK         block forever before the forward of STEP
  --fault sigterm:STEP:RANK      send SIGTERM to this rank before the forward of STEP
  --fault termpeer:STEP:RANK     send SIGTERM to the other rank, then block forever, before
                                 the forward of STEP (a signalled survivor of a lost peer)
  --fault nan:STEP:RANK          make RANK's gradient of one weight NaN in STEP
  --fault nanloss:STEP:RANK      make RANK's loss NaN in STEP
  --fault enospc:STEP:RANK       from STEP on, every write by RANK fails with ENOSPC
  --fault enospc_once:STEP:RANK  the first write by RANK from STEP on fails with ENOSPC
  --fault slow:0:RANK            RANK's forward takes 0.2 s longer (a straggler; every attempt)
With ``--reference`` it trains the same global batches in one process with plain PyTorch
(``--skip STEP`` leaves out that step's update, ``--rollback STEP:TO`` restores the
state after step TO when STEP's update would be applied, keeping the data position).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import threading
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

SAMPLES, DIM_IN, DIM_OUT = 64, 16, 4


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, DIM_IN, generator=g)
    w = torch.randn(DIM_IN, DIM_OUT, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(SAMPLES, DIM_OUT, generator=g))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM_IN, 32), nn.Tanh(), nn.Linear(32, DIM_OUT))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--config")
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=-1)  # terascale run passes it, as DeepSpeed's launcher does
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--fault", default="none")
    p.add_argument("--reference", action="store_true")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--skip", type=int, default=None)
    p.add_argument("--rollback", default=None)
    return p.parse_args()


class Fault:
    def __init__(self, spec: str, rank: int) -> None:
        kind, *rest = spec.split(":")
        self.kind = kind
        self.step = int(rest[0]) if rest else -1
        self.rank = int(rest[1]) if len(rest) > 1 else -1
        self.point = rest[2] if len(rest) > 2 else "forward"
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.armed = kind != "none" and rank == self.rank and first_attempt

    def at(self, step: int, point: str) -> bool:
        return self.armed and step == self.step and point == self.point


def fail_writes(once: bool = False) -> None:
    """Every later write of this process fails as on a full disk (os.write/pwrite/pwritev);
    ``once``: only the first (a disk that had room again soon after)."""
    originals = os.write, os.pwrite, os.pwritev

    def full(*args: object, **kwargs: object) -> int:
        if once:
            os.write, os.pwrite, os.pwritev = originals
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    os.write = os.pwrite = os.pwritev = full  # type: ignore[assignment]


def train(args: argparse.Namespace) -> None:
    import terascale

    rank = int(os.environ["RANK"])
    fault = Fault(args.fault, rank)
    out = Path(args.out)
    engine, optimizer, loader, _ = terascale.initialize(model=model(), config=args.config, training_data=dataset())
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if fault.kind == "slow" and rank == fault.rank:  # slower compute: inside the forward
        engine.module.register_forward_pre_hook(lambda module, inputs: time.sleep(0.2))
    log = open(out / "steps.jsonl", "a", buffering=1) if rank == 0 else None
    (out / f"pid{rank}").write_text(str(os.getpid()))
    mse = nn.MSELoss()
    epoch, batches = loader.sampler.epoch, iter(loader)
    window_loss = 0.0
    while engine.global_steps < args.steps:
        try:
            x, y = next(batches)
        except StopIteration:
            epoch += 1
            loader.sampler.set_epoch(epoch)
            batches = iter(loader)
            continue
        step = engine.global_steps + 1
        if fault.at(step, "forward"):
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.kind == "leave":
                (out / "left_at").write_text(str(time.time()))
                os.kill(os.getppid(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.kind == "termpeer":
                os.kill(int((out / f"pid{1 - rank}").read_text()), signal.SIGTERM)
            if fault.kind in ("hang", "termpeer"):
                threading.Event().wait()
            if fault.kind == "sigterm":
                fault.armed = False
                os.kill(os.getpid(), signal.SIGTERM)
            if fault.kind in ("enospc", "enospc_once"):
                fault.armed = False
                fail_writes(once=fault.kind == "enospc_once")
        loss = mse(engine(x), y)
        if fault.at(step, "forward") and fault.kind == "nanloss":
            fault.armed = False
            loss = loss * float("nan")
        hook = None
        if fault.at(step, "forward") and fault.kind == "nan":
            fault.armed = False  # once: a rollback comes back to this step
            hook = engine.module[0].weight.register_hook(lambda g: g * float("nan"))
        if fault.at(step, "backward"):
            os.kill(os.getpid(), signal.SIGKILL)
        engine.backward(loss)
        if hook is not None:
            hook.remove()
        window_loss += float(loss.detach()) / engine.gradient_accumulation_steps()
        if fault.at(step, "step"):
            os.kill(os.getpid(), signal.SIGKILL)
        engine.step()
        if engine.micro_steps % engine.gradient_accumulation_steps() == 0:
            total = torch.tensor([window_loss])
            torch.distributed.all_reduce(total)
            window_loss = 0.0
            if log is not None:
                record = {"step": engine.global_steps, "loss": float(total) / engine.dist.dp_world_size,
                          "world": engine.dist.dp_world_size, "restart": restart, "skipped": engine.skipped_steps, "time": time.time()}
                log.write(json.dumps(record) + "\n")
            if fault.at(step, "save"):
                os.kill(os.getpid(), signal.SIGKILL)
    engine.wait_for_checkpoint()
    state = engine.full_state_dict()
    if rank == 0:
        torch.save({"state": state, "optimizer_steps": optimizer_steps(optimizer), "world": engine.dist.dp_world_size},
                   out / "final.pt")
    engine.destroy()


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    steps = {int(s["step"]) for s in optimizer.state.values() if "step" in s}
    assert len(steps) == 1, steps
    return steps.pop()


def reference(args: argparse.Namespace) -> None:
    """The same global batches in one process: plain PyTorch, AdamW as the config's."""
    data, net = dataset(), model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.0)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    rollback_at, rollback_to = map(int, args.rollback.split(":")) if args.rollback else (None, None)
    saved, losses, step, epoch = None, [], 0, 0
    order: list[int] = []
    while step < args.steps:
        if len(order) < args.batch:
            sampler.set_epoch(epoch)
            order += list(sampler)
            epoch += 1
        idx, order = order[: args.batch], order[args.batch :]
        x, y = data[idx]
        loss = nn.functional.mse_loss(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        if step + 1 == rollback_at:
            net.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
            step = rollback_to
            rollback_at = None
            continue
        if step + 1 != args.skip:
            optimizer.step()
        step += 1
        losses.append(float(loss))
        if step == rollback_to:
            saved = ({k: v.clone() for k, v in net.state_dict().items()}, _clone(optimizer.state_dict()))
    torch.save({"state": {k: v.clone() for k, v in net.state_dict().items()}, "losses": losses}, Path(args.out) / "reference.pt")


def _clone(state: dict) -> dict:
    import copy

    return copy.deepcopy(state)


if __name__ == "__main__":
    arguments = parse()
    if arguments.reference:
        reference(arguments)
    else:
        train(arguments)
