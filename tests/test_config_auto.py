"""``"auto"`` values, legacy spellings and DeepSpeed's lax syntax (see ``[Note: auto values]``).

The resolution table: every key the Hugging Face Trainer's DeepSpeed integration fills in,
resolved with and without an integration's values, and the errors for what cannot be
derived. Then legacy keys (the configs of DeepSpeed's own slides), numbers written as
strings, and ``pin_memory`` on a machine without an accelerator.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from distributed import run_ranks
from terascale.config import AutoContext, Config, ConfigError, Given


def _resolve(raw: dict, world: int = 2, model: nn.Module | None = None, given: dict | None = None) -> Config:
    return Config.load(raw).resolve(AutoContext(world_size=world, model=model, given=given or {}))


def _problems(raw: dict, **kw) -> list[str]:
    with pytest.raises(ConfigError) as info:
        _resolve(raw, **kw)
    return info.value.problems


class HasConfig(nn.Module):
    """A model whose config says its hidden size (as Hugging Face models do)."""

    class config:  # noqa: N801 - stands in for a PretrainedConfig
        hidden_size = 48

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(48, 96)


# (config, world, expected resolved values) with no integration: what the run determines.
DERIVED = [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2}, 4,
     {"train_micro_batch_size_per_gpu": 4}),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"}, 2,
     {"train_batch_size": 8, "gradient_accumulation_steps": 1}),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}, 2,
     {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1}),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                   "stage3_prefetch_bucket_size": "auto",
                                                   "stage3_param_persistence_threshold": "auto"}}, 1,
     {"zero_optimization.reduce_bucket_size": 48 * 48, "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * 48 * 48),
      "zero_optimization.stage3_param_persistence_threshold": 480}),
    ({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": "auto", "eps": "auto",
                                                                        "weight_decay": "auto"}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto"}}}, 1,
     {"scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": 1e-3}),
]  # fmt: skip


@pytest.mark.parametrize("raw,world,expected", DERIVED)
def test_auto_values_the_run_determines(raw, world, expected):
    cfg = _resolve(raw, world=world, model=HasConfig())
    assert cfg.auto_keys == ()
    resolved = {r.path: r.value for r in cfg.resolved}
    for path, value in expected.items():
        assert resolved[path] == value, (path, resolved)
    sizes = cfg.resolve_batch(world)
    assert sizes.train_batch_size == sizes.micro_batch_size * sizes.gradient_accumulation_steps * world
    if "optimizer" in raw:  # "auto" optimizer parameters take the optimizer's defaults (absent keys)
        assert cfg.optimizer.params == {"lr": 1e-3}


def test_hidden_size_from_the_largest_square_weight_when_the_model_has_no_config():
    model = nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 8), nn.Linear(8, 8))
    cfg = _resolve({"train_batch_size": 8, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}, model=model)
    assert cfg.zero_optimization.reduce_bucket_size == 64 * 64


# (config, the problem's beginning): what nothing outside an integration can set.
UNDERIVABLE = [
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"},
     'train_batch_size: "auto" cannot be derived: give train_batch_size or train_micro_batch_size_per_gpu'),
    ({"train_batch_size": 8, "gradient_clipping": "auto"},
     'gradient_clipping: "auto" cannot be derived here; give a value (the Hugging Face Trainer integration fills it '
     "from max_grad_norm"),
    ({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": "auto"}}},
     'optimizer.params.lr: "auto" cannot be derived here; give a value (the Hugging Face Trainer integration fills '
     "it from learning_rate)"),
    ({"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}},
     'scheduler.params.total_num_steps: "auto" cannot be derived here'),
    ({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}},
     'scheduler.params.warmup_num_steps: "auto" cannot be derived here'),
    ({"train_batch_size": 8, "fp16": {"enabled": "auto"}}, 'fp16.enabled: "auto" cannot be derived here'),
    ({"train_batch_size": 8, "bf16": {"enabled": "auto"}}, 'bf16.enabled: "auto" cannot be derived here'),
    ({"train_batch_size": 8, "activation_checkpointing": {"number_checkpoints": "auto"}},
     'activation_checkpointing.number_checkpoints: "auto" is not a value terascale can resolve for this key'),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto"}},
     'zero_optimization.stage3_param_persistence_threshold: "auto" is 10·hidden, but the model\'s hidden size is unknown'),
]  # fmt: skip


@pytest.mark.parametrize("raw,problem", UNDERIVABLE)
def test_auto_values_nothing_can_set_are_errors_naming_the_key(raw, problem):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))  # no config, no square weight
    problems = _problems(raw, model=model)
    assert any(p.startswith(problem) for p in problems), problems


def test_an_unresolved_config_loads_with_autos_listed_and_the_engine_refuses_none_left():
    cfg = Config.load({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
                       "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}})  # fmt: skip
    assert cfg.auto_keys == ("train_batch_size", "zero_optimization.reduce_bucket_size")
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000  # read as absent until resolved
    assert Config.load({"train_batch_size": 2}).auto_keys == ()


TRAINER = {
    "train_micro_batch_size_per_gpu": Given(4, "TrainingArguments.per_device_train_batch_size"),
    "gradient_accumulation_steps": Given(2, "TrainingArguments.gradient_accumulation_steps"),
    "train_batch_size": Given(16, "per_device × accumulation × world"),
    "gradient_clipping": Given(1.0, "TrainingArguments.max_grad_norm"),
    "optimizer.params.lr": Given(5e-5, "TrainingArguments.learning_rate"),
    "optimizer.params.betas": Given([0.9, 0.98], "TrainingArguments.adam_beta1/adam_beta2"),
    "fp16.enabled": Given(False, "TrainingArguments.fp16"),
    "bf16.enabled": Given(True, "TrainingArguments.bf16"),
    "scheduler.params.warmup_min_lr": Given(0, "the Trainer", match=False),
    "scheduler.params.total_num_steps": Given(100, "the Trainer's number of steps"),
}


def test_an_integrations_values_fill_autos_and_explicit_values_must_agree():
    raw = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.5, "total_num_steps": "auto"}},
    }  # fmt: skip
    cfg = _resolve(raw, given=TRAINER)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.train_batch_size) == (4, 2, 16)
    assert cfg.gradient_clipping == 1.0 and cfg.bf16.enabled and not cfg.fp16.enabled
    assert cfg.optimizer.params == {"lr": 5e-5, "betas": [0.9, 0.98]}
    # warmup_min_lr is filled only where "auto" (match=False): an explicit 0.5 stays.
    assert cfg.scheduler.params == {"warmup_min_lr": 0.5, "total_num_steps": 100}
    why = {r.path: r.why for r in cfg.resolved}
    assert why["optimizer.params.lr"] == "TrainingArguments.learning_rate"
    # A key the config leaves out stays out (the integration fills only what asks for it).
    cfg = _resolve({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}, given=TRAINER)
    assert cfg.gradient_clipping == 0.0 and cfg.optimizer is None

    problems = _problems({**raw, "train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1}, given=TRAINER)
    assert problems == [
        "train_micro_batch_size_per_gpu: the config says 8 but TrainingArguments.per_device_train_batch_size is 4; "
        'make them agree or write "auto"'
    ]  # 1 == 1.0 agrees


# A published Hugging Face AutoTP config: the batch triplet left to the Trainer.
HF_AUTOTP = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "zero_optimization": {"stage": 1}}  # fmt: skip


@pytest.mark.parametrize("tp,world,replicas", [(4, 4, 1), (2, 4, 2), (1, 4, 4)])
def test_auto_batch_sizes_count_data_parallel_replicas_not_ranks(tp, world, replicas):
    raw = {**HF_AUTOTP, "tensor_parallel": {"autotp_size": tp}}
    dp = Config.load(raw).data_parallel_size(world)
    assert dp == replicas
    given = {"train_micro_batch_size_per_gpu": Given(2, "micro"), "gradient_accumulation_steps": Given(2, "accumulation")}
    cfg = _resolve(raw, world=dp, given=given)
    assert cfg.train_batch_size == 2 * 2 * replicas
    assert cfg.resolve_batch(dp).train_batch_size == cfg.train_batch_size  # what the engine checks agrees
    # Counting ranks instead was the defect: 2 × 2 × 4 = 16 for one replica.
    if replicas < world:
        with pytest.raises(ConfigError, match=f"train_batch_size 16 != .* × data-parallel world size {replicas}"):
            Config.load({**raw, "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                         "gradient_accumulation_steps": 2}).resolve_batch(dp)  # fmt: skip


def test_the_data_parallel_size_divides_out_every_model_parallel_size():
    both = Config.load({"train_batch_size": 8, "tensor_parallel": {"tp_size": 2}, "pipeline": {"stages": 2}})
    assert both.data_parallel_size(8) == 2
    auto_stages = Config.load({"train_batch_size": 8, "tensor_parallel": {"tp": {"tp_size": 2}}})
    assert auto_stages.data_parallel_size(8) == 4 and auto_stages.data_parallel_size(8, pipeline_stages=4) == 1
    with pytest.raises(ConfigError, match="6 ranks do not split into tensor-parallel size 4 × pipeline stages 1"):
        Config.load({**HF_AUTOTP, "tensor_parallel": {"autotp_size": 4}}).data_parallel_size(6)


# -- legacy spellings ---------------------------------------------------------------------------------


def test_the_configs_of_deepspeeds_slides_load_with_one_note_per_legacy_key():
    bert = Config.load({
        "train_batch_size": 4096, "train_micro_batch_size_per_gpu": 64, "steps_per_print": 1000,
        "optimizer": {"type": "Lamb", "params": {"lr": 2e-3, "weight_decay": 0.01, "bias_correction": False,
                                                 "max_coeff": 0.3, "min_coeff": 0.01, "max_grad_norm": 1.0}},
        "fp16": {"enabled": True, "loss_scale": 0},
    })  # fmt: skip
    assert bert.gradient_clipping == 1.0 and "max_grad_norm" not in bert.optimizer.params
    assert bert.notes == (
        "optimizer.params.max_grad_norm: 1.0 is a legacy key; read as gradient_clipping: 1.0 (clip the global "
        "gradient norm (DeepSpeed's engine does it, not the optimizer))",
    )
    gpt2 = Config.load({
        "train_batch_size": 512, "gradient_accumulation_steps": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "max_grad_norm": 1.0}},
        "zero_optimization": True,
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
    })  # fmt: skip
    assert gpt2.zero_optimization.stage == 1 and gpt2.gradient_clipping == 1.0
    assert len(gpt2.notes) == 2 and gpt2.notes[0].startswith("zero_optimization: true is DeepSpeed's legacy spelling")


def test_a_legacy_key_that_disagrees_with_its_replacement_names_both():
    with pytest.raises(ConfigError) as info:
        Config.load({"gradient_clipping": 0.5, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}})
    assert info.value.problems == [
        "optimizer.params.max_grad_norm 1.0 (legacy: clip the global gradient norm (DeepSpeed's engine does it, not "
        "the optimizer)) and gradient_clipping 0.5 disagree; remove optimizer.params.max_grad_norm and keep "
        "gradient_clipping"
    ]
    same = Config.load({"gradient_clipping": 1, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}})
    assert same.gradient_clipping == 1.0
    fp32 = Config.load({"fp32_allreduce": True})
    assert fp32.communication_data_type == "fp32" and fp32.notes


def test_numbers_written_as_strings_are_read_as_numbers():
    cfg = Config.load({"train_batch_size": "16", "gradient_clipping": "1.0",
                       "zero_optimization": {"stage": 2, "reduce_bucket_size": "5e8", "allgather_bucket_size": "2e8"}})
    assert cfg.train_batch_size == 16 and cfg.gradient_clipping == 1.0
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.zero_optimization.allgather_bucket_size == 200_000_000
    with pytest.raises(ConfigError, match="reduce_bucket_size: expected an integer, got '5e8x'"):
        Config.load({"zero_optimization": {"reduce_bucket_size": "5e8x"}})
    with pytest.raises(ConfigError, match="reduce_bucket_size: expected an integer"):
        Config.load({"zero_optimization": {"reduce_bucket_size": "2.5"}})


# -- pin_memory without an accelerator ----------------------------------------------------------------


def _pinned_rank() -> tuple[list[str], float]:
    import terascale

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("terascale").addHandler(handler)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 2))
    pinned = {"device": "cpu", "pin_memory": True}
    config = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "offload_optimizer": pinned, "offload_param": pinned,
                                    "stage3_param_persistence_threshold": 0}}  # fmt: skip
    engine, *_ = terascale.initialize(model=model, config=config)
    x = torch.randn(2, 8)
    losses = []
    for _ in range(3):
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return records, losses[-1] - losses[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning is possible here")
def test_pin_memory_without_an_accelerator_trains_and_says_so_once():
    (records, improvement), (other, _) = run_ranks(_pinned_rank, 2)
    said = [r for r in records if "pin_memory" in r]
    assert said == [
        "config: zero_optimization.offload_optimizer.pin_memory, zero_optimization.offload_param.pin_memory: no "
        "accelerator on this machine, so host buffers are not pinned (pinning only speeds up copies to a GPU)"
    ]
    assert not [r for r in other if "pin_memory" in r]  # rank 0 says it for the job
    assert improvement < 0


# -- what DeepSpeed accepts that a strict schema would not -----------------------------------------


def test_foreign_keys_are_ignored_with_a_note_and_typos_are_errors():
    cfg = Config.load({"train_batch_size": 8, "_comment": "for 8 GPUs", "cuda_visible_devices": 0,
                       "aio": {"block_size": 1048576, "note": "tuned"}})  # fmt: skip
    assert cfg.notes == (
        "_comment: not a DeepSpeed setting; ignored, as DeepSpeed ignores it",
        "cuda_visible_devices: not a DeepSpeed setting; ignored, as DeepSpeed ignores it",
        "aio.note: not a DeepSpeed setting; ignored, as DeepSpeed ignores it",
    )
    with pytest.raises(ConfigError) as info:
        Config.load({"train_batch_size": 8, "gradient_cliping": 1.0, "lr_scheduler": {"type": "WarmupLR"}})
    assert info.value.problems == [
        "gradient_cliping: unknown key; did you mean 'gradient_clipping'?",
        "lr_scheduler: unknown key; did you mean 'scheduler'?",
    ]
    with pytest.raises(ConfigError, match=r"zero_optimization.stage3_max_live_params: unknown key; did you mean"):
        Config.load({"zero_optimization": {"stage3_max_live_params": 1}})  # strict, as in DeepSpeed


def test_auto_in_zero_optimization_is_deepspeeds_default_and_other_deepspeed_spellings():
    cfg = _resolve({"train_batch_size": 8, "steps_per_print": "auto", "zero_optimization": {
        "stage": "auto", "sub_group_size": "auto", "stage3_max_live_parameters": "auto",
        "offload_optimizer": {"device": "auto"}, "stage3_gather_16bit_weights_on_model_save": "auto"}})  # fmt: skip
    zero = cfg.zero_optimization
    assert (zero.stage, zero.sub_group_size, zero.max_live_parameters) == (0, 1_000_000_000, 1_000_000_000)
    assert zero.offload_optimizer.device == "none" and not zero.gather_16bit_weights_on_model_save
    assert cfg.steps_per_print is None
    why = {r.path: r.why for r in cfg.resolved}
    assert why["zero_optimization.stage"].startswith("DeepSpeed's default")
    # The old bf16 section name takes the integration's bf16 value too.
    cfg = _resolve({"train_batch_size": 8, "bfloat16": {"enabled": "auto"}}, given={"bf16.enabled": Given(True, "args")})
    assert cfg.bf16.enabled and "bfloat16: DeepSpeed's old name" in cfg.notes[0]
    odd = Config.load({"steps_per_print": float("inf"), "communication_data_type": "bfp16", "log_level": "info",
                       "fp16": {"enabled": True, "type": "fp16", "opt_level": "O2"},
                       "flops_profiler": {"profile_step": -1}})  # fmt: skip
    assert odd.steps_per_print is None and odd.communication_data_type == "bf16" and odd.log_level == "info"
    assert len(odd.notes) == 3
    with pytest.raises(ConfigError, match="fp16.type: 'bfloat16' is not an fp16 setting"):
        Config.load({"fp16": {"enabled": True, "type": "bfloat16"}})
    assert Config.load({"gradient_allreduce_op": "sum", "managed_gradient_accumulation": False}).unbuilt_settings() == []
    assert Config.load({"dump_state": True}).unbuilt_settings() == [
        "dump_state=true: engine state dump is not built yet in this version of terascale"
    ]
