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

_DS = "terascale.integrations.deepspeed"
_UTILS = f"{_DS}.utils"
_PARAMS = f"{_DS}.params"
_ACCEL = f"{_DS}.accelerator"
_ENGINE_API = "terascale.engine.deepspeed_api"

_ACCELERATOR = {
    "get_accelerator": f"{_ACCEL}:get_accelerator",
    "set_accelerator": f"{_ACCEL}:set_accelerator",
    "is_current_accelerator_supported": f"{_ACCEL}:is_current_accelerator_supported",
}
_SAFE = ("safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state", "safe_get_local_fp32_param",
         "safe_get_local_grad", "safe_get_local_optimizer_state", "safe_set_full_fp32_param",
         "safe_set_full_optimizer_state")  # fmt: skip
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
    "runtime.zero.partition_parameters": _ZERO,
    "runtime.zero.offload_config": {n: f"{_ENGINE_API}:{n}" for n in ("OffloadDeviceEnum", "OffloadStateTypeEnum")},
    "runtime.pipe": _PIPE,
    "runtime.pipe.module": _PIPE,
    "runtime.pipe.engine": {"PipelineEngine": "terascale.pipe:PipelineEngine"},
    "runtime.pipe.topology": {n: f"{_UTILS}:{n}" for n in _TOPOLOGIES},
    "runtime.activation_checkpointing": {},
    "runtime.activation_checkpointing.checkpointing": "terascale.checkpointing",
    "ops": {},
    "ops.adam": {n: f"{_DS}.ops:{n}" for n in ("DeepSpeedCPUAdam", "FusedAdam")},
    "ops.lamb": {"FusedLamb": f"{_DS}.ops:FusedLamb"},
    "ops.adagrad": {"DeepSpeedCPUAdagrad": f"{_DS}.ops:DeepSpeedCPUAdagrad"},
    "checkpoint.utils": {"clone_tensors_for_torch_save": f"{_UTILS}:clone_tensors_for_torch_save"},
    "profiling.flops_profiler": {n: f"terascale.profiling.flops:{n}" for n in ("get_model_profile", "FlopsProfiler")},
    "moe.sharded_moe": {n: f"terascale.moe.layer:{n}" for n in ("TopKGate", "MOELayer")},
    "sequence": {},
    "sequence.layer": {"DistributedAttention": "terascale.parallel.sequence.attention:DistributedAttention"},
    "runtime.sequence_parallel": {},
    "runtime.sequence_parallel.ulysses_sp": {n: f"{_DS}.ulysses:{n}" for n in (
        "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter")},
    "constants": {n: f"{_UTILS}:{n}" for n in ("TORCH_DISTRIBUTED_DEFAULT_PORT", "CROSS_RANK", "CROSS_SIZE")},
    "env_report": {"main": f"{_UTILS}:env_report_main"},
}

_NO_OPS = "terascale builds no C++/CUDA ops (DeepSpeed's op builders); its I/O engine is terascale.offload.AsyncIO"
_INFERENCE = "DeepSpeed's inference engine (init_inference, kernel injection) is not built in terascale yet"
_DATA_EFFICIENCY = "data efficiency (curriculum learning, random-LTD, data sampling) is not built yet"
_ULYSSES = ("FPDT (DeepSpeed's chunked, offloaded Ulysses attention) is not built; Ulysses sequence parallelism is: "
            "sequence_parallel_size in the config, tiled MLP and loss in its sequence_parallel section")
_KERNELS = "DeepSpeed's fused transformer kernels are not built (terascale compiles no CUDA)"
_ZERO_OPTIMIZERS = ("DeepSpeed's ZeRO optimizer wrapper classes: terascale's model state is not an optimizer "
                    "(engine.optimizer is the torch optimizer)")  # fmt: skip

