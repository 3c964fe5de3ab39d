"""``import terascale as deepspeed``: the DeepSpeed names published code uses resolve (or are
refused with a reason), and the important ones behave as DeepSpeed's do.

The names and their use counts come from ``tests/data/deepspeed_names.json`` (written by
``tools/scan_deepspeed_names.py`` from DeepSpeedExamples, Megatron-DeepSpeed, transformers,
accelerate, TRL, OpenRLHF and LLaMA-Factory); every name is resolved again here, so the
table in ``docs/deepspeed_names.md`` cannot drift from the code.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distributed import run_ranks
from toy import make_data, make_model

DATA = json.loads((Path(__file__).parent / "data" / "deepspeed_names.json").read_text())
NAMES = DATA["names"]

# What the scan supports today (docs/deepspeed_names.md): provided uses of all scanned uses,
# and of the uses of features terascale builds (the rest are DeepSpeed features the config
# refuses too: inference kernels, compression training, random-LTD, expert tensor parallelism, ...).
MIN_PROVIDED = 0.90
MIN_PROVIDED_OF_BUILT = 0.90
MAX_MISSING = 0.01  # names with neither a terascale object nor a stated reason


def _config(stage: int = 0, world: int = 1, **extra) -> dict:
    return {
        "train_batch_size": 2 * world,
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **extra,
    }


# -- the scanned names ----------------------------------------------------------------------------------


def test_every_scanned_name_has_the_status_the_table_gives() -> None:
    from terascale.integrations.deepspeed.names import status_of

    drift = []
    for e in NAMES:
        status, _ = status_of(e["name"])
        if status != e["status"]:
            drift.append(f"{e['name']}: table says {e['status']}, now {status}")
    assert not drift, "rerun tools/scan_deepspeed_names.py --write:\n" + "\n".join(drift)


def test_weighted_coverage() -> None:
    from terascale.integrations.deepspeed.names import resolve, status_of

    total = sum(e["files"] for e in NAMES)
    provided = refused_feature = missing = 0
    for e in NAMES:
        try:
            resolve(e["name"])
        except (AttributeError, ImportError):
            status, note = status_of(e["name"])
            if status == "missing":
                missing += e["files"]
            elif note.startswith("feature:"):
                refused_feature += e["files"]
            continue
        provided += e["files"]
    assert provided / total >= MIN_PROVIDED, provided / total
    assert provided / (total - refused_feature) >= MIN_PROVIDED_OF_BUILT, provided / (total - refused_feature)
    assert missing / total <= MAX_MISSING, missing / total


def test_refused_names_import_and_say_why_when_used() -> None:
    """[Note: refused when used, not when imported]: DeepSpeed's own functions and classes
    import; using one that terascale does not provide raises the reason."""
    import terascale as deepspeed
    from terascale.integrations.deepspeed.unprovided import NotProvidedError

    with pytest.raises(NotProvidedError, match="inference kernels .* not built"):
        deepspeed.replace_transformer_layer(None, None)
    assert deepspeed.moe.layer.MoE is not None  # read as an attribute, as DeepSpeed's CIFAR example does
    assert not hasattr(deepspeed, "no_such_name") and not hasattr(deepspeed.moe, "no_such_module")
    from terascale.moe.mappings import gather_tokens

    with pytest.raises(NotProvidedError, match="expert tensor parallelism"):
        gather_tokens(None)
    # A module of older DeepSpeed releases (0.19.8 has no compression.compress) fails at the
    # import, with the reason.
    with pytest.raises(ModuleNotFoundError, match="compression .* not built"):
        from terascale.compression.compress import init_compression  # noqa: F401
    # A class: isinstance is False (a program's other branch), instantiating refuses, and
    # hasattr on it stays a probe.
    from terascale.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    assert not isinstance(object(), DeepSpeedZeroOptimizer) and not hasattr(DeepSpeedZeroOptimizer, "step")
    with pytest.raises(NotProvidedError, match="ZeRO optimizer wrapper classes"):
        DeepSpeedZeroOptimizer(None)
    with pytest.raises(NotProvidedError, match="ZeRO optimizer wrapper classes"):
        type("Mine", (DeepSpeedZeroOptimizer,), {})()
    from terascale.utils.nvtx import instrument_w_nvtx  # a DeepSpeed helper with no counterpart

    with pytest.raises(NotProvidedError, match="no terascale counterpart"):
        instrument_w_nvtx(print)
    # A name a DeepSpeed module imports from another is that one's: terascale's where provided.
    from terascale.runtime.zero.partition_parameters import get_accelerator as reexported

    assert reexported is deepspeed.accelerator.get_accelerator
    # Names DeepSpeed does not have fail at the import, as they would against DeepSpeed.
    with pytest.raises(ImportError):
        from terascale.runtime.zero.stage3 import NoSuchClass  # noqa: F401
    with pytest.raises(ModuleNotFoundError):
        import terascale.runtime.zero.no_such_module  # noqa: F401
    from terascale.accelerator import get_accelerator
    from terascale.ops.op_builder import GDSBuilder

    with pytest.raises(AttributeError, match="no C\\+\\+/CUDA ops"):
        get_accelerator().build_extension  # noqa: B018
    assert not GDSBuilder().is_compatible()
    with pytest.raises(RuntimeError, match="no terascale counterpart"):
        GDSBuilder().load()


def test_deepspeed_import_paths() -> None:
    """The ``from deepspeed.X import Y`` lines of the scanned programs, spelled for terascale."""
    import terascale
    import terascale.comm as dist
    from terascale import checkpointing, zero
    from terascale.accelerator.real_accelerator import get_accelerator
    from terascale.checkpoint.utils import clone_tensors_for_torch_save  # noqa: F401
    from terascale.ops.adam import DeepSpeedCPUAdam, FusedAdam  # noqa: F401
    from terascale.ops.lamb import FusedLamb
    from terascale.optim import Lamb
    from terascale.pipe import LayerSpec, PipelineModule  # noqa: F401
    from terascale.runtime.activation_checkpointing import checkpointing as ckpt
    from terascale.runtime.config import LAMB_OPTIMIZER, DeepSpeedConfig  # noqa: F401
    from terascale.runtime.dataloader import RepeatingLoader  # noqa: F401
    from terascale.runtime.pipe.module import PipelineModule as PM
    from terascale.runtime.utils import see_memory_usage, set_random_seed  # noqa: F401
    from terascale.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum  # noqa: F401
    from terascale.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus  # noqa: F401
    from terascale.utils import logger, safe_get_full_grad  # noqa: F401
    from terascale.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: F401

    assert ckpt is checkpointing and PM is PipelineModule and FusedLamb is Lamb
    assert terascale.zero is zero and terascale.comm is dist and get_accelerator is terascale.get_accelerator
    assert terascale.runtime.zero.GatheredParameters is zero.GatheredParameters  # by attribute, as deepspeed.X.Y
    assert callable(dist.get_rank) and dist.ReduceOp.SUM is torch.distributed.ReduceOp.SUM


# -- get_accelerator() -----------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU accelerator (tests/test_cuda.py style runs cover CUDA)")
def test_accelerator_on_the_cpu() -> None:
    from terascale.accelerator import get_accelerator

    acc = get_accelerator()
    assert (acc.device_name(), acc.device_name(0), acc.current_device_name()) == ("cpu", "cpu", "cpu")
    assert acc.is_available() and acc.device_count() == 1 and acc.communication_backend_name() == "gloo"
    assert acc.current_device() == int(os.environ.get("LOCAL_RANK", "0")) and acc.device() is None
    acc.set_device(0)
    acc.synchronize()
    acc.manual_seed(3)
    a = torch.rand(4)
    acc.manual_seed_all(3)
    assert torch.equal(a, torch.rand(4))
    state = acc.get_rng_state()
    b = torch.rand(2)
    acc.set_rng_state(state)
    assert torch.equal(b, torch.rand(2))
    acc.reset_peak_memory_stats()
    assert 0 < acc.memory_allocated() <= acc.max_memory_allocated()
    assert acc.total_memory() >= acc.available_memory() > 0 and acc.memory_reserved() > 0
    acc.empty_cache()
    assert acc.is_bf16_supported() and acc.is_fp16_supported() and torch.bfloat16 in acc.supported_dtypes()
    t = torch.ones(3)
    assert acc.pin_memory(t) is t and not acc.is_pinned(t) and acc.on_accelerator(t)
    assert acc.LongTensor([1, 2]).dtype == torch.int64 and acc.FloatTensor([1.0]).device.type == "cpu"
    start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
    stream = acc.Stream()
    with acc.stream(stream):
        start.record()
        torch.ones(100).sum()
        end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0.0
    acc.range_push("x")
    acc.range_pop()


# -- deepspeed.comm and init_distributed on 2 ranks ------------------------------------------------------------


def _comm_rank(config_path: str) -> dict:
    import argparse

    import terascale as deepspeed
    from terascale import comm as dist
    from terascale.accelerator import get_accelerator

    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=1)
    parts = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(parts, torch.tensor([float(rank)]))
    flat = torch.zeros(world)
    dist.all_gather_into_tensor(flat, torch.tensor([float(rank)]))
    mine = torch.zeros(1)
    dist.reduce_scatter_tensor(mine, torch.ones(world))
    mx = torch.tensor([float(rank)])
    dist.all_reduce(mx, op=dist.ReduceOp.MAX)
    objs: list = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    group = dist.new_group([0, 1])
    dist.barrier(group)
    # A DeepSpeed-style script's start: argparse with add_config_arguments, initialize(args=...).
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed_config", config_path])
    model = make_model()
    engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    return {
        "init": dist.is_initialized(), "rank": rank, "world": world, "local": dist.get_local_rank(),
        "sum": t.item(), "bcast": b.item(), "gather": [p.item() for p in parts], "flat": flat.tolist(),
        "rs": mine.item(), "max": mx.item(), "objs": objs, "group_ranks": dist.get_all_ranks_from_group(group),
        "engine": (engine.global_rank, engine.local_rank, engine.get_data_parallel_rank(), engine.train_batch_size()),
    }  # fmt: skip


def _explicit_init_rank(port: int) -> tuple[int, int, float, str]:
    import os

    import terascale as deepspeed
    from terascale import comm as dist

    # DeepSpeed's explicit rendezvous: rank, world size and init_method, not torchrun's environment
    # (whose agent-store flag, set by run_ranks, would make rank 0 a client of a store nobody hosts).
    del os.environ["TORCHELASTIC_USE_AGENT_STORE"]
    ctx = deepspeed.init_distributed(dist_backend="gloo", init_method=f"tcp://127.0.0.1:{port}",
                                     rank=int(os.environ["RANK"]), world_size=2)
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return ctx.rank, ctx.world_size, t.item(), ctx.backend


def test_init_distributed_from_an_explicit_rank_and_init_method() -> None:
    from distributed import free_port

    out = run_ranks(_explicit_init_rank, 2, free_port())
    assert out == [(0, 2, 3.0, "gloo"), (1, 2, 3.0, "gloo")]


def test_comm_and_init_distributed_on_two_ranks(tmp_path: Path) -> None:
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(_config(stage=2, world=2)))
    out = run_ranks(_comm_rank, 2, str(config))
    for rank, r in enumerate(out):
        assert (r["init"], r["rank"], r["world"], r["local"]) == (True, rank, 2, rank)
        got = (r["sum"], r["bcast"], r["gather"], r["flat"], r["rs"], r["max"])
        assert got == (3.0, 1.0, [0.0, 1.0], [0.0, 1.0], 2.0, 1.0)
        assert r["objs"] == [{"rank": 0}, {"rank": 1}] and r["group_ranks"] == [0, 1]
        assert r["engine"] == (rank, rank, rank, 4)


# -- safe_get_full_* at ZeRO-3 on 2 ranks, and zero_to_fp32 on the checkpoint it saves -------------------------------


def _reference_grads(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The averaged gradient of the 2-rank step: the mean of each rank's micro-batch gradient."""
    model = make_model()
    losses = [model(x[2 * r : 2 * r + 2], y[2 * r : 2 * r + 2]) for r in range(2)]
    (sum(losses) / 2).backward()
    # An unused parameter (``rare``) gets a zero gradient at stages 1-3, as in DeepSpeed.
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _safe_rank(save_dir: str) -> dict:
    import terascale as deepspeed
    from terascale import utils as ds_utils

    model = make_model()
    engine, *_ = deepspeed.initialize(model=model, config=_config(stage=3, world=2))
    x, y = make_data(2, 4)
    rank = engine.global_rank
    ref = _reference_grads(x[0], y[0])
    named = dict(model.named_parameters())
    loss = engine(x[0, 2 * rank : 2 * rank + 2], y[0, 2 * rank : 2 * rank + 2])
    engine.backward(loss)
    grad_err = max((ds_utils.safe_get_full_grad(p) - ref[n]).abs().max().item() for n, p in named.items())
    local_grads = {n: ds_utils.safe_get_local_grad(p) for n, p in named.items()}
    engine.step()
    full = engine.full_state_dict()
    param_err = max((ds_utils.safe_get_full_fp32_param(p) - full[n]).abs().max().item() for n, p in named.items())
    # AdamW's first step: exp_avg = (1 - beta1) * grad.
    moments = {n: ds_utils.safe_get_full_optimizer_state(p, "exp_avg") for n, p in named.items()}
    moment_err = max((moments[n] - 0.1 * ref[n]).abs().max().item() for n in named)
    local_params = {n: ds_utils.safe_get_local_fp32_param(p) for n, p in named.items()}
    w, shape = named["blocks.0.weight"], full["blocks.0.weight"].shape  # (w itself is empty between uses)
    ds_utils.safe_set_full_fp32_param(w, torch.full(shape, 0.5))
    ds_utils.safe_set_full_optimizer_state(w, torch.zeros(shape), "exp_avg")
    after = engine.full_state_dict()["blocks.0.weight"]
    with pytest.raises(ValueError, match="no state 'nope'"):
        ds_utils.safe_set_full_optimizer_state(w, torch.zeros(shape), "nope")
    engine.save_checkpoint(save_dir)
    return {
        "grad_err": grad_err, "param_err": param_err, "moment_err": moment_err,
        "local_grads": local_grads, "local_params": local_params,
        "full": full, "final": engine.full_state_dict(), "ref": ref,
        "set": (after.eq(0.5).all().item(), ds_utils.safe_get_full_optimizer_state(w, "exp_avg").abs().max().item()),
    }  # fmt: skip


