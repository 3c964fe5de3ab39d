"""Optimizer and parameter offload (host and NVMe) train exactly like no offload."""

from __future__ import annotations

import pytest

from distributed import run_ranks
from terascale.offload.kernel_aio import open_queue
from parity import Case, check


def _nvme(path, **kw) -> dict:
    return {"offload_optimizer": {"device": "nvme", "nvme_path": str(path), **kw}}


def test_offloaded_optimizer_matches_the_reference(tmp_path):
    # Small sub-groups make several runs per rank, so the swap pipeline (read ahead, write
    # behind) has something to overlap; buffer_count 1 and 2 degrade to serial swaps.
    cases = [
        Case(stage=1, gas=2, zero={"offload_optimizer": {"device": "cpu"}}),
        Case(stage=2, gas=2, clip=0.5, zero={**_nvme(tmp_path, buffer_count=4), "sub_group_size": 400}),
        Case(stage=3, tied=True, use_rare=True, zero={**_nvme(tmp_path, buffer_count=1), "sub_group_size": 300}),
        Case(stage=3, frozen=True, zero={**_nvme(tmp_path, buffer_count=2, ratio=0.5), "sub_group_size": 200}),
        Case(stage=2, extra={"aio": {"block_size": 4096, "queue_depth": 2, "single_submit": True}},
             zero={**_nvme(tmp_path), "sub_group_size": 1000}),
    ]  # fmt: skip
    check(2, cases, zero_unused_grads=True)
    assert not any((tmp_path / "terascale_swap").rglob("*.swp"))  # destroy() removed them


def _swap_rank(path: str, layers: int = 6) -> dict:
    import torch
    from torch import nn

    import terascale

    torch.manual_seed(0)
    # Six layers: the gradient shards (6 x 2048 per rank) outgrow the two 4096-element
    # optimizer buffers, so they go to disk too ([Note: gradient swapping]).
    model = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(layers)))
    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        # The step after backward, whose reads ahead and gradient files this measures (with
        # step_in_backward backward would step the runs itself: tests/test_step_in_backward.py).
        "zero_optimization": {"stage": 2, "sub_group_size": 4096,
                              **_nvme(path, buffer_count=2, step_in_backward=False)},
    }  # fmt: skip
    engine, *_ = terascale.initialize(model=model, config=config)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    read_in_backward = []
    for _ in range(3):
        loss = engine(x).float().square().mean()
        engine.model_state.swapper.writes.drain()  # the step's last writes (they finish under forward)
        before = engine.offload_io()["read"]
        engine.backward(loss)
        read_in_backward.append(engine.offload_io()["read"] - before)
        engine.step()
    mem = engine.memory_breakdown()
    files = sorted(p.name for p in engine.model_state.swapper.directory.path.glob("*.swp"))
    grads = engine.model_state.grads.swapper
    grad_files = [] if grads is None else sorted(p.name for p in grads.directory.path.glob("*.swp"))
    engine.destroy()
    return {"mem": mem, "files": files, "grad_files": grad_files, "read_in_backward": read_in_backward}


def test_between_steps_the_optimizer_state_is_only_on_disk(tmp_path):
    psi = 6 * 64 * 64
    for got in run_ranks(_swap_rank, 2, str(tmp_path)):
        mem = got["mem"]
        assert mem["optimizer_state"] == 0 and mem["master_params"] == 0
        # fp32 masters + two fp32 Adam moments for this rank's half, in 4096-element runs,
        # and the bf16 gradient shards ([Note: gradient swapping]); no gradient in memory.
        assert mem["nvme"] == 12 * psi // 2 + 2 * psi // 2
        assert mem["grads"] == 0
        assert got["files"] == ["run0.swp", "run1.swp", "run2.swp"]  # 4096-element sub-groups
        assert got["grad_files"] == [f"grad{g}.swp" for g in range(6)]  # one per layer
        # Two optimizer buffers of a run, two of a 2048-element bf16 gradient shard, and
        # two of a run's 4096 bf16 gradient elements (the step reads one run ahead).
        assert 0 < mem["offload_buffers"] <= 2 * 12 * 4096 + 2 * 4096 + 2 * 2 * 4096
        # Backward writes gradient shards and reads nothing of its own (one micro-step):
        # what it reads is the optimizer's first runs, read ahead of the step. Before
        # the first step they hold masters only (4 bytes an element), after it masters
        # and moments (12); two of the three runs fit the two buffers.
        assert got["read_in_backward"][0] == 2 * 4 * 4096
        assert got["read_in_backward"][1:] == [2 * 12 * 4096] * 2
    assert not any((tmp_path / "terascale_swap").rglob("*.swp"))


