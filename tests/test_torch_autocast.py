"""``torch_autocast`` (DeepSpeed's section) at every ZeRO stage, against plain PyTorch
running the same forward under ``torch.autocast`` on one process.

The reference computes each rank's micro-batch apart (autocast's low-precision sums over
a batch depend on how the batch is split) and averages their fp32 gradients, or, for the
parameters of ``lower_precision_safe_modules``, averages them as the ranks reduce them: in
the autocast dtype.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from distributed import run_ranks

STEPS, WORLD, MICRO, LR = 3, 2, 4, 1e-2


class Net(nn.Module):
    """Its forward gives the loss: the engine's autocast covers the loss too."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.body(x), y)


def net() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(STEPS, WORLD * MICRO, 12, generator=g), torch.randint(0, 5, (STEPS, WORLD * MICRO), generator=g)


def reference(dtype: torch.dtype, low_comm: bool, loss_scale: float = 1.0,
              loss_outside: bool = False) -> tuple[list[float], dict]:  # fmt: skip
    """``loss_outside``: the loss on the autocast logits, after the autocast region."""
    # One thread, as each rank: a low-precision matmul's rounding depends on how its sums
    # are split between threads.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(dtype, low_comm, loss_scale, loss_outside)
    finally:
        torch.set_num_threads(threads)


def _reference(dtype: torch.dtype, low_comm: bool, loss_scale: float, loss_outside: bool) -> tuple[list[float], dict]:
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    x, y = data()
    linear = {id(p) for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()}
    losses = []
    for s in range(STEPS):
        grads, step_losses = [], []
        for r in range(WORLD):
            model.zero_grad()
            xr, yr = x[s, r * MICRO : (r + 1) * MICRO], y[s, r * MICRO : (r + 1) * MICRO]
            with torch.autocast("cpu", dtype=dtype):
                loss = model.body(xr) if loss_outside else model(xr, yr)
            if loss_outside:
                loss = nn.functional.cross_entropy(loss, yr)
            (loss.float() * loss_scale).backward()
            grads.append([p.grad.clone() / loss_scale for p in model.parameters()])
            step_losses.append(float(loss.detach()))
        for k, p in enumerate(model.parameters()):
            parts = [g[k] for g in grads]
            if low_comm and id(p) in linear:  # reduced in the autocast dtype, as the ranks do
                p.grad = ((parts[0].to(dtype) + parts[1].to(dtype)) / WORLD).float()
            else:
                p.grad = (parts[0] + parts[1]) / WORLD
        opt.step()
        losses.append(sum(step_losses) / WORLD)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(cases: list[tuple[int, dict]]) -> list:
    import terascale

    rank = int(os.environ["RANK"])
    out = []
    for stage, section in cases:
        section = dict(section)
        fp16 = section.pop("fp16", {})
        config = {"fp16": fp16,"train_batch_size": WORLD * MICRO, "train_micro_batch_size_per_gpu": MICRO,
                  "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
                  "zero_optimization": {"stage": stage}, "torch_autocast": {"enabled": True, **section}}  # fmt: skip
        engine, _, _, _ = terascale.initialize(model=net(), config=config)
        x, y = data()
        losses = []
        for s in range(STEPS):
            lo = rank * MICRO
            loss = engine(x[s, lo : lo + MICRO], y[s, lo : lo + MICRO])
            assert loss.dtype == torch.float32  # cross-entropy runs in fp32 under autocast
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        out.append((losses, engine.full_state_dict(), engine.loss_scale, engine.skipped_steps))
        engine.destroy()
    return out


