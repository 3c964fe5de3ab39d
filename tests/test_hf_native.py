"""transformers' own Trainer on terascale standing in for DeepSpeed (the native path), real ranks.

``transformers.Trainer`` with ``TrainingArguments(deepspeed=config)`` drives DeepSpeed through
accelerate's ``DeepSpeedPlugin`` and ``transformers.integrations.deepspeed``; with
``TERASCALE_AS_DEEPSPEED=1`` that DeepSpeed is terascale. Parity: the same tiny Llama, data
and arguments trained by the plain Trainer (DDP over gloo) and by the native path with an
"auto"-valued config at ZeRO-2 and at ZeRO-3 with the optimizer offloaded to the CPU: the
logged losses, gradient norms and learning rates, the saved weights, evaluation and
``predict`` agree within fp32 rounding. At ZeRO-3 the model comes from ``from_pretrained``
under ``zero.Init`` (``is_deepspeed_zero3_enabled()``), a run resumed from its checkpoint
logs what the unbroken run logged, and PEFT LoRA trains as the plain Trainer trains it.

The ranks start as fresh interpreters with the switch on, as ``terascale run --as-deepspeed``
starts them: transformers and accelerate decide when they are imported whether DeepSpeed
is installed, and the warm fork server ([Note: forked ranks]) imported them without it.
One rank function does all the training and loading (a fresh start costs about 7 s of CPU
a rank, mostly imports); the tests check its parts. Serially the file costs about 36 s of
CPU, the two ranks running side by side.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from distributed import run_ranks
from test_hf_trainer import _args as _suite_args
from test_hf_trainer import AUTO_CONFIG, Tokens, _assert_same_training, _history, _on_cpu, tiny_llama

transformers = pytest.importorskip("transformers")

CPU = {"device": "cpu", "pin_memory": True}


def _zero(stage: int, **extra) -> dict:
    return {**AUTO_CONFIG, "zero_optimization": {**AUTO_CONFIG["zero_optimization"], "stage": stage, **extra}}


# ZeRO-3 saves 16-bit weights with save_model (checkpoint-N folders too), as accelerate's
# `zero3_save_16bit_model` asks; the resumed run's config leaves it off.
CASES = {"zero2": _zero(2), "zero3": _zero(3, offload_optimizer=CPU, stage3_gather_16bit_weights_on_model_save=True)}


def _args(out: str, **kw):
    return _suite_args(out, transformers.TrainingArguments, **kw)


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)  # the adapters' initial values, whatever the base's construction drew
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def _native_rank(out: str) -> dict:
    """Everything the tests check, trained on one pair of ranks (see the module docstring)."""
    import importlib.metadata

    import deepspeed
    import torch.distributed as dist
    from transformers import LlamaForCausalLM, Trainer
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    r: dict = {"version": importlib.metadata.version("deepspeed"), "is_terascale": deepspeed.__terascale__}
    # The plain Trainer first: once a Trainer has run on DeepSpeed, accelerate puts every later
    # Accelerator of the process on it (ACCELERATE_USE_DEEPSPEED), as it does on DeepSpeed itself.
    # 20 samples a rank: 10 micro-batches of 2 an epoch in windows of 4, 4 and 2 (the
    # Trainer ends the last one early), 2 epochs: 6 optimizer steps.
    data, evals, pair = Tokens(40), Tokens(8, seed=2), Tokens(8, seed=2).ids[:2]
    # (transformers prepares a Trainer that evaluates before it trains for evaluation only, and its
    # training would then run without DDP: this one only evaluates.)
    r["plain/eval_init"] = Trainer(model=tiny_llama(), args=_args(f"{out}/plain_eval")).evaluate(evals)["eval_loss"]
    plain = Trainer(model=tiny_llama(), args=_args(f"{out}/plain"), train_dataset=data)
    plain.train()
    r["plain"] = (_history(plain), {k: v.detach().clone() for k, v in plain.model.state_dict().items()})
    r["plain/eval"] = plain.evaluate(evals)["eval_loss"]
    r["plain/predict"] = plain.predict(evals).predictions
    with torch.no_grad():
        r["plain/pair"] = float(plain.model(input_ids=pair, labels=pair).loss)
    # 8 samples a rank, windows of 2 micro-batches: 2 steps.
    small, lora_args = Tokens(16), dict(gradient_accumulation_steps=2, num_train_epochs=1, learning_rate=1e-2,
                                        warmup_steps=0)  # fmt: skip
    plain = Trainer(model=_lora(tiny_llama()), args=_args(f"{out}/lora_plain", **lora_args), train_dataset=small)
    plain.train()
    r["lora_plain"] = _history(plain)
    plain.save_model(f"{out}/lora_plain/final")
    del plain
    if dist.get_rank() == 0:
        tiny_llama().save_pretrained(f"{out}/init")  # the same initial weights, for from_pretrained
    dist.barrier()

    for name, config in CASES.items():
        zero3 = name == "zero3"
        save = dict(save_strategy="steps", save_steps=4) if zero3 else {}
        args = _args(f"{out}/{name}", deepspeed=config, **save)  # before the model: from_pretrained reads it
        r[f"{name}/zero3_enabled"] = is_deepspeed_zero3_enabled()
        model = LlamaForCausalLM.from_pretrained(f"{out}/init")
        r[f"{name}/partitioned"] = model.model.embed_tokens.weight.numel() == 0  # built under zero.Init
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        r[name] = _history(trainer)
        r[f"{name}/engine"] = type(trainer.model_wrapped).__module__
        trainer.save_model(f"{out}/{name}/final")
        r[f"{name}/eval"] = trainer.evaluate(evals)["eval_loss"]
        r[f"{name}/predict"] = trainer.predict(evals).predictions
        trainer.model_wrapped.destroy()
        del trainer, model, args

    # Resumed at step 4 (in the second epoch) from the ZeRO-3 run's checkpoint, on a model
    # initialised otherwise: the checkpoint brings the weights, optimizer, schedule and data order.
    args = _args(f"{out}/resumed", deepspeed=_zero(3, offload_optimizer=CPU), save_strategy="steps", save_steps=4)
    resumed = Trainer(model=tiny_llama(seed=5), args=args, train_dataset=data)
    resumed.train(resume_from_checkpoint=f"{out}/zero3/checkpoint-4")
    r["resumed"] = _history(resumed)
    # Without stage3_gather_16bit_weights_on_model_save, save_model writes a checkpoint (as on DeepSpeed).
    resumed.save_model(f"{out}/resumed/final")
    resumed.model_wrapped.destroy()
    del resumed, args

    # PEFT LoRA at ZeRO-3 through the Trainer, on a base built under zero.Init.
    args = _args(f"{out}/lora", deepspeed=_zero(3), **lora_args)
    trainer = Trainer(model=_lora(LlamaForCausalLM.from_pretrained(f"{out}/init")), args=args, train_dataset=small)
    trainer.train()
    r["lora"] = _history(trainer)
    trainer.save_model(f"{out}/lora/final")
    trainer.model_wrapped.destroy()
    del trainer, args

    # Without the Trainer (transformers' "non-Trainer integration"): HfDeepSpeedConfig kept
    # alive, from_pretrained under zero.Init, deepspeed.initialize, a forward.
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}  # fmt: skip
    keep = HfDeepSpeedConfig(config)
    model = LlamaForCausalLM.from_pretrained(f"{out}/zero3/final")
    engine, *_ = deepspeed.initialize(model=model, config_params=config)
    engine.eval()
    with torch.no_grad():
        r["hf_config/pair"] = float(engine(input_ids=pair, labels=pair).loss)
    engine.destroy()
    del keep

    # Evaluation before any training: the Trainer prepares an engine without an optimizer.
    trainer = Trainer(model=tiny_llama(), args=_args(f"{out}/eval_only", deepspeed=_zero(3)))
    r["zero3/eval_init"] = trainer.evaluate(evals)["eval_loss"]

    # What was saved, read back as a user would, with no DeepSpeed config alive (so
    # from_pretrained builds whole models): here, where transformers' modelling is imported.
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    if dist.get_rank() == 0:
        for name in CASES:
            r[f"{name}/loaded"] = LlamaForCausalLM.from_pretrained(f"{out}/{name}/final").state_dict()
        r["resumed/fp32"] = get_fp32_state_dict_from_zero_checkpoint(f"{out}/resumed/final")
    return r


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("native")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TERASCALE_AS_DEEPSPEED", "1")  # read by the fresh ranks' start-up (terascale-standin.pth)
        results = run_ranks(_native_rank, 2, str(out), timeout=400, fresh=True)
    return results[0], out


def test_native_trainer_matches_the_plain_trainer_at_zero_2_and_3(native):
    r, out = native
    assert r["is_terascale"] and "+terascale" in r["version"]
    ref_history, ref_state = r["plain"]
    assert len(ref_history) == 6
    for name in CASES:
        assert r[f"{name}/engine"].startswith("terascale."), name
        assert r[f"{name}/zero3_enabled"] == r[f"{name}/partitioned"] == (name == "zero3")
        # save_model -> from_pretrained gives the trained weights
        _assert_same_training(name, r[name], r[f"{name}/loaded"], ref_history, ref_state, rtol=1e-5, atol=2e-6)


def test_evaluate_and_predict_after_training_match_the_plain_trainer(native):
    r, _ = native
    for name in CASES:
        assert r[f"{name}/eval"] == pytest.approx(r["plain/eval"], rel=1e-5), name
        torch.testing.assert_close(torch.as_tensor(r[f"{name}/predict"]), torch.as_tensor(r["plain/predict"]),
                                   rtol=1e-4, atol=1e-5, msg=name)  # fmt: skip
    # The trained weights, loaded under zero.Init outside the Trainer.
    assert r["hf_config/pair"] == pytest.approx(r["plain/pair"], rel=1e-5)


def test_evaluate_before_training_runs_on_an_engine_without_optimizer(native):
    r, _ = native
    assert r["zero3/eval_init"] == pytest.approx(r["plain/eval_init"], rel=1e-5)


def test_resume_from_checkpoint_continues_as_the_unbroken_run(native):
    r, out = native
    # Steps 1-4 come from the checkpoint's trainer state, 5-6 are trained again.
    assert r["resumed"] == r["zero3"]
    files = sorted(os.listdir(out / "zero3" / "checkpoint-4"))
    assert {"latest", "global_step4", "trainer_state.json", "model.safetensors"} <= set(files), files
    # No 16-bit gathering at save: the weights are in a checkpoint, which zero_to_fp32 reads.
    final = out / "resumed" / "final"
    assert "model.safetensors" not in os.listdir(final) and (final / "latest").is_file()
    for k, v in r["zero3/loaded"].items():
        assert torch.equal(r["resumed/fp32"][k], v), k


def test_lora_at_zero_3_through_the_native_trainer_matches_the_plain_trainer(native):
    r, out = native
    from safetensors.torch import load_file

    plain, ours = r["lora_plain"], r["lora"]
    assert len(plain) == len(ours) == 2
    for (loss, norm, lr), (ref_loss, ref_norm, ref_lr) in zip(ours, plain):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-4), (ours, plain)
        assert lr == pytest.approx(ref_lr)
    ref = load_file(out / "lora_plain" / "final" / "adapter_model.safetensors")
    got = load_file(out / "lora" / "final" / "adapter_model.safetensors")
    assert ref.keys() == got.keys() and ref
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=2e-6, msg=k)
    assert "model.safetensors" not in os.listdir(out / "lora" / "final")  # the frozen base is not saved