def test_gradients_that_fit_the_optimizer_buffers_stay_in_memory(tmp_path):
    # Four layers: 4 x 2048 gradient elements per rank fit the two 4096-element optimizer
    # buffers, so they stay in host memory and nothing reads them back in the step.
    psi = 4 * 64 * 64
    for got in run_ranks(_swap_rank, 2, str(tmp_path), 4):
        assert got["grad_files"] == []
        assert got["mem"]["grads"] == 2 * psi // 2  # this rank's bf16 gradient shards
        assert got["mem"]["nvme"] == 12 * psi // 2  # only masters and moments on disk


def _buffer_size_rank(path: str, buffer_size: int) -> str:
    import torch
    from torch import nn

    import terascale

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))  # one group of 8320 elements
    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              **_params_nvme(path, buffer_size=buffer_size)},
    }  # fmt: skip
    try:
        engine, *_ = terascale.initialize(model=model, config=config)
    except ValueError as exc:
        return str(exc)
    engine.backward(engine(torch.randn(2, 64)).square().mean())
    engine.step()
    engine.destroy()
    return "trained"


def test_buffer_size_bounds_each_parameter_as_in_deepspeed(tmp_path):
    # DeepSpeed needs the largest parameter (4096 elements) to fit a buffer; a group's shard
    # may be larger (terascale's buffers hold whole shards).
    assert run_ranks(_buffer_size_rank, 1, str(tmp_path), 4096) == ["trained"]
    (msg,) = run_ranks(_buffer_size_rank, 1, str(tmp_path), 4000)
    assert "buffer_size is 4000 elements but parameter '0.weight' has 4096" in msg, msg


def _allocator_policy_rank(path: str) -> list[list[str]]:
    import torch
    from torch import nn

    import terascale
    from terascale.zero import sharded

    calls: list[str] = []
    sharded.map_large_allocations = lambda: calls.append("map")
    sharded.reuse_large_allocations = lambda: calls.append("reuse")
    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, **_nvme(path)},
    }
    seen = []
    for bound in (512 << 20, 1 << 10):  # above, then below this rank's ~50 KB on NVMe
        sharded.BOUNDED_HOST_MIN_NVME_BYTES = bound
        engine, *_ = terascale.initialize(model=nn.Linear(64, 64), config=config)
        engine.backward(engine(torch.randn(2, 64)).square().mean())
        engine.step()
        engine.destroy()
        seen.append(calls[:])
        calls.clear()
    return seen


def test_the_host_allocator_policy_follows_the_states_on_nvme(tmp_path):
    # [Note: host memory with an NVMe tier]: a CPU rank maps large blocks while it builds;
    # with under BOUNDED_HOST_MIN_NVME_BYTES on NVMe the heap gets them back.
    assert run_ranks(_allocator_policy_rank, 1, str(tmp_path), device="cpu") == [[["map", "reuse"], ["map"]]]


