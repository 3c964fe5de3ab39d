"""Memory discipline of the NVMe tier: host memory is bounded by buffers, not by the model.

A 41.9M-parameter model has 671 MB of model states (bf16 parameters and gradients, fp32
masters and two Adam moments: 16 bytes per parameter). Built inside ``zero.Init``
straight to NVMe and trained with parameters, gradients and optimizer state there, the
process's peak RSS grows by less than a 64 MiB budget (the states are 10x that);
the same model without offload grows by more than the states, so the measurement sees
them.
"""

from __future__ import annotations

import torch

from distributed import run_ranks

LAYERS, WIDTH = 40, 1024
BUDGET = 64 * 2**20


def _config(path: str | None) -> dict:
    # The working set is set by the stage-3 knobs: blocks are freed after their forward
    # (max_reuse_distance 0; by default all would stay for backward) and at most two are
    # gathered ahead and two blocks' gradients reduced at once (the default prefetch and
    # reduce buckets, 50M and 500M elements, each hold this whole model).
    zero = {"stage": 3, "sub_group_size": 1 << 18, "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 2 * WIDTH * WIDTH,
            "reduce_bucket_size": 2 * WIDTH * WIDTH}
    if path is not None:
        zero["offload_param"] = {"device": "nvme", "nvme_path": path, "max_in_cpu": 0, "buffer_count": 3}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": path, "buffer_count": 3}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
    }


def _train_rank(path: str | None) -> dict:
    import threading

    import psutil
    import torch
    from torch import nn

    import terascale
    from terascale.comm import init_distributed
    from terascale.zero import Init

    init_distributed()
    proc = psutil.Process()
    config = _config(path)
    # Warm up on a one-layer model: imports, I/O threads and gloo's buffers are a fixed
    # cost of the process, not of the model, and stay out of the measured growth.
    warm, *_ = terascale.initialize(model=nn.Linear(WIDTH, WIDTH, bias=False), config=config)
    warm.backward(warm(torch.randn(2, WIDTH).bfloat16()).float().square().mean())
    warm.step()
    warm.destroy()
    del warm
    torch.manual_seed(0)
    x = torch.randn(2, WIDTH)
    start = proc.memory_info().rss
    peak = [start]
    done = threading.Event()

    def sample() -> None:  # (ru_maxrss would count the start-up's own peak)
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            done.wait(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    with Init(config=config):
        model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))
    engine, *_ = terascale.initialize(model=model, config=config)
    losses = []
    for _ in range(2 * 3):  # 3 steps of 2 micro-steps
        loss = engine(x.bfloat16()).float().square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    mem = engine.memory_breakdown()
    done.set()
    sampler.join()
    engine.destroy()
    return {"growth": peak[0] - start, "mem": mem, "losses": losses}


def test_offloaded_training_stays_within_a_memory_budget_a_tenth_of_its_states(tmp_path):
    params = LAYERS * WIDTH * WIDTH
    states = 16 * params
    assert states >= 10 * BUDGET
    # Host memory of CPU ranks: a GPU rank's RSS holds the CUDA context and its pinned buffers.
    (offloaded,) = run_ranks(_train_rank, 1, str(tmp_path), timeout=600, device="cpu")
    (plain,) = run_ranks(_train_rank, 1, None, timeout=600, device="cpu")
    print(f"peak RSS growth: offloaded {offloaded['growth'] / 2**20:.0f} MiB, in memory "
          f"{plain['growth'] / 2**20:.0f} MiB; model states {states / 2**20:.0f} MiB")  # fmt: skip
    assert plain["growth"] > states  # the measurement sees model states
    assert offloaded["growth"] < BUDGET, offloaded["growth"] / 2**20
    mem = offloaded["mem"]
    assert mem["params"] == mem["grads"] == mem["master_params"] == mem["optimizer_state"] == 0
    assert mem["nvme"] == states
    torch.testing.assert_close(offloaded["losses"], plain["losses"], rtol=1e-3, atol=0)  # the same training
    assert not any((tmp_path / "terascale_swap").rglob("*.swp"))
