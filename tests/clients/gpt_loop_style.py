"""A GPT training loop in the shape of DeepSpeed's bf16 master-weights example: ranks and
world size from ``deepspeed.comm``, the device from the accelerator object, a model built
on ``nn.TransformerEncoderLayer`` (whose attention reads ``out_proj.weight`` without
calling ``out_proj``: an external parameter at ZeRO-3), ZeRO-3 with parameter persistence
off, the config given as a path, ``loss.backward()`` called directly, ``engine.destroy()``.
Only the import lines name terascale. ``--reference`` trains the same model in plain
PyTorch on one process over the global batch, for comparison.

    terascale run --nproc 2 gpt_loop_style.py --deepspeed_config CONFIG --out DIR
    python gpt_loop_style.py --reference --world 2 --out DIR
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn as nn

import terascale as deepspeed
from terascale.accelerator import get_accelerator


class SimpleTransformerModel(nn.Module):
    def __init__(self, vocab_size: int, hidden_dim: int, num_layers: int, num_heads: int, max_seq_len: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, hidden_dim)
        self.pos_embedding = nn.Embedding(max_seq_len, hidden_dim)
        layer = nn.TransformerEncoderLayer(d_model=hidden_dim, nhead=num_heads, dim_feedforward=hidden_dim * 4,
                                           dropout=0.0, batch_first=True, norm_first=True)
        self.transformer = nn.TransformerEncoder(layer, num_layers=num_layers, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(hidden_dim)
        self.head = nn.Linear(hidden_dim, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=input_ids.device)
        x = self.embedding(input_ids) + self.pos_embedding(torch.arange(seq, device=input_ids.device))
        return self.head(self.ln_f(self.transformer(x, mask=mask, is_causal=True)))


def get_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--deepspeed_config", type=str, default=None)
    parser.add_argument("--num_steps", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--seq_length", type=int, default=16)
    parser.add_argument("--vocab_size", type=int, default=128)
    parser.add_argument("--hidden_dim", type=int, default=64)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def tokens(args: argparse.Namespace, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randint(0, args.vocab_size, (args.batch_size, args.seq_length + 1), generator=g)


def model_of(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(args.seed)
    return SimpleTransformerModel(args.vocab_size, args.hidden_dim, args.num_layers, args.num_heads, args.seq_length)


def reference(args: argparse.Namespace) -> None:
    """Plain PyTorch on the global batch (every rank's rows), AdamW as the config says."""
    config = json.loads(Path(args.deepspeed_config).read_text())
    model = model_of(args)
    p = config["optimizer"]["params"]
    opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                            weight_decay=p["weight_decay"])
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for step in range(args.num_steps):
        rows = torch.cat([tokens(args, step, r) for r in range(args.world)])
        logits = model(rows[:, :-1])
        loss = loss_fn(logits.reshape(-1, args.vocab_size), rows[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    Path(args.out, "reference.json").write_text(json.dumps({"losses": losses}))
    torch.save(model.state_dict(), Path(args.out, "reference.pt"))


def main() -> None:
    args = get_args()
    if args.reference:
        return reference(args)
    deepspeed.init_distributed()
    local_rank = args.local_rank
    if local_rank == -1:
        local_rank = int(deepspeed.comm.get_rank())
    rank = deepspeed.comm.get_rank()
    world_size = deepspeed.comm.get_world_size()
    device = get_accelerator().device_name(local_rank)
    get_accelerator().manual_seed_all(args.seed)
    model = model_of(args)
    model_engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                         config=args.deepspeed_config)
    model_engine.train()
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for step in range(args.num_steps):
        rows = tokens(args, step, rank).to(device)
        logits = model_engine(rows[:, :-1])
        loss = loss_fn(logits.reshape(-1, args.vocab_size).float(), rows[:, 1:].reshape(-1))
        loss.backward()  # PyTorch-style backward, not model_engine.backward(loss)
        model_engine.step()
        mean = loss.detach().clone()
        deepspeed.comm.all_reduce(mean)
        losses.append(mean.item() / world_size)
    with deepspeed.zero.GatheredParameters(list(model_engine.module.parameters())):
        state = {k: v.detach().clone() for k, v in model_engine.module.state_dict().items()}
    if rank == 0:
        Path(args.out, "rank0.json").write_text(json.dumps({"losses": losses, "world": world_size}))
        torch.save(state, Path(args.out, "engine.pt"))
    model_engine.destroy()


if __name__ == "__main__":
    main()