# DeepSpeed path prefix -> (kind, reason). ``feature``: a DeepSpeed feature terascale does not
# build yet (the config refuses it too); ``design``: terascale does this another way.
REFUSED: dict[str, tuple[str, str]] = {
    "init_inference": ("feature", _INFERENCE),
    "inference": ("feature", _INFERENCE),
    "module_inject": ("feature", _INFERENCE),
    "replace_transformer_layer": ("feature", _INFERENCE),
    "revert_transformer_layer": ("feature", _INFERENCE),
    "InferenceEngine": ("feature", _INFERENCE),
    "DeepSpeedInferenceConfig": ("feature", _INFERENCE),
    **{f"moe.{m}": ("feature", "expert tensor parallelism (deepspeed.moe's token mappings, capacity bins) "
                    "is not built yet; terascale's experts compose with data parallelism and ZeRO")
       for m in ("mappings", "capacity_bins")},
    "DeepSpeedTransformerLayer": ("feature", _KERNELS),
    "DeepSpeedTransformerConfig": ("feature", _KERNELS),
    "ops.transformer": ("feature", _KERNELS),
    "ops.sparse_attention": ("feature", "sparse attention is not built yet"),
    "compression": ("feature", "compression (quantization-aware training, pruning) is not built yet"),
    "runtime.data_pipeline": ("feature", _DATA_EFFICIENCY),
    "sequence.fpdt_layer": ("feature", _ULYSSES),
    "compile": ("feature", "DeepCompile (deepspeed.compile passes) is not built yet"),
    "runtime.domino": ("feature", "Domino (tensor-parallel communication overlap) is not built yet"),
    "io": ("feature", "DeepSpeed's FastFileWriter (deepspeed.io) is not built; checkpoints use their own writer"),
    "ops.lion": ("feature", "no Lion optimizer in terascale yet"),
    "ops.op_builder": ("design", _NO_OPS),
    "ops.aio": ("design", _NO_OPS),
    "tp_model_init": ("design", "the config's tensor_parallel.autotp_size sets tensor parallelism (AutoTP)"),
    "checkpoint": ("design", "universal checkpoints: terascale checkpoints reshard at load with no conversion step, "
                             "so the conversion's constants have no counterpart"),
    "runtime.fp16": ("design", _ZERO_OPTIMIZERS),
    "runtime.bf16_optimizer": ("design", _ZERO_OPTIMIZERS),
    "runtime.zero.stage3": ("design", _ZERO_OPTIMIZERS),
    "runtime.zero.stage_1_and_2": ("design", _ZERO_OPTIMIZERS),
    "runtime.zero.partition_parameters._orig_torch_arange": (
        "design", "DeepSpeed's zero.Init patches torch's tensor constructors; terascale's patches nothing"),
    "runtime.zero.partition_parameters.zero_wrapper_for_fp_tensor_constructor": (
        "design", "DeepSpeed's zero.Init patches torch's tensor constructors; terascale's patches nothing"),
    "runtime.zero.partition_parameters.get_accelerator": ("design", "a DeepSpeed module's own import, not an API"),
    "runtime.pipe.schedule": ("design", "terascale's pipeline schedules are pure functions (terascale.pipe.schedule), "
                                        "not DeepSpeed's instruction classes"),
    "runtime.pipe.engine.PipelineEngine._INSTRUCTION_MAP": (
        "design", "terascale's pipeline runner has no instruction map to extend (terascale.pipe.runner)"),
    "runtime.state_dict_factory": ("design", "Megatron checkpoint loading: terascale's checkpoints load on any layout"),
    "runtime.utils.PartitionedTensor": ("design", "pipeline activations move as whole tensors (terascale.pipe.p2p)"),
    "comm.TorchBackend": ("design", "terascale.comm calls torch.distributed directly; there are no backend classes"),
    "utils.timer": ("design", "the engine's timers are engine.timers (forward/backward/step)"),
    "launcher.runner": ("design", "terascale.launcher.runner is terascale's own (its env files: ENV_FILE_NAMES)"),
    "param.": ("design", "terascale attaches nothing to parameters (DESIGN.md, groups of flat shards): code that "
                         "checks hasattr(p, 'ds_id') takes its path for ordinary parameters"),
}

for _base in ("get_accelerator", "accelerator.get_accelerator", "accelerator.real_accelerator.get_accelerator"):
    for _method in ("get_op_builder", "create_op_builder", "build_extension", "op_builder_dir"):
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
        entry = MODULES[self.path]
        if isinstance(entry, str):
            # Another name of a real module: the import system returns sys.modules[name].
            sys.modules[module.__name__] = importlib.import_module(entry)
            return
        path = self.path
        module.__doc__ = f"DeepSpeed's deepspeed.{path} on terascale (terascale.integrations.deepspeed.names)."
        module.__getattr__ = lambda name: attribute(path, name)  # type: ignore[method-assign]
        module.__dir__ = lambda: sorted({*entry, *_children(path)})  # type: ignore[method-assign]
        module.__all__ = sorted(entry)

    def get_code(self, fullname: str) -> types.CodeType | None:
        """The code ``python -m`` runs: the aliased module's own (its ``__main__`` block)."""
        entry = MODULES[self.path]
        if isinstance(entry, str):
            spec = importlib.util.find_spec(entry)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "get_code"):
                return spec.loader.get_code(entry)
        return compile("", fullname, "exec")


def find_spec(fullname: str) -> importlib.machinery.ModuleSpec | None:
    """The spec of ``terascale.<DeepSpeed path>`` when :data:`MODULES` has the path;
    ModuleNotFoundError with the reason when the path is refused; else None."""
    path = fullname.removeprefix("terascale.")
    if path in MODULES:
        is_package = bool(_children(path)) or not isinstance(MODULES[path], str)
        return importlib.util.spec_from_loader(fullname, _Loader(path), is_package=is_package)
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
        raise AttributeError(f"{name}: {REFUSED['param.'][1]}")
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
    try:
        obj = resolve(name)
    except (AttributeError, ImportError) as err:
        hit = refusal(path)
        if hit is not None:
            return "refused", f"{hit[0]}: {hit[1]}"
        return "missing", f"not provided ({type(err).__name__}: {err})"
    return "provided", _describe(name, obj)


def _describe(name: str, obj: Any) -> str:
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