def test_offload_settings_are_checked():
    from terascale.config import Config, ConfigError

    # An offload the stage cannot use is ignored, as DeepSpeed ignores it, and said so.
    cfg = Config.load({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})
    assert cfg.zero_optimization.offload_optimizer is None
    assert cfg.notes == ("zero_optimization.offload_optimizer: device 'cpu' is ignored at stage 0, as DeepSpeed "
                         "ignores it (only stage 1-3 partitions optimizer state); set stage to offload",)
    cfg = Config.load({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert cfg.zero_optimization.offload_param is None and "ignored at stage 2" in cfg.notes[0]
    with pytest.raises(ConfigError, match="nvme_path is required"):
        Config.load({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})


def _missing_dir_rank(path: str) -> str:
    from torch import nn

    import terascale

    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1, **_nvme(path)},
    }
    try:
        terascale.initialize(model=nn.Linear(4, 4), config=config)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_missing_nvme_path_is_a_clear_error(tmp_path):
    (msg,) = run_ranks(_missing_dir_rank, 1, str(tmp_path / "absent"))
    assert "absent' is not an existing directory" in msg


def _params_nvme(path, **kw) -> dict:
    return {"offload_param": {"device": "nvme", "nvme_path": str(path), "max_in_cpu": 0, **kw}}


def test_offloaded_parameters_match_the_reference(tmp_path):
    # Every non-persistent shard on disk (max_in_cpu 0), read ahead along the trace.
    cases = [
        Case(stage=3, gas=2, clip=0.5, zero={"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}),
        Case(stage=3, tied=True, use_rare=True, zero=_params_nvme(tmp_path, buffer_count=2)),
        Case(stage=3, frozen=True, gas=2, zero={**_params_nvme(tmp_path), **_nvme(tmp_path), "sub_group_size": 300}),
        Case(stage=3, reuse=True, zero={**_params_nvme(tmp_path, max_in_cpu=200), "stage3_max_reuse_distance": 0}),
    ]  # fmt: skip
    if open_queue(1) is not None:  # the same through the kernel's AIO queue
        cases.append(Case(stage=3, gas=2, extra={"aio": {"backend": "kernel", "block_size": 4096}},
                          zero={**_params_nvme(tmp_path), **_nvme(tmp_path, buffer_count=2), "sub_group_size": 300}))  # fmt: skip
    check(2, cases, zero_unused_grads=True)
    assert not any((tmp_path / "terascale_swap").rglob("*.swp"))


def _param_swap_rank(path: str) -> dict:
    import torch
    from torch import nn

    import terascale

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(6)))
    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 0,  # gathers on demand: reads ahead do the overlap
            "stage3_max_reuse_distance": 0,  # every block gathered again for backward
            **_params_nvme(path, buffer_count=3),
        },
    }
    engine, *_ = terascale.initialize(model=model, config=config)
    x = torch.randn(4, 64)
    for _ in range(3):
        engine.backward(engine(x).square().mean())
        engine.step()
    home = engine.model_state.params
    out = {"mem": engine.memory_breakdown(), "fetches": home.fetches, "ahead": home.fetches_ahead,
           "staged": home.staged_gathers, "gathers": engine.model_state.schedule.gathers,
           "files": len(list(home.directory.path.glob("*.swp")))}  # fmt: skip
    engine.destroy()
    return out


def test_parameter_shards_live_on_disk_and_are_read_ahead(tmp_path):
    psi = 6 * 64 * 64
    for got in run_ranks(_param_swap_rank, 2, str(tmp_path)):
        mem = got["mem"]
        assert mem["params"] == 0 and mem["gathered_params"] == 0
        assert mem["nvme"] == 4 * psi // 2  # fp32 shards of every block
        assert got["files"] == 6
        # Every gather reads its shard once (nothing stays in memory); each step gathers
        # the 6 groups for forward and all but the last again for backward, and after the
        # first step the trace lets the reads start ahead of most gathers. The forward
        # after a step gathers its first two groups from the step's staging buffers
        # (buffer_count 3 keeps 2; [Note: staged shards]) without reading them.
        assert got["gathers"] == 12 + 11 + 11
        assert got["staged"] == 2 * 2
        assert got["fetches"] == got["gathers"] - got["staged"]
        assert got["ahead"] >= 2 * 11 - 4, got
        assert 0 < mem["offload_buffers"] <= 3 * 4 * 64 * 64 // 2
