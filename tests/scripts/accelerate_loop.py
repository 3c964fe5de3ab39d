"""A plain accelerate training loop, launched by tests/test_accelerate_native.py as
``accelerate launch --use_deepspeed --zero_stage 2 ... accelerate_loop.py OUT_DIR DS_CONFIG``
with ``TERASCALE_AS_DEEPSPEED=1``: accelerate's own DeepSpeed path, on terascale.

One launch trains four configurations in the same two ranks, one after another, each
with a fresh ``AcceleratorState`` built from the environment variables ``accelerate
launch`` sets for it (``prepare_deepspeed_cmd_env``): the launch's own (ZeRO-2 from the
command line's flags), ZeRO-3 from the same flags, ZeRO-3 from ``--deepspeed_config_file``
with optimizer and scheduler sections (``DummyOptim``/``DummyScheduler``), and DDP (plain
``accelerate launch``, the reference). Launching each would cost ~13 s of interpreter
starts on a 2-core machine; they differ only in those variables.

Each run: 4 micro-batches in windows of 2 (``accumulate``), ``save_state``, 2 more,
``get_state_dict`` and ``unwrap_model``, ``load_state``, and the same 2 again: rank 0
writes the losses, learning rates and weights to ``OUT_DIR/<run>.pt``.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

SAMPLES, MICRO_BATCH, ACCUMULATION, SAVE_AT, AFTER = 64, 4, 2, 4, 2
# What `accelerate launch --use_deepspeed` sets beyond the launcher's own variables.
_DEEPSPEED_VARIABLES = (
    "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE", "ACCELERATE_GRADIENT_CLIPPING",
    "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "ACCELERATE_DEEPSPEED_CONFIG_FILE", "ACCELERATE_CONFIG_DS_FIELDS",
)  # fmt: skip


def runs(config_file: str) -> dict[str, dict[str, str] | None]:
    """Run name -> the environment variables ``accelerate launch`` would set for it
    (None: as launched)."""
    flags = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_GRADIENT_CLIPPING": "0", "ACCELERATE_CONFIG_DS_FIELDS": ""}
    return {
        "zero2": None,
        "zero3": {**flags, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
                  "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true"},
        "zero3_file": {**flags, "ACCELERATE_DEEPSPEED_CONFIG_FILE": config_file},
        # accelerate's multi-process CPU training is its MULTI_CPU type (a GPU machine: MULTI_GPU).
        "ddp": {} if torch.cuda.is_available() else {"ACCELERATE_USE_CPU": "true"},
    }


def train(out: str, name: str) -> None:
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, set_seed
    from accelerate.utils.deepspeed import DummyOptim, DummyScheduler

    from terascale.optim import WarmupLR

    # Without an accelerator accelerate picks no process-group backend for DeepSpeed (its
    # CPU path is MULTI_CPU, which DeepSpeed's launch does not take): name gloo.
    handlers = [] if torch.cuda.is_available() else [InitProcessGroupKwargs(backend="gloo")]
    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATION, kwargs_handlers=handlers)
    set_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 1, generator=g)
    rank, world = accelerator.process_index, accelerator.num_processes
    batches = [(x[i : i + MICRO_BATCH], y[i : i + MICRO_BATCH]) for i in range(0, SAMPLES, MICRO_BATCH)][rank::world]
    batches = [(a.to(accelerator.device), b.to(accelerator.device)) for a, b in batches]
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:  # no prepared DataLoader tells accelerate the micro-batch size
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = MICRO_BATCH
    # The same AdamW and linear warm-up everywhere: from the config's sections through
    # DummyOptim/DummyScheduler, or built here.
    if plugin is not None and "optimizer" in plugin.deepspeed_config:
        opt = DummyOptim(model.parameters(), lr=1e-2, weight_decay=0.01)
        sched = DummyScheduler(opt, warmup_num_steps=3)
        model, opt, sched = accelerator.prepare(model, opt, sched)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1e-2, warmup_num_steps=3, warmup_type="linear")
        if plugin is not None:
            model, opt, sched = accelerator.prepare(model, opt, sched)
        else:  # a prepared scheduler steps once per process per update: step it here instead
            model, opt = accelerator.prepare(model, opt)
            accelerator.register_for_checkpointing(sched)
    losses: list[float] = []
    lrs: list[float] = []

    def run(lo: int, hi: int) -> None:
        for xb, yb in batches[lo:hi]:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                opt.step()
                if plugin is not None or accelerator.sync_gradients:
                    sched.step()
                opt.zero_grad()
            losses.append(accelerator.gather(loss.detach()).mean().item())
            lrs.append(sched.get_last_lr()[0])

    run(0, SAVE_AT)
    accelerator.save_state(f"{out}/{name}-state")
    run(SAVE_AT, SAVE_AT + AFTER)
    state = accelerator.get_state_dict(model)  # at ZeRO-3 on rank 0 only, as DeepSpeed's
    state = state and {k: v.detach().float().cpu().clone() for k, v in state.items()}
    unwrapped = type(accelerator.unwrap_model(model)).__name__
    accelerator.load_state(f"{out}/{name}-state")
    unbroken = losses[:]
    del losses[:]
    run(SAVE_AT, SAVE_AT + AFTER)
    if accelerator.is_main_process:
        torch.save({"losses": unbroken, "resumed": losses, "lrs": lrs, "state": state, "unwrapped": unwrapped,
                    "distributed_type": str(accelerator.distributed_type), "num_processes": world},
                   f"{out}/{name}.pt")  # fmt: skip
    accelerator.wait_for_everyone()
    engine = getattr(model, "destroy", None)
    if engine is not None:
        engine()


def main() -> None:
    from accelerate.state import AcceleratorState, GradientState

    out, config_file = sys.argv[1:3]
    for name, env in runs(config_file).items():
        if env is not None:
            # A fresh state from the environment, as a new launch would build it (accelerate's
            # own tests reset it the same way).
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
            for key in _DEEPSPEED_VARIABLES:
                os.environ.pop(key, None)
            os.environ.update(env)
        train(out, name)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
