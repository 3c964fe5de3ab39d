"""Unit tests for terascale.config: loading, DeepSpeed compatibility, errors, batch triplet."""

from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path

import pytest
import torch

from terascale.config import BatchSizes, Config, ConfigError, add_config_arguments

# A DeepSpeed BERT pre-training config (bing_bert style): Lamb, dynamic fp16, clipping.
BERT_CONFIG = {
    "train_batch_size": 4096,
    "train_micro_batch_size_per_gpu": 64,
    "steps_per_print": 1000,
    "prescale_gradients": True,
    "gradient_predivide_factor": 2.0,
    "optimizer": {
        "type": "Lamb",
        "params": {"lr": 11e-3, "weight_decay": 0.01, "bias_correction": False,
                   "max_coeff": 0.3, "min_coeff": 0.01},
    },
    "gradient_clipping": 1.0,
    "wall_clock_breakdown": False,
    "fp16": {"enabled": True, "loss_scale": 0},
}

# A Megatron GPT-2 DeepSpeed config: Adam, fp16 with window/hysteresis, ZeRO stage 0.
GPT2_CONFIG = {
    "train_batch_size": 512,
    "gradient_accumulation_steps": 4,
    "steps_per_print": 1,
    "zero_optimization": {
        "stage": 0, "allgather_partitions": True, "reduce_scatter": True,
        "allgather_bucket_size": 5e8, "reduce_bucket_size": 5e8, "overlap_comm": False,
        "contiguous_gradients": True,
    },
    "optimizer": {
        "type": "Adam",
        "params": {"lr": 0.00015, "max_grad_norm": 1.0, "betas": [0.9, 0.95]},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.00015, "warmup_num_steps": 100},
    },
    "gradient_clipping": 1.0,
    "fp16": {
        "enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2,
        "min_loss_scale": 1, "initial_scale_power": 12,
    },
    "wall_clock_breakdown": True,
    "zero_allow_untested_optimizer": False,
    "activation_checkpointing": {
        "partition_activations": False, "contiguous_memory_optimization": False,
        "cpu_checkpointing": False, "number_checkpoints": 4,
    },
    "tensorboard": {"enabled": True, "output_path": "runs/", "job_name": "gpt2"},
}


def _problems(source: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        Config.load(source)  # type: ignore[arg-type]
    return info.value.problems


# ---- loading -----------------------------------------------------------------------


def test_load_from_path_dict_json_string_and_config(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(BERT_CONFIG))
    from_str_path = Config.load(str(path))
    from_path = Config.load(path)
    from_dict = Config.load(BERT_CONFIG)
    from_json = Config.load(json.dumps(BERT_CONFIG))
    from_b64 = Config.load(base64.urlsafe_b64encode(json.dumps(BERT_CONFIG).encode()).decode())
    assert from_str_path == from_path == from_dict == from_json == from_b64
    assert Config.load(from_dict) is from_dict
    assert from_dict.train_batch_size == 4096


def test_load_source_errors(tmp_path: Path) -> None:
    assert "does not exist" in _problems(str(tmp_path / "missing.json"))[0]
    assert "does not exist" in _problems(tmp_path / "missing.json")[0]
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8, "fp16": {"enabled": }}')
    with pytest.raises(ConfigError, match=r"bad\.json.*not valid JSON: .* line 1 column .*nor hjson"):
        Config.load(bad)
    # What DeepSpeed's hjson reader accepts loads too: comments and trailing commas.
    commented = tmp_path / "commented.json"
    commented.write_text('{\n  // the global batch\n  "train_batch_size": 8, # per step\n  "fp16": {"enabled": true,},\n}\n')
    assert Config.load(commented) == Config.load({"train_batch_size": 8, "fp16": {"enabled": True}})
    assert _problems('{"fp16": {"enabled": true}, "fp16": {},}') == [
        "fp16: given twice in the same JSON object; keep one"
    ]
    assert _problems('{"fp16": {"enabled": true}, "fp16": {}}') == [
        "fp16: given twice in the same JSON object; keep one"
    ]
    lst = tmp_path / "list.json"
    lst.write_text("[1, 2]")
    assert "top level must be a JSON object" in _problems(lst)[0]
    assert "expected a path" in _problems(42)[0]


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_sise": 8}))
    with pytest.raises(ConfigError) as info:
        Config.load(path)
    assert str(path) in str(info.value)


