"""TRL's trainers on terascale standing in for DeepSpeed (TRL's own DeepSpeed code), 2 ranks.

Parity with the same trainer without DeepSpeed (DDP over gloo) on a tiny Llama within fp32
rounding:

- ``SFTTrainer`` at ZeRO-3: the logged losses and gradient norms. TRL's fused LM head reads
  ``lm_head.weight.ds_status`` ([Note: ZeRO-3 parameter attributes]); transformers counts
  the parameters with ``ds_numel``. Then generation under TRL's
  ``unwrap_model_for_generation`` (what GRPO, RLOO and online DPO do: ``GatheredParameters``
  over every parameter and the ZeRO-3 hooks' removal through
  ``engine.optimizer.parameter_offload``, [Note: the parameter coordinator TRL reads]) gives
  the plain model's greedy tokens, and the parameters are sharded again afterwards.
- slow: ``DPOTrainer`` at ZeRO-3, whose reference model TRL prepares with
  ``deepspeed.initialize(model=ref, config=...)`` and no optimizer (a forward-only engine),
  and ``GRPOTrainer`` (generation inside the training loop).

TRL's configs default to ``bf16=True``: the plain Trainer then autocasts fp32 weights,
while DeepSpeed trains bf16 weights with fp32 masters (a different computation, on
DeepSpeed as here), so both run in fp32. The ranks start as fresh interpreters with the
switch on (transformers and accelerate decide at import whether DeepSpeed is installed,
and the warm fork server imported them without it: see test_hf_native.py). Serially, on
this 2-core machine: the make-test part about 20 s (two interpreter starts with TRL's
imports, then two short trainings), the slow part about 30 s more.
"""

from __future__ import annotations

import os

import pytest
import torch

from distributed import run_ranks

pytest.importorskip("trl")

VOCAB = 64
ZERO3 = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
    "gradient_clipping": "auto", "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}  # fmt: skip
COMMON = dict(
    per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-2, logging_steps=1,
    report_to=[], save_strategy="no", seed=0, disable_tqdm=True, bf16=False,
)  # fmt: skip
PROMPT = [[5, 9, 12, 7], [3, 3, 4, 8]]


def tokenizer():
    """A word-level tokenizer over ``w0 .. w60`` (built here: nothing is downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(VOCAB - 3)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _save_tiny_llama(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer().save_pretrained(path)


def _words(g: torch.Generator, n: int) -> str:
    return " ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 3, (n,), generator=g))


def _setup(out: str):
    import datasets
    import torch.distributed as dist

    datasets.disable_progress_bars()
    if int(os.environ["RANK"]) == 0:
        _save_tiny_llama(f"{out}/init")
    if dist.is_initialized():
        dist.barrier()
    return datasets, torch.Generator().manual_seed(3)


def _sft_rank(out: str) -> dict:
    import torch.distributed as dist
    from transformers.trainer_pt_utils import get_model_param_count
    from trl import SFTConfig, SFTTrainer
    from trl.models.utils import unwrap_model_for_generation

    datasets, g = _setup(out)
    data = datasets.Dataset.from_dict({"text": [_words(g, 12) for _ in range(16)]})
    r: dict = {}
    for name, config in (("plain", None), ("zero3", ZERO3)):
        args = SFTConfig(output_dir=f"{out}/sft_{name}", deepspeed=config, max_length=16, use_cpu=True, **COMMON)
        trainer = SFTTrainer(model=f"{out}/init", args=args, train_dataset=data, processing_class=tokenizer())
        trainer.train()
        r[name] = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
        r[f"{name}/engine"] = type(trainer.model_wrapped).__module__
        r[f"{name}/params"] = get_model_param_count(trainer.model)
        prompt = torch.tensor(PROMPT)
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
            r[f"{name}/generated"] = model.generate(
                input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False
            ).tolist()
        r[f"{name}/numel_after"] = trainer.model.model.layers[0].mlp.up_proj.weight.numel()
        if name == "zero3":
            trainer.model_wrapped.destroy()
        dist.barrier()
    return r


def _dpo_grpo_rank(out: str) -> dict:
    import torch.distributed as dist
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer

    datasets, g = _setup(out)
    pairs = datasets.Dataset.from_dict({"prompt": [_words(g, 4) for _ in range(16)],
                                        "chosen": [_words(g, 3) for _ in range(16)],
                                        "rejected": [_words(g, 5) for _ in range(16)]})  # fmt: skip
    prompts = datasets.Dataset.from_dict({"prompt": [_words(g, 4) for _ in range(8)]})

    def longer(completions, **kwargs) -> list[float]:
        return [float(len(c.split())) for c in completions]

    r: dict = {}
    for name, config in (("plain", None), ("zero3", ZERO3)):
        args = DPOConfig(output_dir=f"{out}/dpo_{name}", deepspeed=config, max_length=16, use_cpu=True, **COMMON)
        trainer = DPOTrainer(model=f"{out}/init", args=args, train_dataset=pairs, processing_class=tokenizer())
        trainer.train()
        r[f"dpo/{name}"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if name == "zero3":
            ref = trainer.ref_model
            r["dpo/ref"] = (type(ref).__module__, ref.optimizer, ref.module.model.layers[0].mlp.up_proj.weight.numel())
        dist.barrier()
        grpo = {**COMMON, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "max_steps": 2}
        args = GRPOConfig(output_dir=f"{out}/grpo_{name}", deepspeed=config, num_generations=4, max_completion_length=6,
                          generation_batch_size=8, use_cpu=True, **grpo)  # fmt: skip
        trainer = GRPOTrainer(model=f"{out}/init", reward_funcs=longer, args=args, train_dataset=prompts,
                              processing_class=tokenizer())  # fmt: skip
        trainer.train()
        r[f"grpo/{name}"] = [(h["loss"], h["reward"]) for h in trainer.state.log_history if "loss" in h]
        dist.barrier()
    return r


def _fresh_ranks(fn, out) -> dict:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TERASCALE_AS_DEEPSPEED", "1")  # read by the fresh ranks' start-up (terascale-standin.pth)
        return run_ranks(fn, 2, str(out), timeout=400, fresh=True, device="cpu")[0]


def test_sft_trainer_at_zero3_matches_the_plain_trainer_and_generates_the_same(tmp_path):
    r = _fresh_ranks(_sft_rank, tmp_path)
    assert r["zero3/engine"].startswith("terascale.") and r["plain/engine"].startswith("torch.")
    assert len(r["plain"]) == 3
    torch.testing.assert_close(r["zero3"], r["plain"], rtol=1e-5, atol=1e-6)
    # ds_numel: transformers counts a ZeRO-3 model's parameters whole (not 0 for the empty shards).
    assert r["zero3/params"] == r["plain/params"] > 0
    assert r["zero3/generated"] == r["plain/generated"]
    assert r["zero3/numel_after"] == 0 and r["plain/numel_after"] == 32 * 64  # sharded again after generation


@pytest.mark.slow
def test_dpo_and_grpo_trainers_at_zero3_match_the_plain_trainers(tmp_path):
    r = _fresh_ranks(_dpo_grpo_rank, tmp_path)
    module, optimizer, numel = r["dpo/ref"]
    assert module.startswith("terascale.") and optimizer is None and numel == 0  # forward only, sharded
    assert len(r["dpo/plain"]) == 3 and len(r["grpo/plain"]) == 2
    torch.testing.assert_close(r["dpo/zero3"], r["dpo/plain"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r["grpo/zero3"], r["grpo/plain"], rtol=1e-5, atol=1e-6)
