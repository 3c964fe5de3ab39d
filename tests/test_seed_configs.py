"""DeepSpeed-shaped configs (BERT + Lamb + fp16, GPT-2 + Adam + fp16) load and train unchanged."""

from __future__ import annotations

import pathlib

import pytest
import torch

from distributed import run_ranks

transformers = pytest.importorskip("transformers")

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "examples" / "configs"


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32)
    return BertForMaskedLM(cfg)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))


def _train(model_name: str, config_name: str, steps: int):
    import terascale

    model = {"bert": _bert, "gpt2": _gpt2}[model_name]()
    initial = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    engine, *_ = terascale.initialize(model=model, config=str(CONFIGS / config_name))
    assert next(engine.module.parameters()).dtype == torch.float16
    g = torch.Generator().manual_seed(engine.dist.dp_rank)
    ids = torch.randint(0, 64, (engine.micro_batch_size, 16), generator=g)
    losses = []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        # The same batch every time: a model that trains drives its loss down.
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    return losses, engine.full_state_dict(), initial, engine.skipped_steps, engine.global_steps


@pytest.mark.parametrize(
    "model_name,config_name,steps,must_improve",
    [("bert", "bert_lamb_fp16.json", 6, True), ("gpt2", "gpt2_adam_fp16.json", 3, False)],
)
def test_seed_config_trains(model_name, config_name, steps, must_improve):
    results = run_ranks(_train, 2, model_name, config_name, steps, timeout=300)
    (losses, state, initial, skipped, global_steps), (_, other_state, _, _, _) = results
    assert global_steps == steps
    assert skipped < steps  # dynamic loss scaling settles; some steps are applied
    assert all(torch.isfinite(torch.tensor(losses)))
    changed = sum(not torch.equal(state[k], initial[k]) for k in state)
    assert changed > len(state) // 2
    for k in state:  # data-parallel ranks hold identical weights
        assert torch.equal(state[k], other_state[k]), k
    if must_improve:
        assert losses[-1] < losses[0] - 0.1, losses
