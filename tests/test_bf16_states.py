"""bf16 master weights and optimizer states ([Note: bf16 masters and optimizer states]):
the rounding, the step against the fused fp32 kernel, every stage and tier, checkpoints
between fp32 and bf16 states, and the refusals."""

from __future__ import annotations

import logging

import pytest
import torch

import state_tiers
from distributed import run_ranks
from terascale.offload import host_adam
from terascale.optim.rounding import StochasticRounding, narrow_


def test_stochastic_rounding_is_unbiased_and_leaves_bf16_values_alone():
    lo = torch.tensor(1.0, dtype=torch.bfloat16)
    hi = torch.nextafter(lo.float(), torch.tensor(2.0)).bfloat16()  # not the next bf16: widen
    step = float(torch.tensor(1.0 + 2**-7).bfloat16()) - 1.0  # bf16's step at 1.0
    assert step == 2**-7 and float(hi) == 1.0
    rounding = StochasticRounding(1 << 16)
    for fraction in (0.1, 0.5, 0.9):
        x = torch.full((1 << 16,), 1.0 + fraction * step)
        for sign in (1.0, -1.0):
            out = torch.empty(1 << 16, dtype=torch.bfloat16)
            narrow_((sign * x).clone(), out, rounding.noise(3, x.device, 0, x.numel(), 0))
            assert set(out.abs().float().unique().tolist()) == {1.0, 1.0 + step}
            mean = float(out.float().abs().mean())
            assert abs(mean - (1.0 + fraction * step)) < 0.02 * step, (fraction, sign, mean)
    nearest = torch.empty(4, dtype=torch.bfloat16)
    narrow_(torch.full((4,), 1.0 + 0.4 * step), nearest, None)
    assert torch.equal(nearest, torch.ones(4, dtype=torch.bfloat16))
    exact = torch.randn(1000).bfloat16()
    out = torch.empty_like(exact)
    narrow_(exact.float(), out, rounding.noise(5, exact.device, 17, 1000, 1))
    assert torch.equal(out, exact)
    inf = torch.tensor([float("inf"), -float("inf")])
    narrow_(inf.clone(), out[:2], rounding.noise(5, exact.device, 0, 2, 2))
    assert torch.equal(out[:2].float(), inf)


def test_noise_depends_on_step_and_position_only():
    a, b = StochasticRounding(4096), StochasticRounding(1024)
    whole = a.noise(7, torch.device("cpu"), 1000, 4096, 1).clone()  # a view of the table, at this step's place
    assert torch.equal(b.noise(7, torch.device("cpu"), 3000, 1024, 1), whole[2000:3024])
    assert not torch.equal(a.noise(8, torch.device("cpu"), 1000, 4096, 1), whole)
    assert not torch.equal(a.noise(7, torch.device("cpu"), 1000, 4096, 2), whole)
    assert int(whole.min()) >= 0 and int(whole.max()) < 1 << 16


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_nearest_rounding_step_is_the_fused_step_on_widened_values(state_dtype):
    torch.manual_seed(0)
    shapes = [(1000,), (37, 53)]
    ours = [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().float()) for p in ours]
    kw = dict(lr=1e-2, weight_decay=0.1, fused=True)
    ref_opt, our_opt = torch.optim.AdamW(ref, **kw), torch.optim.AdamW(ours, **kw)
    assert host_adam.supports_low_precision(our_opt)
    multiplier = torch.tensor(0.5)
    for _ in range(4):
        grads = [torch.randn(s).bfloat16() for s in shapes]
        for p, g in zip(ref, grads):
            p.grad = g.float() * multiplier
        ref_opt.step()
        with torch.no_grad():  # the reference narrows what it keeps, as the bf16 step does
            for p in ref:
                p.copy_(p.bfloat16().float())
                for key in ("exp_avg", "exp_avg_sq"):
                    s = ref_opt.state[p][key]
                    s.copy_(s.to(state_dtype).float())
        host_adam.step(our_opt, ours, grads, multiplier, chunk_numel=256, state_dtype=state_dtype)
        for a, b in zip(ref, ours):
            assert b.dtype == torch.bfloat16 and torch.equal(a.bfloat16(), b)
            assert our_opt.state[b]["exp_avg"].dtype == state_dtype
            assert torch.equal(ref_opt.state[a]["exp_avg_sq"].to(state_dtype), our_opt.state[b]["exp_avg_sq"])


