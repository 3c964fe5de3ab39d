"""The Hugging Face Trainer on terascale (``terascale.integrations.transformers``), real ranks.

Parity: the same tiny Llama, data and TrainingArguments trained by the plain Trainer
(DDP over gloo) and by terascale's Trainer with a DeepSpeed config full of "auto" values,
at ZeRO stages 0, 2 and 3, with and without offload: the logged losses and gradient norms
and the final weights agree within fp32 rounding. An epoch of 10 micro-batches with 4 per
window ends in a window of 2, so the Trainer's own window boundaries are exercised.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from distributed import run_ranks

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 96, 16


def _on_cpu() -> bool:
    """Whether this rank trains on the CPU (run_ranks gives each rank a GPU where there are enough)."""
    return os.environ.get("TERASCALE_DEVICE") == "cpu" or not torch.cuda.is_available()

_VERSION = tuple(int(p) for p in transformers.__version__.split(".")[:2])
# Older Trainers log the loss rounded to 4 decimals, and their DDP runs reduce gradients
# in the middle of a window that spans two epochs (a short last window is not ended at the
# epoch's end), so they are compared on epochs of whole windows only.
_LOGGED_LOSS_ROUNDING = 1e-4 if _VERSION < (4, 47) else 0
_SHORT_LAST_WINDOW = _VERSION >= (4, 47)


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    return LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 1) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


AUTO_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
}


def _args(out: str, args_class=None, **kw):
    """The suite's TrainingArguments (terascale's subclass unless ``args_class`` says otherwise)."""
    if args_class is None:
        from terascale.integrations.transformers import TrainingArguments as args_class

    base = dict(
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=4, num_train_epochs=2,
        learning_rate=3e-3, warmup_steps=2, max_grad_norm=0.5, logging_steps=1, report_to=[], use_cpu=_on_cpu(),
        save_strategy="no", seed=0, disable_tqdm=True,
    )  # fmt: skip
    base.update(kw)
    return args_class(**base)


def _history(trainer) -> list[tuple[float, float, float]]:
    return [(h["loss"], float(h["grad_norm"]), h["learning_rate"]) for h in trainer.state.log_history if "loss" in h]


def _parity_rank(out: str, cases: list[tuple[str, dict]]) -> dict:
    import transformers as hf

    from terascale.integrations.transformers import Trainer

    # 20 per rank: 10 micro-batches of 2, windows of 4, 4, 2 (older Trainers: 16, 4 + 4).
    data = Tokens(40 if _SHORT_LAST_WINDOW else 32)
    results = {}
    model = tiny_llama()
    plain = hf.Trainer(model=model, args=_args(f"{out}/plain"), train_dataset=data)
    plain.train()
    results["plain"] = (_history(plain), {k: v.detach().clone() for k, v in model.state_dict().items()})
    results["plain/eval"] = plain.evaluate(Tokens(8, seed=2))["eval_loss"]
    for name, config in cases:
        model = tiny_llama()
        trainer = Trainer(model=model, args=_args(f"{out}/{name}"), train_dataset=data, config=config)
        trainer.train()
        results[name] = (_history(trainer), trainer.engine.full_state_dict())
        evaluated = trainer.evaluate(Tokens(8, seed=2))["eval_loss"]
        results[name + "/eval"] = evaluated
        results[name + "/resolved"] = {r.path: r.value for r in trainer.engine.config.resolved}
        trainer.engine.destroy()
    return results


def _zero(stage: int, **extra) -> dict:
    return {**AUTO_CONFIG, "zero_optimization": {**AUTO_CONFIG["zero_optimization"], "stage": stage, **extra}}


def test_trainer_matches_the_plain_trainer_at_every_stage(tmp_path):
    nvme = str(tmp_path / "nvme")
    os.mkdir(nvme)
    cpu = {"device": "cpu", "pin_memory": True}
    cases = [
        ("stage0", _zero(0)),
        ("stage2", _zero(2)),
        ("stage3", _zero(3)),
        ("stage2_cpu", _zero(2, offload_optimizer=cpu)),
        ("stage3_cpu", _zero(3, offload_optimizer=cpu, offload_param=cpu)),
        ("stage3_nvme", _zero(3, offload_optimizer={"device": "nvme", "nvme_path": nvme},
                              offload_param={"device": "nvme", "nvme_path": nvme})),
    ]  # fmt: skip
    results = run_ranks(_parity_rank, 2, str(tmp_path), cases, timeout=400)
    ref_history, ref_state = results[0]["plain"]
    assert len(ref_history) == (6 if _SHORT_LAST_WINDOW else 4)  # windows per epoch × 2 epochs
    for name, _ in cases:
        _assert_same_training(name, *results[0][name], ref_history, ref_state, rtol=1e-5, atol=2e-6)
        resolved = results[0][name + "/resolved"]
        assert resolved["train_micro_batch_size_per_gpu"] == 2 and resolved["gradient_accumulation_steps"] == 4
        assert resolved["train_batch_size"] == 16 and resolved["gradient_clipping"] == 0.5
        assert resolved["zero_optimization.reduce_bucket_size"] == 32 * 32
        assert resolved["zero_optimization.stage3_param_persistence_threshold"] == 320
    for name, _ in cases:  # evaluation after training runs through the engine (stage 3: gathered)
        assert results[0][f"{name}/eval"] == pytest.approx(results[0]["plain/eval"], rel=1e-5), name
    assert not list(Path(tmp_path / "nvme").rglob("*.swp")), "swap files left behind"


# -- saving, from_pretrained, resuming -------------------------------------------------------------


def _resume_rank(out: str) -> dict:
    from transformers import LlamaForCausalLM

    from terascale.integrations.transformers import Trainer

    data = Tokens(48)
    config = {**_zero(3), "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                                     "weight_decay": "auto"}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                 "warmup_num_steps": "auto", "total_num_steps": "auto"}}}  # fmt: skip
    # 6 steps an epoch, 2 epochs; resumed from step 8, in the second epoch.
    kw = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=2, save_strategy="steps",
              save_steps=4, weight_decay=0.01)  # fmt: skip
    whole = Trainer(model=tiny_llama(), args=_args(f"{out}/run", **kw), train_dataset=data, config=config)
    whole.train()
    history = _history(whole)
    whole.save_model(f"{out}/final")
    weights = whole.engine.full_state_dict()
    resolved = {r.path: r.value for r in whole.engine.config.resolved}
    whole.engine.destroy()
    resumed = Trainer(model=tiny_llama(seed=5), args=_args(f"{out}/resumed", **kw), train_dataset=data, config=config)
    resumed.train(resume_from_checkpoint=f"{out}/run/checkpoint-8")
    loaded = LlamaForCausalLM.from_pretrained(f"{out}/final").state_dict()
    return {"history": history, "resumed": _history(resumed), "weights": weights, "loaded": loaded,
            "resumed_weights": resumed.engine.full_state_dict(), "resolved": resolved,
            "files": sorted(os.listdir(f"{out}/run/checkpoint-8"))}  # fmt: skip


def test_save_model_loads_with_from_pretrained_and_resume_is_exact(tmp_path):
    result = run_ranks(_resume_rank, 2, str(tmp_path), timeout=300)[0]
    assert len(result["history"]) == 12
    # The resumed run's log (steps 1-8 come from the checkpoint's trainer state, 9-12 are
    # trained) is the uninterrupted run's, bit for bit.
    assert result["resumed"] == result["history"]
    for k, v in result["weights"].items():
        assert torch.equal(result["resumed_weights"][k], v), k
        assert torch.equal(result["loaded"][k], v), k
    assert "latest" in result["files"] and "global_step8" in result["files"] and "trainer_state.json" in result["files"]
    resolved = result["resolved"]
    assert resolved["optimizer.params.lr"] == 3e-3 and resolved["optimizer.params.betas"] == [0.9, 0.999]
    assert resolved["optimizer.params.weight_decay"] == 0.01
    assert resolved["scheduler.params.total_num_steps"] == 12 and resolved["scheduler.params.warmup_num_steps"] == 2
    assert resolved["scheduler.params.warmup_max_lr"] == 3e-3 and resolved["scheduler.params.warmup_min_lr"] == 0
    # The config's WarmupDecayLR (not the Trainer's linear schedule) sets the lr the Trainer
    # logs: from warmup_min_lr up to warmup_max_lr, then down towards 0 at total_num_steps.
    lrs = [lr for _, _, lr in result["history"]]
    assert lrs[0] == 0 and max(lrs) == pytest.approx(3e-3) and lrs[-1] < max(lrs) / 2, lrs


# -- PEFT under ZeRO-3, TrainingArguments(deepspeed=...), disagreeing values ----------------------


def _peft_rank(out: str) -> dict:
    import transformers as hf
    from peft import LoraConfig, PeftModel, get_peft_model

    from terascale.integrations.peft import save_merged
    from terascale.integrations.transformers import Trainer, TrainingArguments

    def lora():
        return get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))

    result: dict = {}
    model = lora()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cpu = {"device": "cpu"}
    config = _zero(3, offload_optimizer=cpu, offload_param=cpu)
    # The config through terascale's TrainingArguments(deepspeed=...), as users of the Trainer write it.
    args = TrainingArguments(output_dir=f"{out}/lora", deepspeed=config, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, num_train_epochs=1, learning_rate=1e-2, report_to=[],
                             use_cpu=_on_cpu(), save_strategy="no", seed=0, disable_tqdm=True, logging_steps=1)  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(32))
    trainer.train()
    engine = trainer.engine
    result["state"] = engine.full_state_dict()
    result["initial"] = initial
    result["optimizer_numel"] = sum(t.numel() for s in engine.optimizer.state.values() for t in s.values()
                                    if torch.is_tensor(t) and t.dim() > 0)  # fmt: skip
    trainer.save_model(f"{out}/adapter")
    save_merged(engine, f"{out}/merged")
    result["adapter_files"] = sorted(os.listdir(f"{out}/adapter")) if engine.rank == 0 else []
    # Plain PEFT: the same base weights with the saved adapter, merged by PEFT itself.
    base = tiny_llama()
    result["peft_merged"] = PeftModel.from_pretrained(base, f"{out}/adapter").merge_and_unload().state_dict()
    result["loaded_merged"] = hf.LlamaForCausalLM.from_pretrained(f"{out}/merged").state_dict()
    engine.destroy()
    # An explicit value that disagrees with the TrainingArguments is an error naming both.
    wrong = {**_zero(2), "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5}
    try:
        Trainer(model=tiny_llama(), args=_args(f"{out}/wrong"), train_dataset=Tokens(8), config=wrong).train()
    except ValueError as err:
        result["mismatch"] = str(err)
    return result


def test_lora_at_stage_3_trains_only_adapters_and_saves_adapter_and_merged_weights(tmp_path):
    results = run_ranks(_peft_rank, 2, str(tmp_path), timeout=300)
    r = results[0]
    changed = sorted(k for k in r["state"] if not torch.equal(r["state"][k], r["initial"][k].float()))
    assert changed and all("lora_" in k for k in changed), changed
    adapter_numel = sum(v.numel() for k, v in r["initial"].items() if "lora_" in k)
    # Adam's two moments for the adapters only, split evenly: each rank holds half of 2 x adapters.
    assert [x["optimizer_numel"] for x in results] == [adapter_numel, adapter_numel]
    assert "adapter_model.safetensors" in r["adapter_files"] and "adapter_config.json" in r["adapter_files"]
    assert "model.safetensors" not in r["adapter_files"]  # the frozen base is not saved with the adapter
    assert r["peft_merged"].keys() == r["loaded_merged"].keys()
    for k, v in r["peft_merged"].items():
        torch.testing.assert_close(r["loaded_merged"][k], v, rtol=1e-6, atol=1e-6, msg=k)
    assert "train_micro_batch_size_per_gpu: the config says 4 but TrainingArguments.per_device_train_batch_size is 2" \
        in r["mismatch"] and "gradient_clipping" not in r["mismatch"]  # 0.5 == max_grad_norm 0.5


# -- the Trainer's subclasses ---------------------------------------------------------------------


def _subclasses_rank(out: str, with_trl: bool) -> dict:
    import transformers as hf

    from terascale.integrations.transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, terascale_trainer

    def t5():
        torch.manual_seed(0)
        return hf.T5ForConditionalGeneration(hf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                         num_heads=4, decoder_start_token_id=0))  # fmt: skip

    class Pairs(Tokens):
        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.ids[i].flip(0)}

    common = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=1,
                  learning_rate=3e-3, report_to=[], use_cpu=_on_cpu(), save_strategy="no", seed=0, disable_tqdm=True,
                  logging_steps=1)  # fmt: skip
    out_ = {}
    plain = hf.Seq2SeqTrainer(model=t5(), args=hf.Seq2SeqTrainingArguments(output_dir=f"{out}/s0", **common),
                              train_dataset=Pairs(16))  # fmt: skip
    plain.train()
    ours = Seq2SeqTrainer(model=t5(), args=Seq2SeqTrainingArguments(output_dir=f"{out}/s1", deepspeed=_zero(3), **common),
                          train_dataset=Pairs(16))  # fmt: skip
    ours.train()
    out_["seq2seq"] = (_history(plain), _history(ours))
    ours.engine.destroy()
    if not with_trl:
        return out_
    import datasets
    import trl

    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = hf.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="w0", eos_token="w1")
    texts = {"text": [" ".join(f"w{(i * 7 + j) % VOCAB}" for j in range(10)) for i in range(16)]}
    sft_args = dict(common, max_length=SEQ, bf16=False)
    plain = trl.SFTTrainer(model=tiny_llama(), args=trl.SFTConfig(output_dir=f"{out}/t0", **sft_args),
                           train_dataset=datasets.Dataset.from_dict(texts), processing_class=tokenizer)  # fmt: skip
    plain.train()
    SFTTrainer = terascale_trainer(trl.SFTTrainer)
    ours = SFTTrainer(model=tiny_llama(), args=trl.SFTConfig(output_dir=f"{out}/t1", **sft_args),
                      train_dataset=datasets.Dataset.from_dict(texts), processing_class=tokenizer,
                      config=_zero(3))  # fmt: skip
    ours.train()
    out_["sft"] = (_history(plain), _history(ours))
    return out_


def test_seq2seq_and_trl_sft_trainers_train_on_terascale_as_the_plain_ones(tmp_path):
    import importlib.util

    with_trl = importlib.util.find_spec("trl") is not None  # installed by `make test`
    result = run_ranks(_subclasses_rank, 2, str(tmp_path), with_trl, timeout=300)[0]
    assert sorted(result) == (["seq2seq", "sft"] if with_trl else ["seq2seq"])
    for name, (plain, ours) in result.items():
        assert len(plain) == len(ours) >= 2, name
        for (loss, norm, _), (ref_loss, ref_norm, _) in zip(ours, plain):
            assert loss == pytest.approx(ref_loss, rel=1e-5, abs=_LOGGED_LOSS_ROUNDING), (name, ours, plain)
            assert norm == pytest.approx(ref_norm, rel=1e-4), (name, ours, plain)


# -- autoTP: batch sizes and data per data-parallel replica ------------------------------------------


def _autotp_rank(out: str) -> dict:
    """The plain Trainer on 4 processes (DDP, one sample each per step) and terascale's with
    a Hugging Face AutoTP config at tp=4 (one replica, micro-batches of 2, windows of 2) and
    tp=2 (two replicas, micro-batches of 1, windows of 2): every step takes the same 4
    samples. Returns the histories, the final weights, the resolved batch sizes and the
    input ids each rank trained on."""
    import transformers as hf

    import terascale
    from terascale.integrations.transformers import Trainer

    def llama():  # heads and kv-heads split over 4 ranks
        torch.manual_seed(0)
        config = hf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ)  # fmt: skip
        return hf.LlamaForCausalLM(config)

    class Recording(Trainer):
        def training_step(self, model, inputs, *args, **kwargs):
            self.seen.append(inputs["input_ids"].detach().cpu().clone())
            return super().training_step(model, inputs, *args, **kwargs)

    data = Tokens(16)
    # eps well above fp32 noise: sliced and whole matrix products round differently, and
    # Adam's first steps are sign(g) of near-zero gradients otherwise.
    common = dict(num_train_epochs=1, adam_epsilon=1e-4)
    model = llama()
    plain = hf.Trainer(model=model, args=_args(f"{out}/plain", per_device_train_batch_size=1,
                                               gradient_accumulation_steps=1, **common), train_dataset=data)  # fmt: skip
    plain.train()
    results = {"plain": (_history(plain), {k: v.detach().clone() for k, v in model.state_dict().items()})}
    for tp, micro in ((4, 2), (2, 1)):
        config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                  "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                  "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": tp}}  # fmt: skip
        if tp == 4:  # the config's optimizer; at tp=2 the Trainer's own, built before the slicing
            config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                               "weight_decay": "auto"}}  # fmt: skip
        trainer = Recording(model=llama(), args=_args(f"{out}/tp{tp}", per_device_train_batch_size=micro,
                                                      gradient_accumulation_steps=2, **common),
                            train_dataset=data, config=config)  # fmt: skip
        trainer.seen = []
        trainer.train()
        results[f"tp{tp}"] = (_history(trainer), trainer.engine.full_state_dict())
        results[f"tp{tp}/resolved"] = {r.path: r.value for r in trainer.engine.config.resolved}
        results[f"tp{tp}/seen"] = torch.cat(trainer.seen)
        trainer.engine.destroy()
    # Without the Trainer: "auto" train_batch_size from the other two and the replicas.
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "tensor_parallel": {"autotp_size": 4}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}  # fmt: skip
    engine, *_ = terascale.initialize(model=llama(), config=config)
    results["initialize"] = engine.config.train_batch_size
    engine.destroy()
    return results


def test_autotp_batch_sizes_and_data_follow_the_data_parallel_replicas(tmp_path):
    """A published AutoTP config ("auto" batch triplet) on 4 ranks: train_batch_size counts
    replicas (world / tp), tensor-parallel peers see the same samples, and training is the
    plain Trainer's on the same samples per step."""
    results = run_ranks(_autotp_rank, 4, str(tmp_path), timeout=400)
    ref_history, ref_state = results[0]["plain"]
    assert len(ref_history) == 4
    for tp, micro in ((4, 2), (2, 1)):
        name = f"tp{tp}"
        replicas = 4 // tp
        for rank, r in enumerate(results):
            resolved = r[name + "/resolved"]
            assert resolved["train_micro_batch_size_per_gpu"] == micro, (name, resolved)
            assert resolved["train_batch_size"] == micro * 2 * replicas, (name, resolved)
            # The ranks of one tensor-parallel group train on the same samples; replicas on others.
            peer = results[rank // tp * tp]
            assert torch.equal(r[name + "/seen"], peer[name + "/seen"]), (name, rank)
        if replicas > 1:
            assert not torch.equal(results[0][name + "/seen"], results[tp][name + "/seen"]), name
        _assert_same_training(name, *results[0][name], ref_history, ref_state)
    assert [r["initialize"] for r in results] == [4] * 4


def _assert_same_training(name: str, history: list, state: dict, ref_history: list, ref_state: dict, *,
                          rtol: float = 1e-4, atol: float = 1e-5) -> None:  # fmt: skip
    """The logged (loss, grad norm, lr) of every step and the final weights (within
    ``rtol``/``atol``: sliced and whole matrix products round differently) match the
    plain Trainer's."""
    assert len(history) == len(ref_history), (name, history)
    for (loss, norm, lr), (ref_loss, ref_norm, ref_lr) in zip(history, ref_history):
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=_LOGGED_LOSS_ROUNDING), (name, history, ref_history)
        assert norm == pytest.approx(ref_norm, rel=1e-4), (name, history, ref_history)
        assert lr == pytest.approx(ref_lr, rel=1e-6), name
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v.float(), rtol=rtol, atol=atol, msg=f"{name}: {k}")


