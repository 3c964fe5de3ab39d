"""Muon with tensor parallelism: each sliced matrix orthogonalized whole ([Note: whole
matrices across tensor-parallel slices]), at ZeRO stages 0-3 and on both offload tiers,
tp=2 and tp=2 x dp=2, against the unsliced model stepped by the reference Muon
(``muon_reference.py``); and Hugging Face GPT-2 under autoTP, whose fused q,k,v weight is
joined block by block before it is orthogonalized.

The models' column-parallel weights are sliced by rows and the row-parallel ones by
columns, tall and wide, so a slice's own orthogonalization (and its √(rows/cols) scale)
would differ from the whole matrix's in every case.
"""

from __future__ import annotations

import torch

from distributed import run_ranks
from muon_reference import ADAM_LR, LR, MOMENTUM, WD, ReferenceMuon, muon_config
from tp_model import TPNet, make_batches

STEPS, MICRO = 3, 2


def _reference(dp: int, ids: torch.Tensor, labels: torch.Tensor) -> tuple[list, dict]:
    """Losses ``[step][dp rank]`` and final weights of the unsliced model, every
    data-parallel rank's micro-batch in each step's gradient."""
    torch.manual_seed(0)
    model = TPNet(None)
    optimizer = ReferenceMuon(model, LR, ADAM_LR, WD, MOMENTUM)
    losses = []
    for step in range(STEPS):
        model.zero_grad()
        per_rank = []
        for d in range(dp):
            loss = model(ids[step, d * MICRO : (d + 1) * MICRO], labels[step, d * MICRO : (d + 1) * MICRO])
            (loss / dp).backward()
            per_rank.append(loss.item())
        optimizer.step()
        losses.append(per_rank)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_rank(tp: int, cases: list[tuple[int, dict]]) -> list[tuple]:
    import terascale
    from terascale.parallel import Topology

    topo = Topology(tp=tp)
    dp, dp_rank = topo.size("dp"), topo.rank("dp")
    ids, labels = make_batches(STEPS, MICRO * dp)
    ref_losses, ref_state = _reference(dp, ids, labels)
    out = []
    for stage, extra in cases:
        torch.manual_seed(0)
        config = muon_config(MICRO * dp, MICRO, stage, extra, sub_group_size=40)
        engine, *_ = terascale.initialize(model=TPNet(topo.group("tp")), config=config, mpu=topo.mpu())
        rows = slice(dp_rank * MICRO, (dp_rank + 1) * MICRO)
        losses = []
        for step in range(STEPS):
            loss = engine(ids[step, rows], labels[step, rows])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out.append(((stage, extra), losses, [r[dp_rank] for r in ref_losses], engine.full_state_dict(), ref_state))
        engine.destroy()
    return out


def _check(results: list[list[tuple]]) -> None:
    for rank, per_case in enumerate(results):
        for case, losses, ref_losses, state, ref_state in per_case:
            where = f"rank {rank} {case}"
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6, msg=where)
            assert set(state) == set(ref_state), where
            for name, ref in ref_state.items():
                torch.testing.assert_close(state[name], ref, rtol=1e-5, atol=2e-6, msg=f"{where}: {name}")


def test_muon_with_tp2_matches_the_unsliced_reference_at_every_stage_and_tier(tmp_path) -> None:
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    cases = [(0, {"ns": "standard"}), (1, {}), (2, {"offload_optimizer": {"device": "cpu"}}),
             (3, {"offload_optimizer": nvme})]  # fmt: skip
    _check(run_ranks(_train_rank, 2, 2, cases, timeout=300))


def test_muon_with_tp2_dp2_matches_the_unsliced_reference() -> None:
    # Stage 0 splits the matrices between the data-parallel ranks first, ZeRO stages gather
    # them from their shards first: each then goes through the tensor-parallel exchange.
    _check(run_ranks(_train_rank, 4, 2, [(0, {}), (2, {}), (3, {"offload_optimizer": {"device": "cpu"}})],
                     timeout=300))  # fmt: skip


