"""terascale.data under the Hugging Face Trainer on terascale (real ranks): packed samples of a
prepared dataset train a Llama, and a run resumed from the Trainer's checkpoint on another
world size (the same global batch) trains on exactly the samples the uninterrupted run did.

The Trainer orders the samples itself (accelerate's seedable sampler, one permutation per
epoch from the seed, batches dealt to the processes in turn), so a global step is the same
run of that permutation on any world size, and its resume skips whole steps; what this
checks is that terascale's datasets, engine and checkpoints keep all of that true. The
oracle is the uninterrupted run: each step's samples (seen by a forward pre-hook on every
rank) are compared as sets, step by step.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from distributed import run_ranks

transformers = pytest.importorskip("transformers")

SEQ, STEPS, SAVE_AT, GLOBAL_BATCH = 16, 8, 3, 8


def _llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)  # fmt: skip
    return LlamaForCausalLM(config)


def _train_rank(data: str, out: str, resume: str | None, per_device: int) -> list[tuple[int, list[int]]]:
    """This rank's (step, sample) pairs: the first 4 tokens of each sample name it."""
    from terascale.data import PackedSamples
    from terascale.integrations.transformers import Trainer, TrainingArguments

    model = _llama()
    seen: list[tuple[int, list[int]]] = []
    trainer = None

    def record(module, args, kwargs):
        if module.training:
            for row in kwargs["input_ids"].tolist():
                seen.append((trainer.state.global_step, row[:4]))

    model.register_forward_pre_hook(record, with_kwargs=True)
    world = int(os.environ["WORLD_SIZE"])
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "zero_optimization": {"stage": 2}}  # fmt: skip
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=per_device, gradient_accumulation_steps=GLOBAL_BATCH // (per_device * world),
        max_steps=STEPS, learning_rate=3e-3, report_to=[], use_cpu=True, save_strategy="steps", save_steps=SAVE_AT,
        seed=0, disable_tqdm=True, logging_steps=1,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=PackedSamples(data, SEQ, labels="same"), config=config)
    trainer.train(resume_from_checkpoint=resume)
    trainer.engine.destroy()
    return seen


def _steps(ranks: list[list[tuple[int, list[int]]]]) -> dict[int, list[tuple[int, ...]]]:
    out: dict[int, list[tuple[int, ...]]] = {}
    for seen in ranks:
        for step, sample in seen:
            out.setdefault(step, []).append(tuple(sample))
    return {s: sorted(v) for s, v in out.items()}


def test_the_trainer_resumes_on_another_world_size_on_the_same_samples(tmp_path):
    from terascale.data import prepare

    rng = np.random.default_rng(0)
    (tmp_path / "src").mkdir()
    for k in range(20):  # 5 steps of 8 samples an epoch: the 8 steps cross into the second
        (tmp_path / "src" / f"{k}.txt").write_bytes(bytes(rng.integers(32, 127, size=32 + (k == 19), dtype=np.uint8)))
    prepare([tmp_path / "src"], tmp_path / "ds", workers=1, progress=False)
    data = str(tmp_path / "ds")

    whole = _steps(run_ranks(_train_rank, 2, data, str(tmp_path / "a"), None, 2, timeout=300))
    assert {s: len(v) for s, v in whole.items()} == dict.fromkeys(range(STEPS), GLOBAL_BATCH)
    assert (Path(tmp_path) / "a" / f"checkpoint-{SAVE_AT}").is_dir()
    resumed = _steps(run_ranks(_train_rank, 1, data, str(tmp_path / "b"), str(tmp_path / "a" / f"checkpoint-{SAVE_AT}"),
                               4, timeout=300))  # fmt: skip
    assert sorted(resumed) == list(range(SAVE_AT, STEPS))
    for step in range(SAVE_AT, STEPS):
        assert resumed[step] == whole[step], f"step {step}"
