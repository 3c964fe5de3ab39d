"""Every config in tests/configs (the shapes other projects publish for DeepSpeed) trains, or
is refused with an error that names the feature terascale does not build.

The corpus (tests/configs/SOURCES.md says what each file is modelled on) covers the keys,
value types and spellings found in published configs: "auto" everywhere an integration
fills it, legacy keys, comments and trailing commas, numbers written as strings, and
sections of features terascale does not build. Each runs as published on 2 ranks (gloo)
with a tiny model for two optimizer steps; see tests/corpus.py for the harness.
"""

from __future__ import annotations

import importlib.util
import json
import os

from corpus import CONFIGS, train_corpus_rank
from distributed import run_ranks

# What each file must do: None = train two steps; a string = be refused with an error
# containing it (the unbuilt feature it names).
EXPECTED: dict[str, str | None] = {
    "accelerate_launch_auto_stage_device.json": None,
    "accelerate_readme_zero2_string_true.json": None,
    "accelerate_sp_alst_seq_parallel.json": None,
    "accelerate_zero3_gather_auto.json": None,
    "alpaca_offload_opt_param.json": None,
    "axolotl_zero1_torch_compile.json": None,
    "axolotl_zero3_bf16_cpuoffload_all.json": None,
    "bigscience_hf_zero2_cpu_offload_auto.json": None,
    "bigscience_tr11_bf16_zero0_grad_accum_fp32.json": None,
    "blog_hf_zero2_extra_autos.json": None,
    "blog_zero3_comments_auto.json": None,
    "blog_zero3_quoted_numbers.json": None,
    "dschat_bfloat16_hybrid_engine.json": None,
    "dsdocs_autotuning_micro_auto.json": "autotuning is not built yet",
    "dsdocs_curriculum_gpt2_seqlen.json": "curriculum learning is not built yet",
    "dsdocs_lrrt_lrrangetest.json": None,
    # Monitors, the comms logger and the flops profiler: it trains where tensorboard is installed.
    "dsdocs_monitors_profilers.json": None if importlib.util.find_spec("tensorboard")
    else "the 'tensorboard' package is not installed",
    "dsdocs_warmup_cosine_bf16.json": None,
    "dsdocs_zenflow_auto.json": "ZenFlow's selective updates",
    "dsdocs_zero_infinity_nvme.json": None,
    # hpz 16 on the corpus's 2 ranks: the secondary partition spans both (one "node").
    "dsdocs_zeropp_hpz_quantized.json": None,
    "dsexamples_bert_lamb_sparse_attention.json": "sparse attention is not built yet",
    "dsexamples_bert_onebitlamb_nccl.json": None,
    "dsexamples_bert_pld_predivide.json": "progressive layer drop is not built yet",
    "dsexamples_bert_zerooneadam.json": None,
    "dsexamples_cifar_warmuplr.json": None,
    "dsexamples_imagenet_fp16_z1_cuda_visible.json": None,
    "dsexamples_megatron_fp32_allreduce_zero_false.json": None,
    "dsexamples_megatron_zero2_legacy_fusion.json": None,
    "dsexamples_megatron_zero3_cpu_offload_legacy.json": None,
    # The published misspellings, which DeepSpeed refuses too: named, with the right key.
    "dsexamples_megatron_zero_infinity_2021_typos.json": (
        "zero_optimization.stage3_param_persitance_threshold: unknown key; did you mean "
        "'stage3_param_persistence_threshold'?"
    ),
    "dsexamples_megatron_zero_true_allgather_size.json": None,
    "dsexamples_pipeline_parallel.json": None,  # DeepSpeed's pipeline defaults ask for nothing
    "dsexamples_qanet_onecycle.json": None,
    "dsexamples_squad_onebitadam_mpi.json": None,
    "dsexamples_vit_random_ltd_data_efficiency.json": "data efficiency (curriculum / data routing) is not built yet",
    "dstests_bingbert_eigenvalue_quantize_tensorboard.json": "eigenvalue computation is not built yet",
    "dstests_hybrid_engine_stage0_offload_param.json": None,
    "dstests_megatron_gpt2_disable_allgather.json": None,
    "dstests_torch_compile_bf16_scale_keys.json": "DeepCompile is not built yet",
    "gptneox_ds_section_hjson.json": None,
    "hf_docs_apex_amp_auto.json": None,
    "hf_zero2_bfloat16_auto.json": None,
    "hf_zero3_auto.json": None,
    "internvl_seg_amp_log.json": "Apex AMP is not built yet",
    "internvl_zero3_sci_floats.json": None,
    "lightning_docs_zero2_offload_warmuplr.json": None,
    "llamafactory_z0_round_robin.json": None,
    # autoTP slices Hugging Face models; the corpus trains a toy model, which it names.
    "llamafactory_z2_autotp_comment.json": "auto_tp supports Hugging Face models of type",
    "llamafactory_z3_fp8_monitor_config.json": None,
    "llamafactory_z3_offload.json": None,
    "llava_zero3_offload_sci_sub_group.json": None,
    "lmflow_chatbot_comms_logger.json": None,
    "megatron_gpt_bfp16_bfloat16_flops.json": None,
    "megatron_gpt_stage0_offload_wandb.json": None,
    "megatron_moe_elasticity_curriculum.json": None,
    "megatron_offload_pp_ratio.json": None,
    "openrlhf_zero3_auto_defaults.json": None,
    "slides_bert_lamb_max_grad_norm.json": None,
    "slides_gpt2_adam_zero_true.json": None,
    "trlx_gptj_fp16_extra_keys.json": None,
}


