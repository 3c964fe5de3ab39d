"""Hugging Face MoE models with their experts split over ranks at ``initialize``
([Note: Hugging Face experts]), against the unchanged model in one process: losses
(the model's own load-balancing loss included) and every parameter, at ZeRO 0, 2 and 3."""

from __future__ import annotations

import pytest

from distributed import run_ranks

STEPS, SEQ, VOCAB = 3, 8, 64
_DEC = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=32, output_router_logits=True)  # fmt: skip
MODELS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_DEC, intermediate_size=32, num_local_experts=4,
                                                             num_experts_per_tok=2, router_aux_loss_coef=0.1)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(_DEC, intermediate_size=32, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                  decoder_sparse_step=1, norm_topk_prob=False, router_aux_loss_coef=0.1)),
    # Shared experts, sigmoid scores with a bias, grouped top-k; no auxiliary loss in this model.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(_DEC, intermediate_size=32, moe_intermediate_size=16,
                    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                    first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=4,
                    v_head_dim=8, num_key_value_heads=4)),
}  # fmt: skip


def _model(name: str):
    import torch
    import transformers

    config_cls, model_cls, kwargs = MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**kwargs)
    return getattr(transformers, model_cls)(config).float()


def _batches(world: int):
    import torch

    g = torch.Generator().manual_seed(3)
    return [[torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(world)] for _ in range(STEPS)]


def _hf_rank(name: str, stage: int, spelling: str, extra: dict | None = None) -> None:
    import torch
    import torch.distributed as dist

    import terascale
    from terascale.comm import init_distributed
    from terascale.moe.hf import ExpertParallelExperts

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    data = _batches(world)
    # Reference: the unchanged model on every rank's batch, loss averaged over ranks.
    ref = _model(name)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.0)
    ref_losses = []
    for batch in data:
        opt.zero_grad()
        losses = [ref(input_ids=ids, labels=ids).loss for ids in batch]
        (sum(losses) / world).backward()
        opt.step()
        ref_losses.append([loss.item() for loss in losses])
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {}),
            **(extra or {}).get("zero_optimization", {})}
    section = {"moe": {"ep_size": 2}} if spelling == "moe" else {"expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": name}}
    config = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6, "weight_decay": 0.0}},
        **{k: v for k, v in (extra or {}).items() if k != "zero_optimization"},
        "zero_optimization": zero, **section,
    }  # fmt: skip
    model = _model(name)
    engine, *_ = terascale.initialize(model=model, config=config)
    split = [m for m in engine.module.modules() if isinstance(m, ExpertParallelExperts)]
    assert split and all(m.num_experts == m.global_num_experts // 2 for m in split)
    for step, batch in enumerate(data):
        loss = engine(input_ids=batch[rank], labels=batch[rank]).loss
        torch.testing.assert_close(loss.item(), ref_losses[step][rank], rtol=2e-5, atol=1e-6)
        engine.backward(loss)
        engine.step()
    got = engine.full_state_dict()  # every expert, under the model's own names and shapes
    want = ref.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=2e-6, msg=lambda m, k=k: f"{k}: {m}")


# ZeRO-3 with split experts runs in the composition test below (with offload and recompute).
@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)])
def test_mixtral_experts_split_over_two_ranks_match_one_process(stage):
    run_ranks(_hf_rank, 2, "mixtral", stage, "moe", timeout=300)


@pytest.mark.parametrize("name", ["qwen2_moe", "deepseek_v3"])
def test_shared_expert_models_match_one_process(name):
    run_ranks(_hf_rank, 2, name, 2, "expert_parallel", timeout=300)


def test_experts_compose_with_offload_and_activation_checkpointing(tmp_path):
    # ZeRO-3 with parameters and optimizer state on the host and every decoder layer
    # recomputed in backward (its all-to-alls too); then ZeRO-2 with the optimizer on NVMe.
    host = {"zero_optimization": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
            "activation_checkpointing": {"policy": "blocks"}}  # fmt: skip
    run_ranks(_hf_rank, 2, "mixtral", 3, "moe", host, timeout=300)
    nvme = {"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    run_ranks(_hf_rank, 2, "mixtral", 2, "moe", nvme, timeout=300)


def _refused_rank(cases: list[str]) -> dict[str, str]:
    return {case: _refused(case) for case in cases}  # every rank refuses at the same point: in step for the next


def _refused(case: str) -> str:
    import terascale

    model = _model("mixtral")
    ep = {"mismatch": {"enabled": True, "autoep_size": 2, "preset_model": "qwen3_moe"}, "odd": {"autoep_size": 3}}
    if case == "dense":
        import transformers

        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in MODELS["mixtral"][2].items()
                                                                         if k not in ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits")}))  # fmt: skip
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "expert_parallel": ep.get(case, {"autoep_size": 2})}  # fmt: skip
    try:
        terascale.initialize(model=model, config=config)
    except ValueError as e:
        return str(e)
    return "no error"


def test_expert_parallel_config_that_cannot_apply_is_refused():
    out = run_ranks(_refused_rank, 2, ["mismatch", "dense", "odd"])[0]
    assert "preset_model is 'qwen3_moe' but the model is a 'mixtral' model" in out["mismatch"]
    assert "no Hugging Face fused-experts module" in out["dense"]
    assert "ep_size 3 does not divide the data-parallel world of 2 ranks" in out["odd"]


def _hf_checkpoint_rank(ep_size: int, save_dir: str, load: bool) -> dict:
    import torch.distributed as dist

    import terascale
    from terascale.comm import init_distributed

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 2}, "moe": {"ep_size": ep_size}}  # fmt: skip
    engine, *_ = terascale.initialize(model=_model("mixtral"), config=config)
    data = _batches(world)
    if load:
        engine.load_checkpoint(save_dir)
    else:
        for batch in data[:2]:
            engine.backward(engine(input_ids=batch[rank], labels=batch[rank]).loss)
            engine.step()
        engine.save_checkpoint(save_dir)
    state = engine.full_state_dict()
    loss = engine(input_ids=data[2][rank], labels=data[2][rank]).loss
    engine.backward(loss)
    engine.step()
    return {"state": state, "next": engine.full_state_dict(), "loss": loss.item()}


def test_fused_experts_checkpoint_loads_without_expert_parallelism(tmp_path):
    import torch

    saved = run_ranks(_hf_checkpoint_rank, 2, 2, str(tmp_path), False)
    loaded = run_ranks(_hf_checkpoint_rank, 2, 1, str(tmp_path), True)
    for a, b in zip(saved, loaded):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-5)
        for key in ("state", "next"):  # the saved model, and one more step from its optimizer state
            for k, v in a[key].items():
                torch.testing.assert_close(b[key][k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def _save_pretrained_rank(out: str) -> dict:
    import torch.distributed as dist

    import terascale
    from terascale.comm import init_distributed

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "moe": {"ep_size": 2}}  # fmt: skip
    engine, *_ = terascale.initialize(model=_model("mixtral"), config=config)
    batch = _batches(world)[0]
    engine.backward(engine(input_ids=batch[rank], labels=batch[rank]).loss)
    engine.step()
    engine.save_pretrained(out)
    return engine.full_state_dict()


def test_save_pretrained_writes_the_whole_model_that_from_pretrained_loads(tmp_path):
    import torch
    import transformers

    state = run_ranks(_save_pretrained_rank, 2, str(tmp_path))[0]
    loaded = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32)
    got = loaded.state_dict()
    assert loaded.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4  # every expert, unsplit
    for k, v in state.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
