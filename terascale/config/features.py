"""Which config features this version of terascale provides, as one table of data.

Each :class:`Feature` names a capability, says whether it is built, and knows which settings
of a config ask for it. :func:`unbuilt_settings` lists every setting that asks for a feature
with ``built=False``, so a valid but unsupported request fails loudly instead of being
silently ignored. When later work builds a feature it flips that one ``built`` entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# A validated terascale.config.Config, read by attribute. This table is data the schema
# consults (Config.unbuilt_settings), so it names the type without importing it.
Config = Any


@dataclass(frozen=True)
class Feature:
    """One capability: ``requests(cfg)`` returns the settings (``"path=value"``) asking for it."""

    description: str
    built: bool
    requests: Callable[[Config], list[str]]


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


def _flags(section: str, *names: str) -> Callable[[Config], list[str]]:
    """Settings ``section.name`` (a path of attributes) that are true."""

    def requests(cfg: Config) -> list[str]:
        obj = _resolve(cfg, section)
        prefix = f"{section}." if section else ""
        return [f"{prefix}{name}=true" for name in names if getattr(obj, name) is True]

    return requests


def _set_true(path: str, key: str) -> Callable[[Config], list[str]]:
    """A true boolean at ``path``, reported under its JSON key ``key``."""

    def requests(cfg: Config) -> list[str]:
        return [f"{key}=true"] if _resolve(cfg, path) is True else []

    return requests


def _stage(n: int) -> Callable[[Config], list[str]]:
    def requests(cfg: Config) -> list[str]:
        return [f"zero_optimization.stage={n}"] if cfg.zero_optimization.stage == n else []

    return requests


def _offload(which: str, device: str) -> Callable[[Config], list[str]]:
    deprecated = {"offload_optimizer": "cpu_offload", "offload_param": "cpu_offload_param"}[which]

    def requests(cfg: Config) -> list[str]:
        zero = cfg.zero_optimization
        offload = getattr(zero, which)
        if offload is None or offload.device != device:
            return []
        setting = f"zero_optimization.{which}.device={device}"
        if getattr(zero, deprecated) is True:
            setting = f"zero_optimization.{deprecated}=true (deprecated; means {setting})"
        return [setting]

    return requests


def _enabled_inside(value: Any, path: str) -> list[str]:
    """Paths of every ``"enabled": true`` in a loosely typed section, at any depth."""
    found: list[str] = []
    if isinstance(value, dict):
        for key, inner in value.items():
            if key == "enabled" and inner is True:
                found.append(f"{path}.enabled=true")
            else:
                found.extend(_enabled_inside(inner, f"{path}.{key}"))
    return found


def _loose_enabled(section: str) -> Callable[[Config], list[str]]:
    def requests(cfg: Config) -> list[str]:
        return _enabled_inside(getattr(cfg, section), section)

    return requests


def _resolve(cfg: Config, path: str) -> Any:
    obj: Any = cfg
    for part in path.split(".") if path else ():
        obj = getattr(obj, part)
    return obj


def _present(path: str) -> Callable[[Config], list[str]]:
    """A loose section whose mere presence (non-empty) switches its feature on."""

    def requests(cfg: Config) -> list[str]:
        return [f"{path} section"] if _resolve(cfg, path) else []

    return requests


def _combine(*parts: Callable[[Config], list[str]]) -> Callable[[Config], list[str]]:
    def requests(cfg: Config) -> list[str]:
        return [setting for part in parts for setting in part(cfg)]

    return requests


def _above(path: str, threshold: int) -> Callable[[Config], list[str]]:
    def requests(cfg: Config) -> list[str]:
        obj = _resolve(cfg, path)
        return [f"{path}={obj}"] if obj > threshold else []

    return requests


def _deepcompile(cfg: Config) -> list[str]:
    return ["compile.deepcompile=true"] if (cfg.compile or {}).get("deepcompile") is True else []


def _sum_reduction(cfg: Config) -> list[str]:
    return ["gradient_allreduce_op=sum"] if cfg.gradient_allreduce_op == "sum" else []


def _unmanaged_accumulation(cfg: Config) -> list[str]:
    return [] if cfg.managed_gradient_accumulation else ["managed_gradient_accumulation=false"]


def _never(cfg: Config) -> list[str]:
    return []


def _step_in_backward(cfg: Config) -> list[str]:
    offload = cfg.zero_optimization.offload_optimizer
    value = "auto" if offload is None else offload.step_in_backward
    return [] if value is False else [f"zero_optimization.offload_optimizer.step_in_backward={_fmt(value)}"]


def _overlap_step(cfg: Config) -> list[str]:
    offload = cfg.zero_optimization.offload_optimizer
    return ["zero_optimization.offload_optimizer.overlap_step=true"] if offload and offload.overlap_step else []


FEATURES: tuple[Feature, ...] = (
    # Built: listed so the table is the one place that says what terascale provides.
    Feature("fp16 mixed precision with loss scaling", True, _flags("fp16", "enabled")),
    Feature("bf16 mixed precision", True, _flags("bf16", "enabled")),
    Feature("gradient clipping, accumulation, prescale/predivide", True, _never),
    Feature("optimizer and scheduler sections", True, _never),
    Feature("steps_per_print and wall_clock_breakdown", True, _never),
    Feature("csv_monitor, tensorboard and wandb monitors", True, _never),
    Feature("communication_data_type and data_types.grad_accum_dtype", True, _never),
    Feature("memory_breakdown", True, _never),
    Feature("dataloader_drop_last", True, _never),
    Feature("ZeRO stage 0 (data parallel)", True, _stage(0)),
    Feature("ZeRO stage 1", True, _stage(1)),
    Feature("ZeRO stage 2", True, _stage(2)),
    Feature("ZeRO stage 3", True, _stage(3)),
    Feature("optimizer offload to CPU", True, _offload("offload_optimizer", "cpu")),
    Feature("optimizer offload to NVMe", True, _offload("offload_optimizer", "nvme")),
    Feature("parameter offload to CPU", True, _offload("offload_param", "cpu")),
    Feature("parameter offload to NVMe", True, _offload("offload_param", "nvme")),
    Feature("NVMe optimizer step under backward", True, _step_in_backward),
    Feature("host optimizer step overlapped with the next window", True, _overlap_step),
    Feature(
        "ZeRO++ quantized communication",
        True,
        _flags("zero_optimization", "zero_quantized_weights", "zero_quantized_gradients"),
    ),
    Feature(
        "ZeRO++ hierarchical partitioning",
        True,
        _above("zero_optimization.zero_hpz_partition_size", 1),
    ),
    # Not built yet.
    Feature(
        "ZeRO++ int8 storage of frozen weights",
        False,
        _flags("zero_optimization", "zero_quantized_nontrainable_weights"),
    ),
    Feature("LoCo-ZeRO++", False, _present("zero_optimization.zeropp_loco_param")),
    Feature("MiCS sharding", False, _above("zero_optimization.mics_shard_size", 0)),
    Feature(
        "ZenFlow's selective updates (the top-k gradients on the device, the rest on the host; "
        "zero_optimization.offload_optimizer.overlap_step runs the whole host step behind the next window)",
        False,
        _present("zero_optimization.zenflow"),
    ),
    Feature(
        "fp16 master weights and gradients", False, _flags("fp16", "fp16_master_weights_and_grads")
    ),
    Feature(
        "bf16 master weights / optimizer states",
        True,
        _flags("bf16", "bf16_master_weights_and_grads", "bf16_optimizer_states"),
    ),
    Feature("flops profiler", True, _flags("flops_profiler", "enabled")),
    Feature("communication logger", True, _flags("comms_logger", "enabled")),
    Feature("torch.profiler trace window", True, _flags("profiler", "enabled")),
    Feature(
        "asynchronous checkpoint save",
        True,
        _set_true("checkpoint.async_save", "checkpoint.async"),
    ),
    Feature(
        "universal / node-local / pipeline-parallel checkpoint I/O",
        False,
        _combine(
            _flags("checkpoint", "load_universal", "use_node_local_storage"),
            _flags("checkpoint.parallel_write", "pipeline_stage"),
        ),
    ),
    Feature("checkpoint writer engines", False, _present("checkpoint.writer")),
    Feature("sparse gradients", True, _flags("", "sparse_gradients")),
    Feature("engine state dump", False, _flags("", "dump_state")),
    Feature("summed (not averaged) gradient reduction", True, _sum_reduction),
    Feature("unmanaged gradient accumulation (reduction in step())", True, _unmanaged_accumulation),
    Feature("disabling Python's cyclic garbage collector", False, _flags("", "disable_python_gc")),
    Feature("CUDA graph harvesting", False, _flags("", "graph_harvesting")),
    Feature("DeepCompile", False, _deepcompile),
    Feature("sparse attention", False, _present("sparse_attention")),
    Feature("weight quantization", False, _present("weight_quantization")),
    *(
        Feature(description, False, _loose_enabled(section))
        for section, description in (
            ("amp", "Apex AMP"),
            ("autotuning", "autotuning"),
            ("compression_training", "compression training"),
            ("data_efficiency", "data efficiency (curriculum / data routing)"),
            ("curriculum_learning", "curriculum learning"),
            ("progressive_layer_drop", "progressive layer drop"),
            ("eigenvalue", "eigenvalue computation"),
            ("quantize_training", "quantization-aware training"),
            ("hybrid_engine", "hybrid (RLHF) engine"),
            ("nebula", "Nebula checkpointing"),
            ("datastates", "DataStates checkpointing"),
            ("comet", "Comet monitor"),
            ("trackio", "Trackio monitor"),
        )
    ),
)


def unbuilt_settings(cfg: Config) -> list[str]:
    """One line per setting in ``cfg`` that asks for a feature with ``built=False``."""
    lines: list[str] = []
    for feature in FEATURES:
        if feature.built:
            continue
        for setting in feature.requests(cfg):
            lines.append(
                f"{setting}: {feature.description} is not built yet in this version of terascale"
            )
    return lines