def test_every_file_of_the_corpus_has_an_expectation():
    files = sorted(p.name for p in CONFIGS.glob("*.json"))
    assert files == sorted(EXPECTED), "a config without an expectation (or an expectation without a file)"


def test_the_corpus_trains_or_names_the_unbuilt_feature(tmp_path):
    nvme = tmp_path / "nvme"
    os.mkdir(nvme)
    names = sorted(EXPECTED)
    results = run_ranks(train_corpus_rank, 2, names, str(nvme), timeout=600)
    trained, refused, wrong = [], [], []
    for name in names:
        kind, value = results[0][name]
        want = EXPECTED[name]
        if want is None and kind == "trained":
            losses, steps, _ = value
            assert steps == 2 and results[1][name][0] == "trained", name
            trained.append(name)
        elif want is not None and kind == "refused" and want in value:
            refused.append(name)
        else:
            wrong.append(f"{name}: expected {'training' if want is None else repr(want)}, got {kind}: {str(value)[:400]}")
    assert not wrong, "\n".join(wrong)
    expected_trained = sum(want is None for want in EXPECTED.values())
    assert (len(trained), len(refused)) == (expected_trained, len(EXPECTED) - expected_trained)
    assert not list(nvme.rglob("*.swp")), "swap files left behind"


def test_the_corpus_exercises_what_public_configs_contain():
    """The corpus keeps covering the spellings the harness must survive (guards its edits)."""
    from terascale.config import Config
    from terascale.config.source import read_source

    autos, notes, hjson_only = set(), [], []
    for name in sorted(EXPECTED):
        text = (CONFIGS / name).read_text()
        try:
            json.loads(text)
        except ValueError:
            hjson_only.append(name)
        raw, _ = read_source(CONFIGS / name)
        if "unknown key" not in (EXPECTED[name] or ""):  # all but the misspelled file load
            cfg = Config.load(raw)
            autos.update(cfg.auto_keys)
            notes.extend(cfg.notes)
    assert {"train_micro_batch_size_per_gpu", "gradient_clipping", "optimizer.params.lr", "fp16.enabled",
            "bf16.enabled", "zero_optimization.stage3_prefetch_bucket_size", "scheduler.params.total_num_steps",
            "zero_optimization.stage", "zero_optimization.sub_group_size", "steps_per_print"} <= autos  # fmt: skip
    said = "\n".join(notes)
    for legacy in ("optimizer.params.max_grad_norm", "zero_optimization: true", "fp32_allreduce", "bfloat16",
                   "'bfp16'", "allgather_size", "fp16.type", "cuda_visible_devices", "_comment",
                   "offload_param: device 'cpu' is ignored at stage"):  # fmt: skip
        assert legacy in said, legacy
    assert len(hjson_only) == 2, hjson_only
