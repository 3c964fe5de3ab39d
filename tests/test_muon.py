"""Muon (and AdamW beside it) at every ZeRO stage and offload tier, on 2 and 4 ranks,
against a single-process reference written from the published algorithm
(``muon_reference.py``), on the whole global batch; AdamW for the embedding, the head, the
norm and the biases. The model's matrices have different shapes and the
ZeRO pieces are small, so matrices lie in parts on several ranks and pieces hold parts of
several matrices ([Note: whole matrices on shards]).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from distributed import run_ranks
from muon_reference import ADAM_LR, LR, MOMENTUM, WD, ReferenceMuon, muon_config, orthogonal
from terascale.optim.muon import balanced_owners, muon_param_groups, newton_schulz, uses_muon

STEPS, GLOBAL, VOCAB, DIM = 4, 4, 24, 16
MATRIX_NUMEL = 3 * DIM * DIM + 3 * DIM * DIM + DIM * DIM  # up, down, mix


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, 3 * DIM)  # wide
        self.down = nn.Linear(3 * DIM, DIM, bias=False)  # tall
        self.mix = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        h = self.norm(h + self.mix(h))
        return nn.functional.cross_entropy(self.lm_head(h).flatten(0, 1), labels.flatten())


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (STEPS, GLOBAL, 6), generator=g)
    return ids, torch.roll(ids, 1, dims=-1)


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    net = Net()
    ids, labels = data()
    optimizer = ReferenceMuon(net, LR, ADAM_LR, WD, MOMENTUM)
    losses = []
    for s in range(STEPS):
        net.zero_grad()
        loss = net(ids[s], labels[s])
        loss.backward()
        losses.append(float(loss.detach()))
        optimizer.step()
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}


def config(world: int, stage: int, extra: dict) -> dict:
    return muon_config(GLOBAL, GLOBAL // world, stage, extra)


def train(world: int, cases: list[tuple[int, dict]], steps: range = range(STEPS), load: str | None = None,
          save: str | None = None) -> list:  # fmt: skip
    """Train each case for ``steps`` (from the checkpoint in ``load``, saving to ``save``)."""
    import terascale
    from terascale.zero import WrapPolicy

    rank, micro = int(os.environ["RANK"]), GLOBAL // world
    out = []
    for stage, extra in cases:
        extra = dict(extra)
        torch.manual_seed(0)
        # Built under zero.Init: the matrices are partitioned before Muon picks its own by shape.
        with terascale.zero.Init(config=config(world, stage, {}), enabled=extra.pop("zero_init", False)):
            net = Net()
        engine, optimizer, _, _ = terascale.initialize(model=net, config=config(world, stage, extra),
                                                       wrap_policy=WrapPolicy(module_classes=(nn.Linear,)))  # fmt: skip
        if load is not None:
            engine.load_checkpoint(load)
        ids, labels = data()
        losses = []
        for s in steps:
            lo = rank * micro
            loss = engine(ids[s, lo : lo + micro], labels[s, lo : lo + micro])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        if save is not None:
            engine.save_checkpoint(save)
        held = {use: sum(p.numel() for g in optimizer.param_groups if g["use_muon"] == use for p in g["params"])
                for use in (True, False)}  # fmt: skip
        # In memory now: the momenta's elements, and the dimensions of the other state held.
        states = optimizer.state.values()
        held["momenta"] = sum(st["momentum_buffer"].numel() for st in states if "momentum_buffer" in st)
        held["other"] = {t.dim() for st in states for k, t in st.items() if k != "momentum_buffer" and t.numel()}
        out.append((losses, engine.full_state_dict(), engine.memory_breakdown()["optimizer_state"], held))
        engine.destroy()
    return out


def _check(world: int, cases: list[tuple[int, dict]], results: list) -> None:
    ref_losses, ref_state = reference()
    for i, case in enumerate(cases):
        losses = torch.tensor([r[i][0] for r in results]).mean(dim=0)
        torch.testing.assert_close(losses, torch.tensor(ref_losses), rtol=1e-5, atol=1e-6, msg=str(case))
        for r in results:
            for k, v in ref_state.items():
                torch.testing.assert_close(r[i][1][k], v, rtol=1e-5, atol=2e-6, msg=f"{case}: {k}")
        stage, extra = case
        if stage > 0 and "offload_optimizer" not in extra:  # (on NVMe the masters are in their files)
            # Each rank: one buffer for its share of the matrices, Adam's two for the rest.
            assert sum(r[i][3][True] for r in results) == MATRIX_NUMEL
            for r in results:
                assert r[i][2] == 4 * r[i][3][True] + 8 * r[i][3][False], (case, r[i][2:])
        if extra.get("save_muon_momentum_buffer_in_memory"):
            # The momenta in memory, Adam's moments on NVMe (only its 0-d step counters here).
            assert sum(r[i][3]["momenta"] for r in results) == MATRIX_NUMEL
            assert all(r[i][3]["other"] == {0} for r in results), [r[i][3] for r in results]


def test_muon_matches_the_reference_at_every_stage_and_tier_on_two_ranks(tmp_path) -> None:
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    cases = [(0, {"ns": "standard"}), (1, {}), (2, {}), (3, {"ns": "standard", "zero_init": True}),
             (2, {"offload_optimizer": {"device": "cpu"}}), (3, {"offload_optimizer": nvme}),
             (2, {"offload_optimizer": nvme, "save_muon_momentum_buffer_in_memory": True})]  # fmt: skip
    _check(2, cases, run_ranks(train, 2, 2, cases))


def test_muon_matches_the_reference_at_zero_3_on_four_ranks() -> None:
    cases = [(3, {})]
    _check(4, cases, run_ranks(train, 4, 4, cases))


def test_gram_newton_schulz_is_the_standard_iteration() -> None:
    torch.manual_seed(0)
    for shape in [(16, 64), (64, 16), (24, 24)]:
        g = torch.randn(*shape)
        torch.testing.assert_close(newton_schulz(g, 5, "gram"), orthogonal(g), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(newton_schulz(g, 5, "standard"), orthogonal(g), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="ns_method"):
        newton_schulz(torch.randn(3, 4), 5, "cubic")


def test_parameters_are_split_by_deepspeeds_rule_and_owners_balance() -> None:
    net = Net()
    assert [n for n, p in net.named_parameters() if uses_muon(n, p)] == ["up.weight", "down.weight", "mix.weight"]
    groups = muon_param_groups(net, [{"params": list(net.parameters()), "lr": 0.1}])
    assert [(g["use_muon"], len(g["params"]), g["lr"]) for g in groups] == [(True, 3, 0.1), (False, 6, 0.1)]
    net.wte = nn.Embedding(VOCAB, DIM)  # GPT-2's name: an embedding table all the same (AdamW's)
    assert [len(g["params"]) for g in muon_param_groups(net, [{"params": list(net.parameters())}])] == [3, 7]
    owners = balanced_owners([8, 7, 6, 5, 4, 3, 2, 1], 4)
    loads = [sum(c for c, o in zip([8, 7, 6, 5, 4, 3, 2, 1], owners) if o == r) for r in range(4)]
    assert max(loads) == 9 and min(loads) == 9


def test_the_planner_counts_one_buffer_for_muons_share_and_two_for_adams() -> None:
    from terascale.plan import plan
    from terascale.zero.estimate import estimate_memory

    net = Net()
    numel = sum(p.numel() for p in net.parameters())
    state = 4 * MATRIX_NUMEL + 8 * (numel - MATRIX_NUMEL)  # what memory_breakdown() shows (the tests above)
    for stage in (1, 2, 3):
        parts = plan(net, config(2, stage, {}), world=2).chosen.parts
        (found,) = [p.bytes for p in parts if p.category == "optimizer states"]
        assert found == state / 2, (stage, found)  # fp32 training: the shards are the masters
    rows = {(r.stage, r.offload_optimizer): r for r in estimate_memory(net, 2, offload=("none",), optimizer="Muon")}
    assert rows[(3, "none")].device == pytest.approx((4 * numel + 4 * numel + state) / 2)  # + 2-byte params, grads


def test_muon_state_resumes_exactly_on_another_world_size_and_stage(tmp_path) -> None:
    # Two steps on 2 ranks at ZeRO-2 (on NVMe, the momenta in memory), the last two from its
    # checkpoint on 4 ranks at ZeRO-3 and on 1 rank at stage 0: momenta and Adam's moments
    # carried by value.
    nvme = {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}, "save_muon_momentum_buffer_in_memory": True}
    run_ranks(train, 2, 2, [(2, nvme)], range(2), None, str(tmp_path / "c"))
    _, ref_state = reference()
    for world, stage in ((4, 3), (1, 0)):
        (result,) = run_ranks(train, world, world, [(stage, {})], range(2, STEPS), str(tmp_path / "c"))[0]
        for k, v in ref_state.items():
            torch.testing.assert_close(result[1][k], v, rtol=1e-5, atol=2e-6, msg=f"world {world}: {k}")


# Published configs, as their authors wrote them: the finetune demo's z2_muon.json and
# z3_muon.json (delock/deepspeed_finetune_demo) and the config of DeepSpeed's tests/unit/ops/muon
# (fp16, ZeRO-3 with host offload and its momentum-in-memory switch).
Z2_MUON = {"train_batch_size": 8, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "Muon", "params": {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                                    "weight_decay": 0.01}},
           "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "zero_allow_untested_optimizer": True}
Z3_MUON = {"train_batch_size": 8, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "Muon", "params": {"muon_lr": 1e-3, "adam_lr": 2e-5, "momentum": 0.95,
                                                    "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
           "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "zero_allow_untested_optimizer": True}
DS_UNIT = {"train_batch_size": 8, "optimizer": {"type": "muon", "params": {"lr": 0.01}}, "gradient_clipping": 1.0,
           "fp16": {"enabled": True},
           "zero_optimization": {"stage": 3, "reduce_scatter": False, "save_muon_momentum_buffer_in_memory": True,
                                 "offload_optimizer": {"device": "cpu", "pin_memory": True}}}  # fmt: skip


def train_published(world: int, configs: list[dict]) -> list:
    import terascale
    from terascale.optim.muon import Muon

    out = []
    for config in configs:
        torch.manual_seed(0)
        net = Net()
        before = {k: v.clone() for k, v in net.state_dict().items()}
        engine, optimizer, _, _ = terascale.initialize(model=net, config=config)
        ids, labels = data()
        assert engine.train_micro_batch_size_per_gpu() == GLOBAL  # 8 over 2 ranks
        for s in range(3):
            engine.backward(engine(ids[s], labels[s]))
            engine.step()
        after = engine.full_state_dict()
        out.append((isinstance(optimizer.optimizer, Muon), sorted(g["use_muon"] for g in optimizer.param_groups),
                    engine.global_steps, sorted(k for k in before if not torch.equal(before[k], after[k].to(before[k])))))  # fmt: skip
        engine.destroy()
    return out


def _frozen_and_lrs(world: int) -> list:
    """DeepSpeed's Muon cases of partly frozen models and learning rates, as its unit tests
    pose them (tests/unit/ops/muon/test_muon_partial_training.py): each kind's lr as the
    engine's optimizer has it, and whether a step trains only what is trainable."""
    import terascale

    out = []
    cases = [({"lr": 0.02, "weight_decay": 0.01}, ("up", "down", "mix", "lm_head")),  # only AdamW's left
             ({"lr": 0.02, "weight_decay": 0.01}, ("up",)),
             ({"lr": 0.02, "muon_lr": 0.04, "adam_lr": 0.001, "weight_decay": 0.01}, ())]  # fmt: skip
    ids, labels = data()
    for params, frozen in cases:
        torch.manual_seed(0)
        net = Net()
        for name, p in net.named_parameters():
            p.requires_grad = not name.startswith(frozen)
        before = {k: v.clone() for k, v in net.state_dict().items()}
        config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Muon", "params": params},
                  "zero_optimization": {"stage": 2}}  # fmt: skip
        engine, *_ = terascale.initialize(model=net, model_parameters=net.parameters(), config=config)
        lrs = {g["use_muon"]: g["lr"] for g in engine.basic_optimizer.param_groups}
        engine.backward(engine(ids[0, :1], labels[0, :1]))
        engine.step()
        after = engine.full_state_dict()
        moved = {k.rsplit(".", 1)[0] for k in before if not torch.equal(before[k], after[k])}
        out.append((lrs, sorted(moved)))
        engine.destroy()
    return out


def test_muon_with_frozen_parameters_and_each_kinds_lr_as_deepspeeds_tests_pose_them() -> None:
    (only_adam, both, overrides), _ = run_ranks(_frozen_and_lrs, 2, 2)
    assert only_adam == ({False: 0.02}, ["embed", "norm"])  # no Muon group at all: nothing to orthogonalize
    assert both == ({True: 0.02, False: 0.02}, ["down", "embed", "lm_head", "mix", "norm"])
    assert overrides[0] == {True: 0.04, False: 0.001}


def test_published_muon_configs_train_unchanged() -> None:
    for muon, kinds, steps, changed in run_ranks(train_published, 2, 2, [Z2_MUON, Z3_MUON, DS_UNIT])[0]:
        assert muon and kinds == [False, True] and steps == 3
        assert "up.weight" in changed and "embed.weight" in changed and "lm_head.weight" in changed, changed