# -- sequence parallelism --------------------------------------------------------------------------


def _sequence_parallel_rank(out: str) -> dict:
    """The plain Trainer on 2 processes (DDP, micro-batches of 1, windows of 2: 4 samples a
    step) and terascale's with each sequence split over both (one replica, micro-batches of
    2, windows of 2: the same 4 samples a step), the size given by the config and by
    ``TrainingArguments.parallelism_config``."""
    import transformers as hf
    from accelerate import ParallelismConfig

    from terascale.integrations.transformers import Trainer

    data = Tokens(16)
    common = dict(num_train_epochs=1, adam_epsilon=1e-4, gradient_accumulation_steps=2)
    model = tiny_llama()
    plain = hf.Trainer(model=model, args=_args(f"{out}/plain", per_device_train_batch_size=1, **common),
                       train_dataset=data)  # fmt: skip
    plain.train()
    results = {"plain": (_history(plain), {k: v.detach().clone() for k, v in model.state_dict().items()})}
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "zero_optimization": {"stage": 3}}  # fmt: skip
    for name, extra, kw in (("config", {"sequence_parallel_size": 2}, {}),
                            ("arguments", {}, {"parallelism_config": ParallelismConfig(sp_size=2)})):  # fmt: skip
        trainer = Trainer(model=tiny_llama(), args=_args(f"{out}/{name}", per_device_train_batch_size=2, **common, **kw),
                          train_dataset=data, config={**config, **extra})  # fmt: skip
        trainer.train()
        assert trainer.engine.get_sequence_parallel_world_size() == 2
        assert trainer.get_total_train_batch_size(trainer.args) == 4  # the Trainer counts one replica
        results[name] = (_history(trainer), trainer.engine.full_state_dict())
        results[name + "/batch"] = trainer.engine.config.train_batch_size
        trainer.engine.destroy()
    return results


def test_trainer_with_sequence_parallelism_matches_the_plain_trainer(tmp_path):
    results = run_ranks(_sequence_parallel_rank, 2, str(tmp_path), timeout=400)
    ref_history, ref_state = results[0]["plain"]
    assert len(ref_history) == 4
    for name in ("config", "arguments"):
        for r in results:
            assert r[name + "/batch"] == 4  # micro 2 x windows of 2 x 1 replica
            _assert_same_training(name, *r[name], ref_history, ref_state)