def _safe_partitioned_rank() -> dict:
    import terascale as deepspeed
    from terascale import utils as ds_utils

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    model[0].bias.requires_grad_(False)  # frozen: no master, no gradient
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
        "zero_optimization": {"stage": 1}})  # fmt: skip
    x = torch.arange(16.0).view(2, 8) / 16
    engine.backward(engine(x[engine.global_rank : engine.global_rank + 1]).sum())
    trained = [p for p in model.parameters() if p.requires_grad]
    before = [ds_utils.safe_get_full_grad(p).clone() for p in trained]
    # Every rank sets every gradient, also where the rank holds none of it (the last bias is
    # in rank 1's partition only): collective, as DeepSpeed's; then add one to each.
    for p, g in zip(trained, before):
        ds_utils.safe_set_full_grad(p, 2 * g)
    ds_utils.safe_update_full_grad_vectorized(list(model.parameters()), lambda old, p: old + 1)
    after = [ds_utils.safe_get_full_grad(p) for p in trained]
    frozen = model[0].bias
    nothing = (ds_utils.safe_get_full_fp32_param(frozen), ds_utils.safe_get_full_grad(frozen),
               ds_utils.safe_get_local_fp32_param(frozen))  # fmt: skip
    engine.step()
    return {"twice_plus_one": all(torch.equal(a, 2 * b + 1) for a, b in zip(after, before)),
            "frozen": nothing, "params": [ds_utils.safe_get_full_fp32_param(p) for p in trained]}  # fmt: skip


