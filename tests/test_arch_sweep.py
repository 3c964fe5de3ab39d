"""Many architectures trained at ZeRO-3 on two ranks, against plain PyTorch.

Each model of ``arch_zoo`` (Hugging Face causal and masked LMs, encoder-decoders, speech,
vision, mixtures of experts, plain torch attention models) is built from a tiny config,
given to ``terascale.initialize`` as a DeepSpeed script would (``model_parameters=
model.parameters()``, frozen ones included), and trained a few steps at stage 3 with
``stage3_param_persistence_threshold: 0`` (every parameter sharded, gathered around its
use) with ``engine.backward`` and ``engine.step``. The same model trained by plain PyTorch
on the whole global batch must give the same losses and final parameters within fp32
rounding.

The architectures of one session run in a few ``run_ranks`` calls (start-up dominates);
the default run holds a cross-section, ``-m slow`` (``make test-all``) adds the rest.
"""

from __future__ import annotations

import traceback

import pytest
import torch

from arch_zoo import ARCHS, build, loss_of, make_batches, missing
from distributed import run_ranks
from toy import make_data, make_model, reference_train

pytest.importorskip("transformers")

WORLD, MICRO, STEPS = 2, 2, 3
# Adam's update divides by sqrt(v): for an element whose gradient is rounding noise (the
# bias of an attention key projection has none in exact arithmetic) it would turn that
# noise into a full step either way. An eps far above such noise (and below the real
# gradients) keeps the update proportional to the gradient there, so fp32 tolerances hold.
LR, EPS, WD = 1e-3, 1e-4, 0.01

# The default run: every family and every structural feature once (shared and tied
# weights, frozen tables, .forward calls, nested ModuleLists, external parameters, experts).
DEFAULT = (
    "gpt2", "llama", "qwen2", "phi", "gpt_neox", "opt", "bloom", "falcon",
    "bert", "albert", "distilbert", "squeezebert", "funnel",
    "t5", "marian", "whisper", "vit", "mixtral",
    "torch_encoder", "torch_mha", "vit_like",
)  # fmt: skip
CHUNK = 12  # architectures per run_ranks call: a hang costs one chunk, not the session


def _config() -> dict:
    return {
        "train_batch_size": MICRO * WORLD,
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": WD}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }


def _train_engine(name: str) -> dict:
    import os

    import terascale

    rank = int(os.environ["RANK"])
    model = build(name)
    engine, *_ = terascale.initialize(model=model, model_parameters=model.parameters(), config=_config())
    try:
        losses = []
        for batch in make_batches(name, STEPS, MICRO * WORLD):
            mine = {k: v[rank * MICRO : (rank + 1) * MICRO] for k, v in batch.items()}
            loss = loss_of(engine(**mine))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        state = engine.full_state_dict()
    finally:
        engine.destroy()
    return {"losses": losses, "state": state if rank == 0 else None}


def _train_reference(name: str) -> dict:
    """Plain PyTorch on the whole global batch; a trainable parameter without a gradient
    gets a zero one (ZeRO's semantics: AdamW then still decays it)."""
    model = build(name)
    trainable = [p for p in model.parameters() if p.requires_grad]
    initial = [p.detach().clone() for p in trainable]
    opt = torch.optim.AdamW(trainable, lr=LR, eps=EPS, weight_decay=WD)
    losses = []
    for batch in make_batches(name, STEPS, MICRO * WORLD):
        loss = loss_of(model(**batch))
        loss.backward()
        for p in trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    moved = torch.tensor([(p.detach() - p0).abs().max().item() for p, p0 in zip(trainable, initial)])
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "state": state, "moved": moved.median().item()}


def _sweep_rank(names: list[str]) -> dict[str, dict]:
    """Train each architecture with terascale (an error is reported, not raised: both
    ranks fail alike and go on to the next), then this rank's share of the references."""
    import os

    rank = int(os.environ["RANK"])
    out: dict[str, dict] = {}
    for name in names:
        try:
            out[name] = _train_engine(name)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    for i, name in enumerate(names):
        if i % WORLD == rank:
            out[name]["reference"] = _train_reference(name)
    return out


_results: dict[str, dict] = {}


def _run(names: list[str]) -> None:
    """Train ``names`` on the ranks; file each one's combined result in ``_results``."""
    try:
        by_rank = run_ranks(_sweep_rank, WORLD, names, timeout=60 + 30 * len(names))
    except Exception as e:  # a hang or crash: every architecture of the chunk reports it
        _results.update({name: {"error": f"{type(e).__name__}: {e}"} for name in names})
        return
    for name in names:
        ranks = [r[name] for r in by_rank]
        combined = {"reference": next(r["reference"] for r in ranks if "reference" in r)}
        errors = [r["error"] for r in ranks if "error" in r]
        if errors:
            combined["error"] = errors[0]
        else:
            # Equal micro-batches: the global batch's loss is the mean of the ranks' losses.
            combined["losses"] = torch.tensor([r["losses"] for r in ranks]).mean(0).tolist()
            combined["state"] = ranks[0]["state"]
        _results[name] = combined