def test_bert_config_loads_and_is_built() -> None:
    cfg = Config.load(BERT_CONFIG)
    assert cfg.optimizer is not None and cfg.optimizer.type == "Lamb"
    assert cfg.optimizer.params["max_coeff"] == 0.3
    assert cfg.fp16.enabled and cfg.fp16.dynamic_loss_scale
    assert cfg.fp16.initial_dynamic_scale == 2.0**16
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print == 1000
    assert cfg.prescale_gradients and cfg.gradient_predivide_factor == 2.0
    assert cfg.compute_dtype == torch.float16
    assert cfg.require_built() is cfg
    assert cfg.resolve_batch(8) == BatchSizes(4096, 64, 8)


def test_gpt2_config_loads_and_is_built() -> None:
    cfg = Config.load(GPT2_CONFIG)
    assert cfg.zero_optimization.stage == 0
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000  # 5e8 from JSON float
    assert isinstance(cfg.zero_optimization.reduce_bucket_size, int)
    assert cfg.fp16.loss_scale_window == 1000 and cfg.fp16.hysteresis == 2
    assert cfg.fp16.initial_scale_power == 12
    assert cfg.scheduler is not None and cfg.scheduler.params["warmup_num_steps"] == 100
    assert cfg.activation_checkpointing.number_checkpoints == 4
    assert cfg.tensorboard.enabled and cfg.tensorboard.job_name == "gpt2"
    cfg.require_built()
    assert cfg.resolve_batch(2) == BatchSizes(512, 64, 4)


def test_to_dict_round_trips() -> None:
    cfg = Config.load(
        {
            **GPT2_CONFIG,
            "checkpoint": {"async": False, "keep_last_n": 3},
            "zero_optimization": {"stage3_max_live_parameters": 7},
            "aio": {"intra_op_parallelism": 2},
        }
    )
    dumped = cfg.to_dict()
    assert dumped["checkpoint"]["async"] is False
    assert dumped["zero_optimization"]["stage3_max_live_parameters"] == 7
    assert Config.load(json.dumps(dumped)) == cfg


# ---- defaults and aliases ------------------------------------------------------------

def _in(section: str, **defaults: object) -> dict[str, object]:
    return {f"{section}.{key}": value for key, value in defaults.items()}


