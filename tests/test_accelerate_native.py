"""accelerate's own DeepSpeed path on terascale standing in for DeepSpeed: ``accelerate launch
--use_deepspeed`` over a plain accelerate loop (tests/scripts/accelerate_loop.py), 2 ranks.

Parity with DDP (the same loop, no DeepSpeed) within fp32 rounding at ZeRO-2 and ZeRO-3
from the command line's flags and at ZeRO-3 from a config file whose optimizer and
scheduler sections the loop reaches through ``DummyOptim``/``DummyScheduler``: the losses,
the learning rates, ``get_state_dict``'s weights; ``save_state`` -> ``load_state``
continues with the unbroken run's losses; ``unwrap_model`` gives the user's module.

One real ``accelerate launch`` (accelerate's CLI, its DeepSpeed launcher, torchrun) trains
all four configurations, each with a fresh ``AcceleratorState`` from the variables the
launch would set for it (the script says how). Serially, on this 2-core machine, the file
takes about 17 s, nearly all of it the launch's three interpreter starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distributed import free_port

pytest.importorskip("accelerate")

SCRIPT = Path(__file__).parent / "scripts" / "accelerate_loop.py"
# Sections filled from DummyOptim/DummyScheduler ("auto"), as accelerate's docs write them.
CONFIG_FILE = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.999],
                                              "eps": 1e-8}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto", "warmup_type": "linear"}},
}  # fmt: skip
DEEPSPEED_RUNS = ("zero2", "zero3", "zero3_file")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("accelerate")
    config = out / "ds.json"
    config.write_text(json.dumps(CONFIG_FILE))
    accelerate = Path(sys.executable).with_name("accelerate")
    env = {**os.environ, "TERASCALE_AS_DEEPSPEED": "1", "OMP_NUM_THREADS": "1"}
    command = [
        str(accelerate), "launch", "--use_deepspeed", "--zero_stage", "2", "--gradient_clipping", "0",
        "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()), str(SCRIPT), str(out), str(config),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=out, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    return {name: torch.load(out / f"{name}.pt") for name in ("ddp", *DEEPSPEED_RUNS)}


def test_the_reference_is_ddp_over_two_processes(runs):
    assert runs["ddp"]["num_processes"] == 2
    assert runs["ddp"]["distributed_type"] in ("DistributedType.MULTI_CPU", "DistributedType.MULTI_GPU")
    for name in DEEPSPEED_RUNS:
        assert runs[name]["distributed_type"] == "DistributedType.DEEPSPEED", name


@pytest.mark.parametrize("name", DEEPSPEED_RUNS)
def test_deepspeed_path_matches_ddp(runs, name):
    ref, got = runs["ddp"], runs[name]
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["lrs"], ref["lrs"], rtol=1e-6, atol=0)
    assert got["lrs"][0] < got["lrs"][-1]  # the warm-up ran
    assert got["state"].keys() == ref["state"].keys()
    torch.testing.assert_close(got["state"], ref["state"], rtol=1e-5, atol=1e-6)
    assert got["unwrapped"] == "Sequential"


@pytest.mark.parametrize("name", ("ddp", *DEEPSPEED_RUNS))
def test_load_state_continues_exactly(runs, name):
    run = runs[name]
    assert run["resumed"] == run["losses"][-len(run["resumed"]) :]
