"""ZeRO++ through the engine: hpZ, qwZ and qgZ on 4 ranks posing as 2 nodes x 2 ranks,
against plain ZeRO-3 of the same model and batches."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks

WIDTH, LAYERS, MICRO = 48, 4, 4
ADAMW = {"type": "AdamW", "params": {"lr": 3e-3}}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 1))


def _config(zpp: dict, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": extra.pop("gas", 1),
        # SGD with momentum by default: a parameter's change follows its gradient's, so a
        # gradient error shows in the parameters (Adam's normalised steps hide its scale).
        "optimizer": extra.pop("optimizer", {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}),
        "gradient_clipping": 100.0,  # far above the norm: only so that the engine reports it
        # Every group freed after its forward use and re-gathered in backward (a model too
        # large to keep gathered: what hpZ is for).
        "zero_optimization": {"stage": extra.pop("stage", 3), "param_persistence_threshold": 0,
                              "stage3_max_reuse_distance": 0, **extra.pop("zero", {}), **zpp},
        **extra,
    }  # fmt: skip


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randn(MICRO, WIDTH, generator=g)
    return x, x[:, :1].sin() + 0.1 * torch.randn(MICRO, 1, generator=g)


class _Recorder:
    """Collectives seen, with the group's size and the phase the test is in."""

    def __init__(self) -> None:
        self.phase = ""
        self.seen: list[tuple[str, str, int]] = []

    def record(self, op, payload, group, async_op, call):
        import torch.distributed as dist

        self.seen.append((self.phase, op, dist.get_world_size(group)))
        return call()

    def start(self, op, payload, group):
        import torch.distributed as dist

        self.seen.append((self.phase, op, dist.get_world_size(group)))
        return None


def _exact_full(fg) -> torch.Tensor:
    """Group ``fg``'s parameters as every rank's unquantized shards give them."""
    from terascale.comm import all_gather_flat

    out = torch.empty(fg.layout.padded_numel, dtype=fg.dtype)
    all_gather_flat(out, fg.shard.contiguous(), fg.group)
    return out


def _forward_full(fg) -> torch.Tensor:
    """Group ``fg``'s parameters as a quantized gather decodes them (or exact without qwZ)."""
    from terascale.comm.quant import dequantize, quantize

    full = _exact_full(fg)
    if fg.quant is None:
        return full
    n = fg.layout.shard_numel
    for r in range(fg.layout.world_size):
        dequantize(quantize(full[r * n : (r + 1) * n], fg.quant), fg.quant, full[r * n : (r + 1) * n])
    return full


def _train(zpp: dict, steps: int, record: bool = False, checks: bool = False, **extra) -> dict:
    import torch.distributed as dist

    import terascale
    from terascale.comm import ops

    rank = dist.get_rank() if dist.is_initialized() else 0
    gas = extra.get("gas", 1)
    engine, *_ = terascale.initialize(model=_model(), config=_config(zpp, **extra))
    rank = dist.get_rank()
    groups = [fg for fg in engine.model_state.groups if not fg.persistent]
    rec = _Recorder()
    captured: list[torch.Tensor] = []
    first = engine.module[0]
    hook = first.register_forward_pre_hook(lambda m, _: captured.append(m.weight.detach().clone()))
    losses, norms, secondary_ok, quant_ok = [], [], [], []
    for step in range(steps):
        for micro in range(gas):
            x, y = _batch(step, micro, rank)
            x = x.to(first.weight.dtype)
            with ops.recording(rec) if record else _null():
                rec.phase = f"forward {step}"
                loss = torch.nn.functional.mse_loss(engine(x).float(), y)
                rec.phase = f"backward {step}"
                engine.backward(loss)
            losses.append(loss.item())
            if checks and micro == 0:
                for fg in groups:
                    if fg.secondary is not None:
                        # what the forward computed with: the shards, decoded if sent as codes
                        lo, hi = fg.secondary_range()
                        secondary_ok.append(torch.equal(fg.secondary, _forward_full(fg)[lo:hi]))
                fg0 = next(fg for fg in groups if any(p is first.weight for p in fg.params))
                if fg0.quant is not None:
                    slot = fg0.layout.slots[[p is first.weight for p in fg0.params].index(True)]
                    full = _forward_full(fg0)
                    quant_ok.append(torch.equal(captured[-1].reshape(-1), full[slot.offset : slot.offset + slot.numel]))
            engine.step()  # every micro-step (the engine steps at the window's end)
        norms.append(engine.get_global_grad_norm())
        if checks:
            secondary_ok.append(all(fg.secondary is None for fg in groups))  # invalid after the step
    hook.remove()
    params = {n: p.detach().float().clone() for n, p in _full_params(engine).items()}
    return {"losses": losses, "norms": norms, "params": params, "seen": rec.seen, "secondary_ok": secondary_ok,
            "quant_ok": quant_ok, "groups": len(groups)}  # fmt: skip


