"""The DeepSpeed-name compatibility layer: one map of DeepSpeed's public names onto terascale.

``import terascale as deepspeed`` makes a DeepSpeed program's ``deepspeed.X`` names
terascale's. Most live where DeepSpeed has them already (``terascale.initialize``,
``terascale.zero.Init``, ``terascale.comm.get_rank``, ``terascale.checkpointing``,
``terascale.pipe.PipelineModule``); the rest are in :data:`MODULES`, keyed by DeepSpeed's
module path: ``"runtime.utils": {"see_memory_usage": "terascale.integrations.deepspeed.utils:
see_memory_usage"}`` makes ``from terascale.runtime.utils import see_memory_usage`` work.

[Note: DeepSpeed's module paths]
The modules of :data:`MODULES` have no files: ``terascale/__init__.py`` appends a finder to
``sys.meta_path`` (asked only for ``terascale.*`` modules no file provides) that builds
each from its entry here, importing targets when first read. So DeepSpeed's layout
(``runtime/zero/partition_parameters``, ``accelerator/real_accelerator``, ...) costs no
tree of re-export files and never mixes into terascale's own packages: a path under one
of them (``terascale.checkpoint.utils``) is served only when imported by that name. An
entry that is a string instead of a dict makes the path another name of that module
(``runtime.activation_checkpointing.checkpointing`` is ``terascale.checkpointing``).
``python -m terascale.utils.zero_to_fp32`` runs through the same finder.

Names terascale does not provide are in :data:`REFUSED` with the reason; reading one
raises AttributeError (or, importing it, ModuleNotFoundError) with that reason, so
``hasattr`` and ``try: import`` probes still work. :func:`resolve` and :func:`status_of`
answer for the scan of published code (``tools/scan_deepspeed_names.py``,
``docs/deepspeed_names.md``).

This module imports nothing heavy: ``import terascale`` stays free of torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

from terascale.integrations.deepspeed import unprovided

_DS = "terascale.integrations.deepspeed"
_UTILS = f"{_DS}.utils"
_PARAMS = f"{_DS}.params"
_ACCEL = f"{_DS}.accelerator"
_ENGINE_API = "terascale.engine.deepspeed_api"
_VISION = "terascale.parallel.sequence.vision"

_ACCELERATOR = {
    "get_accelerator": f"{_ACCEL}:get_accelerator",
    "set_accelerator": f"{_ACCEL}:set_accelerator",
    "is_current_accelerator_supported": f"{_ACCEL}:is_current_accelerator_supported",
}
_SAFE = ("safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state", "safe_get_local_fp32_param",
         "safe_get_local_grad", "safe_get_local_optimizer_state", "safe_set_full_fp32_param",
         "safe_set_full_optimizer_state", "safe_set_full_grad", "safe_set_local_grad", "safe_set_local_fp32_param",
         "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized")  # fmt: skip
_LEAF = ("set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module")
_ZERO = {
    "Init": "terascale.zero:Init",
    "GatheredParameters": "terascale.zero:GatheredParameters",
    "register_external_parameter": "terascale.zero:register_external_parameter",
    "unregister_external_parameter": "terascale.zero:unregister_external_parameter",
    "TiledLinear": "terascale.zero:TiledLinear",
    "ZeroParamStatus": f"{_UTILS}:ZeroParamStatus",
}
_PIPE = {n: f"terascale.pipe:{n}" for n in ("PipelineModule", "LayerSpec", "TiedLayerSpec")}
_ONEBIT = {"OnebitAdam": "terascale.optim.onebit:OneBitAdam", "ZeroOneAdam": "terascale.optim.zoadam:ZeroOneAdam",
           "OnebitLamb": "terascale.optim.onebit_lamb:OneBitLamb"}
_SPARSE = ("SparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig", "VariableSparsityConfig",
           "BigBirdSparsityConfig", "BSLongformerSparsityConfig", "LocalSlidingWindowSparsityConfig",
           "SparseSelfAttention", "BertSparseSelfAttention", "SparseAttentionUtils")
_CHECKPOINT_KEYS = (
    "OPTIMIZER_STATE_DICT", "BASE_OPTIMIZER_STATE", "PARAM_GROUPS", "PARTITION_COUNT", "ZERO_STAGE", "CLIP_GRAD",
    "LOSS_SCALER", "PARAM", "PARAM_SHAPES", "BUFFER_NAMES", "FROZEN_PARAM_SHAPES", "DS_VERSION",
    "UNIVERSAL_CHECKPOINT_INFO", "UNIVERSAL_CHECKPOINT_VERSION_KEY", "UNIVERSAL_CHECKPOINT_VERSION_VALUE",
    "VOCAB_TENSOR", "PADDED_VOCAB_SIZE", "ORIGINAL_VOCAB_SIZE", "CAT_DIM", "VOCABULARY_PARAMETER_PATTERNS",
    "PIPELINE_REPLICATED_PARAMETER_PATTERNS", "PARAMETER_TO_AVERAGE_PATTERNS",
    "PARAMETER_WITH_ROW_PARALLELISM_PATTERNS", "TP_REPLICATED_PARAMETER_PATTERNS",
    "PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0", "PARAMETER_WITH_SUB_PARAMS", "SUB_PARAM_SHAPE")
_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
_TOPOLOGIES = ("PipeModelDataParallelTopology", "PipeDataParallelTopology")
_OPTIMIZER_NAMES = ("ADAM_OPTIMIZER", "ADAMW_OPTIMIZER", "LAMB_OPTIMIZER", "SGD_OPTIMIZER", "ONEBIT_ADAM_OPTIMIZER",
                    "ONEBIT_LAMB_OPTIMIZER", "ZERO_ONE_ADAM_OPTIMIZER")  # fmt: skip

# DeepSpeed module path (after ``deepspeed.``) -> {DeepSpeed name: "module:attribute"}, or
# the name of the terascale module that path is another name of. ``""`` is ``terascale``.
MODULES: dict[str, dict[str, str] | str] = {
    "": {
        "init_distributed": "terascale.comm.api:init_distributed",
        "DeepSpeedEngine": "terascale.engine:Engine",
        "PipelineEngine": "terascale.pipe:PipelineEngine",
        "PipelineModule": "terascale.pipe:PipelineModule",
        "DeepSpeedConfig": f"{_DS}.config:DeepSpeedConfig",
        "DeepSpeedConfigError": "terascale.config:ConfigError",
        "get_accelerator": f"{_ACCEL}:get_accelerator",
        "OnDevice": f"{_UTILS}:OnDevice",
        "log_dist": f"{_UTILS}:log_dist",
        "version": "terascale:__version__",
        "init_inference": f"{_DS}.inference:init_inference",
        "InferenceEngine": f"{_DS}.inference:InferenceEngine",
        "DeepSpeedInferenceConfig": f"{_DS}.inference:DeepSpeedInferenceConfig",
        "DeepSpeedTransformerLayer": f"{_DS}.transformer:DeepSpeedTransformerLayer",
        "DeepSpeedTransformerConfig": f"{_DS}.transformer:DeepSpeedTransformerConfig",
    },
    "accelerator": _ACCELERATOR,
    "accelerator.real_accelerator": _ACCELERATOR,
    "utils": {
        "logger": f"{_UTILS}:logger",
        "log_dist": f"{_UTILS}:log_dist",
        "OnDevice": f"{_UTILS}:OnDevice",
        "RepeatingLoader": f"{_UTILS}:RepeatingLoader",
        "is_initialized": "terascale.comm.api:is_initialized",
        **{n: f"{_PARAMS}:{n}" for n in _SAFE},
        **{n: f"terascale.zero:{n}" for n in _LEAF},
    },
    "utils.logging": {"logger": f"{_UTILS}:logger", "log_dist": f"{_UTILS}:log_dist"},
    "utils.groups": {n: f"{_UTILS}:{n}" for n in (
        "_get_sequence_parallel_group", "_get_sequence_parallel_world_size", "_get_sequence_parallel_rank")},
    "utils.zero_to_fp32": f"{_DS}.zero_to_fp32",
    "runtime": {},
    "runtime.utils": {n: f"{_UTILS}:{n}" for n in ("see_memory_usage", "set_random_seed", "move_to_device")},
    "runtime.dataloader": {"RepeatingLoader": f"{_UTILS}:RepeatingLoader"},
    "runtime.engine": {"DeepSpeedEngine": "terascale.engine:Engine"},
    "runtime.config": {"DeepSpeedConfig": f"{_DS}.config:DeepSpeedConfig",
                       **{n: f"{_UTILS}:{n}" for n in _OPTIMIZER_NAMES}},  # fmt: skip
    "runtime.lr_schedules": {
        **{n: f"terascale.optim:{n}" for n in _SCHEDULERS},
        "VALID_LR_SCHEDULES": "terascale.optim:SUPPORTED_SCHEDULERS",
    },
    # Older DeepSpeed's 1-bit optimizers (removed in DeepSpeed 0.19); the rest of runtime.fp16 is refused.
    "runtime.fp16": {},
    "runtime.fp16.onebit": _ONEBIT,
    "runtime.fp16.onebit.adam": {"OnebitAdam": _ONEBIT["OnebitAdam"]},
    "runtime.fp16.onebit.zoadam": {"ZeroOneAdam": _ONEBIT["ZeroOneAdam"]},
    "runtime.fp16.onebit.lamb": {"OnebitLamb": _ONEBIT["OnebitLamb"]},
    "runtime.zero": _ZERO,
    "runtime.zero.partition_parameters": {
        **_ZERO, **{n: f"{_UTILS}:{n}" for n in ("zero_wrapper_for_fp_tensor_constructor", "_orig_torch_arange")}},
    "runtime.zero.linear": f"{_DS}.zero_linear",
    "runtime.zero.offload_config": {n: f"{_ENGINE_API}:{n}" for n in ("OffloadDeviceEnum", "OffloadStateTypeEnum")},
    "runtime.pipe": _PIPE,
    "runtime.pipe.module": _PIPE,
    "runtime.pipe.engine": {"PipelineEngine": "terascale.pipe:PipelineEngine"},
    "runtime.pipe.topology": {n: f"{_UTILS}:{n}" for n in _TOPOLOGIES},
    "runtime.activation_checkpointing": {},
    "runtime.activation_checkpointing.checkpointing": "terascale.checkpointing",
    "ops": {"__compatible_ops__": f"{_DS}.op_builders:COMPATIBLE_OPS",
            **{n: f"{_DS}.transformer:{n}" for n in ("DeepSpeedTransformerLayer", "DeepSpeedTransformerConfig")}},
    "ops.transformer": {n: f"{_DS}.transformer:{n}" for n in ("DeepSpeedTransformerLayer", "DeepSpeedTransformerConfig")},
    "ops.transformer.transformer": {n: f"{_DS}.transformer:{n}" for n in (
        "DeepSpeedTransformerLayer", "DeepSpeedTransformerConfig")},
    "inference": {n: f"{_DS}.inference:{n}" for n in (
        "InferenceEngine", "DeepSpeedInferenceConfig", "DeepSpeedTPConfig", "init_inference")},
    "inference.config": {n: f"{_DS}.inference:{n}" for n in ("DeepSpeedInferenceConfig", "DeepSpeedTPConfig")},
    "inference.engine": {"InferenceEngine": f"{_DS}.inference:InferenceEngine"},
    "io": {n: f"{_DS}.file_writers:{n}" for n in ("FastFileWriter", "FastFileWriterConfig", "PyFileWriter",
                                                   "MockFileWriter")},
    "runtime.data_pipeline": {},
    "runtime.data_pipeline.curriculum_scheduler": {"CurriculumScheduler": f"{_DS}.data_pipeline:CurriculumScheduler"},
    "runtime.data_pipeline.data_sampling": {},
    "runtime.data_pipeline.data_sampling.indexed_dataset": {n: f"{_DS}.data_pipeline:{n}" for n in (
        "MMapIndexedDataset", "MMapIndexedDatasetBuilder", "index_file_path", "data_file_path")},
    "elasticity": {n: f"{_DS}.elasticity:{n}" for n in ("compute_elastic_config", "elasticity_enabled",
                                                         "ElasticityError", "ElasticityConfigError",
                                                         "ElasticityIncompatibleWorldSize")},
    "elasticity.config": {n: f"{_DS}.elasticity:{n}" for n in (
        "ElasticityError", "ElasticityConfigError", "ElasticityIncompatibleWorldSize")},
    "elasticity.elasticity": {n: f"{_DS}.elasticity:{n}" for n in ("compute_elastic_config", "elasticity_enabled")},
    "compression": {},
    "compression.helper": {n: f"{_DS}.compression_helpers:{n}" for n in (
        "recursive_getattr", "recursive_setattr", "convert_conv1d_to_linear")},
    "ops.sparse_attention": {n: f"{_DS}.sparse_attention:{n}" for n in _SPARSE},
    "ops.sparse_attention.sparsity_config": {n: f"{_DS}.sparse_attention:{n}" for n in _SPARSE if "Config" in n},
    "ops.sparse_attention.sparse_self_attention": {"SparseSelfAttention": f"{_DS}.sparse_attention:SparseSelfAttention"},
    "ops.sparse_attention.bert_sparse_self_attention": {
        "BertSparseSelfAttention": f"{_DS}.sparse_attention:BertSparseSelfAttention"},
    "ops.sparse_attention.sparse_attention_utils": {
        "SparseAttentionUtils": f"{_DS}.sparse_attention_utils:SparseAttentionUtils"},
    "ops.op_builder": {n: f"{_DS}.op_builders:{n}" for n in (
        "OpBuilder", "AsyncIOBuilder", "UtilsBuilder", "CPUAdamBuilder", "FusedAdamBuilder", "FusedLambBuilder",
        "CPUAdagradBuilder", "CPULionBuilder", "FusedLionBuilder", "GDSBuilder", "QuantizerBuilder",
        "FPQuantizerBuilder", "TransformerBuilder", "StochasticTransformerBuilder", "SparseAttnBuilder",
        "InferenceBuilder", "RandomLTDBuilder", "SpatialInferenceBuilder", "CCLCommBuilder", "ShareMemCommBuilder",
        "InferenceCoreBuilder", "RaggedOpsBuilder", "RaggedUtilsBuilder", "EvoformerAttnBuilder",
        "CUTLASSOpsBuilder", "DeepCompileBuilder", "TransformerInferenceBuilder", "ALL_OPS")},
    "ops.op_builder.builder": {"OpBuilder": f"{_DS}.op_builders:OpBuilder"},
    "ops.op_builder.all_ops": {"ALL_OPS": f"{_DS}.op_builders:ALL_OPS"},
    "ops.aio": {n: f"{_DS}.op_builders:{n}" for n in ("AsyncIOBuilder", "aio_handle")},
    "ops.adam": {n: f"{_DS}.ops:{n}" for n in ("DeepSpeedCPUAdam", "FusedAdam")},
    "ops.lamb": {"FusedLamb": f"{_DS}.ops:FusedLamb"},
    "ops.adagrad": {"DeepSpeedCPUAdagrad": f"{_DS}.ops:DeepSpeedCPUAdagrad"},
    "ops.lion": {n: f"{_DS}.ops:{n}" for n in ("DeepSpeedCPULion", "FusedLion")},
    "checkpoint.utils": {"clone_tensors_for_torch_save": f"{_UTILS}:clone_tensors_for_torch_save"},
    # terascale.checkpoint is terascale's own package; its module __getattr__ asks here.
    "checkpoint": {n: f"{_DS}.checkpoint_constants:{n}" for n in _CHECKPOINT_KEYS},
    "checkpoint.constants": {n: f"{_DS}.checkpoint_constants:{n}" for n in _CHECKPOINT_KEYS},
    "profiling.flops_profiler": {n: f"terascale.profiling.flops:{n}" for n in ("get_model_profile", "FlopsProfiler")},
    "moe.sharded_moe": {n: f"terascale.moe.layer:{n}" for n in ("TopKGate", "MOELayer")},
    "sequence": {},
    "sequence.layer": {"DistributedAttention": "terascale.parallel.sequence.attention:DistributedAttention"},
    # AutoSP (multimodal): vision attention over sharded patches, fusion adapters at the projection.
    "sequence.auto_sp": {"auto_wrap_model_for_sp": f"{_VISION}:auto_wrap_model_for_sp"},
    "sequence.autosp_vit": {"UlyssesSPViTAttention": f"{_VISION}:UlyssesSPViTAttention"},
    "sequence.autosp_detector": {
        "SPModelInfo": f"{_VISION}:SPModelInfo",
        "detect_model_sp_info": f"{_VISION}:detect_model_sp_info",
        # DeepSpeed's registries, read-only here (extend through the functions' arguments).
        "_VIT_ATTN_CLASSNAMES": f"{_VISION}:VISION_ATTENTION_NAMES",
        "_VIT_HAS_CLS_TOKEN": f"{_VISION}:VISION_ATTENTION",
        "_LLM_ATTN_CLASSNAMES": f"{_VISION}:LANGUAGE_ATTENTION",
        "_VISION_PROJ_KEYWORDS": f"{_VISION}:PROJECTION_KEYWORDS",
    },
    "sequence.autosp_fusion": {n: f"terascale.parallel.sequence.fusion:{n}" for n in (
        "ModalityFusionSPAdapter", "LlavaFusionAdapter", "InternVLFusionAdapter", "Qwen2VLFusionAdapter")},
    "runtime.sequence_parallel": {},
    "runtime.sequence_parallel.ulysses_sp": {n: f"{_DS}.ulysses:{n}" for n in (
        "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "TiledMLP", "sequence_tiled_compute",
        "TiledFusedLogitsLoss")},
    "constants": {n: f"{_UTILS}:{n}" for n in ("TORCH_DISTRIBUTED_DEFAULT_PORT", "CROSS_RANK", "CROSS_SIZE")},
    "env_report": {"main": f"{_UTILS}:env_report_main"},
    # What a program learns about the install and the running torch (versions.py).
    "git_version_info": f"{_DS}.versions",
    "utils.torch": {n: f"{_DS}.versions:{n}" for n in (
        "required_torch_version", "jit_script_compat", "register_grad_hook")},
    "accelerator.cpu_accelerator": {"CPU_Accelerator": f"{_ACCEL}:CPU_Accelerator"},
    "accelerator.cuda_accelerator": {"CUDA_Accelerator": f"{_ACCEL}:CUDA_Accelerator"},
    "accelerator.abstract_accelerator": {"DeepSpeedAccelerator": f"{_ACCEL}:Accelerator"},
    # The config models: DeepSpeed's names of terascale's sections (the same fields and aliases).
    "runtime.zero.config": {
        "DeepSpeedZeroConfig": "terascale.config.zero:ZeroConfig",
        "DeepSpeedZeroOffloadParamConfig": "terascale.config.zero:OffloadParamConfig",
        "DeepSpeedZeroOffloadOptimizerConfig": "terascale.config.zero:OffloadOptimizerConfig",
        "ZeroStageEnum": f"{_DS}.constants:ZeroStageEnum",
    },
    "runtime.precision_config": {"DeepSpeedFP16Config": "terascale.config.schema:Fp16Config",
                                 "DeepSpeedBF16Config": "terascale.config.schema:Bf16Config",
                                 "get_bfloat16_config": f"{_DS}.constants:get_bfloat16_config",
                                 "get_fp16_config": f"{_DS}.constants:get_fp16_config"},
    "runtime.constants": {n: f"{_DS}.constants:{n}" for n in (
        "GRADIENT_CLIPPING", "GRADIENT_CLIPPING_DEFAULT", "TRAIN_BATCH_SIZE", "TRAIN_MICRO_BATCH_SIZE_PER_GPU",
        "GRADIENT_ACCUMULATION_STEPS", "STEPS_PER_PRINT", "STEPS_PER_PRINT_DEFAULT", "ZERO_OPTIMIZATION")},
    "runtime.zero.tiling": {"TiledLinear": "terascale.zero:TiledLinear"},
    "monitor": {},
    **{f"monitor.{m}": {c: f"{_DS}.monitor:{c}"} for m, c in (
        ("tensorboard", "TensorBoardMonitor"), ("wandb", "WandbMonitor"), ("csv_monitor", "csvMonitor"),
        ("config", "DeepSpeedMonitorConfig"), ("monitor", "MonitorMaster"), ("comet", "CometMonitor"))},
    "utils.timer": {"trim_mean": f"{_DS}.constants:trim_mean"},
    "runtime.swap_tensor": {"MIN_SWAPPABLE_BYTES": f"{_DS}.constants:MIN_SWAPPABLE_BYTES"},
    "utils.numa": {n: f"{_DS}.constants:{n}" for n in ("parse_range", "parse_range_list")},
}

_LR_CONSTANTS = ("LR_SCHEDULE", "LR_RANGE_TEST", "ONE_CYCLE", "WARMUP_LR", "WARMUP_DECAY_LR", "WARMUP_COSINE_LR",
                 "LR_RANGE_TEST_MIN_LR", "LR_RANGE_TEST_STEP_RATE", "LR_RANGE_TEST_STEP_SIZE",
                 "LR_RANGE_TEST_STAIRCASE", "EDGE_VALUE", "MID_VALUE", "CYCLE_FIRST_STEP_SIZE",
                 "CYCLE_FIRST_STAIR_COUNT", "CYCLE_SECOND_STEP_SIZE", "CYCLE_SECOND_STAIR_COUNT", "DECAY_STEP_SIZE",
                 "CYCLE_MIN_LR", "CYCLE_MAX_LR", "DECAY_LR_RATE", "CYCLE_MIN_MOM", "CYCLE_MAX_MOM", "DECAY_MOM_RATE",
                 "WARMUP_MIN_LR", "WARMUP_MAX_LR", "WARMUP_NUM_STEPS", "WARMUP_TYPE", "WARMUP_LOG_RATE",
                 "WARMUP_LINEAR_RATE", "WARMUP_MIN_RATIO", "COS_MIN_RATIO", "TOTAL_NUM_STEPS")  # fmt: skip
MODULES["runtime.lr_schedules"].update({n: f"{_DS}.constants:{n}" for n in _LR_CONSTANTS})
MODULES["runtime.config"]["get_gradient_clipping"] = f"{_DS}.constants:get_gradient_clipping"
MODULES["runtime.utils"].update({"partition_uniform": "terascale.pipe.partition:partition_uniform",
                                 "partition_balanced": f"{_UTILS}:partition_balanced",
                                 "prefix_sum_inc": f"{_DS}.constants:prefix_sum_inc"})
MODULES["utils"].update({n: f"{_DS}.versions:{n}" for n in ("set_log_level_from_string",
                                                             "get_log_level_from_string")})
MODULES["utils.logging"].update({n: f"{_DS}.versions:{n}" for n in ("set_log_level_from_string",
                                                                     "get_log_level_from_string")})

_NO_OPS = "terascale builds no C++/CUDA ops (DeepSpeed's op builders); its I/O engine is terascale.offload.AsyncIO"
_INFERENCE = ("DeepSpeed's inference kernels and their layer replacement (module_inject, inference v2 / ragged "
              "batching) are not built; init_inference runs the model's own layers (dtype, device, AutoTP)")
_DATA_EFFICIENCY = "data efficiency (curriculum learning, random-LTD, data sampling) is not built yet"
_ULYSSES = ("FPDT (DeepSpeed's chunked, offloaded Ulysses attention) is not built; Ulysses sequence parallelism is: "
            "sequence_parallel_size in the config, tiled MLP and loss in its sequence_parallel section")
_KERNELS = "DeepSpeed's fused transformer kernels are not built (terascale compiles no CUDA)"
_ZERO_OPTIMIZERS = ("DeepSpeed's ZeRO optimizer wrapper classes: terascale's model state is not an optimizer "
                    "(engine.optimizer is the torch optimizer)")  # fmt: skip

# DeepSpeed path prefix -> (kind, reason). ``feature``: a DeepSpeed feature terascale does not
# build yet (the config refuses it too); ``design``: terascale does this another way.
REFUSED: dict[str, tuple[str, str]] = {
    "inference": ("feature", _INFERENCE),
    "module_inject": ("feature", _INFERENCE),
    "replace_transformer_layer": ("feature", _INFERENCE),
    "revert_transformer_layer": ("feature", _INFERENCE),
    **{f"moe.{m}": ("feature", "expert tensor parallelism (deepspeed.moe's token mappings, capacity bins) "
                    "is not built yet; terascale's experts compose with data parallelism and ZeRO")
       for m in ("mappings", "capacity_bins")},
    "compression": ("feature", "compression (quantization-aware training, pruning) is not built yet"),
    "runtime.data_pipeline": ("feature", _DATA_EFFICIENCY),
    "sequence.fpdt_layer": ("feature", _ULYSSES),
    "compile": ("feature", "DeepCompile (deepspeed.compile passes) is not built yet"),
    "runtime.domino": ("feature", "Domino (tensor-parallel communication overlap) is not built yet"),
    "ops.op_builder": ("design", _NO_OPS),
    # Builders of ops terascale does not run: the class answers is_compatible() False, load() refuses.
    **{f"ops.op_builder.{b}.{m}": ("design", _NO_OPS) for b in ("GDSBuilder", "QuantizerBuilder", "FPQuantizerBuilder",
       "TransformerBuilder", "SparseAttnBuilder", "InferenceBuilder") for m in ("load", "jit_load")},
    "tp_model_init": ("design", "the config's tensor_parallel.autotp_size sets tensor parallelism (AutoTP)"),
    "checkpoint": ("design", "universal checkpoints: terascale checkpoints reshard at load with no conversion step "
                             "(its metadata keys are provided: deepspeed.checkpoint.UNIVERSAL_CHECKPOINT_INFO, ...)"),
    "runtime.fp16": ("design", _ZERO_OPTIMIZERS),
    "runtime.bf16_optimizer": ("design", _ZERO_OPTIMIZERS),
    "runtime.zero.stage3": ("design", _ZERO_OPTIMIZERS),
    "runtime.zero.stage_1_and_2": ("design", _ZERO_OPTIMIZERS),
    "runtime.zero.partition_parameters.get_accelerator": ("design", "a DeepSpeed module's own import, not an API"),
    "runtime.pipe.schedule": ("design", "terascale's pipeline schedules are pure functions (terascale.pipe.schedule), "
                                        "not DeepSpeed's instruction classes"),
    "runtime.pipe.engine.PipelineEngine._INSTRUCTION_MAP": (
        "design", "terascale's pipeline runner has no instruction map to extend (terascale.pipe.runner)"),
    "runtime.state_dict_factory": ("design", "Megatron checkpoint loading: terascale's checkpoints load on any layout"),
    "runtime.utils.PartitionedTensor": ("design", "pipeline activations move as whole tensors (terascale.pipe.p2p)"),
    "comm.TorchBackend": ("design", "terascale.comm calls torch.distributed directly; there are no backend classes"),
    "utils.timer": ("design", "the engine's timers are engine.timers (forward/backward/step)"),
    # deepspeed.launcher.runner is terascale.launcher.runner (DeepSpeed's names: terascale.launcher.deepspeed_cli).
    "launcher.launch": ("design", "each node's ranks are started by torchrun's agent (terascale run), not "
                                  "DeepSpeed's per-node launcher"),
    "launcher.multinode_runner": ("design", "terascale run builds the pdsh/mpirun/srun commands itself "
                                            "(terascale.launcher.backends); there are no runner classes"),
    "param.": ("design", "terascale's ZeRO-3 parameters answer DeepSpeed's ds_* attributes "
                         "(terascale.zero.param_attributes.ZeroParameter); this one is not among them"),
}

for _base in ("get_accelerator", "accelerator.get_accelerator", "accelerator.real_accelerator.get_accelerator"):
    for _method in ("build_extension", "op_builder_dir"):
        REFUSED[f"{_base}.{_method}"] = ("design", _NO_OPS)

# Engine attributes set in Engine.__init__ (not visible on the class).
ENGINE_INSTANCE_ATTRIBUTES = ("config", "module", "optimizer", "lr_scheduler", "dist", "precision", "activations",
                              "loss_scaler", "micro_batch_size")  # fmt: skip


def refusal(path: str) -> tuple[str, str] | None:
    """``(kind, reason)`` when DeepSpeed path ``path`` (after ``deepspeed.``) or a prefix of it is refused."""
    if path.startswith("param."):
        return REFUSED["param."]
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        hit = REFUSED.get(".".join(parts[:n]))
        if hit is not None:
            return hit
    return None


def _target(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj


def _children(path: str) -> set[str]:
    """The submodule names :data:`MODULES` has under DeepSpeed path ``path``."""
    prefix = f"{path}." if path else ""
    return {k[len(prefix) :].split(".")[0] for k in MODULES if k.startswith(prefix) and k != path and k}


def attribute(path: str, name: str) -> Any:
    """``deepspeed.<path>.<name>`` on terascale's side: a mapped object, a mapped submodule,
    or AttributeError (with the reason where the name is refused)."""
    entry = MODULES.get(path)
    if isinstance(entry, dict) and name in entry:
        return _target(entry[name])
    if name in _children(path):
        return importlib.import_module(f"terascale.{path}.{name}" if path else f"terascale.{name}")
    full = f"{path}.{name}" if path else name
    hit = refusal(full)
    # [Note: refused when used, not when imported] (unprovided.py)
    origin = unprovided.taken_from(path, name)
    if origin is not None:  # DeepSpeed's module imports it from another: answer as that one does
        module, _, attr = origin.partition(":")
        sub = f"{module}.{attr}" if module else attr
        if unprovided.has_module(sub) and not unprovided.defines(module, attr):
            return importlib.import_module(f"terascale.{sub}")
        return getattr(importlib.import_module(f"terascale.{module}" if module else "terascale"), attr)
    if unprovided.defines(path, name):
        return unprovided.stand_in(path, name, hit[1] if hit else None)
    if unprovided.has_module(full):
        return importlib.import_module(f"terascale.{full}")
    where = f"terascale.{path}" if path else "terascale"
    if hit is not None:
        raise AttributeError(f"deepspeed.{full}: {hit[1]}")
    raise AttributeError(f"module {where!r} has no attribute {name!r}")


class _Loader(importlib.abc.Loader):
    """Builds one module of :data:`MODULES` (see [Note: DeepSpeed's module paths])."""

    def __init__(self, path: str) -> None:
        self.path = path

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        entry = MODULES.get(self.path, {})  # {}: a DeepSpeed module terascale provides nothing of
        if isinstance(entry, str):
            # Another name of a real module: the import system returns sys.modules[name].
            sys.modules[module.__name__] = importlib.import_module(entry)
            return
        path = self.path
        module.__doc__ = f"DeepSpeed's deepspeed.{path} on terascale (terascale.integrations.deepspeed.names)."
        module.__getattr__ = lambda name: attribute(path, name)  # type: ignore[method-assign]
        module.__dir__ = lambda: sorted({*entry, *_children(path), *unprovided.names(path)})  # type: ignore[method-assign]
        module.__all__ = sorted(entry)

    def get_code(self, fullname: str) -> types.CodeType | None:
        """The code ``python -m`` runs: the aliased module's own (its ``__main__`` block)."""
        entry = MODULES.get(self.path, {})
        if isinstance(entry, str):
            spec = importlib.util.find_spec(entry)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "get_code"):
                return spec.loader.get_code(entry)
        return compile("", fullname, "exec")


def find_spec(fullname: str) -> importlib.machinery.ModuleSpec | None:
    """The spec of ``terascale.<DeepSpeed path>`` when :data:`MODULES` has the path or
    DeepSpeed has that module ([Note: refused when used, not when imported]);
    ModuleNotFoundError with the reason when the path is refused; else None."""
    path = fullname.removeprefix("terascale.")
    if path in MODULES:
        is_package = bool(_children(path)) or not isinstance(MODULES[path], str) or unprovided.is_package(path)
        return importlib.util.spec_from_loader(fullname, _Loader(path), is_package=is_package)
    if unprovided.has_module(path):
        return importlib.util.spec_from_loader(fullname, _Loader(path), is_package=unprovided.is_package(path))
    hit = refusal(path)
    if hit is not None:
        raise ModuleNotFoundError(f"deepspeed.{path}: {hit[1]}", name=fullname)
    return None


# -- the scan's questions --------------------------------------------------------------------------


def resolve(name: str) -> Any:
    """The terascale object a scanned DeepSpeed name stands for (``deepspeed.a.b``,
    ``import deepspeed.a``, ``deepspeed.a.f().x``, ``engine.x``); raises AttributeError or
    ImportError when it has none."""
    if name.startswith("import deepspeed"):
        return importlib.import_module("terascale" + name.removeprefix("import deepspeed"))
    if name.startswith("engine."):
        from terascale.engine import Engine
        from terascale.pipe import PipelineEngine

        attr = name.removeprefix("engine.")
        if attr in ENGINE_INSTANCE_ATTRIBUTES:
            return attr
        for cls in (Engine, PipelineEngine):
            if hasattr(cls, attr):
                return getattr(cls, attr)
        raise AttributeError(f"the engine has no attribute {attr!r}")
    if name.startswith("param."):
        from terascale.zero.param_attributes import ZeroParameter

        attr = name.removeprefix("param.")
        if attr not in vars(ZeroParameter):
            raise AttributeError(f"{name}: {REFUSED['param.'][1]}")
        return getattr(ZeroParameter, attr)
    head, call, rest = name.partition("().")
    obj = _walk(head.removeprefix("deepspeed").lstrip(".").split("."))
    if call:
        obj = obj()
        for part in rest.split("."):
            obj = getattr(obj, part)
    return obj


def _walk(parts: list[str]) -> Any:
    """``terascale.<parts>`` by attribute, importing modules on the way as an import
    statement naming them would."""
    obj: Any = importlib.import_module("terascale")
    for i, part in enumerate(p for p in parts if p):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            if not isinstance(obj, types.ModuleType):
                raise
            try:
                obj = importlib.import_module(f"{obj.__name__}.{part}")
            except ModuleNotFoundError as err:
                raise AttributeError(str(err)) from err
    return obj


def status_of(name: str) -> tuple[str, str]:
    """``("provided", what it is in terascale)``, ``("refused", reason)`` or ``("missing", ...)``."""
    path = name.removeprefix("import ").removeprefix("deepspeed").lstrip(".").replace("().", ".")
    if path in REFUSED and REFUSED[path][0] == "design" and "." in path:
        # A name kept only to refuse (the unbuilt op builders' load): its object exists to say no.
        return "refused", f"design: {REFUSED[path][1]}"
    try:
        obj = resolve(name)
        if _stands_in(obj):  # DeepSpeed's name, standing in to refuse when used
            raise AttributeError(f"{name} is a stand-in")
    except (AttributeError, ImportError, unprovided.NotProvidedError) as err:
        hit = refusal(path)
        if hit is not None:
            return "refused", f"{hit[0]}: {hit[1]}"
        return "missing", f"not provided ({type(err).__name__}: {err})"
    return "provided", _describe(name, obj)


def _stands_in(obj: Any) -> bool:
    """A stand-in function or class, or a module of DeepSpeed's that terascale serves only
    with stand-ins ([Note: refused when used, not when imported])."""
    if unprovided.is_stand_in(obj):
        return True
    loader = getattr(getattr(obj, "__spec__", None), "loader", None)
    return isinstance(obj, types.ModuleType) and isinstance(loader, _Loader) and loader.path not in MODULES


def _describe(name: str, obj: Any) -> str:
    if name.startswith("param."):
        return f"terascale.zero.param_attributes.ZeroParameter.{name.removeprefix('param.')} (ZeRO-3 parameters)"
    if name.startswith("engine."):
        attr = name.removeprefix("engine.")
        if attr in ENGINE_INSTANCE_ATTRIBUTES:
            return f"Engine.{attr} (attribute)"
        from terascale.engine import Engine

        owner = next((c for c in Engine.__mro__ if attr in c.__dict__), None)
        return f"{owner.__name__ if owner else 'PipelineEngine'}.{attr}"
    if isinstance(obj, types.ModuleType):
        return f"module {obj.__name__}"
    head, call, rest = name.partition("().")
    if call:  # an attribute of what a call returns: name it by the returned object's class
        cls = type(_walk(head.removeprefix("deepspeed").lstrip(".").split("."))())
        return f"{cls.__module__}.{cls.__qualname__}.{rest}"
    qual = getattr(obj, "__qualname__", None)
    module = getattr(obj, "__module__", None)
    if qual and module and not isinstance(obj, (str, int, float, tuple)):
        return f"{module}.{qual}"
    return f"value {obj!r}"[:80]
