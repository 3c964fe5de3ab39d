"""The group plan: which module owns which parameters, in which order."""

from __future__ import annotations

import torch
from torch import nn

from terascale.zero.wrap import WrapPolicy, plan_groups


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # a block runs (see [Note: modules that never run])
        return self.norm(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight  # tied: embedding and output head


def test_default_policy_groups_repeated_blocks_and_keeps_tied_weights_at_the_root():
    net = Net()
    ids = {id(p): 0 for p in net.parameters()}
    plans = plan_groups(net, WrapPolicy(), ids)
    assert [p.module_name for p in plans] == ["", "blocks.0", "blocks.1", "blocks.2"]
    assert plans[0].names == ("emb.weight",)  # the tied weight, once, in the common ancestor
    assert plans[1].names == ("blocks.0.fc.weight", "blocks.0.fc.bias", "blocks.0.norm.weight", "blocks.0.norm.bias")
    assert all(not p.persistent for p in plan_groups(net, WrapPolicy(), ids, shard_params=True))


def test_min_params_and_explicit_classes():
    net = Net()
    ids = {id(p): 0 for p in net.parameters()}
    assert [p.module_name for p in plan_groups(net, WrapPolicy(min_params=10**6), ids)] == [""]
    plans = plan_groups(net, WrapPolicy(module_classes=(nn.Linear,)), ids)
    assert [p.module_name for p in plans] == ["", "blocks.0.fc", "blocks.1.fc", "blocks.2.fc"]
    # The root keeps the tied weight and every LayerNorm.
    assert len(plans[0].names) == 1 + 2 * 3


def test_persistent_small_params_and_optimizer_group_order():
    net = Net()
    # Biases in optimizer group 1, weights in 0, the first block frozen.
    opt = {}
    for name, p in net.named_parameters():
        opt[id(p)] = 1 if name.endswith("bias") else 0
    for p in net.blocks[0].parameters():
        del opt[id(p)]
    plans = plan_groups(net, WrapPolicy(), opt, persistence_threshold=9, shard_params=True)
    persistent = [p for p in plans if p.persistent]
    # Trainable and frozen small parameters apart: each group shards evenly on its own.
    assert [p.module_name for p in persistent] == ["<persistent>", "<persistent>"]
    assert all(p.numel() < 9 for plan in persistent for p in plan.params)
    assert min(persistent[0].opt_group) >= 0 and set(persistent[1].opt_group) == {-1}
    for plan in plans:
        # Runs of one optimizer group are contiguous; a group is all trainable or all frozen.
        keys = list(plan.opt_group)
        assert keys == sorted(keys) and (min(keys) >= 0 or set(keys) == {-1})
    block0 = next(p for p in plans if p.module_name == "blocks.0")
    assert set(block0.opt_group) == {-1}
    assert torch.Size([8, 8]) == block0.params[0].shape
