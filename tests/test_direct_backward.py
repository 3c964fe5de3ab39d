"""``loss.backward()`` on the engine's output instead of ``engine.backward(loss)``
(DeepSpeed >= 0.18.3), at every ZeRO stage, with accumulation, clipping and fp16 loss
scaling: the same losses and parameters as ``engine.backward`` gives
(``[Note: direct backward]`` in ``terascale/engine/direct_backward.py``)."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from toy import make_data, make_model

WORLD, MICRO, STEPS = 2, 2, 3


def _config(stage: int, gas: int, fp16: bool = False, clip: float = 0.0) -> dict:
    config = {
        "train_batch_size": MICRO * gas * WORLD,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "stage3_param_persistence_threshold": 0},
    }
    if fp16:  # dynamic scaling from 2^8: a scale that is not 1 must reach the gradients once
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8}
    return config


def _backward(engine, loss: torch.Tensor, mode: str) -> None:
    if mode == "engine":
        engine.backward(loss)
    elif mode == "direct":
        loss.backward()
    elif mode == "scaled":  # DeepSpeed's form for a script that scales the loss itself
        engine.scale(loss).backward()
    else:  # alternate: a window may mix both
        engine.backward(loss) if engine.micro_steps % 2 else loss.backward()


def _toy_rank(cases: list[tuple]) -> list[tuple[list[float], dict, list]]:
    import os

    import terascale

    rank = int(os.environ["RANK"])
    out = []
    for stage, gas, fp16, mode in cases:
        model = make_model()
        engine, *_ = terascale.initialize(model=model, config=_config(stage, gas, fp16, clip=0.5))
        x, y = make_data(STEPS, MICRO * gas * WORLD)
        x = x.to(engine.precision.compute_dtype)
        losses, norms = [], []
        for s in range(STEPS):
            for m in range(gas):
                lo = (m * WORLD + rank) * MICRO
                loss = engine(x[s, lo : lo + MICRO], y[s, lo : lo + MICRO])
                _backward(engine, loss, mode)
                engine.step()
                losses.append(loss.item())
            norms.append(engine.get_global_grad_norm())
        assert engine.global_steps == STEPS and engine.micro_steps == STEPS * gas
        out.append((losses, engine.full_state_dict(), norms, engine.loss_scale))
        engine.destroy()
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_loss_backward_trains_as_engine_backward(stage: int) -> None:
    """Accumulation over 3 micro-steps (1/3 is not a power of two), clipping, fp16 with a
    dynamic scale: each form of backward gives engine.backward's losses, norms and weights."""
    cases = [(stage, gas, fp16, mode) for gas, fp16 in ((1, False), (3, False), (3, True))
             for mode in ("engine", "direct", "scaled", "mixed")]  # fmt: skip
    results = run_ranks(_toy_rank, WORLD, cases)
    for rank_results in results:
        by_case = dict(zip(cases, rank_results))
        for case, (losses, state, norms, scale) in by_case.items():
            ref_losses, ref_state, ref_norms, ref_scale = by_case[case[:3] + ("engine",)]
            assert losses == pytest.approx(ref_losses, rel=1e-6), case
            assert norms == pytest.approx(ref_norms, rel=1e-5), case
            assert scale == ref_scale, case
            for k, v in ref_state.items():
                torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=f"{case}: {k}")
        assert by_case[(stage, 3, True, "engine")][3] == 2.0**8  # fp16 ran scaled


def _gradient_penalty_rank(stage: int) -> list[tuple[list[float], dict]]:
    """torch.autograd.grad through the engine's output is no training backward: it must not
    open a window (engine.backward's results are unchanged by it)."""
    import os

    import terascale

    rank = int(os.environ["RANK"])
    out = []
    for probe in (False, True):
        engine, *_ = terascale.initialize(model=make_model(), config=_config(stage, 2))
        x, y = make_data(STEPS, MICRO * 2 * WORLD)
        losses = []
        for s in range(STEPS):
            for m in range(2):
                lo = (m * WORLD + rank) * MICRO
                inputs = x[s, lo : lo + MICRO].clone().requires_grad_(True)
                loss = engine(inputs, y[s, lo : lo + MICRO])
                if probe:
                    (grad,) = torch.autograd.grad(loss, inputs, retain_graph=True)
                    assert grad.shape == inputs.shape
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        out.append((losses, engine.full_state_dict()))
        engine.destroy()
    return out


@pytest.mark.parametrize("stage", [0, 3])
def test_autograd_grad_on_the_output_is_not_a_training_backward(stage: int) -> None:
    for (plain, plain_state), (probed, probed_state) in run_ranks(_gradient_penalty_rank, WORLD, stage):
        assert probed == plain
        for k, v in plain_state.items():
            torch.testing.assert_close(probed_state[k], v, rtol=0, atol=0, msg=k)


