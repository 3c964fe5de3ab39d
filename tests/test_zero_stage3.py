"""Stage 3 behaviour: parameters sharded between uses, the trace and prefetch,
GatheredParameters, zero.Init, mixed precision, HF models, optimizer checks."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from toy import make_data, make_model


def _config(stage: int = 3, world: int = 2, **zero) -> dict:
    return {
        "train_batch_size": 2 * world,
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    }


def _linear_groups():
    from torch import nn

    from terascale.zero import WrapPolicy

    return WrapPolicy(module_classes=(nn.Linear,))


def _train(engine, steps: int, use_rare=lambda s: False) -> list[float]:
    x, y = make_data(steps, 2 * engine.world_size)
    x = x.to(engine.precision.compute_dtype)
    losses = []
    for s in range(steps):
        lo = engine.dist.dp_rank * 2
        loss = engine(x[s, lo : lo + 2], y[s, lo : lo + 2], use_rare=use_rare(s))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _schedule_rank(reuse: int) -> dict:
    import terascale

    model = make_model()
    engine, *_ = terascale.initialize(
        model=model, config=_config(stage3_max_reuse_distance=reuse), wrap_policy=_linear_groups()
    )
    schedule = engine.model_state.schedule
    sharded_at_start = all(p.numel() == 0 for p in model.parameters())
    gathers = []
    for _ in range(3):
        before = schedule.gathers
        _train(engine, 1)
        gathers.append(schedule.gathers - before)
    sharded_after_step = all(p.numel() == 0 for p in model.parameters())
    out = {
        "sharded_at_start": sharded_at_start,
        "sharded_after_step": sharded_after_step,
        "trace": list(schedule.trace),
        "gathers": gathers,
        "prefetches": schedule.prefetches,
        "memory": engine.memory_breakdown(),
        "numel": sum(fg.numel for fg in engine.model_state.groups),
        "kept": (engine.model_state.full_buffers.reused, engine.model_state.full_buffers.idle_bytes),
    }
    # A different code path (the 'rare' branch): the trace no longer matches; no hang, re-trace.
    _train(engine, 2, use_rare=lambda s: True)
    out["trace_rare"] = list(schedule.trace)
    engine.destroy()
    return out


def test_stage3_shards_between_uses_traces_and_prefetches():
    for reuse, (r0, r1) in ((0, run_ranks(_schedule_rank, 2, 0)), (10**9, run_ranks(_schedule_rank, 2, 10**9))):
        assert r0 == r1 or r0["trace"] == r1["trace"]
        assert r0["sharded_at_start"] and r0["sharded_after_step"]
        # Groups in use order: root first; the forward visits inp, blocks.0, blocks.3, head.
        assert r0["trace"][0] == r0["trace"][-1] or len(r0["trace"]) >= 5
        assert r0["trace_rare"] != r0["trace"] and len(r0["trace_rare"]) > len(r0["trace"])
        # The first iteration has no trace, later ones prefetch along it.
        assert r0["prefetches"] > 0
        assert r0["gathers"][1] == r0["gathers"][2]
        # Between steps only shards (half of every group) and no gathered group remain;
        # freed full buffers served later gathers and none is kept past backward.
        assert r0["memory"]["gathered_params"] == 0
        assert r0["kept"][0] > 0 and r0["kept"][1] == 0
        half = (r0["numel"] + 1) // 2 * 4
        assert abs(r0["memory"]["params"] - half) <= 4 * 8
        if reuse == 0:
            gathers_no_reuse = r0["gathers"][2]
        else:
            # Reuse within the distance keeps forward's groups for backward: fewer gathers.
            assert r0["gathers"][2] < gathers_no_reuse


def _gathered_rank(stage: int) -> dict:
    import os

    import terascale
    from terascale.zero import GatheredParameters

    rank = int(os.environ["RANK"])
    model = make_model()
    engine, *_ = terascale.initialize(model=model, config=_config(stage), wrap_policy=_linear_groups())
    _train(engine, 1)
    w = model.head.weight
    with GatheredParameters([w]):
        shape = tuple(w.shape)
        if rank == 1:
            w.data.fill_(3.0)  # no modifier_rank: discarded
    after_discard = engine.full_state_dict()["head.weight"]
    with GatheredParameters(w, modifier_rank=0):
        if rank == 0:
            w.data.fill_(0.5)
    state = engine.full_state_dict()
    losses = _train(engine, 1)
    return {"shape": shape, "discard": after_discard, "state": state, "loss": losses, "bias": state["head.bias"]}


@pytest.mark.parametrize("stage", [2, 3])
def test_gathered_parameters_read_and_modify(stage):
    r0, r1 = run_ranks(_gathered_rank, 2, stage)
    assert r0["shape"] == r1["shape"] == (5, 24)
    assert not (r0["discard"] == 3.0).any()
    for r in (r0, r1):
        # modifier_rank 0's values reach every rank's shard and the fp32 masters.
        assert torch.equal(r["state"]["head.weight"], torch.full((5, 24), 0.5))
    torch.testing.assert_close(r0["state"]["head.bias"], r1["state"]["head.bias"], rtol=0, atol=0)


def _init_rank(stage: int) -> dict:
    import terascale
    from terascale.zero import GatheredParameters, Init

    torch.manual_seed(0)
    plain = make_model()
    with Init(config=_config(stage)):
        torch.manual_seed(0)
        model = make_model()
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}  # full inside
    empty = all(p.numel() == 0 for p in model.parameters())  # and empty outside, as DeepSpeed's
    with GatheredParameters(list(model.parameters())):
        same_init = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))
    engine, *_ = terascale.initialize(model=model, config=_config(stage), wrap_policy=_linear_groups())
    losses = _train(engine, 3)
    engine.destroy()
    ref, *_ = terascale.initialize(model=plain, config=_config(stage), wrap_policy=_linear_groups())
    return {"empty": empty, "same_init": same_init, "shapes": shapes, "losses": losses, "ref": _train(ref, 3)}


@pytest.mark.parametrize("stage", [0, 3])
def test_zero_init_partitions_while_building(stage):
    for r in run_ranks(_init_rank, 2, stage):
        assert r["empty"] and r["same_init"]
        assert r["shapes"]["inp.weight"] == (24, 12)  # shape queries see the full shape
        assert r["losses"] == r["ref"]


def _init_peak_rank(use_init: bool) -> float:
    import threading

    import psutil
    from torch import nn

    from terascale.comm import init_distributed
    from terascale.zero import Init

    init_distributed()
    proc = psutil.Process()
    start = proc.memory_info().rss
    peak = [start]
    done = threading.Event()

    def sample() -> None:  # the high-water mark of this construction alone
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            done.wait(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    with Init(config=_config(3), enabled=use_init):
        model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(48)))
    done.set()
    sampler.join()
    peak[0] = max(peak[0], proc.memory_info().rss)
    assert sum(p.numel() for p in model.parameters()) == (0 if use_init else 48 * (1024 * 1024 + 1024))
    return peak[0] - start


def test_zero_init_peak_memory_is_a_shard_plus_one_layer():
    full = 48 * (1024 * 1024 + 1024) * 4  # fp32 bytes, 201 MB
    plain = run_ranks(_init_peak_rank, 2, False)
    sharded = run_ranks(_init_peak_rank, 2, True)
    for grown in plain:
        assert grown > 0.95 * full
    for grown in sharded:
        # 2 ranks: half the model, plus the layer being initialised, its gathered copy and
        # the process's own growth (gloo buffers, allocator slack): 32 MiB, 8 layers' worth.
        assert grown < full / 2 + 32 * 2**20, (grown, full)
    print("peak growth MB: plain", [g / 1e6 for g in plain], "zero.Init", [g / 1e6 for g in sharded])


def _precision_rank(stage: int, precision: str) -> dict:
    import terascale

    cfg = _config(stage)
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    else:
        # A huge initial scale overflows first: the skip must be agreed by all ranks.
        # Hysteresis 1: stage 0 has none (DeepSpeed's non-ZeRO fp16 optimizer), so it agrees.
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 30, "loss_scale_window": 2, "hysteresis": 1}
    engine, *_ = terascale.initialize(model=make_model(), config=cfg, wrap_policy=_linear_groups())
    losses = _train(engine, 8)
    return {"losses": losses, "skipped": engine.skipped_steps, "scale": engine.loss_scale}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_stages_agree_with_stage0(precision):
    ref = run_ranks(_precision_rank, 2, 0, precision)
    for stage in (1, 2, 3):
        got = run_ranks(_precision_rank, 2, stage, precision)
        for r, s in zip(ref, got):
            assert s["skipped"] == r["skipped"] and s["scale"] == r["scale"]
            if precision == "fp16":
                assert s["skipped"] > 0
            # Same math; gradients accumulate and reduce in the 16-bit dtype at ZeRO stages.
            torch.testing.assert_close(torch.tensor(s["losses"]), torch.tensor(r["losses"]), rtol=2e-2, atol=2e-2)


def _hf_rank(stage: int, arch: str) -> list[float]:
    import transformers

    import terascale

    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=32)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=101, max_position_embeddings=32,
        )
        model = transformers.LlamaForCausalLM(cfg)
    config = _config(stage, world=2)
    config["gradient_clipping"] = 1.0
    engine, *_ = terascale.initialize(model=model, config=config)  # default wrap policy: the blocks
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 101, (4, 4, 16), generator=g)
    losses = []
    for s in range(4):
        batch = tokens[s, engine.dist.dp_rank * 2 : engine.dist.dp_rank * 2 + 2]
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


# GPT-2 trains under every stage in test_arch_sweep too: its run here is in the slow tail.
@pytest.mark.parametrize("arch", [pytest.param("gpt2", marks=pytest.mark.slow), "llama"])
def test_hf_models_train_unmodified_at_every_stage(arch):
    pytest.importorskip("transformers")
    ref = run_ranks(_hf_rank, 2, 0, arch)
    for stage in (1, 2, 3):
        got = run_ranks(_hf_rank, 2, stage, arch)
        for r, s in zip(ref, got):
            torch.testing.assert_close(torch.tensor(s), torch.tensor(r), rtol=1e-5, atol=1e-5)


def _save16_rank(out_dir: str) -> dict:
    import terascale

    plain, *_ = terascale.initialize(model=make_model(), config=_config(3), wrap_policy=_linear_groups())
    refused = plain.save_16bit_model(out_dir, "refused.safetensors")
    plain.destroy()
    config = _config(3)
    config["bf16"] = {"enabled": True}
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, *_ = terascale.initialize(model=make_model(), config=config, wrap_policy=_linear_groups())
    _train(engine, 2)
    saved = engine.save_16bit_model(out_dir, "model.safetensors")
    state = engine.full_state_dict()
    from safetensors.torch import load_file

    # Collective: the file is complete wherever the call returns, so rank 1 reads it at once.
    read_back = sorted(load_file(f"{out_dir}/model.safetensors"))
    # Rank 0's write fails (the folder is a file): every rank raises, none is left waiting.
    open(f"{out_dir}/blocker", "w").close()
    try:
        engine.save_16bit_model(f"{out_dir}/blocker", "model.safetensors")
        failed = "no error"
    except Exception as err:  # noqa: BLE001
        failed = f"{type(err).__name__}: {err}"
    _train(engine, 1)  # the ranks' collectives still line up after the failure
    return {"refused": refused, "saved": saved, "state": state, "read_back": read_back,
            "failed": failed}  # fmt: skip


def test_save_16bit_model_gathers_stage3_weights(tmp_path):
    from safetensors.torch import load_file

    r0, r1 = run_ranks(_save16_rank, 2, str(tmp_path))
    assert r0["refused"] is False and not (tmp_path / "refused.safetensors").exists()
    assert r0["saved"] is True
    # The writer raises its own error; the other rank an error naming the write and rank 0's.
    assert r0["failed"].startswith(("FileExistsError", "NotADirectoryError")), r0["failed"]
    assert r1["failed"].startswith("CheckpointError: save_16bit_model to") and "rank 0: " in r1["failed"], r1["failed"]
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert r1["read_back"] == sorted(weights)
    assert weights.keys() == r0["state"].keys()
    for k, v in weights.items():
        assert v.dtype == torch.bfloat16 and v.shape == r0["state"][k].shape
        assert torch.equal(v, r0["state"][k].bfloat16())


def _held_gradients_rank() -> int:
    import terascale

    model = make_model()
    model.rare.requires_grad_(False)  # an unused branch would hold up the order too (see the note there)
    # Biases and the norm fall below the threshold: a persistent group of small parameters
    # from every layer, whose last gradient (inp.bias) arrives at the end of backward.
    config = _config(stage3_param_persistence_threshold=100, reduce_bucket_size=1)
    engine, *_ = terascale.initialize(model=model, config=config, wrap_policy=_linear_groups())
    grads = engine.model_state.grads
    assert any(fg.persistent for fg in engine.model_state.groups)
    held = []

    def count(_p) -> None:
        held.append(sum(t is not None for t in grads._flat))

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(count)
    _train(engine, 2)
    engine.destroy()
    return max(held)


def test_backward_reduces_each_group_when_done_not_when_the_persistent_group_is():
    # Launching in plain reverse-group order would wait for the persistent group (last in
    # the plan, done last) and hold every layer's gradient buffer until the end.
    for held in run_ranks(_held_gradients_rank, 2):
        assert held <= 2


# -- frozen weights beside adapters (PEFT) --------------------------------------------------------


def _adapter_rank() -> dict:
    from torch import nn

    import terascale

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = nn.Linear(64, 64)  # frozen, as a PEFT base layer
            self.down, self.up = nn.Linear(64, 4, bias=False), nn.Linear(4, 64, bias=False)  # the adapter

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(self.base(x) + self.up(self.down(x)))

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(6)])
    for block in model:
        block.base.requires_grad_(False)
    config = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 4160}}  # fmt: skip
    engine, *_ = terascale.initialize(model=model, config=config)
    seen: list[int] = []
    for block in model:
        block.register_full_backward_hook(lambda *a: seen.append(engine.memory_breakdown()["gathered_params"]))
    x = torch.randn(2, 64, requires_grad=True)  # inputs that need gradients, as hidden states do
    for _ in range(2):
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
    state = engine.optimizer.state.values()
    return {"gathered_in_backward": max(seen), "optimizer_numel": sum(s["exp_avg"].numel() for s in state)}


def test_frozen_weights_are_gathered_a_block_at_a_time_and_adapters_state_is_split_evenly():
    r0, r1 = run_ranks(_adapter_rank, 2)
    block_bytes = (64 * 64 + 64) * 4
    # Six frozen blocks; backward holds the block it is in and the one prefetched (a block's
    # worth of prefetch), not every frozen block until backward ends.
    assert r0["gathered_in_backward"] <= 2 * block_bytes + 2 * 2 * 64 * 4 * 4, r0
    # Each block's adapter (2 x 256 elements) is a group of its own, halved between the ranks.
    assert r0["optimizer_numel"] == r1["optimizer_numel"] == 6 * 512 // 2