# Written out from DeepSpeed's runtime/constants.py, precision_config.py, zero/config.py,
# zero/offload_config.py and aio constants: the oracle for "defaults equal DeepSpeed's".
DEEPSPEED_DEFAULTS: dict[str, object] = {
    "gradient_clipping": 0.0, "steps_per_print": 10, "wall_clock_breakdown": False,
    "prescale_gradients": False, "gradient_predivide_factor": 1.0, "sparse_gradients": False,
    "zero_allow_untested_optimizer": False, "communication_data_type": None,
    **_in("fp16", enabled=False, loss_scale=0, initial_scale_power=16, loss_scale_window=1000,
          hysteresis=2, consecutive_hysteresis=False, min_loss_scale=1, auto_cast=False),
    **_in("bf16", enabled=False),
    **_in("zero_optimization", stage=0, contiguous_gradients=True, reduce_scatter=True,
          reduce_bucket_size=500_000_000, allgather_partitions=True,
          allgather_bucket_size=500_000_000, overlap_comm=False, load_from_fp32_weights=True,
          elastic_checkpoint=False, offload_param=None, offload_optimizer=None,
          sub_group_size=1_000_000_000, prefetch_bucket_size=50_000_000,
          param_persistence_threshold=100_000, model_persistence_threshold=sys.maxsize,
          max_live_parameters=1_000_000_000, max_reuse_distance=1_000_000_000,
          gather_16bit_weights_on_model_save=False, ignore_unused_parameters=True,
          round_robin_gradients=False, zero_hpz_partition_size=1, zero_quantized_weights=False,
          zero_quantized_gradients=False, mics_shard_size=-1, cpu_offload=None),
    # aio.block_size and queue_depth differ on purpose: terascale's defaults are measured, see below.
    **_in("aio", thread_count=1, single_submit=False, overlap_events=True, use_gds=False),
    **_in("activation_checkpointing", partition_activations=False,
          contiguous_memory_optimization=False, cpu_checkpointing=False,
          number_checkpoints=None, synchronize_checkpoint_boundary=False, profile=False),
    **_in("flops_profiler", enabled=False, profile_step=1, module_depth=-1, top_modules=1,
          detailed=True, output_file=None),
    **_in("tensorboard", enabled=False, output_path="", job_name="DeepSpeedJobName"),
    **_in("csv_monitor", enabled=False, output_path="", job_name="DeepSpeedJobName"),
    **_in("wandb", enabled=False, project="deepspeed", team=None, group=None),
    **_in("checkpoint", tag_validation="WARN", load_universal=False,
          use_node_local_storage=False, keep_last_n=None, async_save=False),
    "checkpoint.parallel_write.pipeline_stage": False,
    "data_types.grad_accum_dtype": None,
}


def _get(obj: object, path: str) -> object:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def test_defaults_equal_deepspeed() -> None:
    cfg = Config.load({})
    wrong = {k: (_get(cfg, k), v) for k, v in DEEPSPEED_DEFAULTS.items() if _get(cfg, k) != v}
    assert wrong == {}
    # DeepSpeed's 1 MiB x 8 moved less than 16 MiB x 16 on huge-page buffers (bench/aio.py,
    # RESULTS.md "NVMe tier (issue 18)"); explicit values are kept.
    assert (cfg.aio.block_size, cfg.aio.queue_depth) == (16 << 20, 16)
    assert Config.load({"aio": {"block_size": 1_048_576}}).aio.block_size == 1_048_576
    assert cfg.compute_dtype == torch.float32
    assert cfg.grad_accum_dtype == torch.float32
    assert cfg.communication_dtype is None


def test_offload_defaults_equal_deepspeed() -> None:
    zero = Config.load(
        {"zero_optimization": {"offload_param": {}, "offload_optimizer": {}}}
    ).zero_optimization
    assert zero.offload_param is not None and zero.offload_optimizer is not None
    param, optim = zero.offload_param, zero.offload_optimizer
    assert (param.device, param.nvme_path, param.pin_memory) == ("none", None, False)
    assert (param.buffer_count, param.buffer_size, param.max_in_cpu) == (5, 10**8, 10**9)
    assert (optim.device, optim.nvme_path, optim.pin_memory, optim.buffer_count) == (
        "none", None, False, 4)
    assert (optim.fast_init, optim.ratio, optim.pipeline_read, optim.pipeline_write) == (
        False, 1.0, False, False)
    assert optim.pipeline is False