def _reshard_rank(folder: str) -> dict:
    """A step at tp=2 ZeRO-2 with host offload, the next from its checkpoint at tp=1 x dp=2
    stage 0, the last from that one at tp=2 ZeRO-3: momenta and Adam's moments carried by
    value across the slicings, the unsliced reference's trajectory throughout."""
    import terascale
    from terascale.parallel import Topology

    ids, labels = make_batches(STEPS, MICRO)
    layouts = [(2, {"stage": 2, "offload_optimizer": {"device": "cpu"}}), (1, {"stage": 0}), (2, {"stage": 3})]
    for step, (tp, zero) in enumerate(layouts):
        topo = Topology(tp=tp)
        dp, dp_rank = topo.size("dp"), topo.rank("dp")
        micro = MICRO // dp
        config = muon_config(MICRO, micro, zero.pop("stage"), zero, sub_group_size=40)
        torch.manual_seed(1234 if step else 0)  # resumed: loading must overwrite every weight
        engine, *_ = terascale.initialize(model=TPNet(topo.group("tp") if tp > 1 else None), config=config,
                                          mpu=topo.mpu())  # fmt: skip
        if step:
            engine.load_checkpoint(folder)
        rows = slice(dp_rank * micro, (dp_rank + 1) * micro)
        engine.backward(engine(ids[step, rows], labels[step, rows]))
        engine.step()
        engine.save_checkpoint(folder)
        state = engine.full_state_dict()
        engine.destroy()
    return {"state": state, "ref_state": _reference(1, ids, labels)[1]}


def test_muon_state_reshards_across_tensor_parallel_layouts(tmp_path) -> None:
    for rank, r in enumerate(run_ranks(_reshard_rank, 2, str(tmp_path / "ckpt"), timeout=300)):
        for name, ref in r["ref_state"].items():
            torch.testing.assert_close(r["state"][name], ref, rtol=1e-5, atol=2e-6, msg=f"rank {rank}: {name}")


def _gpt2():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _autotp_rank() -> dict:
    import terascale

    ids = torch.randint(0, 64, (STEPS, 2, 12), generator=torch.Generator().manual_seed(5))
    config = {"train_batch_size": 2, "tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "Muon", "params": {"lr": LR, "adam_lr": ADAM_LR, "weight_decay": WD,
                                                        "momentum": MOMENTUM, "eps": 1e-4}}}  # fmt: skip
    engine, *_ = terascale.initialize(model=_gpt2(), config=config)
    losses = []
    for step in range(STEPS):
        loss = engine(input_ids=ids[step], labels=ids[step]).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.full_state_dict()
    engine.destroy()
    ref = _gpt2()
    # GPT-2's tables are wte/wpe and its head is tied to wte: AdamW's by terascale's rule
    # (every nn.Embedding), so the reference names them as its own rule reads them.
    renamed = torch.nn.ModuleDict({"embed": torch.nn.ModuleList([ref.transformer.wte, ref.transformer.wpe]),
                                   "body": ref})  # fmt: skip
    # Adam's eps well above fp32 noise: the key bias's gradient is zero but for rounding,
    # which differs between sliced and unsliced products, and Adam's first steps are its sign.
    optimizer = ReferenceMuon(renamed, LR, ADAM_LR, WD, MOMENTUM, eps=1e-4)
    ref_losses = []
    for step in range(STEPS):
        ref.zero_grad()
        loss = ref(input_ids=ids[step], labels=ids[step]).loss
        loss.backward()
        optimizer.step()
        ref_losses.append(loss.item())
    return {"losses": losses, "ref_losses": ref_losses, "state": state, "ref_state": ref.state_dict()}


def test_muon_under_autotp_joins_gpt2s_fused_qkv_before_orthogonalizing() -> None:
    for rank, r in enumerate(run_ranks(_autotp_rank, 2, timeout=300)):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=1e-5, atol=1e-6)
        for name, ref in r["ref_state"].items():
            torch.testing.assert_close(r["state"][name], ref, rtol=1e-4, atol=1e-5, msg=f"rank {rank}: {name}")
