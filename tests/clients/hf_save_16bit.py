"""A Hugging Face model trained at ZeRO-3 and saved the two ways the transformers/accelerate
DeepSpeed integrations save one: the engine's consolidated 16-bit state dict handed to
``save_pretrained`` (what ``Trainer.save_model`` does under ZeRO-3 with
``stage3_gather_16bit_weights_on_model_save``) and ``engine.save_16bit_model``; then
``from_pretrained`` reloads the first and the weights are compared with the engine's
gathered parameters. Only the import line names terascale.

    terascale run --nproc 2 hf_save_16bit.py --out DIR
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import terascale as deepspeed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                       "stage3_gather_16bit_weights_on_model_save": True}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        ids = torch.randint(0, 64, (2, 12), generator=g).to(engine.device)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    out = Path(args.out)
    state_dict = engine._zero3_consolidated_16bit_state_dict()  # every rank joins the gather
    if rank == 0:
        engine.module.save_pretrained(out / "pretrained", state_dict=state_dict, safe_serialization=True)
    engine.save_16bit_model(str(out / "16bit"), "model.bin")
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        live = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    torch.distributed.barrier()
    if rank == 0:
        reloaded = AutoModelForCausalLM.from_pretrained(out / "pretrained", torch_dtype=torch.bfloat16)
        saved = torch.load(out / "16bit" / "model.bin", weights_only=True)
        worst = max((reloaded.state_dict()[k].float() - v).abs().max().item() for k, v in live.items())
        worst_bin = max((saved[k].float() - v).abs().max().item() for k, v in live.items() if k in saved)
        record = {"keys": sorted(live), "reloaded_max_diff": worst, "bin_max_diff": worst_bin,
                  "bin_keys": sorted(saved), "dtype": str(next(iter(saved.values())).dtype)}
        (out / "rank0.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