def test_overlap_comm_default_follows_stage() -> None:
    # DeepSpeed turns overlap_comm on by default for stage 3 only.
    assert Config.load({"zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm
    assert not Config.load({"zero_optimization": {"stage": 2}}).zero_optimization.overlap_comm
    explicit = {"zero_optimization": {"stage": 3, "overlap_comm": False}}
    assert not Config.load(explicit).zero_optimization.overlap_comm


def test_aliases() -> None:
    cfg = Config.load(
        {
            "bfloat16": {"enabled": True},
            "aio": {"intra_op_parallelism": 4},
            "zero_optimization": {
                "stage3_gather_fp16_weights_on_model_save": True,
                "stage3_max_live_parameters": 123,
                "stage3_prefetch_bucket_size": 456,
            },
            "checkpoint": {"async": True},
            "seq_parallel_comm_data_type": "bf16",
        }
    )
    assert cfg.bf16.enabled and cfg.compute_dtype == torch.bfloat16
    assert cfg.aio.thread_count == 4
    assert cfg.zero_optimization.gather_16bit_weights_on_model_save is True
    assert cfg.zero_optimization.max_live_parameters == 123
    assert cfg.zero_optimization.prefetch_bucket_size == 456
    assert cfg.checkpoint.async_save is True
    assert cfg.seq_parallel_communication_data_type == "bf16"
    # Field names load too, as with DeepSpeed's populate_by_name models.
    by_name = Config.load(
        {
            "aio": {"thread_count": 2},
            "zero_optimization": {
                "max_live_parameters": 9,
                "stage3_gather_16bit_weights_on_model_save": True,
            },
        }
    )
    assert by_name.aio.thread_count == 2 and by_name.zero_optimization.max_live_parameters == 9
    assert by_name.zero_optimization.gather_16bit_weights_on_model_save


def test_alias_given_twice_is_an_error() -> None:
    problems = _problems({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}})
    assert problems == ["bfloat16: duplicate of 'bf16' (same setting); keep one"]


def test_deprecated_cpu_offload_booleans_map_to_offload_sections() -> None:
    zero = Config.load(
        {
            "zero_optimization": {
                "stage": 3,
                "cpu_offload": True,
                "cpu_offload_param": True,
                "cpu_offload_use_pin_memory": True,
            }
        }
    ).zero_optimization
    assert zero.offload_optimizer is not None and zero.offload_optimizer.device == "cpu"
    assert zero.offload_param is not None and zero.offload_param.device == "cpu"
    assert zero.offload_optimizer.pin_memory and zero.offload_param.pin_memory


def test_legacy_boolean_zero_optimization() -> None:
    assert Config.load({"zero_optimization": True}).zero_optimization.stage == 1
    assert Config.load({"zero_optimization": False}).zero_optimization.stage == 0


def test_other_deepspeed_top_level_keys_are_accepted() -> None:
    cfg = Config.load(
        {
            "memory_breakdown": True,
            "dump_state": False,
            "elasticity": {"enabled": False, "max_train_batch_size": 100},
            "comms_logger": {"enabled": False, "verbose": False},
            "timers": {"throughput": {"enabled": True, "synchronized": True}},
            "amp": {"enabled": False, "opt_level": "O1"},
            "autotuning": {"enabled": False},
            "pipeline": {"stages": "auto", "partition": "best"},
            "compression_training": {"sparse_pruning": {"shared_parameters": {"enabled": False}}},
            "data_efficiency": {"enabled": False},
            "curriculum_learning": {"enabled": False},
            "flops_profiler": {"enabled": False, "profile_step": 2},
            "csv_monitor": {"enabled": True, "output_path": "logs/"},
            "wandb": {"enabled": True, "project": "p"},
            "checkpoint": {"tag_validation": "Fail", "keep_last_n": 2},
            "sparse_gradients": False,
            "vocabulary_size": 50304,
            "dataloader_drop_last": True,
            "zero_force_ds_cpu_optimizer": False,
        }
    )
    assert cfg.checkpoint.tag_validation == "FAIL"
    assert not cfg.elasticity.enabled and cfg.elasticity.max_train_batch_size == 100
    cfg.require_built()


@pytest.mark.parametrize(
    ("spelling", "dtype"),
    [
        ("fp32", torch.float32),
        ("float32", torch.float32),
        ("FP16", torch.float16),
        ("half", torch.float16),
        ("torch.float16", torch.float16),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
    ],
)
def test_dtype_spellings(spelling: str, dtype: torch.dtype) -> None:
    cfg = Config.load(
        {"communication_data_type": spelling, "data_types": {"grad_accum_dtype": spelling}}
    )
    assert cfg.communication_dtype == dtype
    assert cfg.grad_accum_dtype == dtype


def test_fp16_and_bf16_both_enabled_is_an_error() -> None:
    expected = "fp16.enabled and bf16.enabled are both true; enable at most one of them"
    assert _problems({"fp16": {"enabled": True}, "bf16": {"enabled": True}}) == [expected]
    assert _problems({"fp16": {"enabled": True}, "bfloat16": {"enabled": True}}) == [expected]
    # Still reported next to field errors that stop pydantic's whole-model checks.
    both = _problems({"fp16": {"enabled": True}, "bf16": {"enabled": True}, "gradient_clip": 1})
    assert expected in both and len(both) == 2


# ---- error messages ------------------------------------------------------------------


def test_top_level_typo_suggests_nearest_key() -> None:
    assert _problems({"train_batch_sise": 8}) == [
        "train_batch_sise: unknown key; did you mean 'train_batch_size'?"
    ]
    with pytest.raises(ConfigError) as info:
        Config.load({"gradient_cliping": 1.0})
    assert str(info.value) == (
        "invalid terascale config: gradient_cliping: unknown key; "
        "did you mean 'gradient_clipping'?"
    )
    assert isinstance(info.value, ValueError)


def test_nested_typo_suggests_key_at_same_depth() -> None:
    assert _problems({"zero_optimization": {"stage3_max_live_params": 1}}) == [
        "zero_optimization.stage3_max_live_params: unknown key; "
        "did you mean 'stage3_max_live_parameters'?"
    ]
    assert _problems({"zero_optimization": {"offload_optimizer": {"pin_memroy": True}}}) == [
        "zero_optimization.offload_optimizer.pin_memroy: unknown key; did you mean 'pin_memory'?"
    ]
    assert _problems({"fp16": {"initial_scale_pow": 12}}) == [
        "fp16.initial_scale_pow: unknown key; did you mean 'initial_scale_power'?"
    ]


def test_unknown_key_without_close_match_lists_valid_keys() -> None:
    (problem,) = _problems({"wandb": {"zzz": 1}})
    assert problem.startswith("wandb.zzz: unknown key; valid keys here: ")
    assert "project" in problem and "team" in problem


def test_wrong_type_names_full_path() -> None:
    assert _problems({"zero_optimization": {"stage": "three"}}) == [
        "zero_optimization.stage: expected an integer, got 'three'"
    ]
    assert _problems({"fp16": {"enabled": "maybe"}}) == [
        "fp16.enabled: expected a boolean (true or false), got 'maybe'"
    ]
    assert _problems({"zero_optimization": {"offload_param": 3}}) == [
        "zero_optimization.offload_param: expected an object, got 3"
    ]
    assert _problems({"optimizer": {"params": {}}}) == ["optimizer.type: required key is missing"]


def test_fixed_choices_are_listed() -> None:
    assert _problems({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}) == [
        "zero_optimization.offload_optimizer.device: "
        "expected one of 'none', 'cpu' or 'nvme', got 'gpu'"
    ]
    assert _problems({"zero_optimization": {"stage": 4}}) == [
        "zero_optimization.stage: expected one of 0, 1, 2, 3, got 4"
    ]
    (problem,) = _problems({"communication_data_type": "int8"})
    assert problem.startswith("communication_data_type: expected one of 'fp32', 'fp16', 'bf16'")
    assert problem.endswith("got 'int8'")


def test_value_checks() -> None:
    assert _problems({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}) == [
        "zero_optimization.offload_param: nvme_path is required when device is 'nvme'; "
        "set it to a directory"
    ]
    (ratio,) = _problems({"zero_optimization": {"offload_optimizer": {"ratio": 0.5}}})
    assert "needs stage 3" in ratio
    assert _problems({"gradient_clipping": -1}) == [
        "gradient_clipping: expected a value >= 0.0, got -1"
    ]
    assert _problems({"train_batch_size": ["auto"]}) == [
        "train_batch_size: expected an integer, got a list"
    ]


def test_all_problems_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        Config.load(
            {
                "trian_batch_size": 8,
                "fp16": {"enabled": "yes please", "los_scale": 0},
                "zero_optimization": {"stage": "three", "offload_param": {"device": "disk"}},
                "train_micro_batch_size_per_gpu": 0,
            }
        )
    problems = info.value.problems
    assert len(problems) == 6
    message = str(info.value)
    assert message.startswith("invalid terascale config, 6 problems:\n")
    for fragment in (
        "trian_batch_size: unknown key; did you mean 'train_batch_size'?",
        "fp16.enabled: expected a boolean",
        "fp16.los_scale: unknown key; did you mean 'loss_scale'?",
        "zero_optimization.stage: expected an integer, got 'three'",
        "zero_optimization.offload_param.device: expected one of 'none', 'cpu' or 'nvme'",
        "train_micro_batch_size_per_gpu: expected a value > 0, got 0",
    ):
        assert fragment in message


# ---- batch triplet -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "world", "expected"),
    [
        ((32, 4, 2), 4, (32, 4, 2)),
        ((32, 4, None), 2, (32, 4, 4)),
        ((32, None, 4), 2, (32, 4, 4)),
        ((None, 3, 5), 2, (30, 3, 5)),
        ((24, None, None), 3, (24, 8, 1)),
        ((None, 6, None), 4, (24, 6, 1)),
        ((7, None, None), 1, (7, 7, 1)),
    ],
)
def test_batch_derivation(given: tuple, world: int, expected: tuple[int, int, int]) -> None:
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    got = Config.load({k: v for k, v in zip(keys, given) if v is not None}).resolve_batch(world)
    assert (got.train_batch_size, got.micro_batch_size, got.gradient_accumulation_steps) == expected
    # The invariant DeepSpeed asserts, checked independently of the derivation.
    assert got.train_batch_size == got.micro_batch_size * got.gradient_accumulation_steps * world


