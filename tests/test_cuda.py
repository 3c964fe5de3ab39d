"""The CUDA path: NCCL, device placement and low precision on a GPU, same checks as on CPU.

CI has no GPU and skips these; they run wherever one is visible (the lent GPU machines).
Multi-rank tests elsewhere in the suite use one GPU per rank when there are enough GPUs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import test_precision as precision
from distributed import run_ranks
from parity import Case, check

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_stage0_on_cuda_matches_cpu_reference():
    # fp32 on the GPU (TF32 off, PyTorch's default for matmul) against plain PyTorch on the
    # CPU: accumulation, clipping, a tied weight and a parameter unused on some steps.
    results = check(1, [Case(gas=3, clip=0.05), Case(gas=2, clip=0.05, tied=True, use_rare=True)])
    assert all(r[2] == "cuda:0" for r in results[0])


def test_zero_stages_on_cuda_match_cpu_reference():
    # Flat groups, NCCL reduce-scatter/all-gather, storage freeing and re-gathering on the GPU.
    cases = [Case(stage=s, gas=2, clip=0.05, tied=True, use_rare=True) for s in (1, 2, 3)]
    results = check(1, cases, zero_unused_grads=True)
    assert all(r[2] == "cuda:0" for r in results[0])


def _backend_and_dtypes() -> tuple[str, str, list[str]]:
    import torch.distributed as dist

    import terascale
    from toy import make_model

    config = {"train_batch_size": 4, "fp16": {"enabled": True}, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    engine, optimizer, *_ = terascale.initialize(model=make_model(), config=config)
    masters = sorted({str(p.dtype) for g in optimizer.param_groups for p in g["params"]})
    devices = {str(p.device) for p in engine.module.parameters()}
    assert devices == {"cuda:0"}, devices
    return dist.get_backend(), str(next(engine.module.parameters()).dtype), masters


def test_cuda_uses_nccl_fp16_params_fp32_masters():
    backend, param_dtype, masters = run_ranks(_backend_and_dtypes, 1)[0]
    assert backend == "nccl"
    assert param_dtype == "torch.float16" and masters == ["torch.float32"]


def test_bf16_on_cuda_trains_close_to_fp32():
    steps = 12
    losses, state = run_ranks(precision._bf16_rank, 1, steps, 8)[0]
    precision.check_bf16_close_to_fp32(losses, state, steps)


def test_fp16_dynamic_scaling_on_cuda():
    record = run_ranks(precision._fp16_rank, 1, False)[0]
    assert [r[1] for r in record] == [0, 0, 1, 2, 3, 3, 3, 3]
    assert [r[0] for r in record] == [256.0, 512.0, 512.0, 256.0, 128.0, 128.0, 256.0, 256.0]


# -- the integrations and LAMB on shards, on one GPU -----------------------------------------------


def test_hf_trainer_on_cuda_matches_the_plain_trainer(tmp_path):
    import test_hf_trainer as hf

    cases = [("stage3", hf._zero(3)), ("stage3_cpu", hf._zero(3, offload_optimizer={"device": "cpu", "pin_memory": True},
                                                             offload_param={"device": "cpu", "pin_memory": True}))]  # fmt: skip
    (result,) = run_ranks(hf._parity_rank, 1, str(tmp_path), cases, timeout=400)
    ref_history, ref_state = result["plain"]
    for name, _ in cases:
        history, state = result[name]
        for (loss, norm, _), (ref_loss, ref_norm, _) in zip(history, ref_history):
            assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-4), name
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v.float().cpu(), rtol=1e-5, atol=2e-6, msg=f"{name}: {k}")


def test_lightning_strategy_on_cuda_matches_ddp(tmp_path):
    import test_lightning as lightning

    cases = [("stage3", lightning._zero(3)), ("stage2_cpu", lightning._zero(2, offload_optimizer={"device": "cpu"}))]
    (result,) = run_ranks(lightning._parity_rank, 1, str(tmp_path), cases, timeout=400)
    ref_seen, ref_val, _ = result["ddp"]
    for name, _ in cases:
        seen, val, _ = result[name]
        torch.testing.assert_close(torch.tensor(seen), torch.tensor(ref_seen), rtol=1e-5, atol=1e-6, msg=name)


def test_lamb_on_cuda_shards_uses_whole_parameter_trust_ratios():
    import test_zero_optimizers as optimizers

    optimizers._check(1, [("lamb", {"stage": 3, "sub_group_size": 7}, "config"), ("lamb", {"stage": 2}, "client")])


def test_activation_checkpointing_on_cuda_matches_plain_pytorch(tmp_path):
    # Host offload on a side stream into pinned buffers (reused across steps), the contiguous
    # arena in pinned memory, NVMe spill from the GPU, selective checkpointing, at stages 0
    # and 3, against plain PyTorch on the same GPU (CUDA dropout replayed by the recompute).
    import test_activation_checkpointing as act

    cases = [(p, t, 2) for p in ("blocks", "selective", "every_n") for t in ("device", "host", "nvme", "contiguous")]
    for stage in (0, 3):
        results = run_ranks(act._parity_rank, 1, stage, cases, str(tmp_path), timeout=600)
        assert all(r["device"] == "cuda:0" for r in results[0])


def _cuda_offload_store() -> dict:
    import terascale.checkpointing as ckpt
    from act_model import Block

    ckpt.configure(checkpoint_in_cpu=True, contiguous_checkpointing=False)
    store = ckpt._API.checkpointing.store
    block = Block(64).cuda()
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    for _ in range(2):  # the second step reuses the first step's pinned buffers
        h = x
        for _ in range(4):
            h = ckpt.checkpoint(block, h, scale=0.5)
        ckpt._API.checkpointing.before_backward()
        h.sum().backward()
    pooled = store._pool._free
    return {
        "offloads": store.offloads,
        "side_stream": store._copies._side is not None,
        "pinned": all(b.is_pinned() for bufs in pooled.values() for b, _ in bufs),
        "pooled": sum(len(v) for v in pooled.values()),
        "peak": store.resident_peak,
    }


def test_cpu_checkpointing_on_cuda_uses_a_side_stream_and_reuses_pinned_buffers():
    facts = run_ranks(_cuda_offload_store, 1)[0]
    assert facts["offloads"] and facts["side_stream"] and facts["pinned"]
    assert facts["pooled"] == 4  # one buffer per checkpoint, taken again by the second step
    assert facts["peak"] <= 3 * 8 * 64 * 4  # the prefetch window, not every checkpoint


def _sparse_on_cuda() -> list:
    import terascale
    from torch import nn

    out = []
    for stage in (0, 2, 3):
        for sparse in (True, False):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Embedding(100, 16, sparse=sparse), nn.Flatten(), nn.Linear(4 * 16, 3))
            config = {"train_batch_size": 8, "sparse_gradients": True, "steps_per_print": 1000,
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                      "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}  # fmt: skip
            engine, *_ = terascale.initialize(model=model, config=config)
            g = torch.Generator().manual_seed(1)
            for _ in range(3):
                ids, y = torch.randint(0, 100, (8, 4), generator=g), torch.randint(0, 3, (8,), generator=g)
                out_ = engine(ids)
                engine.backward(torch.nn.functional.cross_entropy(out_, y.to(out_.device)))
                engine.step()
            out.append(engine.full_state_dict())
            engine.destroy()
    return out


def test_sparse_gradients_on_cuda_match_the_dense_embedding():
    states = run_ranks(_sparse_on_cuda, 1)[0]
    for sparse_state, dense_state in zip(states[::2], states[1::2]):
        for key, value in dense_state.items():
            torch.testing.assert_close(sparse_state[key], value, rtol=1e-5, atol=2e-6)


def test_tiled_linear_on_cuda_gathers_one_tile_at_a_time():
    import test_tiling

    for ratio in run_ranks(test_tiling._zero3_tiled_rank, 1):
        assert 0 < ratio <= 1.2, ratio
    run_ranks(test_tiling._tile_above_rank, 1, 3)


def _gpus(n: int):
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} CUDA devices (one per rank, NCCL)")


def test_pipeline_module_on_one_cuda_rank_matches_plain_pytorch():
    # pp=1: the PipelineModule, train_batch's schedule and ZeRO-3 over one GPU against the
    # plain model on the CPU (TF32 off, PyTorch's default for matmul).
    import test_parallel3d as p3d

    p3d._check(run_ranks(p3d._parity_rank, 1, [(1, 1, 3, 1)], timeout=400))


@_gpus(2)
def test_tensor_parallel_on_cuda_matches_plain_pytorch():
    # NCCL all-reduces/all-gathers in the tensor-parallel layers, vocab-parallel loss, ZeRO 0-3.
    import test_tensor_parallel_engine as tp

    tp._check(run_ranks(tp._train_rank, 2, 2, tp.TP2_CASES, timeout=400))


@_gpus(4)
def test_pipeline_and_tensor_parallel_on_cuda_match_plain_pytorch(tmp_path):
    # NCCL point-to-point between stages (batched sends/receives), tp-partitioned boundaries,
    # and the checkpoint reshard across pp/tp/dp on GPUs.
    import test_parallel3d as p3d

    p3d._check(run_ranks(p3d._parity_rank, 4, [(2, 2, 0, 1), (2, 2, 1, 2), (2, 1, 3, 1)], timeout=400))
    p3d._check([[r] for r in run_ranks(p3d._reshard_rank, 4, str(tmp_path / "ckpt"), timeout=400)])


def _resilience_on_cuda(save_dir: str) -> tuple[int, int, list[str], float]:
    import terascale
    from toy import make_model

    config = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3},
              "checkpoint": {"save_dir": save_dir, "interval_steps": 2, "auto_resume": True},
              "health": {"straggler": {"enabled": True, "every_n_steps": 2}, "non_finite": {"policy": "skip"}}}
    engine, *_ = terascale.initialize(model=make_model(), config=config)
    x, y = torch.randn(4, 12), torch.randint(0, 5, (4,))
    for step in range(1, 5):
        hook = None
        if step == 3:  # a NaN gradient: the step is skipped, the others train
            hook = next(engine.module.parameters()).register_hook(lambda g: g * float("nan"))
        engine.backward(engine(x, y))
        if hook is not None:
            hook.remove()
        engine.step()
    engine.wait_for_checkpoint()
    report = engine.straggler_report
    return engine.global_steps, engine.skipped_steps, sorted(p.name for p in Path(save_dir).iterdir()), report.compute_s[0]


def test_resilience_on_cuda(tmp_path):
    # Interval saves from device state, the straggler timing (device synchronised around
    # the measured phases) and the non-finite check on a GPU.
    steps, skipped, saved, compute_s = run_ranks(_resilience_on_cuda, 1, str(tmp_path))[0]
    assert (steps, skipped) == (4, 1)
    assert saved == ["global_step2", "global_step4", "latest"] and compute_s > 0


def _host_step_rank(offload: bool, bf16_states: bool) -> dict:
    import terascale

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    zero = {"stage": 2, "sub_group_size": 1000, **({"offload_optimizer": {"device": "cpu", "pin_memory": True}} if offload else {})}
    bf16 = {"enabled": True, "bf16_master_weights_and_grads": bf16_states, "bf16_optimizer_states": bf16_states}
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5, "bf16": bf16,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": zero}  # fmt: skip
    engine, *_ = terascale.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(4):
        x, y = torch.randn(4, 32, generator=g), torch.randn(4, 8, generator=g)
        loss = (engine(x.to("cuda", torch.bfloat16)).float() - y.cuda()).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    transfers = engine.model_state.host_transfers
    pinned = transfers is not None and transfers.nbytes() > 0 and transfers.pinned()
    out = {"losses": losses, "staged": transfers is not None, "pinned": pinned,
           "ahead": 0 if transfers is None else transfers.ahead_runs,
           "params": {n: p.float().cpu() for n, p in engine.full_state_dict().items()}}  # fmt: skip
    engine.destroy()
    return out


@pytest.mark.parametrize("bf16_states", [False, True])
def test_host_step_on_cuda_goes_through_pinned_staging_and_matches_the_device_step(bf16_states):
    # [Note: the host step's transfers]: gradients down and new values up through pinned
    # buffers on a copy stream; the host's fused AdamW against the device's, a few ulps apart.
    device = run_ranks(_host_step_rank, 1, False, bf16_states)[0]
    host = run_ranks(_host_step_rank, 1, True, bf16_states)[0]
    assert host["staged"] and host["pinned"] and not device["staged"]
    assert host["ahead"] > 0  # the gradients went down under backward
    torch.testing.assert_close(torch.tensor(host["losses"]), torch.tensor(device["losses"]), rtol=2e-2, atol=1e-3)
    for name, value in device["params"].items():
        torch.testing.assert_close(host["params"][name], value, rtol=2e-2, atol=2e-2)
