"""A pipeline-parallel convolutional classifier in the shape of DeepSpeed's AlexNet
pipeline example: a flat list of layers in a ``PipelineModule``, the second stage starting
with an in-place ``ReLU``, ``RepeatingLoader``, ``runtime.utils.set_random_seed``,
``init_distributed(dist_backend=...)`` and ``engine.train_batch()`` over the loader
``initialize`` builds from ``training_data``. Only the import lines name terascale.

    terascale run --nproc 2 pipeline_alexnet_style.py --pipeline-parallel-size 2 --out DIR
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import terascale as deepspeed
from terascale.pipe import PipelineModule
from terascale.utils import RepeatingLoader


def get_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="pipeline classifier")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-s", "--steps", type=int, default=4, help="quit after this many steps")
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2, help="pipeline parallelism")
    parser.add_argument("--backend", type=str, default="gloo", help="distributed backend")
    parser.add_argument("--seed", type=int, default=1138, help="PRNG seed")
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def layers() -> list[nn.Module]:
    # Ten layers split evenly: the second stage begins at index 5, an in-place ReLU that
    # receives the first stage's activation.
    return [
        nn.Conv2d(3, 16, kernel_size=3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, kernel_size=3, padding=1), nn.MaxPool2d(2),
        nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(inplace=True), nn.Linear(64, 10),
    ]


def train_pipe(args: argparse.Namespace) -> None:
    deepspeed.runtime.utils.set_random_seed(args.seed)
    net = PipelineModule(layers=layers(), loss_fn=nn.CrossEntropyLoss(), num_stages=args.pipeline_parallel_size,
                         partition_method="uniform", activation_checkpoint_interval=0)
    g = torch.Generator().manual_seed(0)
    trainset = torch.utils.data.TensorDataset(torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g))
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8}},
              "pipeline": {"activation_checkpoint_interval": 0}}
    engine, _, _, _ = deepspeed.initialize(args=args, model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                                           training_data=trainset, config=config)
    losses = [engine.train_batch().item() for _ in range(args.steps)]
    # The data iterator may also come from the script, repeated over epochs.
    loader = RepeatingLoader(torch.utils.data.DataLoader(trainset, batch_size=2))
    losses.append(engine.train_batch(data_iter=iter(loader)).item())
    dist.barrier()
    if dist.get_rank() == 0:
        record = {"losses": losses, "gas": engine.gradient_accumulation_steps(), "stages": args.pipeline_parallel_size,
                  "first_layer_of_stage_1": "ReLU(inplace=True)"}
        Path(args.out, "rank0.json").write_text(json.dumps(record))


if __name__ == "__main__":
    args = get_args()
    deepspeed.init_distributed(dist_backend=args.backend)
    train_pipe(args)