def test_safe_set_full_grad_where_a_rank_holds_none_of_it_and_frozen_parameters() -> None:
    out = run_ranks(_safe_partitioned_rank, 2)
    for r in out:
        assert r["twice_plus_one"] and r["frozen"] == (None, None, None), r
    for a, b in zip(out[0]["params"], out[1]["params"]):
        assert torch.equal(a, b)


def test_safe_get_full_at_zero3_on_two_ranks_and_zero_to_fp32(tmp_path: Path) -> None:
    out = run_ranks(_safe_rank, 2, str(tmp_path / "ckpt"))
    for r in out:
        assert r["grad_err"] < 1e-5 and r["param_err"] == 0.0 and r["moment_err"] < 1e-6, r
        assert r["set"] == (True, 0.0)
    # Each rank's local part, in rank order, is the whole (flattened) tensor.
    for name, ref in out[0]["ref"].items():
        parts = [r["local_grads"][name] for r in out if r["local_grads"][name] is not None]
        assert torch.allclose(torch.cat(parts), ref.reshape(-1), atol=1e-5), name
        params = [r["local_params"][name] for r in out if r["local_params"][name] is not None]
        assert torch.equal(torch.cat(params), out[0]["full"][name].reshape(-1)), name

    # zero_to_fp32 on the 2-rank ZeRO-3 checkpoint: the function, the module and the script.
    from terascale.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    assert state.keys() == out[0]["final"].keys()
    assert all(torch.equal(state[n], out[0]["final"][n]) for n in state)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    ckpt = str(tmp_path / "ckpt")
    subprocess.run([sys.executable, "-m", "terascale.utils.zero_to_fp32", ckpt, str(tmp_path / "out")],
                   check=True, env=env, capture_output=True)  # fmt: skip
    from terascale.integrations.deepspeed import zero_to_fp32

    subprocess.run([sys.executable, zero_to_fp32.__file__, str(tmp_path / "ckpt"), str(tmp_path / "model.bin")],
                   check=True, env=env, capture_output=True)  # fmt: skip
    for path in (tmp_path / "out" / "pytorch_model.bin", tmp_path / "model.bin"):
        loaded = torch.load(path)
        assert all(torch.equal(loaded[n], state[n]) for n in state), path


