"""A BERT-style masked-LM pre-training loop in the shape of DeepSpeed's "Hello DeepSpeed"
tutorial script: a config dict with fp16 and ZeRO-1 optimizer offload to the CPU,
``log_dist``, ``save_checkpoint(save_dir, client_state={"checkpoint_step": step})`` every
few steps and, in a second run, ``_, client_state = load_checkpoint(load_dir)`` resuming
from ``client_state["checkpoint_step"]``. Only the import lines name terascale.

    terascale run --nproc 2 bert_style.py --checkpoint-dir DIR --steps 6 --out OUT
    terascale run --nproc 2 bert_style.py --load-checkpoint-dir DIR --steps 6 --out OUT2
"""

import argparse
import json
import logging
from pathlib import Path

import torch
from transformers import BertConfig, BertForMaskedLM

import terascale as deepspeed
from terascale.utils import log_dist

VOCAB, SEQ, MASK_ID = 96, 16, 3


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked-LM inputs and labels of one rank for one step (the same on every run)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(4, VOCAB, (size, SEQ), generator=g)
    masked = torch.rand(size, SEQ, generator=g) < 0.15
    masked[:, 0] = True  # at least one prediction per row
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return torch.where(masked, torch.full_like(ids, MASK_ID), ids), labels


def train(args: argparse.Namespace) -> list[float]:
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = BertForMaskedLM(config)
    log_dist("Model Creation Done", ranks=[0], level=logging.INFO)
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "fp16": {"enabled": True},
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
    }
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    log_dist("DeepSpeed engine created", ranks=[0], level=logging.INFO)
    start_step = 1
    if args.load_checkpoint_dir is not None:
        _, client_state = model.load_checkpoint(load_dir=args.load_checkpoint_dir)
        checkpoint_step = client_state["checkpoint_step"]
        start_step = checkpoint_step + 1
    model.train()
    losses = []
    rank = torch.distributed.get_rank()
    for step in range(start_step, args.steps + 1):
        inputs, labels = batch(step, rank, args.batch_size)
        loss = model(input_ids=inputs.to(model.device), labels=labels.to(model.device)).loss
        model.backward(loss)
        model.step()
        losses.append(loss.item())
        if args.checkpoint_dir is not None and step % args.checkpoint_every == 0:
            model.save_checkpoint(save_dir=args.checkpoint_dir, client_state={"checkpoint_step": step})
            log_dist(f"Saved model to {args.checkpoint_dir}", ranks=[0], level=logging.INFO)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--load-checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    losses = train(args)
    if torch.distributed.get_rank() == 0:
        Path(args.out, "rank0.json").write_text(json.dumps({"losses": losses}))


if __name__ == "__main__":
    main()
