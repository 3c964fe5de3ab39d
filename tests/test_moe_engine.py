"""DeepSpeed's ``MoE`` layer trained by the engine with expert parallelism, against the same
model with every expert in one process: losses, dense parameters and each expert's
parameters at ZeRO 0-3 ([Note: expert parameters], [Note: expert-parallel groups])."""

from __future__ import annotations

import json

import pytest
import torch

from distributed import run_ranks

E, H, STEPS, MICRO = 4, 8, 4, 3


def _net(ep_size: int, **moe):
    import torch
    from torch import nn

    from terascale.moe.layer import MoE

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(6, H)
            expert = nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H))
            self.moe = MoE(H, expert, num_experts=E, ep_size=ep_size, **moe)
            self.out = nn.Linear(H, 3)

        def forward(self, x, y):
            h = torch.tanh(self.inp(x))
            m, l_aux, _ = self.moe(h)
            return nn.functional.mse_loss(self.out(h + m), y) + 0.1 * l_aux

    return Net()


def _reference(**moe):
    """The single-process model: ep_size 1, every expert different (seeded)."""
    import torch

    torch.manual_seed(0)
    net = _net(1, **moe)
    with torch.no_grad():
        for i, expert in enumerate(net.moe.deepspeed_moe.experts.deepspeed_experts):
            for p in expert.parameters():
                p.add_(0.1 * (i + 1) * torch.randn_like(p))
    return net


def _local_state(ref_state: dict, ep_rank: int, local: int) -> dict:
    """The reference's state dict with this ep rank's experts renumbered from 0."""
    prefix = "moe.deepspeed_moe.experts.deepspeed_experts."
    out = {}
    for k, v in ref_state.items():
        if not k.startswith(prefix):
            out[k] = v
            continue
        g, rest = k[len(prefix) :].split(".", 1)
        if ep_rank * local <= int(g) < (ep_rank + 1) * local:
            out[f"{prefix}{int(g) - ep_rank * local}.{rest}"] = v
    return out


def _batches(world: int):
    import torch

    g = torch.Generator().manual_seed(7)
    return [[(torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)) for _ in range(world)]
            for _ in range(STEPS * MICRO)]  # fmt: skip


def _config(stage: int, world: int) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every group gathered and freed, experts too
    return {
        "train_batch_size": 1 * MICRO * world, "train_micro_batch_size_per_gpu": 1,
        # SGD: an update proportional to the gradient, so a gradient averaged over the wrong
        # ranks shows (Adam's normalisation would hide a constant factor).
        "optimizer": {"type": "SGD", "params": {"lr": 0.2, "momentum": 0.9}},
        "gradient_clipping": 0.05,  # below the gradients' norm: the global norm (experts counted once) matters
        "zero_optimization": zero, "steps_per_print": 1000,
    }  # fmt: skip


LAMB = {"type": "Lamb", "params": {"lr": 0.02, "weight_decay": 0.01}}
MUON = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.01, "weight_decay": 0.01, "momentum": 0.9}}


def _reference_run(world: int, moe: dict, optimizer: str = "sgd"):
    """Losses and final state of the reference trained on every rank's batches at once:
    each window's loss is the mean over ranks of each rank's mean micro-batch loss."""
    import torch

    from muon_reference import ReferenceMuon
    from terascale.optim import Lamb

    net = _reference(**moe)
    start = {k: v.clone() for k, v in net.state_dict().items()}
    if optimizer == "lamb":
        opt = Lamb(net.parameters(), **LAMB["params"])
    elif optimizer == "muon":
        opt = ReferenceMuon(net, 0.02, 0.01, 0.01, 0.9)
        opt.zero_grad = net.zero_grad
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    losses = []
    data = _batches(world)
    for step in range(STEPS):
        opt.zero_grad()
        window = []
        for micro in range(MICRO):
            per_rank = [net(x, y) for x, y in data[step * MICRO + micro]]
            (sum(per_rank) / (world * MICRO)).backward()
            window.append([loss.item() for loss in per_rank])
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        opt.step()
        losses.append(window)
    return start, losses, {k: v.clone() for k, v in net.state_dict().items()}


