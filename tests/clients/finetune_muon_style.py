"""A causal-LM fine-tune in the shape of the DeepSpeed finetune demo that publishes the Muon
configs (delock/deepspeed_finetune_demo, ``finetune_llama.py``): the config read from
``--deepspeed_config`` and its ``train_batch_size`` overridden, ``HfDeepSpeedConfig`` made
before ``from_pretrained(torch_dtype=bfloat16)``, gradient checkpointing on,
``deepspeed.initialize(args=, model=, model_parameters=, training_data=, collate_fn=,
config=)`` and its data loader, ``model_engine(**batch).loss``, an evaluation under
``no_grad`` between ``eval()`` and ``train()``, ``model_engine.module.state_dict()``. It
imports ``deepspeed`` (terascale run --as-deepspeed serves terascale as it).

    terascale run --as-deepspeed --nproc 2 finetune_muon_style.py --deepspeed_config z3_muon.json --out DIR
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, default_data_collator
from transformers.integrations.deepspeed import HfDeepSpeedConfig

import deepspeed
from deepspeed import comm as dist

SEQ, VOCAB = 16, 64


def dataset(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        labels = ids.clone()
        labels[:4] = -100  # the instruction part, masked from the loss as the demo masks it
        rows.append({"input_ids": ids, "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": labels})
    return rows


def evaluate(model_engine, batches: list[dict]) -> float:
    model_engine.eval()
    losses = []
    with torch.no_grad():
        for batch in batches:
            batch = {k: v.to(model_engine.device) for k, v in batch.items()}
            losses.append(model_engine(**batch).loss.item())
    model_engine.train()
    return sum(losses) / len(losses)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)
    ds_config["train_batch_size"] = args.batch_size
    delattr(args, "deepspeed_config")
    dschf = HfDeepSpeedConfig(ds_config)  # noqa: F841 (kept alive, as the demo keeps it)

    folder = Path(args.out) / "model"
    if int(__import__("os").environ.get("RANK", "0")) == 0 and not folder.exists():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=32)).save_pretrained(folder)
    deepspeed.init_distributed()
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16)
    model.config.use_cache = False
    model.gradient_checkpointing_enable()

    data = dataset(args.batch_size)  # one global batch, seen every step: the loss must fall
    model_engine, optimizer, train_dataloader, lr_scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=data,
        collate_fn=default_data_collator, config=ds_config,
    )  # fmt: skip
    held_out = [default_data_collator(data[:2])]
    before = evaluate(model_engine, held_out)
    losses = []
    for _ in range(args.steps):
        for batch in train_dataloader:
            batch = {k: v.to(model_engine.device) for k, v in batch.items()}
            loss = model_engine(**batch).loss
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
    after = evaluate(model_engine, held_out)
    state = model_engine.module.state_dict()
    groups = [{"use_muon": g["use_muon"], "lr": g["lr"]} for g in optimizer.param_groups]
    if dist.get_rank() == 0:
        record = {"losses": losses, "before": before, "after": after, "groups": groups,
                  "optimizer": type(model_engine.basic_optimizer).__name__, "keys": len(state)}
        (Path(args.out) / "rank0.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