# -- the engine's DeepSpeed methods --------------------------------------------------------------------------


@pytest.mark.usefixtures("own_process_group")
def test_engine_methods() -> None:
    import terascale as deepspeed
    from terascale.integrations.deepspeed.names import resolve

    model = make_model()
    cfg = _config(stage=1, gradient_clipping=1.0, bf16={"enabled": True}, wall_clock_breakdown=False)
    cfg["gradient_accumulation_steps"] = 2
    cfg["train_batch_size"] = 4
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    from terascale.pipe import PipelineEngine

    for e in NAMES:  # every engine name the table says is provided is there on a real engine (or a pipeline one)
        if e["name"].startswith("engine.") and e["status"] == "provided":
            attr = e["name"].removeprefix("engine.")
            assert hasattr(engine, attr) or hasattr(PipelineEngine, attr), e["name"]
            resolve(e["name"])
    assert engine.train_batch_size() == 4 and engine.train_micro_batch_size_per_gpu() == 2
    assert engine.gradient_accumulation_steps() == 2
    assert engine.get_batch_info() == (4, 2, 2)
    assert (engine.local_rank, engine.global_rank, engine.world_size, engine.get_data_parallel_rank()) == (0, 0, 1, 0)
    assert not engine.fp16_enabled() and engine.bfloat16_enabled()
    assert engine.zero_optimization() and engine.zero_optimization_stage() == 1
    assert (engine.gradient_clipping(), engine.steps_per_print(), engine.wall_clock_breakdown()) == (1.0, 1000, False)
    assert engine.optimizer_name() == "AdamW" and engine.get_lr() == [1e-2] and engine.get_mom() == [(0.9, 0.999)]
    assert engine.is_first_stage() and engine.is_last_stage() and engine.get_sequence_parallel_group() is None
    engine.tput_timer.update_epoch_count()
    assert engine.tput_timer.epoch_count == 1
    x, y = make_data(4, 2)
    x = x.bfloat16()
    # no_sync: backwards inside accumulate without a boundary; the one outside ends the window.
    with engine.no_sync():
        assert not engine.is_gradient_accumulation_boundary()
        for s in range(3):
            engine.backward(engine(x[s], y[s]))
        with pytest.raises(AssertionError, match="illegal to call Engine.step.. inside no_sync"):
            engine.step()  # refused, as in DeepSpeed: the window ends after the block
    assert engine.global_steps == 0
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(engine(x[3], y[3]))
    engine.step()
    engine.set_gradient_accumulation_boundary(None)
    assert engine.global_steps == 1
    engine.empty_partition_cache()
    engine.offload_states()  # nothing to move on the CPU
    engine.reload_states()
    state = engine._zero3_consolidated_16bit_state_dict()
    assert state.keys() == engine.full_state_dict().keys() and state["head.weight"].dtype == torch.bfloat16
    engine.compile(backend="eager", compile_kwargs={})
    assert engine.is_compiled
    for s in range(2):
        engine.backward(engine(x[s], y[s]))
        engine.step()
    assert engine.global_steps == 2