def test_stochastic_rounding_keeps_updates_that_nearest_rounding_loses():
    """Updates of a 50th of a bf16 step: to nearest, the weights never move; stochastically,
    they move by the updates' sum in the mean."""
    n, steps, lr = 1 << 14, 40, 1e-3 / 8  # Adam's first steps move by about lr
    finals = {}
    for rounding in (None, StochasticRounding(host_adam.CHUNK_NUMEL)):
        w = torch.nn.Parameter(torch.full((n,), 1.0, dtype=torch.bfloat16))
        opt = torch.optim.Adam([w], lr=lr, fused=True)
        for _ in range(steps):
            host_adam.step(opt, [w], [torch.ones(n, dtype=torch.bfloat16)], torch.tensor(1.0),
                           state_dtype=torch.bfloat16, rounding=rounding, positions=[0])  # fmt: skip
        finals[rounding is None] = float(w.detach().float().mean())
    assert finals[True] == 1.0
    assert abs((1.0 - finals[False]) - steps * lr) < 0.1 * steps * lr, finals


# -- in the engine: every tier, checkpoints between fp32 and bf16 states ----------------------


def _config(stage: int, zero: dict | None = None, *, masters: bool = True, states: bool = True, world: int = 2) -> dict:
    return {
        "train_batch_size": 4 * world,
        "train_micro_batch_size_per_gpu": 4,
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": masters, "bf16_optimizer_states": states},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "sub_group_size": 3000, "stage3_param_persistence_threshold": 0,
                              **(zero or {})},  # fmt: skip
    }


def test_every_stage_and_tier_steps_the_same_and_resumes_exactly(tmp_path):
    (tmp_path / "swap").mkdir()
    nvme = {"device": "nvme", "nvme_path": str(tmp_path / "swap"), "buffer_count": 2}
    configs = [
        _config(2),
        _config(1),
        _config(2, zero={"offload_optimizer": {"device": "cpu"}}),
        _config(2, zero={"offload_optimizer": nvme}),
        _config(3, zero={"offload_optimizer": nvme, "offload_param": {**nvme, "buffer_count": 4}}),
        _config(3),
        _config(2, masters=False, states=False),
        _config(2, states=False),
        _config(2, masters=False, states=False, zero={"offload_optimizer": nvme}),
    ]
    results = run_ranks(state_tiers.tiers_rank, 2, configs, str(tmp_path / "ckpt"))
    for rank in results:
        base = rank[0]
        for got in rank[1:6]:  # stages 1-3, host and NVMe tiers: the same bytes, the same steps
            assert got["losses"] == base["losses"]
            assert all(torch.equal(got["params"][n], base["params"][n]) for n in base["params"])
        for got in rank[:6] + rank[7:8]:
            assert got["resumed"] == got["losses"][3:] and got["resumed_equal"]
        fp32 = rank[6]
        for got in (base, rank[7]):
            assert all(abs(a - b) <= 0.03 * abs(b) + 1e-3 for a, b in zip(got["losses"], fp32["losses"])), (got, fp32)
        # Masters and optimizer state: the bf16 masters are the model's bf16 shards (no bytes of
        # their own) and the moments 4 bytes an element, against fp32 masters 4 + moments 8;
        # 8 bytes with fp32 moments. The swap files hold masters 2 + moments 4 against 4 + 8.
        held = [r["opt_bytes"] + r["master_bytes"] for r in rank]
        assert held[0] == pytest.approx(held[6] * 4 / 12, rel=0.05)
        assert held[7] == pytest.approx(held[6] * 8 / 12, rel=0.05)
        assert rank[3]["disk"] <= 0.55 * rank[8]["disk"]


def _state_of(engine) -> dict:
    """Masters and moments as the checkpoint sees them: "kind/name/start" -> fp32 values."""
    from terascale.checkpoint.spans import SliceMode

    return {
        f"{span.key}/{span.name}/{span.start}": t.detach().float().clone()
        for chunk in engine.model_state.state_slices(engine.optimizer, SliceMode.HELD)
        for span, t in chunk
    }


def _save_rank(save_dir: str, masters: bool, states: bool) -> dict:
    import torch.distributed as dist

    import terascale

    engine, *_ = terascale.initialize(model=state_tiers.model(), config=_config(2, masters=masters, states=states))
    state_tiers.train(engine, state_tiers.batches(dist.get_rank(), 3))
    engine.save_checkpoint(save_dir, tag="s")
    saved = _state_of(engine)
    engine.destroy()
    return saved