def _hf_rank(cases: list[tuple[str, int]]) -> list[tuple[list[float], dict]]:
    """A tiny Llama; its loss is computed inside from its logits, which are an output too."""
    import os

    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    import terascale

    rank = int(os.environ["RANK"])
    gas = 3
    out = []
    for mode, stage in cases:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32))  # fmt: skip
        config = _config(stage, gas)
        # An eps above rounding noise keeps Adam's update proportional to the gradient
        # where it nearly cancels (see tests/test_arch_sweep.py).
        config["optimizer"]["params"].update(lr=1e-3, eps=1e-4)
        engine, *_ = terascale.initialize(model=model, model_parameters=model.parameters(), config=config)
        ids = torch.randint(4, 96, (STEPS, gas * WORLD * MICRO, 16), generator=torch.Generator().manual_seed(1))
        losses = []
        for s in range(STEPS):
            for m in range(gas):
                lo = (m * WORLD + rank) * MICRO
                batch = ids[s, lo : lo + MICRO]
                output = engine(input_ids=batch, labels=batch)
                if mode.startswith("logits"):  # a loss of the script's own, from the logits
                    logits = output.logits[:, :-1].flatten(0, 1)
                    loss = F.cross_entropy(logits, batch[:, 1:].flatten())
                else:
                    loss = output.loss
                    loss *= 1.0  # in place on the output, as the Trainer does (loss *= world)
                if mode.endswith("engine"):
                    engine.backward(loss)
                else:
                    loss.backward()
                engine.step()
                losses.append(loss.item())
        out.append((losses, engine.full_state_dict()))
        engine.destroy()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_hugging_face_loss_and_logits_backward_scale_once(stage: int) -> None:
    """The model's loss depends on its logits, both outputs: a backward from either is
    scaled by 1/steps once, not once per output it passes."""
    pytest.importorskip("transformers")
    cases = [(mode, stage) for mode in ("loss-engine", "loss-direct", "logits-engine", "logits-direct")]
    for rank_results in run_ranks(_hf_rank, WORLD, cases):
        results = dict(zip((mode for mode, _ in cases), rank_results))
        for source in ("loss", "logits"):
            (ref_losses, ref_state), (losses, state) = results[f"{source}-engine"], results[f"{source}-direct"]
            assert losses == pytest.approx(ref_losses, rel=1e-5), source
            for k, v in ref_state.items():
                torch.testing.assert_close(state[k], v, rtol=1e-5, atol=2e-6, msg=f"{source}: {k}")
        # Both losses are the same quantity: the two trainings agree too.
        assert results["logits-direct"][0] == pytest.approx(results["loss-direct"][0], rel=1e-5)


def _module_backward_rank() -> str:
    import terascale

    config = {**_config(2, 1), "train_batch_size": MICRO}  # one rank
    engine, *_ = terascale.initialize(model=make_model(), config=config)
    x, y = make_data(1, MICRO)
    engine.module(x[0], y[0]).backward()  # around the engine: ZeRO never sees these gradients
    try:
        engine.step()
    except RuntimeError as e:
        return str(e)
    return "stepped"


def test_a_backward_around_the_engine_is_refused_with_what_to_call() -> None:
    (message,) = run_ranks(_module_backward_rank, 1)
    assert "no backward of this accumulation window went through the engine" in message
    assert "engine.module(batch)" in message and "engine.backward(loss)" in message


def _torch_func_rank(stage: int) -> list[tuple[list[float], dict, list[float]]]:
    """torch.func.grad and kin through the engine, between each backward and its step
    ([Note: torch.func through the engine]); with ``probe`` the window's last backward is
    also a direct backward of a vmapped forward."""
    import os

    from torch.func import grad, grad_and_value, jacrev, vmap

    import terascale

    rank = int(os.environ["RANK"])
    gas = 3  # a transform's gradient scaled by 1/steps would show
    out = []
    for probe in (False, True):
        engine, *_ = terascale.initialize(model=make_model(), config=_config(stage, gas))
        x, y = make_data(STEPS, MICRO * gas * WORLD)
        losses, errors = [], []
        for s in range(STEPS):
            for m in range(gas):
                lo = (m * WORLD + rank) * MICRO
                xs, ys = x[s, lo : lo + MICRO], y[s, lo : lo + MICRO]
                if probe and m == gas - 1:
                    # Per-sample losses through vmap; their mean is the batch's loss.
                    per_sample = vmap(lambda xi, yi: engine(xi[None], yi[None]))(xs, ys)
                    loss = per_sample.mean()
                    loss.backward()
                else:
                    loss = engine(xs, ys)
                    engine.backward(loss)
                losses.append(loss.item())
                if probe:
                    plain = make_model()
                    plain.load_state_dict(engine.full_state_dict())
                    for transform in (grad, jacrev, lambda f: lambda v: grad_and_value(f)(v)[0]):
                        got = transform(lambda v: engine(v, ys))(xs)
                        want = transform(lambda v: plain(v, ys))(xs)
                        errors.append((got - want).abs().max().item())
                    each = vmap(grad(lambda xi, yi: engine(xi[None], yi[None])))(xs, ys)
                    plain_each = vmap(grad(lambda xi, yi: plain(xi[None], yi[None])))(xs, ys)
                    errors.append((each - plain_each).abs().max().item())
                engine.step()
        assert engine.global_steps == STEPS and engine.micro_steps == STEPS * gas
        out.append((losses, engine.full_state_dict(), errors))
        engine.destroy()
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_torch_func_through_the_engine_is_the_plain_modules(stage: int) -> None:
    """torch.func.grad, jacrev, grad_and_value and vmap(grad) through the engine give the
    plain module's input gradients (unscaled by the accumulation steps), and calling them
    between a backward and its step changes no training; a vmapped forward's direct
    backward trains as engine.backward (at ZeRO-3 the transforms gather groups that must
    not outlive the update)."""
    for (losses, state, _), (probed, probed_state, errors) in run_ranks(_torch_func_rank, WORLD, stage):
        assert errors and max(errors) < 1e-5
        assert probed == pytest.approx(losses, rel=1e-5)
        for k, v in state.items():
            torch.testing.assert_close(probed_state[k], v, rtol=1e-5, atol=1e-6, msg=k)