def _check(cases: list, expected: list, results: list | None = None) -> None:
    results = results or run_ranks(train, WORLD, cases)
    for i, (case, (ref_losses, ref_state)) in enumerate(zip(cases, expected)):
        losses = torch.tensor([r[i][0] for r in results]).mean(dim=0)
        torch.testing.assert_close(losses, torch.tensor(ref_losses), rtol=1e-5, atol=1e-6, msg=str(case))
        for k, v in ref_state.items():
            got = results[0][i][1][k]
            assert torch.allclose(got, v, rtol=1e-5, atol=1e-6), (case, k, (got - v).abs().max().item(), v.abs().max().item())


def test_bf16_autocast_matches_plain_pytorch_at_every_stage() -> None:
    fp32_comm = {"dtype": "bfloat16", "lower_precision_safe_modules": []}
    cases = [(stage, fp32_comm) for stage in (0, 1, 2, 3)]
    _check(cases, [reference(torch.bfloat16, low_comm=False)] * len(cases))


def test_fp16_autocast_scales_the_loss_at_stages_0_and_2() -> None:
    # Loss scaling as the fp16 section's keys say (here a dynamic scale starting at 2^4,
    # which these steps never overflow): the reference scales by 16 and unscales.
    section = {"dtype": "float16", "lower_precision_safe_modules": [], "fp16": {"initial_scale_power": 4}}
    cases = [(0, section), (2, section)]
    results = run_ranks(train, WORLD, cases)
    assert [(r[2], r[3]) for r in results[0]] == [(16.0, 0), (16.0, 0)]
    _check(cases, [reference(torch.float16, low_comm=False, loss_scale=16.0)] * len(cases), results)


def test_lower_precision_safe_modules_reduce_their_gradients_in_bf16() -> None:
    # DeepSpeed's default list (torch's Linear, Conv1d/2d/3d): the Linear layers' gradients are
    # averaged in bf16 over the ranks, the LayerNorm's in fp32.
    cases = [(stage, {"dtype": "bfloat16"}) for stage in (0, 2, 3)]
    _check(cases, [reference(torch.bfloat16, low_comm=True)] * len(cases))


def _pipe_rank() -> tuple[list[float], dict]:
    """Net's body as a two-stage pipeline (its loss the pipeline's loss_fn) under bf16 autocast."""
    import terascale
    from terascale.parallel import Topology
    from terascale.pipe import LayerSpec, PipelineModule

    topo = Topology(pp=2)
    torch.manual_seed(0)
    body = net().body
    specs = [LayerSpec(nn.Linear, 12, 32), LayerSpec(nn.GELU), LayerSpec(nn.LayerNorm, 32), LayerSpec(nn.Linear, 32, 5)]
    model = PipelineModule(specs, topology=topo, loss_fn=nn.functional.cross_entropy, partition_method="uniform")
    model.load_state_dict({k: body.state_dict()[k] for k in model.state_dict()})  # the layer indices are the same
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": WORLD, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
              "torch_autocast": {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}}  # fmt: skip
    engine, *_ = terascale.initialize(model=model, config=config)
    x, y = data()
    losses = []
    for s in range(STEPS):  # the two micro-batches are the reference's two ranks' batches
        batches = [(x[s, r * MICRO : (r + 1) * MICRO], y[s, r * MICRO : (r + 1) * MICRO]) for r in range(WORLD)]
        losses.append(float(engine.train_batch(iter(batches))))
    state = {f"body.{k}": v for k, v in engine.full_state_dict().items()}
    engine.destroy()
    return losses, state


def test_a_pipelines_stages_compute_under_autocast() -> None:
    # Each stage's layers run under the engine's autocast; the loss_fn, as a loss outside the
    # model's forward, runs on the last stage's bf16 logits outside it, and so does the reference's.
    ref_losses, ref_state = reference(torch.bfloat16, low_comm=False, loss_outside=True)
    held = set()
    for losses, state in run_ranks(_pipe_rank, WORLD):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for k, v in state.items():  # each stage holds its own layers
            torch.testing.assert_close(v, ref_state[k], rtol=1e-5, atol=1e-6, msg=k)
        held |= set(state)
    assert held == set(ref_state), held