def _full_params(engine) -> dict[str, torch.Tensor]:
    import terascale

    params = list(engine.module.parameters())
    with terascale.zero.GatheredParameters(params):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


ALL = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}


def _resume(zpp: dict, save_dir: str, tag: str, load_zpp: dict | None = None) -> dict:
    """Train 2 steps, save, train 2 more; a fresh engine (``load_zpp``'s options) loads the
    checkpoint and trains the same 2 steps."""
    import terascale

    def run(engine, steps):
        import torch.distributed as dist

        losses = []
        for step in steps:
            x, y = _batch(step, 0, dist.get_rank())
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    engine, *_ = terascale.initialize(model=_model(), config=_config(zpp))
    run(engine, [0, 1])
    engine.save_checkpoint(save_dir, tag=tag)
    after = run(engine, [2, 3])
    loaded, *_ = terascale.initialize(model=_model(), config=_config(zpp if load_zpp is None else load_zpp))
    loaded.load_checkpoint(save_dir, tag=tag)
    assert all(fg.secondary is None for fg in loaded.model_state.groups)
    params = {n: p.clone() for n, p in _full_params(loaded).items()}
    return {"after": after, "resumed": run(loaded, [2, 3]), "params": params}


def _zeropp_rank(save_dir: str) -> dict:
    import os

    os.environ["GROUP_RANK"] = str(int(os.environ["RANK"]) // 2)  # 2 nodes x 2 ranks
    out = {
        "plain": _train({}, 4, record=True),
        "hpz": _train({"zero_hpz_partition_size": 2}, 4, record=True, checks=True),
        "qwz": _train({"zero_quantized_weights": True}, 4, checks=True),
        "qgz": _train({"zero_quantized_gradients": True}, 4, record=True),
        "plain_bf16": _train({}, 12, gas=2, bf16={"enabled": True}, optimizer=ADAMW,
                             zero={"offload_optimizer": {"device": "cpu"}}),
        "all_bf16": _train({"zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                            "zero_quantized_gradients": True}, 12, gas=2, bf16={"enabled": True}, optimizer=ADAMW,
                           zero={"offload_optimizer": {"device": "cpu"}}, checks=True),
    }  # fmt: skip
    try:
        _train({"zero_hpz_partition_size": 3}, 1)
    except ValueError as e:
        out["hpz3"] = str(e)
    # Below stage 3 the keys are ignored (as DeepSpeed ignores them): stage 2 trains as without.
    out["stage2"] = _train({"zero_quantized_weights": True, "zero_quantized_gradients": True}, 2, stage=2)
    out["stage2_plain"] = _train({}, 2, stage=2)
    # hpZ with the parameter shards on the host and on NVMe: the same trajectory.
    out["hpz_offload"] = [
        _train({"zero_hpz_partition_size": 2}, 4, zero={"offload_param": {"device": device, "nvme_path": save_dir}})
        for device in ("cpu", "nvme")
    ]
    out["resume"] = _resume(ALL, save_dir, "zpp")
    out["resume_plain"] = _resume(ALL, save_dir, "zpp2", load_zpp={})
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(_zeropp_rank, 4, str(tmp_path_factory.mktemp("zeropp")), timeout=300)


def _gathers(seen, step: int, world: int) -> int:
    phases = {f"forward {step}", f"backward {step}"}
    return sum(1 for ph, op, w in seen if ph in phases and op == "all_gather_into_tensor" and w == world)


def test_hpz_trains_bit_identically_and_regathers_inside_the_node(results) -> None:
    for r in results:
        plain, hpz = r["plain"], r["hpz"]
        assert hpz["losses"] == plain["losses"]
        for name, p in plain["params"].items():
            assert torch.equal(hpz["params"][name], p), name
        n = hpz["groups"]
        # Step 2 (after two steps): plain ZeRO-3 gathers each group over all 4 ranks for the
        # forward and again for the backward (the schedule prefetches some of those before
        # backward starts, so they are counted per step).
        assert _gathers(plain["seen"], 2, 4) >= 2 * n - 1 and _gathers(plain["seen"], 2, 2) == 0
        # hpZ: the forward's gathers go over the world, the backward's inside the node.
        assert _gathers(hpz["seen"], 2, 4) == n and _gathers(hpz["seen"], 2, 2) >= n - 1
        # each secondary partition equals the primary shards' values, and is dropped at each step
        assert hpz["secondary_ok"] and all(hpz["secondary_ok"])


def test_qwz_computes_with_the_decoded_int8_weights_and_keeps_fp32_masters(results) -> None:
    for r in results:
        plain, qwz = r["plain"], r["qwz"]
        assert qwz["quant_ok"] and all(qwz["quant_ok"])
        assert qwz["losses"] != plain["losses"]  # quantized weights do change the forward...
        for a, b in zip(qwz["losses"], plain["losses"]):
            assert a == pytest.approx(b, rel=2e-2)  # ...by int8's error
        for name, p in plain["params"].items():
            assert (qwz["params"][name] - p).norm() < 0.01 * p.norm(), name


def test_qgz_reduces_across_nodes_in_int4_with_the_plain_scale(results) -> None:
    for r in results:
        plain, qgz = r["plain"], r["qgz"]
        # the gradient norm is the averaged gradient's: a wrong scale (L x the mean) shows here
        for a, b in zip(qgz["norms"], plain["norms"]):
            assert a == pytest.approx(b, rel=0.05)
        seen = [(op, w) for ph, op, w in qgz["seen"] if ph == "backward 2"]
        assert ("all_to_all_single", 2) in seen and ("reduce_scatter_tensor", 4) not in seen


def test_all_three_with_offload_accumulation_and_bf16_train_like_plain_zero3(results) -> None:
    for r in results:
        plain, zpp = r["plain_bf16"], r["all_bf16"]
        assert all(zpp["secondary_ok"])
        half = len(zpp["losses"]) // 2  # means of 12 micro-batch losses (each of 4 samples: noisy)
        first, last = sum(zpp["losses"][:half]) / half, sum(zpp["losses"][half:]) / half
        assert last < 0.9 * first  # it learns
        ref = sum(plain["losses"][half:]) / half
        assert last == pytest.approx(ref, rel=0.1)


def test_zeropp_config_rules(results) -> None:
    r = results[0]
    assert "zero_hpz_partition_size 3 does not divide the 4 ranks" in r["hpz3"]
    assert r["stage2"]["losses"] == r["stage2_plain"]["losses"]


def test_hpz_with_parameter_offload(results) -> None:
    for r in results:
        for run in r["hpz_offload"]:
            assert run["losses"] == r["plain"]["losses"]


def test_checkpoints_hold_full_precision_states_and_resume_exactly(results) -> None:
    for r in results:
        # ZeRO++ saved and loaded: the same next losses as the run that went on
        assert r["resume"]["resumed"] == r["resume"]["after"]
        # loaded without ZeRO++: the same full-precision parameters
        for name, p in r["resume"]["params"].items():
            assert torch.equal(r["resume_plain"]["params"][name], p), name
