"""Activation checkpointing: parity with plain PyTorch for every policy, ZeRO stage, tier and
accumulation, with dropout replayed exactly; ZeRO-3 gathers no more than without it."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from act_model import config, make_net, reference, train
from distributed import run_ranks

POLICIES = ["none", "blocks", "every_n", "selective"]


def _tier(tier: str, nvme: str) -> dict:
    if tier == "host":
        return {"cpu_checkpointing": True}
    if tier == "nvme":
        return {"cpu_checkpointing": True, "nvme_path": nvme, "contiguous_memory_optimization": True}
    if tier == "contiguous":
        return {"contiguous_memory_optimization": True, "number_checkpoints": 2}
    return {}


def _parity_rank(stage: int, cases: list[tuple[str, str, int]], nvme: str) -> list[dict]:
    import terascale
    from terascale.comm import init_distributed

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = init_distributed().device  # the reference runs where terascale will (its dropout RNG)
    refs: dict[int, tuple] = {}
    out = []
    for policy, tier, gas in cases:
        if gas not in refs:
            refs[gas] = reference(world, rank, gas, str(device))
        ref_losses, ref_weights = refs[gas]
        activation = {"policy": policy, "every_n": 3, **_tier(tier, nvme)}
        engine, *_ = terascale.initialize(model=make_net(), config=config(world, gas, stage, activation))
        losses = train(engine, world, rank, gas)
        weights = engine.full_state_dict()
        gathers = engine.model_state.schedule.gathers if stage == 3 else 0
        engine.destroy()
        what = f"stage={stage} policy={policy} tier={tier} gas={gas} rank={rank}"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0, msg=lambda m: f"{what}: {m}")
        for name, value in ref_weights.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {name}: {m}")
        out.append({"policy": policy, "tier": tier, "gas": gas, "gathers": gathers, "device": str(device)})
    return out


@pytest.mark.parametrize("stage", [0, 3])
def test_every_policy_matches_plain_pytorch(stage: int, tmp_path) -> None:
    """policy x tier (device / cpu_checkpointing / NVMe spill + contiguous buffer) x
    accumulation 1 and 2, on 2 ranks, against an all-reduce data-parallel reference."""
    cases = [(p, t, g) for p, t, g in itertools.product(POLICIES, ["device", "host", "nvme"], [1, 2])]
    cases += [("blocks", "contiguous", 2)]
    results = run_ranks(_parity_rank, 2, stage, cases, str(tmp_path), timeout=600)
    if stage == 3:
        # A recompute finds its block gathered by the pre-backward hook: no extra all-gather.
        by_case = {(r["policy"], r["tier"], r["gas"]): r["gathers"] for r in results[0]}
        for (policy, tier, gas), gathers in by_case.items():
            assert gathers == by_case[("none", "device", gas)], (policy, tier, gas, gathers)
    assert not any(tmp_path.rglob("*.swp")), "swap files left behind"


OFFLOAD = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}


def _user_checkpoint_rank(cases: list[tuple[int, bool, str | None, str]]) -> dict:
    import terascale

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo")
    refs = {gas: reference(world, rank, gas) for gas in (1, 2)}  # CPU only: see test_cuda.py for the GPU
    gathers = {}
    for stage, offload, mode, policy in cases:
        gas = 2 if stage != 1 else 1
        cfg = config(world, gas, stage, {"policy": policy}, zero=OFFLOAD if offload else None)
        engine, *_ = terascale.initialize(model=make_net(user_checkpoint=mode), config=cfg)
        losses = train(engine, world, rank, gas)
        weights = engine.full_state_dict()
        if stage == 3:
            gathers[(offload, mode, policy)] = engine.model_state.schedule.gathers
        engine.destroy()
        what = f"stage={stage} offload={offload} mode={mode} policy={policy} rank={rank}"
        ref_losses, ref_weights = refs[gas]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0, msg=lambda m: f"{what}: {m}")
        for name, value in ref_weights.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {name}: {m}")
    return gathers


def test_models_that_checkpoint_themselves_train_at_every_stage() -> None:
    """torch.utils.checkpoint inside the model (reentrant and not) at stages 0-3, with
    parameter and optimizer offload at stage 3, and under a terascale policy as well."""
    modes = ("reentrant", "non_reentrant", "full_recompute")
    cases = [(stage, False, mode, "none") for stage in (0, 1, 2, 3) for mode in modes]
    cases += [(3, True, mode, "none") for mode in modes]
    cases += [(3, True, "non_reentrant", "blocks"), (3, False, None, "none")]
    gathers = run_ranks(_user_checkpoint_rank, 2, cases, timeout=600)[0]
    # The recompute (in backward) keeps what it gathered for the backward that follows: as
    # many all-gathers as without checkpointing, from the first iteration on. (A reentrant
    # checkpoint runs its forward under no_grad, where nothing can be kept for backward.)
    counts = {case: n for case, n in gathers.items() if case[1] != "reentrant"}
    assert set(counts.values()) == {gathers[(False, None, "none")]}, gathers


def _hf_rank(cases: list[tuple[int, bool, bool | None]]) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    import terascale

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo")

    def model(checkpointing: bool, reentrant: bool):
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)  # fmt: skip
        m = LlamaForCausalLM(cfg)
        if checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        m.train()
        return m

    ids = torch.randint(0, 64, (3 * world * 2, 12), generator=torch.Generator().manual_seed(3))

    def batch(step: int) -> torch.Tensor:
        return ids[(step * world + rank) * 2 : (step * world + rank + 1) * 2]

    plain = model(False, False)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.0)
    want = []
    for step in range(3):
        loss = plain(input_ids=batch(step), labels=batch(step)).loss
        loss.backward()
        want.append(loss.item())
        for p in plain.parameters():
            torch.distributed.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()
    for stage, offload, reentrant in cases:
        gc = reentrant is not None
        cfg = {
            "train_batch_size": 2 * world, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **(OFFLOAD if offload else {})},
        }  # fmt: skip
        engine, *_ = terascale.initialize(model=model(gc, bool(reentrant)), config=cfg)
        got = []
        for step in range(3):
            loss = engine(input_ids=batch(step), labels=batch(step)).loss
            engine.backward(loss)
            engine.step()
            got.append(loss.item())
        weights = engine.full_state_dict()
        engine.destroy()
        what = f"stage={stage} offload={offload} reentrant={reentrant}"
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0, msg=lambda m: f"{what}: {m}")
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {name}: {m}")


def test_hf_gradient_checkpointing_trains_under_zero_3_with_offload() -> None:
    cases = [(3, True, False), (3, True, True), (3, False, False), (2, False, True), (0, False, False)]
    run_ranks(_hf_rank, 2, cases, timeout=600)
