"""Topology: the pp x dp x tp grid over a DeviceMesh (tp innermost), its groups under
Megatron's names, and ZeRO sharding over its data-parallel group."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from terascale.parallel import grid_sizes


def test_grid_sizes_and_their_errors() -> None:
    assert grid_sizes(8, pp=2, tp=2) == (2, 2, 2)
    assert grid_sizes(4) == (1, 4, 1)
    with pytest.raises(ValueError, match="do not split into pp=3 x tp=1"):
        grid_sizes(4, pp=3)
    with pytest.raises(ValueError, match="but the world has 4"):
        grid_sizes(4, tp=2, dp=4)
    with pytest.raises(ValueError, match="tp must be >= 1"):
        grid_sizes(4, tp=0)


def _groups_rank() -> dict:
    import torch.distributed as dist

    from terascale.parallel import Topology

    out = {}
    for pp, tp in ((1, 2), (2, 2), (2, 1)):
        topo = Topology(pp=pp, tp=tp)
        mpu = topo.mpu()
        out[(pp, tp)] = {
            "tp": topo.ranks("tp"), "dp": topo.ranks("dp"), "pp": topo.ranks("pp"),
            "coords": (topo.rank("pp"), topo.rank("dp"), topo.rank("tp")),
            "mpu": (mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank(),
                    mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank(),
                    mpu.get_pipe_parallel_world_size(), mpu.get_pipe_parallel_rank(),
                    dist.get_process_group_ranks(mpu.get_data_parallel_group())),
        }  # fmt: skip
    return out


def test_groups_put_tensor_parallel_ranks_next_to_each_other() -> None:
    results = run_ranks(_groups_rank, 4)
    for rank, out in enumerate(results):
        # tp=2: tensor-parallel pairs (0,1), (2,3); data-parallel (0,2), (1,3)
        assert out[(1, 2)]["tp"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert out[(1, 2)]["dp"] == [rank % 2, rank % 2 + 2]
        assert out[(1, 2)]["mpu"] == (2, rank % 2, 2, rank // 2, 1, 0, [rank % 2, rank % 2 + 2])
        # pp=2 x tp=2: stages (0,1) and (2,3); dp is 1
        assert out[(2, 2)]["pp"] == [rank % 2, rank % 2 + 2] and out[(2, 2)]["dp"] == [rank]
        assert out[(2, 2)]["coords"] == (rank // 2, 0, rank % 2)
        # pp=2, dp=2: data-parallel pairs inside a stage
        assert out[(2, 1)]["dp"] == [rank - rank % 2, rank - rank % 2 + 1]


def _zero_over_dp_rank(stage: int) -> None:
    """tp=2 x dp=2 with a replicated model: both tensor-parallel ranks of a pair see the same
    data; ZeRO shards and averages over dp only, so training equals one process on the
    global batch of the two data-parallel ranks."""
    import terascale
    from terascale.parallel import Topology
    from toy import CLASSES, IN, make_model

    topo = Topology(tp=2)
    mpu = topo.mpu()
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}  # fmt: skip
    engine, *_ = terascale.initialize(model=make_model(seed=0), config=config, mpu=mpu)
    assert engine.dist.dp_world_size == 2 and engine.gradient_accumulation_steps() == 1
    plain = make_model(seed=0)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    dp = mpu.get_data_parallel_rank()
    for _ in range(3):
        x, y = torch.randn(4, IN, generator=g), torch.randint(0, CLASSES, (4,), generator=g)
        mine = slice(2 * dp, 2 * dp + 2)
        engine.backward(engine(x[mine], y[mine]))
        engine.step()
        plain(x, y).backward()
        opt.step()
        opt.zero_grad()
    weights = engine.full_state_dict()
    engine.destroy()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_zero_shards_over_the_topologys_data_parallel_group(stage: int) -> None:
    run_ranks(_zero_over_dp_rank, 4, stage)