def _batch_error(given: dict[str, int], world: int) -> str:
    with pytest.raises(ConfigError) as info:
        Config.load(given).resolve_batch(world)
    (problem,) = info.value.problems
    return problem


def test_batch_inconsistencies_show_the_arithmetic() -> None:
    three = {
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
    }
    assert _batch_error(three, 2) == (
        "train_batch_size 32 != train_micro_batch_size_per_gpu 4 × gradient_accumulation_steps 2"
        " × data-parallel world size 2 = 16"
    )
    assert _batch_error({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2) == (
        "train_batch_size 30 is not divisible by train_micro_batch_size_per_gpu 4 × data-parallel"
        " world size 2 = 8, so gradient_accumulation_steps would not be a whole number"
    )
    # Fewer samples than one micro-batch per rank: would floor to 0 steps in DeepSpeed.
    assert "is not divisible by" in _batch_error(
        {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4}, 2
    )
    assert _batch_error({"train_batch_size": 30, "gradient_accumulation_steps": 4}, 2) == (
        "train_batch_size 30 is not divisible by gradient_accumulation_steps 4 × data-parallel"
        " world size 2 = 8, so train_micro_batch_size_per_gpu would not be a whole number"
    )
    assert _batch_error({"train_batch_size": 10}, 4) == (
        "train_batch_size 10 is not divisible by gradient_accumulation_steps 1 × data-parallel"
        " world size 4 = 4, so train_micro_batch_size_per_gpu would not be a whole number"
    )
    assert _batch_error({}, 1) == (
        "set train_batch_size or train_micro_batch_size_per_gpu (or both)"
    )
    assert _batch_error({"gradient_accumulation_steps": 4}, 1) == (
        "set train_batch_size or train_micro_batch_size_per_gpu (or both)"
        " (only gradient_accumulation_steps 4 is set)"
    )
    assert _batch_error({"train_batch_size": 8}, 0) == (
        "data-parallel world size must be a positive integer, got 0"
    )


def test_non_positive_batch_values_are_errors() -> None:
    assert _problems({"train_batch_size": 0}) == ["train_batch_size: expected a value > 0, got 0"]
    assert _problems({"gradient_accumulation_steps": -2}) == [
        "gradient_accumulation_steps: expected a value > 0, got -2"
    ]
    from terascale.config.batch import resolve_batch_sizes

    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu: expected a positive"):
        resolve_batch_sizes(8, -1, None, 1)


# ---- features not built yet ----------------------------------------------------------


def _unbuilt(config: dict) -> list[str]:
    cfg = Config.load(config)
    with pytest.raises(ConfigError) as info:
        cfg.require_built()
    assert info.value.problems == cfg.unbuilt_settings()
    return info.value.problems


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_zero_stage_is_built(stage: int) -> None:
    Config.load({"zero_optimization": {"stage": stage}}).require_built()


def test_offload_settings_are_built() -> None:
    offload = {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"},
    }
    Config.load({"zero_optimization": offload}).require_built()
    Config.load({"zero_optimization": {"stage": 2, "cpu_offload": True}}).require_built()


def test_require_built_lists_everything_at_once() -> None:
    problems = _unbuilt(
        {
            "zero_optimization": {"stage": 3, "zero_quantized_gradients": True,  # built
                                  "zero_quantized_nontrainable_weights": True},
            "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True},
            "flops_profiler": {"enabled": True},  # built
            "comms_logger": {"enabled": True},  # built
            "elasticity": {"enabled": True, "max_train_batch_size": 64, "micro_batch_sizes": [2, 4]},  # built
            "compression_training": {"sparse_pruning": {"shared_parameters": {"enabled": True}}},
            "sparse_gradients": True,
            "checkpoint": {"async": True, "use_node_local_storage": True},
        }
    )
    settings = [p.split(": ", 1)[0] for p in problems]
    assert settings == [
        "zero_optimization.zero_quantized_nontrainable_weights=true",
        "checkpoint.use_node_local_storage=true",
        "compression_training.sparse_pruning.shared_parameters.enabled=true",
    ]
    assert all(p.endswith("is not built yet in this version of terascale") for p in problems)


def test_stage0_config_with_inert_sections_is_built() -> None:
    Config.load(
        {
            **GPT2_CONFIG,
            "aio": {"block_size": 262144, "queue_depth": 32},  # aio alone is harmless
            "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "none"}},
            "pipeline": {"activation_checkpoint_interval": 0},
            "memory_breakdown": True,
        }
    ).require_built()


# ---- argparse helper -----------------------------------------------------------------


def test_add_config_arguments() -> None:
    parser = argparse.ArgumentParser()
    assert add_config_arguments(parser) is parser
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.config == args.deepspeed_config == "ds.json" and args.deepspeed and args.terascale
    args = parser.parse_args(["--terascale", "--config", "ts.json"])
    assert args.config == args.deepspeed_config == "ts.json" and args.deepspeed and args.terascale
    args = parser.parse_args([])
    assert args.config is None and args.deepspeed_config is None
    assert not args.deepspeed and not args.terascale


def test_dynamic_loss_scaling_settings_are_checked_where_it_runs() -> None:
    """loss_scale_window and min_loss_scale must be positive numbers under dynamic loss
    scaling only; with a static scale or fp16 off they are unused and any value loads."""
    for fp16 in ({"enabled": True, "loss_scale": 128, "min_loss_scale": 0}, {"enabled": False, "loss_scale_window": -1}):
        Config.load({"fp16": fp16})
    with pytest.raises(ConfigError, match="min_loss_scale must be positive with dynamic loss scaling"):
        Config.load({"fp16": {"enabled": True, "min_loss_scale": 0}})
    with pytest.raises(ConfigError, match="loss_scale_window"):
        Config.load({"fp16": {"enabled": True, "loss_scale_window": True}})  # a bool is no number