def _load_rank(save_dir: str, masters: bool, states: bool) -> dict:
    import terascale

    engine, *_ = terascale.initialize(model=state_tiers.model(), config=_config(1, masters=masters, states=states, world=1))
    engine.load_checkpoint(save_dir, tag="s")
    loaded = _state_of(engine)
    dtypes = {str(t.dtype) for g in engine.optimizer.param_groups for p in g["params"]
              for t in [p, *engine.optimizer.state[p].values()] if t.dim() > 0}  # fmt: skip
    engine.destroy()
    return {"state": loaded, "dtypes": dtypes}


def _by_element(states: list[dict]) -> dict[str, torch.Tensor]:
    """The spans of every rank, joined into whole flat tensors per kind and name."""
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for state in states:
        for key, t in state.items():
            kind, name, start = key.rsplit("/", 2)
            parts.setdefault(f"{kind}/{name}", []).append((int(start), t.reshape(-1)))
    return {k: torch.cat([t for _, t in sorted(v, key=lambda p: p[0])]) for k, v in parts.items()}


@pytest.mark.parametrize("saved,loaded", [((True, True), (False, False)), ((False, False), (True, True))])
def test_checkpoints_load_between_fp32_and_bf16_states(tmp_path, saved, loaded):
    before = _by_element(run_ranks(_save_rank, 2, str(tmp_path), *saved))
    got = run_ranks(_load_rank, 1, str(tmp_path), *loaded)[0]
    after = _by_element([got["state"]])
    assert got["dtypes"] == ({"torch.bfloat16"} if loaded[0] else {"torch.float32"})
    compared = {k for k in before if before[k].numel() > 1}  # masters and moments, not step counts
    assert {k.rsplit("/", 1)[0] for k in compared} == {"master", "optim/exp_avg", "optim/exp_avg_sq"}
    for key in compared:
        # bf16 -> fp32 is exact; fp32 -> bf16 rounds to nearest.
        expected = before[key].bfloat16().float() if loaded[0] else before[key]
        assert torch.equal(after[key], expected), key


def _refusals_rank() -> list[str]:
    import io

    import terascale

    def build(config, optimizer=None) -> str:
        model = state_tiers.model()
        try:
            engine, *_ = terascale.initialize(model=model, optimizer=optimizer(model.parameters()) if optimizer else None,
                                              config=config)  # fmt: skip
        except ValueError as err:
            return f"{type(err).__name__}: {err}"
        engine.destroy()
        return "built"

    no_optimizer = {k: v for k, v in _config(2, world=1).items() if k != "optimizer"}
    off = _config(2, world=1)
    off["bf16"]["enabled"] = False
    log = io.StringIO()
    logging.getLogger("terascale").addHandler(logging.StreamHandler(log))
    return [
        build(_config(2, masters=False, world=1)),
        build(_config(0, world=1)),
        build({**_config(2, world=1), "data_types": {"grad_accum_dtype": "fp32"}}),
        build({**no_optimizer, "zero_allow_untested_optimizer": True}, lambda p: torch.optim.SGD(p, lr=0.1)),
        build(off) + log.getvalue(),
    ]


def test_refusals_and_what_is_ignored():
    states, stage0, accum, sgd, off = run_ranks(_refusals_rank, 1)[0]
    assert states.startswith("ConfigError") and "bf16_optimizer_states requires bf16_master_weights_and_grads" in states
    assert stage0.startswith("ConfigError") and "only supported with ZeRO Stage 1, 2, or 3" in stage0
    assert accum.startswith("ConfigError") and "grad_accum_dtype is 'fp32'" in accum
    assert sgd.startswith("UsageError") and "step Adam or AdamW" in sgd and "got SGD" in sgd
    assert off.startswith("built") and "apply with bf16.enabled only" in off


def test_the_planner_counts_bf16_masters_and_states():
    from terascale.config import Config
    from terascale.plan.candidates import knobs_from_config

    both = knobs_from_config(Config.load(_config(2)))
    masters = knobs_from_config(Config.load(_config(2, states=False)))
    fp32 = knobs_from_config(Config.load(_config(2, masters=False, states=False)))
    assert (both.master_bytes, both.state_bytes) == (2, 4.0)
    assert (masters.master_bytes, masters.state_bytes) == (2, 8.0)
    assert (fp32.master_bytes, fp32.state_bytes) == (4, 8.0)