@pytest.mark.usefixtures("own_process_group")
def test_no_sync_is_refused_where_gradients_are_partitioned() -> None:
    import terascale as deepspeed

    engine, *_ = deepspeed.initialize(model=make_model(), config=_config(stage=2))
    # DeepSpeed's own words are in the message: programs and tests match them.
    with pytest.raises(AssertionError, match="no_sync context manager is incompatible .*ZeRO stage 2 partitions"):
        with engine.no_sync():
            pass
    engine.destroy()
    engine, *_ = deepspeed.initialize(model=make_model(), config=_config(stage=1))
    with pytest.raises(ValueError, match="no_sync context manager reentry is unsupported"):
        with engine.no_sync(), engine.no_sync():
            pass


# -- ops, config, utils --------------------------------------------------------------------------------------


@pytest.mark.usefixtures("own_process_group")
def test_optimizer_classes_build_what_zero_steps() -> None:
    import terascale as deepspeed
    from terascale.ops.adagrad import DeepSpeedCPUAdagrad
    from terascale.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from terascale.ops.lamb import FusedLamb
    from terascale.optim import Lamb

    params = [torch.nn.Parameter(torch.zeros(3))]
    assert type(FusedAdam(params, lr=1e-3)) is torch.optim.AdamW
    assert type(DeepSpeedCPUAdam(params, adamw_mode=False)) is torch.optim.Adam
    assert type(DeepSpeedCPUAdagrad(params)) is torch.optim.Adagrad and isinstance(FusedLamb(params), Lamb)
    model = make_model()
    engine, opt, *_ = deepspeed.initialize(model=model, optimizer=FusedAdam(model.parameters(), lr=1e-2),
                                           config={k: v for k, v in _config(stage=2).items() if k != "optimizer"})
    x, y = make_data(1, 2)
    engine.backward(engine(x[0], y[0]))
    engine.step()
    assert engine.global_steps == 1
    # isinstance asks for the algorithm, also of the handle initialize returned (DeepSpeed's tests check it).
    assert isinstance(opt, FusedAdam) and isinstance(opt, DeepSpeedCPUAdam) and not isinstance(opt, DeepSpeedCPUAdagrad)
    assert isinstance(torch.optim.Adagrad(params), DeepSpeedCPUAdagrad) and not isinstance(object(), FusedAdam)