def _selected(request: pytest.FixtureRequest) -> list[str]:
    """The architectures this session's selected tests name (run together, not one by one)."""
    names = []
    for item in request.session.items:
        if getattr(item, "originalname", None) == "test_architecture_trains_like_pytorch" and item.module is request.module:
            names.append(item.callspec.params["name"])
    return names


PARAMS = [pytest.param(n, id=n, marks=() if n in DEFAULT else pytest.mark.slow) for n in ARCHS]


@pytest.mark.parametrize("name", PARAMS)
def test_architecture_trains_like_pytorch(name: str, request: pytest.FixtureRequest) -> None:
    why = missing(name)
    if why is not None:
        pytest.skip(why)
    if name not in _results:
        todo = [n for n in _selected(request) if n not in _results and missing(n) is None]
        todo = todo if name in todo else [name]
        for i in range(0, len(todo), CHUNK):
            _run(todo[i : i + CHUNK])
    result = _results[name]
    if "error" in result:
        pytest.fail(f"{name} at ZeRO-3:\n{result['error']}", pytrace=False)
    ref = result["reference"]
    # The training moved the parameters far beyond the tolerances below (typically by lr per step).
    assert ref["moved"] > 50 * 2e-6, (name, ref["moved"])
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{name}: losses per step: {m}")  # fmt: skip
    state = result["state"]
    assert state.keys() == ref["state"].keys(), name
    for k, v in ref["state"].items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=2e-6, msg=lambda m: f"{name}: {k}: {m}")


# -- frozen parameters in the optimizer's parameters -------------------------------------------


def _frozen_rank(cases: list[tuple[int, str]]) -> list[tuple[list[float], dict]]:
    """The toy model with a frozen input layer, its frozen parameters passed to
    ``initialize`` in ``model_parameters`` or in a client optimizer, as DeepSpeed scripts
    do, at each ``(stage, how)``."""
    import os

    import terascale

    rank = int(os.environ["RANK"])
    out = []
    for stage, how in cases:
        model = make_model(frozen=True)
        config = {
            "train_batch_size": MICRO * WORLD,
            "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 1000,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        adamw = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
        if how == "model_parameters":
            kw = {"model_parameters": model.parameters(), "config": {**config, "optimizer": adamw}}
        elif how == "groups":  # weight-decay groups as scripts build them, frozen parameters in both
            named = list(model.named_parameters())
            groups = [{"params": [p for n, p in named if n.endswith("weight")]},
                      {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.01}]  # fmt: skip
            kw = {"model_parameters": groups, "config": {**config, "optimizer": adamw}}
        elif how == "frozen_group":  # a group of frozen parameters only: empty once they are left out
            named = list(model.named_parameters())
            groups = [{"params": [p for _, p in named if p.requires_grad]},
                      {"params": [p for _, p in named if not p.requires_grad], "weight_decay": 0.0}]  # fmt: skip
            kw = {"model_parameters": groups, "config": {**config, "optimizer": adamw}}
        else:
            kw = {"optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01), "config": config}
        engine, *_ = terascale.initialize(model=model, **kw)
        x, y = make_data(4, MICRO * WORLD)
        losses = []
        for s in range(4):
            mine = slice(rank * MICRO, (rank + 1) * MICRO)
            loss = engine(x[s, mine], y[s, mine])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out.append((losses, engine.full_state_dict()))
        engine.destroy()
    return out


def test_frozen_parameters_passed_to_initialize_are_left_out_of_the_optimizer() -> None:
    """DeepSpeed steps only the parameters that require gradients of those it is given."""
    cases = [(stage, how) for stage in (0, 1, 2, 3) for how in ("model_parameters", "groups", "frozen_group", "optimizer")]
    # The unused 'rare' layer: no gradient at stage 0 (as plain PyTorch), a zero one at 1-3 (ZeRO's).
    refs = [reference_train(4, MICRO * WORLD, lr=1e-2, weight_decay=0.01, clip=0.0, frozen=True, zero_unused_grads=z)
            for z in (False, True)]  # fmt: skip
    initial = make_model(frozen=True).state_dict()
    by_rank = run_ranks(_frozen_rank, WORLD, cases)
    for i, case in enumerate(cases):
        ref_losses, ref_state = refs[case[0] > 0]
        losses = torch.tensor([r[i][0] for r in by_rank]).mean(0)
        torch.testing.assert_close(losses, torch.tensor(ref_losses), rtol=1e-5, atol=1e-6, msg=str(case))
        state = by_rank[0][i][1]
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=2e-6, msg=f"{case}: {k}")
        for k in ("inp.weight", "inp.bias"):  # frozen: untouched
            assert torch.equal(state[k], initial[k]), (case, k)
