"""Tensor parallelism under the engine: tp=2 and tp=2 x dp=2 at ZeRO stages 0-3 (with
offload), accumulation, clipping and dropout, against a plain PyTorch reference that
simulates every data-parallel rank; autoTP from the config; a user's own mpu; errors.

The reference runs in each rank's process: the unsliced model, every data-parallel
rank's micro-batches with that rank's RNG stream (so dropout draws the same masks),
gradients averaged, clipped with ``clip_grad_norm_`` and stepped with ``AdamW`` (or with
terascale's ``Lamb`` on the whole tensors, whose trust ratios the sliced run must match).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from distributed import run_ranks
from tp_model import TPNet, make_batches

STEPS, MICRO, LR, WD = 3, 2, 1e-2, 0.01


@dataclass(frozen=True)
class Case:
    stage: int = 0
    gas: int = 2
    clip: float = 0.0
    dropout: float = 0.0
    offload: bool = False
    optimizer: str = "AdamW"  # or "Lamb": whole-parameter trust ratios from tensor-parallel slices


def _config(case: Case, dp: int) -> dict:
    zero: dict = {"stage": case.stage, "reduce_bucket_size": 200, "stage3_param_persistence_threshold": 0}
    if case.offload:
        zero |= {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    return {
        "train_batch_size": MICRO * case.gas * dp,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": case.gas,
        "gradient_clipping": case.clip,
        "optimizer": {"type": case.optimizer, "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": zero,
        "steps_per_print": 1000,
    }


def _rows(step: int, dp_rank: int, micro: int, dp: int) -> slice:
    start = (micro * dp + dp_rank) * MICRO
    return slice(start, start + MICRO)


def _reference(case: Case, dp: int, ids: torch.Tensor, labels: torch.Tensor) -> tuple[list, dict]:
    """Losses ``[step][dp rank][micro]`` and final weights of the unsliced model."""
    torch.manual_seed(0)
    model = TPNet(None, dropout=case.dropout)
    if case.optimizer == "Lamb":
        from terascale.optim import Lamb

        opt = Lamb(model.parameters(), lr=LR, weight_decay=WD)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    rng = []
    for d in range(dp):
        torch.manual_seed(100 + d)
        rng.append(torch.get_rng_state())
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        per_rank = []
        for d in range(dp):
            torch.set_rng_state(rng[d])
            mine = []
            for k in range(case.gas):
                rows = _rows(step, d, k, dp)
                loss = model(ids[step, rows], labels[step, rows])
                (loss / (case.gas * dp)).backward()
                mine.append(loss.item())
            rng[d] = torch.get_rng_state()
            per_rank.append(mine)
        if case.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        opt.step()
        losses.append(per_rank)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_rank(tp: int, cases: list[Case]) -> list[dict]:
    import terascale
    from terascale.parallel import Topology

    out = []
    for case in cases:
        topo = Topology(tp=tp)
        dp, dp_rank = topo.size("dp"), topo.rank("dp")
        ids, labels = make_batches(STEPS, MICRO * case.gas * dp)
        torch.manual_seed(0)
        model = TPNet(topo.group("tp"), dropout=case.dropout)
        engine, *_ = terascale.initialize(model=model, config=_config(case, dp), mpu=topo.mpu())
        torch.manual_seed(100 + dp_rank)
        losses = []
        for step in range(STEPS):
            for k in range(case.gas):
                rows = _rows(step, dp_rank, k, dp)
                loss = engine(ids[step, rows], labels[step, rows])
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        state = engine.full_state_dict()
        norm = engine.get_global_grad_norm()
        engine.destroy()
        ref_losses, ref_state = _reference(case, dp, ids, labels)
        out.append({
            "case": case, "losses": losses, "ref": [x for step in ref_losses for x in step[dp_rank]],
            "state": state, "ref_state": ref_state, "norm": norm,
        })  # fmt: skip
    return out


def _check(results: list[list[dict]]) -> None:
    for rank, per_case in enumerate(results):
        for r in per_case:
            where = f"rank {rank} {r['case']}"
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref"]), rtol=1e-5, atol=1e-6, msg=where)
            assert set(r["state"]) == set(r["ref_state"]), where
            for name, ref in r["ref_state"].items():
                torch.testing.assert_close(r["state"][name], ref, rtol=1e-4, atol=1e-5, msg=f"{where}: {name}")


TP2_CASES = [
    Case(stage=0, clip=0.05, dropout=0.1),
    Case(stage=1, clip=0.05),
    Case(stage=2, gas=1, clip=0.05, dropout=0.1),
    Case(stage=3, clip=0.05),
    Case(stage=0, clip=0.05, optimizer="Lamb"),
    Case(stage=3, clip=0.05, optimizer="Lamb"),
]


def test_tp2_parity_with_plain_pytorch_at_every_stage() -> None:
    _check(run_ranks(_train_rank, 2, 2, TP2_CASES, timeout=300))


def test_tp2_dp2_parity_with_plain_pytorch_at_every_stage() -> None:
    cases = [*TP2_CASES, Case(stage=3, clip=0.05, offload=True), Case(stage=2, gas=1, clip=0.05, optimizer="Lamb")]
    _check(run_ranks(_train_rank, 4, 2, cases, timeout=400))


# -- checkpoints across tensor-parallel layouts ----------------------------------------------

GLOBAL_ROWS = 8  # the same global batch on every layout


def _reshard_rank(folder: str) -> dict:
    """Train 2 steps at tp=2 x dp=2 stage 2, resume at tp=1 x dp=4 stage 3 for 2 steps,
    resume at tp=2 x dp=2 stage 1 for 2 more; the reference trains 6 steps at once."""
    import terascale
    from terascale.parallel import Topology

    ids, labels = make_batches(6, GLOBAL_ROWS)
    layouts = [(2, 2), (1, 3), (2, 1)]  # (tp, stage)
    losses, state = [], None
    for phase, (tp, stage) in enumerate(layouts):
        topo = Topology(tp=tp)
        dp, dp_rank = topo.size("dp"), topo.rank("dp")
        gas = GLOBAL_ROWS // (MICRO * dp)
        torch.manual_seed(1234 if phase else 0)  # resumed phases: loading must overwrite every weight
        model = TPNet(topo.group("tp") if tp > 1 else None)
        engine, *_ = terascale.initialize(model=model, config=_config(Case(stage=stage, gas=gas, clip=0.05), dp), mpu=topo.mpu())
        if phase:
            path, _ = engine.load_checkpoint(folder)
            assert path is not None and engine.global_steps == 2 * phase
        for step in range(2 * phase, 2 * phase + 2):
            total = 0.0
            for k in range(gas):
                rows = _rows(step, dp_rank, k, dp)
                loss = engine(ids[step, rows], labels[step, rows])
                engine.backward(loss)
                engine.step()
                total += loss.item() / gas
            losses.append(total)
        engine.save_checkpoint(folder)
        state = engine.full_state_dict()
        engine.destroy()

    torch.manual_seed(0)
    ref = TPNet(None)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    ref_losses = []
    for step in range(6):
        opt.zero_grad()
        loss = ref(ids[step], labels[step])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        opt.step()
        ref_losses.append(loss.item())
    return {"losses": losses, "state": state, "ref_losses": ref_losses, "ref_state": ref.state_dict()}


def test_checkpoint_reshards_across_tensor_parallel_layouts_and_continues_the_trajectory(tmp_path) -> None:
    from terascale.checkpoint import consolidated_state_dict

    results = run_ranks(_reshard_rank, 4, str(tmp_path / "ckpt"), timeout=400)
    for rank, r in enumerate(results):
        for name, ref in r["ref_state"].items():
            torch.testing.assert_close(r["state"][name], ref, rtol=1e-4, atol=1e-5, msg=f"rank {rank}: {name}")
    # The consolidated file of the tp=2 checkpoint is the unsliced model's state dict.
    merged = consolidated_state_dict(tmp_path / "ckpt")
    assert set(merged) == set(results[0]["ref_state"])
    for name, ref in results[0]["ref_state"].items():
        torch.testing.assert_close(merged[name], ref, rtol=1e-4, atol=1e-5, msg=name)


# -- autoTP from the config, and the consolidated Hugging Face folder ------------------------


def _hf_model(kind: str):
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _autotp_rank(kind: str, folder: str) -> dict:
    import terascale
    from terascale.checkpoint import write_pretrained

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (3, 4, 12), generator=g)
    config = {
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5,
        # eps well above fp32 noise: Adam's first steps are otherwise sign(g) of near-zero
        # gradients, whose rounding differs between sliced and unsliced matrix products.
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "eps": 1e-4}},
        "zero_optimization": {"stage": 2}, "tensor_parallel": {"autotp_size": 2},
    }  # fmt: skip
    engine, *_ = terascale.initialize(model=_hf_model(kind), config=config)
    losses = []
    for step in range(3):
        loss = engine(input_ids=ids[step], labels=ids[step]).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.save_checkpoint(folder)
    state = engine.full_state_dict()
    engine.destroy()
    if torch.distributed.get_rank() == 0:
        write_pretrained(folder, f"{folder}/hf")
    torch.distributed.barrier()

    ref = _hf_model(kind)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, eps=1e-4)
    ref_losses = []
    for step in range(3):
        opt.zero_grad()
        loss = ref(input_ids=ids[step], labels=ids[step]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        ref_losses.append(loss.item())
    reloaded = type(ref).from_pretrained(f"{folder}/hf")
    return {"losses": losses, "ref_losses": ref_losses, "state": state, "ref_state": ref.state_dict(),
            "reloaded": reloaded.state_dict()}  # fmt: skip


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_autotp_from_the_config_trains_like_the_unsliced_model_and_consolidates_to_it(kind: str, tmp_path) -> None:
    for rank, r in enumerate(run_ranks(_autotp_rank, 2, kind, str(tmp_path / "ckpt"), timeout=300)):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=1e-5, atol=1e-6)
        for name, ref in r["ref_state"].items():
            torch.testing.assert_close(r["state"][name], ref, rtol=1e-4, atol=1e-5, msg=f"rank {rank}: {name}")
            torch.testing.assert_close(r["reloaded"][name], ref, rtol=1e-4, atol=1e-5, msg=f"reloaded {name}")


# -- a user's own Megatron-style mpu, and layouts that do not fit ----------------------------


class _UserMpu:
    """A Megatron-style mpu built from plain process groups (no terascale Topology)."""

    def __init__(self, tp: int, claim_dp: int | None = None) -> None:
        import torch.distributed as dist

        from terascale.comm import init_distributed

        init_distributed()  # a Megatron script joins the process group before building its mpu
        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp_groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]
        self.dp_groups = [dist.new_group(list(range(r, world, tp))) for r in range(tp)]
        self.tp_group, self.dp_group = self.tp_groups[rank // tp], self.dp_groups[rank % tp]
        self.world = world
        self.claim_dp = claim_dp

    def get_model_parallel_group(self):
        return self.tp_group

    def get_model_parallel_world_size(self) -> int:
        return torch.distributed.get_world_size(self.tp_group)

    def get_model_parallel_rank(self) -> int:
        return torch.distributed.get_rank(self.tp_group)

    def get_data_parallel_group(self):
        return torch.distributed.group.WORLD if self.claim_dp else self.dp_group

    def get_data_parallel_world_size(self) -> int:
        return torch.distributed.get_world_size(self.get_data_parallel_group())

    def get_data_parallel_rank(self) -> int:
        return torch.distributed.get_rank(self.get_data_parallel_group())


def _user_mpu_rank() -> dict:
    import terascale

    case = Case(stage=2, clip=0.05)
    mpu = _UserMpu(2)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    ids, labels = make_batches(STEPS, MICRO * case.gas * dp)
    torch.manual_seed(0)
    engine, *_ = terascale.initialize(model=TPNet(mpu.tp_group), config=_config(case, dp), mpu=mpu)
    for step in range(STEPS):
        for k in range(case.gas):
            rows = _rows(step, dp_rank, k, dp)
            engine.backward(engine(ids[step, rows], labels[step, rows]))
            engine.step()
    state = engine.full_state_dict()
    engine.destroy()
    errors = []
    for mpu_, extra in ((_UserMpu(2, claim_dp=4), {}), (mpu, {"tensor_parallel": {"tp_size": 4}})):
        try:
            terascale.initialize(model=TPNet(mpu.tp_group), config={**_config(case, 2), **extra}, mpu=mpu_)
        except ValueError as e:
            errors.append(str(e))
    # Lamb's own clipping would take the norm of this rank's slices only (stage 0: at 1-3 it
    # is refused for shards already).
    from terascale.optim import Lamb

    model = TPNet(mpu.tp_group)
    config = {k: v for k, v in _config(Case(stage=0), dp).items() if k != "optimizer"}
    try:
        terascale.initialize(model=model, optimizer=Lamb(model.parameters(), max_grad_norm=1.0), config=config, mpu=mpu)
    except ValueError as e:
        errors.append(str(e))
    return {"state": state, "ref_state": _reference(case, dp, ids, labels)[1], "errors": errors}


def test_a_users_megatron_mpu_trains_with_parity_and_mismatched_layouts_are_refused() -> None:
    for rank, r in enumerate(run_ranks(_user_mpu_rank, 4, timeout=300)):
        for name, ref in r["ref_state"].items():
            torch.testing.assert_close(r["state"][name], ref, rtol=1e-4, atol=1e-5, msg=f"rank {rank}: {name}")
        mismatch, sizes, lamb_clip = r["errors"]
        assert "data-parallel 4 x model(tensor)-parallel 2 x pipeline 1 = 8 ranks, but the world has 4" in mismatch
        assert "tensor-parallel size 4, but the mpu's tensor-parallel group has 2 ranks" in sizes
        assert "Lamb(max_grad_norm=...) with tensor parallelism" in lamb_clip and "gradient_clipping" in lamb_clip


# -- fp16: an overflow on one rank skips the step on every rank ------------------------------


def _overflow_rank() -> dict:
    import torch.distributed as dist

    import terascale
    from terascale.parallel import Topology

    topo = Topology(tp=2)
    ids, labels = make_batches(3, MICRO * 2)
    torch.manual_seed(0)
    model = TPNet(topo.group("tp"))
    config = {**_config(Case(stage=1, gas=1), 2), "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}}
    engine, *_ = terascale.initialize(model=model, config=config, mpu=topo.mpu())
    # Only the last rank's slice of one weight overflows, on the second step.
    poison = {"on": False}
    if dist.get_rank() == 3:
        engine.module.blocks[0].up.weight.register_hook(lambda g: g * float("inf") if poison["on"] else g)
    dp_rank = topo.rank("dp")
    record = []
    for step in range(3):
        poison["on"] = step == 1
        rows = _rows(step, dp_rank, 0, 2)
        engine.backward(engine(ids[step, rows], labels[step, rows]))
        engine.step()
        record.append((engine.was_step_applied(), engine.loss_scale, engine.skipped_steps))
    return {"record": record, "weights": engine.full_state_dict()}


def test_fp16_overflow_on_one_tensor_parallel_rank_skips_the_step_everywhere() -> None:
    results = run_ranks(_overflow_rank, 4, timeout=300)
    for r in results:
        assert r["record"] == [(True, 256.0, 0), (False, 128.0, 1), (True, 128.0, 1)], r["record"]
        for name, w in results[0]["weights"].items():
            torch.testing.assert_close(r["weights"][name], w, rtol=0, atol=0)  # no rank stepped alone