def test_deepspeed_config_and_utils(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from terascale import DeepSpeedConfig, OnDevice
    from terascale.checkpoint.utils import clone_tensors_for_torch_save
    from terascale.runtime.utils import move_to_device, set_random_seed
    from terascale.utils import RepeatingLoader, log_dist

    ds = DeepSpeedConfig(_config(stage=2, fp16={"enabled": True}))
    assert (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (2, 2, 1)
    assert ds.fp16_enabled and not ds.bfloat16_enabled and ds.zero_optimization_stage == 2 and ds.zero_enabled
    assert list(zip(range(5), RepeatingLoader([1, 2]))) == [(0, 1), (1, 2), (2, 1), (3, 2), (4, 1)]
    set_random_seed(7)
    a = torch.rand(2)
    set_random_seed(7)
    assert torch.equal(a, torch.rand(2))
    moved = move_to_device({"a": [torch.ones(1)], "b": 3}, "cpu")
    assert moved["b"] == 3 and moved["a"][0].device.type == "cpu"
    big = torch.zeros(1000)
    small = clone_tensors_for_torch_save({"x": big[:3]})["x"]
    assert small.untyped_storage().nbytes() == 12
    with OnDevice(dtype=torch.float16, device="meta"):
        layer = torch.nn.Linear(4, 4)
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.float16
    assert torch.get_default_dtype() == torch.float32
    with caplog.at_level(logging.INFO, logger="terascale"):
        log_dist("hello", ranks=[0])
    assert "hello" in caplog.text


# -- on a GPU (skipped without one) ----------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_accelerator_on_cuda() -> None:
    from terascale.accelerator import get_accelerator

    acc = get_accelerator()
    assert (acc.device_name(), acc.device_name(0), acc.current_device_name()) == ("cuda", "cuda:0", "cuda:0")
    assert acc.is_available() and acc.device_count() >= 1 and acc.communication_backend_name() == "nccl"
    acc.set_device(0)
    with acc.device(0):
        assert acc.current_device() == 0
    acc.manual_seed_all(5)
    a = torch.rand(4, device="cuda")
    acc.manual_seed(5)
    assert torch.equal(a, torch.rand(4, device="cuda"))
    acc.empty_cache()
    acc.reset_peak_memory_stats()
    before = acc.memory_allocated()
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    assert acc.memory_allocated() - before >= 64 * 2**20 and acc.max_memory_allocated() >= acc.memory_allocated()
    assert acc.total_memory() >= acc.available_memory() > 0 and acc.memory_reserved() >= acc.memory_allocated()
    del block
    pinned = acc.pin_memory(torch.ones(8))
    assert acc.is_pinned(pinned) and acc.on_accelerator(pinned.cuda()) and not acc.on_accelerator(pinned)
    assert acc.LongTensor([1]).device.type == "cuda" and acc.is_bf16_supported() and acc.is_fp16_supported()
    start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
    stream = acc.Stream()
    with acc.stream(stream):
        start.record()
        torch.ones(1024, 1024, device="cuda").sum()
        end.record()
    acc.synchronize()
    assert start.elapsed_time(end) >= 0.0


@cuda
def test_offload_states_frees_the_gpu_and_training_continues_exactly() -> None:
    import terascale as deepspeed
    from terascale.runtime.zero.offload_config import OffloadStateTypeEnum

    x, y = make_data(3, 2)
    x, y = x.cuda(), y.cuda()
    losses = {}
    for offload in (False, True):
        engine, *_ = deepspeed.initialize(model=make_model(), config=_config(stage=3))
        run = []
        for s in range(3):
            if offload and s == 2:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                engine.empty_partition_cache()
                engine.offload_states(include=[OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params,
                                               OffloadStateTypeEnum.lp_params])  # fmt: skip
                freed = before - torch.cuda.memory_allocated()
                with pytest.raises(ValueError, match="reload_states"):
                    engine(x[s], y[s])
                engine.reload_states()
                # Adam's two moments and the fp32 parameters (masters are the parameters in fp32).
                numel = sum(t.numel() for t in engine.full_state_dict().values())
                assert freed >= 3 * 4 * numel * 0.9, (freed, numel)
            loss = engine(x[s], y[s])
            engine.backward(loss)
            engine.step()
            run.append(loss.item())
        losses[offload] = (run, engine.full_state_dict())
        engine.destroy()
    assert losses[True][0] == losses[False][0]
    assert all(torch.equal(losses[True][1][n], losses[False][1][n]) for n in losses[False][1])


@cuda
def test_safe_get_full_on_cuda() -> None:
    import terascale as deepspeed
    from terascale.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state

    model = make_model()
    engine, *_ = deepspeed.initialize(model=model, config=_config(stage=3))
    x, y = make_data(1, 2)
    ref = _reference_grads(torch.cat([x[0], x[0]]), torch.cat([y[0], y[0]]))
    engine.backward(engine(x[0].cuda(), y[0].cuda()))
    for n, p in model.named_parameters():
        g = safe_get_full_grad(p)
        assert g.device.type == "cuda" and torch.allclose(g.cpu(), ref[n], atol=1e-5), n
    engine.step()
    full = engine.full_state_dict()
    for n, p in model.named_parameters():
        assert torch.equal(safe_get_full_fp32_param(p).cpu(), full[n]), n
        assert torch.allclose(safe_get_full_optimizer_state(p, "exp_avg").cpu(), 0.1 * ref[n], atol=1e-6), n


def test_runtime_utils_partition_balanced_has_deepspeeds_signature_and_balance() -> None:
    """deepspeed.runtime.utils.partition_balanced(weights=, num_parts=): the heaviest run as
    light as it can be, then the lightest as heavy as it can be; more parts than weights
    leaves the last ones empty."""
    from terascale.runtime.utils import partition_balanced

    def sums(weights: list[int], parts: int) -> list[int]:
        bounds = partition_balanced(weights=weights, num_parts=parts)
        assert len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == len(weights)
        return [sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])]

    assert sums([3, 1, 2], 5) == [3, 1, 2, 0, 0]
    assert sums([2, 2, 2, 2, 2, 2], 3) == [4, 4, 4]
    assert sorted(sums([2, 0, 2, 2, 0, 2, 2], 3)) == [2, 4, 4]
    assert sorted(sums([1, 1, 0, 1, 1, 1], 4)) == [1, 1, 1, 2]  # not a lone weightless run: [.., 0, ..] sums 0
    with pytest.raises(ValueError, match="num_parts"):
        partition_balanced([1], 0)
