"""terascale.initialize's inputs: an mpu's groups, training data, client optimizer/scheduler."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from toy import make_data, make_model, reference_train

LR = 1e-2
STEPS = 3
MICRO = 2


def _config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000, **extra}


def _train(engine, x, y) -> None:
    for s in range(STEPS):
        lo = engine.dist.dp_rank * MICRO
        engine.backward(engine(x[s, lo : lo + MICRO], y[s, lo : lo + MICRO]))
        engine.step()


class _GridMPU:
    """4 ranks as 2 (data) x 2 (model): model-parallel pairs {0,1}, {2,3}; data {0,2}, {1,3}."""

    def __init__(self) -> None:
        import torch.distributed as dist

        rank = dist.get_rank()
        # Every rank creates every group, in the same order (new_group is collective).
        dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        mp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        self._dp, self._mp = dp[rank % 2], mp[rank // 2]
        self._rank = rank

    def get_data_parallel_group(self):
        return self._dp

    def get_model_parallel_group(self):
        return self._mp

    def get_data_parallel_world_size(self) -> int:
        return 2

    def get_data_parallel_rank(self) -> int:
        return self._rank // 2

    def get_model_parallel_world_size(self) -> int:
        return 2

    def get_model_parallel_rank(self) -> int:
        return self._rank % 2


def _mpu_rank():
    import terascale
    from terascale.comm import init_distributed

    rank = init_distributed().rank  # the default group must exist before subgroups
    mpu = _GridMPU()
    # Ranks 2 and 3 start from other weights: each data-parallel group broadcasts its first rank's.
    model = make_model(seed=0 if rank < 2 else 7)
    engine, *_ = terascale.initialize(
        model=model, mpu=mpu, config=_config(optimizer={"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}})
    )
    assert engine.world_size == 2 and engine.dist.mp_world_size == 2 and engine.dist.dp_rank == rank // 2
    # Each data-parallel group (a model-parallel "column") trains on its own data.
    x, y = make_data(STEPS, 2 * MICRO, seed=1 + rank % 2)
    _train(engine, x, y)
    return engine.full_state_dict()


def test_mpu_data_parallel_group_is_the_reduction_group():
    states = run_ranks(_mpu_rank, 4)
    for column in (0, 1):
        _, ref = reference_train(STEPS, 2 * MICRO, lr=LR, weight_decay=0.01, clip=0.0, data_seed=1 + column)
        for rank in (column, column + 2):
            for k, v in ref.items():
                torch.testing.assert_close(states[rank][k], v, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {k}")
    assert not torch.equal(states[0]["head.weight"], states[1]["head.weight"])


def _loader_rank():
    import terascale
    from torch.utils.data import TensorDataset

    data = TensorDataset(torch.arange(20))
    seen_collate = []

    def collate(rows):
        seen_collate.append(len(rows))
        return torch.stack([r[0] for r in rows])

    engine, _, loader, _ = terascale.initialize(
        model=make_model(), training_data=data, collate_fn=collate,
        config=_config(optimizer={"type": "SGD", "params": {"lr": 0.1}}),
    )
    assert engine.training_dataloader is loader
    loader.sampler.set_epoch(0)
    epoch0 = [b.tolist() for b in loader]
    again = [b.tolist() for b in loader]
    loader.sampler.set_epoch(1)
    epoch1 = [b.tolist() for b in loader]
    return epoch0, again, epoch1, seen_collate


def test_training_data_gives_micro_batches_of_a_disjoint_seeded_shard():
    (e0_a, again_a, e1_a, collate_a), (e0_b, _, _, _) = run_ranks(_loader_rank, 2)
    assert [len(b) for b in e0_a] == [MICRO] * 5  # 10 samples per rank in micro-batches of 2
    # The memory planner measures one sample through the client's collate_fn at initialize
    # ([Note: the planner at initialize]); then the client's collate_fn built every batch.
    assert collate_a[0] == 1 and set(collate_a[1:6]) == {MICRO}
    flat_a = [i for b in e0_a for i in b]
    flat_b = [i for b in e0_b for i in b]
    assert sorted(flat_a + flat_b) == list(range(20))  # disjoint shards covering the data
    assert e0_a == again_a  # the same epoch gives the same order
    assert e0_a != e1_a and len({i for b in e1_a for i in b}) == 10  # set_epoch reshuffles


def _client_optimizer_rank(bf16: bool):
    import terascale

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    config = _config(bf16={"enabled": bf16})
    engine, opt, _, sched = terascale.initialize(
        model=model, optimizer=optimizer, config=config,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    )
    assert opt.optimizer is optimizer and engine.optimizer is optimizer  # opt: its handle
    # The optimizer now steps the fp32 masters (with bf16, not the bf16 model parameters).
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    x, y = make_data(STEPS, MICRO)
    if bf16:
        x = x.bfloat16()
    lrs = []
    for s in range(STEPS):
        engine.backward(engine(x[s], y[s]))
        engine.step()
        lrs.append(engine.get_lr()[0])
    with pytest.raises(ValueError, match="remove one of them"):
        terascale.initialize(model=make_model(), optimizer=torch.optim.SGD(make_model().parameters(), lr=1.0),
                             config=_config(optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    return lrs, engine.full_state_dict(), type(sched).__name__


def test_client_optimizer_and_scheduler_callable():
    lrs, state, sched_name = run_ranks(_client_optimizer_rank, 1, False)[0]
    assert sched_name == "StepLR"
    assert lrs == pytest.approx([LR / 2, LR / 4, LR / 8])
    # StepLR halves after every step: the reference uses the same decay.
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = make_data(STEPS, MICRO)
    for s in range(STEPS):
        model(x[s], y[s]).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_client_optimizer_is_moved_to_fp32_masters_under_bf16():
    lrs, state, _ = run_ranks(_client_optimizer_rank, 1, True)[0]
    assert all(v.dtype == torch.float32 for v in state.values())


def _deepspeed_order_rank(config_path: str) -> dict:
    import argparse

    import terascale

    args = argparse.Namespace(deepspeed_config=config_path, local_rank=0)
    out: dict = {}
    # DeepSpeed's argument order, as published programs call it: args first.
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine, handle, _, _ = terascale.initialize(args, model, opt)
    x, y = make_data(STEPS, MICRO)
    engine.backward(engine(x[0], y[0]))
    engine.step()
    out["positional"] = engine.full_state_dict()
    engine.destroy()
    adam = _config(optimizer={"type": "Adam", "params": {"lr": LR}})
    engine, *_ = terascale.initialize(args, model=make_model(), mesh_param=(1, 1), config_params=adam)
    out["keyword_model"] = engine.optimizer_name()
    engine.destroy()
    for name, call in (("none", lambda: terascale.initialize(model=None, config=_config())),
                       ("model_first", lambda: terascale.initialize(make_model(), config=_config())),
                       ("mesh", lambda: terascale.initialize(args, make_model(), mesh_param=(2, 2)))):  # fmt: skip
        try:
            call()
        except (AssertionError, ValueError) as exc:  # DeepSpeed asserts on a missing model
            out[name] = (isinstance(exc, AssertionError), str(exc))
    return out


def test_deepspeed_argument_order(tmp_path) -> None:
    import json

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_config()))
    (out,) = run_ranks(_deepspeed_order_rank, 1, str(path))
    # The client SGD optimizer passed third, positionally, is the one that trained.
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = make_data(STEPS, MICRO)
    model(x[0], y[0]).backward()
    opt.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(out["positional"][k], v, rtol=1e-6, atol=1e-7, msg=k)
    assert out["keyword_model"] == "Adam"
    assert out["none"][0] and "requires a model" in out["none"][1]
    assert out["model_first"][0] and "first positional argument is args" in out["model_first"][1]
    assert "2 x 2 ranks, but the world has 1" in out["mesh"][1]