def _moe_rank(stage: int, ep_size: int, moe: dict, optimizer: str = "sgd") -> None:
    import torch
    import torch.distributed as dist

    import terascale
    from terascale.comm import init_distributed

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    start, ref_losses, ref_final = _reference_run(world, moe, optimizer)
    local = E // ep_size
    ep_rank = rank % ep_size  # DeepSpeed's layout: ep groups are consecutive ranks
    torch.manual_seed(1000 + rank)  # different on every rank: initialize must broadcast
    net = _net(ep_size, **moe)
    net.load_state_dict(_local_state(start, ep_rank, local))
    config = _config(stage, world)
    config["optimizer"] = {"sgd": config["optimizer"], "lamb": LAMB, "muon": MUON}[optimizer]
    engine, *_ = terascale.initialize(model=net, config=config)
    data = _batches(world)
    for step in range(STEPS):
        for micro in range(MICRO):
            x, y = data[step * MICRO + micro][rank]
            loss = engine(x, y)
            torch.testing.assert_close(loss.item(), ref_losses[step][micro][rank], rtol=2e-5, atol=1e-6)
            engine.backward(loss)
            engine.step()
    final = _local_state(ref_final, ep_rank, local)
    with terascale.zero.GatheredParameters(list(engine.module.parameters())):
        got = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    assert set(got) == set(final)
    for k in final:
        torch.testing.assert_close(got[k], final[k], rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


# ZeRO-1 differs from ZeRO-2 only in when gradients are reduced: the long tail (make test-all).
@pytest.mark.parametrize("stage", [0, pytest.param(1, marks=pytest.mark.slow), 2, 3])
def test_dropless_top2_at_ep2_matches_one_process(stage):
    run_ranks(_moe_rank, 2, stage, 2, {"k": 2, "drop_tokens": False, "top2_2nd_expert_sampling": False})


@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)])
def test_ep2_inside_four_data_parallel_ranks(stage):
    # ep groups [0, 1], [2, 3]; each expert replicated on two ranks (expert-data-parallel).
    run_ranks(_moe_rank, 4, stage, 2, {"k": 2, "drop_tokens": False, "top2_2nd_expert_sampling": False}, timeout=300)


def test_lamb_trust_ratios_take_each_experts_whole_norm():
    # Lamb's per-parameter norms: a dense parameter's parts are summed over the data-parallel
    # ranks, an expert's over its expert-data-parallel ranks only (the others hold other experts).
    run_ranks(_moe_rank, 4, 2, 2, {"k": 2, "drop_tokens": False, "top2_2nd_expert_sampling": False}, "lamb",
              timeout=300)  # fmt: skip


@pytest.mark.parametrize("world,stage", [(2, 0), (4, 2)])
def test_muon_orthogonalizes_each_expert_whole_where_it_lives(world, stage):
    # Stage 0: each rank orthogonalizes its own experts; at ZeRO-2 on 4 ranks an expert's
    # shards are over its expert-data-parallel pair, the dense matrices' over all four, and
    # each goes to an owner among the ranks that hold its shards ([Note: whole matrices on shards]).
    run_ranks(_moe_rank, world, stage, 2, {"k": 2, "drop_tokens": False, "top2_2nd_expert_sampling": False}, "muon",
              timeout=300)  # fmt: skip


def test_top1_with_capacity_and_residual_at_ep2():
    # Token dropping (capacity 1.0, no random selection) and Residual MoE's dense branch.
    run_ranks(_moe_rank, 2, 2, 2, {"k": 1, "capacity_factor": 1.0, "min_capacity": 1, "use_rts": False,
                                   "use_residual": True})  # fmt: skip


