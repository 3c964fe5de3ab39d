"""A CIFAR-10-shaped classifier written the way DeepSpeed's CIFAR tutorial script is:
``deepspeed.add_config_arguments``, ``--local_rank``, ``init_distributed``, the accelerator
object, ``initialize(args=..., training_data=...)`` returning the loader, the engine's
precision queries, evaluation. Only the import line names terascale; the data is random.

    terascale run --nproc 2 cifar_style.py --stage 3 --dtype bf16 --out DIR

``--moe`` is the tutorial's mixture-of-experts mode (``run_ds_moe.sh``, ``run_ds_prmoe.sh``):
one ``deepspeed.moe.layer.MoE`` per ``--num-experts`` value, all sharing ``fc3`` as their
expert (and, with ``--mlp-type residual``, as their dense branch), split over
``--ep-world-size`` ranks.
"""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import terascale as deepspeed
from terascale.accelerator import get_accelerator
from terascale.moe.utils import split_params_into_different_moe_groups_for_optimizer


def add_argument() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="CIFAR-shaped classifier")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from the launcher")
    parser.add_argument("--dtype", default="fp32", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--stage", type=int, default=0, choices=[0, 1, 2, 3])
    parser.add_argument("--moe", default=False, action="store_true", help="use deepspeed mixture of experts (moe)")
    parser.add_argument("--ep-world-size", default=1, type=int, help="(moe) expert parallel world size")
    parser.add_argument("--num-experts", type=int, nargs="+", default=[1], help="number of experts list, MoE related")
    parser.add_argument("--mlp-type", type=str, default="standard", help="accepts [standard, residual]")
    parser.add_argument("--top-k", default=1, type=int, help="(moe) gating top 1 and 2 supported")
    parser.add_argument("--min-capacity", default=0, type=int, help="(moe) minimum capacity of an expert")
    parser.add_argument("--noisy-gate-policy", default=None, type=str, help="(moe) None, RSample or Jitter")
    parser.add_argument("--moe-param-group", action="store_true", help="parameter groups as the MoE mode makes them")
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.moe = args.moe
        if self.moe:
            fc3 = nn.Linear(84, 84)
            self.moe_layer_list = []
            for n_e in args.num_experts:
                self.moe_layer_list.append(
                    deepspeed.moe.layer.MoE(
                        hidden_size=84, expert=fc3, num_experts=n_e, ep_size=args.ep_world_size,
                        use_residual=args.mlp_type == "residual", k=args.top_k, min_capacity=args.min_capacity,
                        noisy_gate_policy=args.noisy_gate_policy,
                    )
                )
            self.moe_layer_list = nn.ModuleList(self.moe_layer_list)
            self.fc4 = nn.Linear(84, 10)
        else:
            self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc2(F.relu(self.fc1(x))))
        if self.moe:
            for layer in self.moe_layer_list:
                x, _, _ = layer(x)
            return self.fc4(x)
        return self.fc3(x)


def ds_config(args: argparse.Namespace) -> dict:
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 10}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "fp16_master_weights_and_grads": False, "loss_scale": 0,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": args.stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True, "cpu_offload": False},
    }


def main() -> None:
    args = add_argument()
    deepspeed.init_distributed()
    _local_rank = int(os.environ.get("LOCAL_RANK"))
    get_accelerator().set_device(_local_rank)

    g = torch.Generator().manual_seed(0)
    trainset = torch.utils.data.TensorDataset(torch.randn(96, 3, 32, 32, generator=g), torch.randint(0, 10, (96,), generator=g))
    testset = torch.utils.data.TensorDataset(torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g))

    torch.manual_seed(0)
    net = Net(args)
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:  # the tutorial's create_moe_param_groups
        parameters = split_params_into_different_moe_groups_for_optimizer(
            {"params": [p for p in net.parameters()], "name": "parameters"})
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset, config=ds_config(args))

    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half

    criterion = nn.CrossEntropyLoss()
    losses = []
    for epoch in range(args.epochs):
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())

    model_engine.eval()
    correct = total = 0
    with torch.no_grad():
        for images, labels in torch.utils.data.DataLoader(testset, batch_size=8):
            if target_dtype is not None:
                images = images.to(target_dtype)
            outputs = model_engine(images.to(local_device))
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels.to(predicted.device)).sum().item()
    if local_rank == 0:
        groups = [(g.get("name"), bool(g.get("moe")), len(g["params"])) for g in optimizer.param_groups]
        record = {"losses": losses, "accuracy": correct / total, "steps": model_engine.global_steps, "groups": groups,
                  "lr": model_engine.get_lr(), "device": str(local_device)}
        Path(args.out, "rank0.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
