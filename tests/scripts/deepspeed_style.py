"""A training script written for DeepSpeed's launcher, run by tests/test_launcher.py through `terascale run`.

It parses ``--local_rank`` itself and adds the config flags with
``deepspeed.add_config_arguments``, as DeepSpeed's examples do, then trains two steps
from ``--deepspeed_config`` and writes ``OUT_DIR/rank<R>.json``: the parsed arguments, the
environment's LOCAL_RANK and the losses.
Usage: deepspeed_style.py --out OUT_DIR --deepspeed --deepspeed_config CONFIG
"""

import argparse
import json
import os
from pathlib import Path

import torch

import terascale as deepspeed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from the launcher")
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(int(os.environ["RANK"])))
    losses = []
    for _ in range(2):
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    rank = int(os.environ["RANK"])
    record = {"rank": rank, "local_rank": args.local_rank, "env_local_rank": int(os.environ["LOCAL_RANK"]),
              "deepspeed": args.deepspeed, "deepspeed_config": args.deepspeed_config, "losses": losses}
    out = Path(args.out)
    (out / f".rank{rank}.json.tmp").write_text(json.dumps(record))
    (out / f".rank{rank}.json.tmp").rename(out / f"rank{rank}.json")
    engine.destroy()


if __name__ == "__main__":
    main()