def _checkpoint_rank(stage: int, ep_size: int, save_dir: str, load: bool) -> dict:
    """Train 2 steps and save (or load what another layout saved), then 2 more steps; the
    losses of the last 2 steps and the whole model's state dict, from rank 0."""
    import torch
    import torch.distributed as dist

    import terascale
    from terascale.comm import init_distributed

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    moe = {"k": 2, "drop_tokens": False, "top2_2nd_expert_sampling": False}
    start = _reference(**moe).state_dict()
    net = _net(ep_size, **moe)
    net.load_state_dict(_local_state(start, rank % ep_size, E // ep_size))
    engine, *_ = terascale.initialize(model=net, config=_config(stage, world))
    data = _batches(world)

    def steps(first: int) -> list[float]:
        losses = []
        for step in range(first, first + 2):
            for micro in range(MICRO):
                x, y = data[step * MICRO + micro][rank]
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        return losses

    if load:
        engine.load_checkpoint(save_dir)
    else:
        steps(0)
        engine.save_checkpoint(save_dir)
    saved = engine.full_state_dict()
    return {"losses": steps(2), "saved": saved}


def test_checkpoint_holds_every_expert_once_and_loads_on_other_ep_sizes(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    whole = run_ranks(_checkpoint_rank, 2, 2, 2, save_dir, False)[0]  # ep 2, ZeRO-2
    names = json.loads(next((tmp_path / "ckpt").glob("global_step*/manifest.json")).read_text())["params"]
    experts = sorted(n for n in names if ".deepspeed_experts." in n)
    assert len(experts) == E * 4  # every expert's 2 weights and 2 biases, each once, by global number
    assert {n.split(".deepspeed_experts.")[1].split(".")[0] for n in experts} == {str(i) for i in range(E)}
    for stage, ep_size in [(3, 1), (0, 2)]:  # all experts on each rank (ZeRO-3); ep 2 at stage 0
        resumed = run_ranks(_checkpoint_rank, 2, stage, ep_size, save_dir, True)[0]
        assert set(resumed["saved"]) == set(whole["saved"])
        for k, v in whole["saved"].items():
            torch.testing.assert_close(resumed["saved"][k], v, rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
        torch.testing.assert_close(resumed["losses"], whole["losses"], rtol=2e-5, atol=1e-6)


class MoEBlock(torch.nn.Module):
    """A residual MoE block for a pipeline stage (a pipeline layer passes one tensor on,
    so the load-balancing loss stays out, as Megatron-DeepSpeed's pipe layers leave it)."""

    def __init__(self, ep_size: int) -> None:
        super().__init__()
        from terascale.moe.layer import MoE

        expert = torch.nn.Sequential(torch.nn.Linear(H, 2 * H), torch.nn.GELU(), torch.nn.Linear(2 * H, H))
        self.moe = MoE(H, expert, num_experts=E, ep_size=ep_size, k=2, drop_tokens=False, top2_2nd_expert_sampling=False)

    def forward(self, x):
        return x + self.moe(x)[0]


PIPE_SEED, PIPE_STEPS, PIPE_GAS = 77, 3, 2


def _pipe_specs(ep_size: int):
    from terascale.pipe import LayerSpec

    return [LayerSpec(torch.nn.Linear, 6, H), LayerSpec(torch.nn.Tanh), LayerSpec(MoEBlock, ep_size),
            LayerSpec(torch.nn.Linear, H, 3)]  # fmt: skip


def _pipe_data(dp: int):
    g = torch.Generator().manual_seed(5)
    return [[[(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(dp)]
             for _ in range(PIPE_GAS)] for _ in range(PIPE_STEPS)]  # fmt: skip


def _pipe_reference(dp: int) -> dict:
    """The same layers in one process (every expert local), every replica's micro-batches."""
    root = torch.nn.Sequential()
    for i, spec in enumerate(_pipe_specs(1)):
        torch.manual_seed(PIPE_SEED + i)
        root.add_module(str(i), spec.typename(*spec.module_args, **spec.module_kwargs))
    opt = torch.optim.SGD(root.parameters(), lr=0.1)
    losses = []
    for step in _pipe_data(dp):
        total = 0.0
        for mb in step:
            for x, y in mb:
                loss = torch.nn.functional.mse_loss(root(x), y) / (PIPE_GAS * dp)
                loss.backward()
                total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in root.state_dict().items()}}


def _pipe_rank(stage: int) -> dict:
    import terascale
    from terascale.parallel import Topology
    from terascale.pipe import PipelineModule

    topo = Topology(pp=2)
    dp, dp_rank = topo.size("dp"), topo.rank("dp")
    torch.manual_seed(100 + torch.distributed.get_rank())
    model = PipelineModule(_pipe_specs(2), topology=topo, loss_fn=torch.nn.functional.mse_loss, seed_layers=True,
                           base_seed=PIPE_SEED, partition_method="uniform")  # fmt: skip
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": PIPE_GAS, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": stage}}  # fmt: skip
    engine, *_ = terascale.initialize(model=model, config=config)
    losses = [float(engine.train_batch(iter([mb[dp_rank] for mb in step]))) for step in _pipe_data(dp)]
    return {"losses": losses, "state": engine.full_state_dict()}


def test_experts_inside_a_pipeline_stage():
    # 4 ranks: 2 stages x 2 replicas; the MoE block's stage splits its 4 experts over its 2 replicas.
    ref = _pipe_reference(2)
    for got in run_ranks(_pipe_rank, 4, 1, timeout=300):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
        assert set(got["state"]) == set(ref["state"])
        for k, v in got["state"].items():
            torch.testing.assert_close(v, ref["state"][k], rtol=0, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
