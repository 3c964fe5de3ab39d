"""The ``zero_optimization``, offload and ``aio`` sections, with DeepSpeed's keys and defaults.

Field names follow DeepSpeed's ``DeepSpeedZeroConfig`` (``max_live_parameters`` with the JSON
alias ``stage3_max_live_parameters``, ...), so either spelling loads. Which of these settings
terascale can act on yet is decided in :mod:`terascale.config.features`, not here.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from terascale.config.errors import field_for_key
from terascale.config.section import Section, parse_number

OffloadDevice = Literal["none", "cpu", "nvme"]


class _OffloadTarget(Section):
    """What both offload sections share: the device, the NVMe directory, pinned buffers."""

    device: OffloadDevice = "none"
    nvme_path: Path | None = None
    pin_memory: bool = False

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> _OffloadTarget:
        if self.device == "nvme" and self.nvme_path is None:
            raise ValueError("nvme_path is required when device is 'nvme'; set it to a directory")
        return self


class OffloadParamConfig(_OffloadTarget):
    """``zero_optimization.offload_param``: where stage-3 parameter shards live between uses."""

    buffer_count: int = Field(5, ge=0)
    buffer_size: int = Field(100_000_000, ge=0)
    max_in_cpu: int = Field(1_000_000_000, ge=0)


class OffloadOptimizerConfig(_OffloadTarget):
    """``zero_optimization.offload_optimizer``: where optimizer state lives and steps."""

    buffer_count: int = Field(4, ge=0)
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    super_offload: bool = False
    convert_grad_on_cpu: bool = True
    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)
    # Beyond DeepSpeed: with "nvme", step each optimizer run under the window's last backward
    # as soon as its gradients are final ([Note: the optimizer step under backward]):
    # "auto" where the config allows it, true (an error where it does not), false (off).
    step_in_backward: Literal["auto"] | bool = "auto"
    # Beyond DeepSpeed's ZeRO-Offload (ZenFlow's name for its switch): the host step of a
    # window runs while the next one computes, on parameters one step old ([Note: the
    # overlapped host step]).
    overlap_step: bool = False
    # The first steps of an overlapped run are taken synchronously: with one step of
    # delay the early updates, while the gradients change fast, train worse (ZeRO-Offload's
    # DPU starts after a warm-up too; ZenFlow's full_warm_up_rounds).
    overlap_step_warmup: int = Field(40, ge=0)

    @model_validator(mode="after")
    def _overlap_needs_the_whole_step_on_the_host(self) -> OffloadOptimizerConfig:
        if self.overlap_step and self.device == "none":
            raise ValueError("overlap_step runs the host's optimizer step behind the next window; set device to "
                             "'cpu' or 'nvme', or drop overlap_step")  # fmt: skip
        if self.overlap_step and self.ratio < 1.0:
            raise ValueError(f"overlap_step with ratio {self.ratio}: the runs kept on the device would step at the "
                             "boundary while the others step behind the next window, on parameters of two ages; "
                             "set ratio to 1 (the default), or drop overlap_step")  # fmt: skip
        return self

    @property
    def pipeline(self) -> bool:
        """True when NVMe reads or writes of neighbouring tiles overlap the optimizer step."""
        return self.pipeline_read or self.pipeline_write


class ZeroConfig(Section):
    """``zero_optimization``: sharding stage, bucket sizes, stage-3 knobs, offload, ZeRO++."""

    stage: int = 0
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = Field(500_000_000, ge=0)
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: int = Field(500_000_000, ge=0)
    # DeepSpeed's default depends on the stage (on for 3, off otherwise); filled in below.
    overlap_comm: bool = False
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    offload_param: OffloadParamConfig | None = None
    offload_optimizer: OffloadOptimizerConfig | None = None
    zenflow: dict[str, Any] | None = None
    sub_group_size: int = Field(1_000_000_000, ge=0)

    # Deprecated DeepSpeed spellings of offload; translated into offload_* below.
    cpu_offload: bool | None = None
    cpu_offload_param: bool | None = None
    cpu_offload_use_pin_memory: bool | None = None

    prefetch_bucket_size: int = Field(50_000_000, ge=0, alias="stage3_prefetch_bucket_size")
    # Beyond DeepSpeed: every nn.Linear with more weight elements than this becomes a
    # TiledLinear of tiles at most this big ([Note: tiled linear layers]).
    tile_linear_above: int | None = Field(None, gt=0)
    param_persistence_threshold: int = Field(
        100_000, ge=0, alias="stage3_param_persistence_threshold"
    )
    model_persistence_threshold: int = Field(
        sys.maxsize, ge=0, alias="stage3_model_persistence_threshold"
    )
    max_live_parameters: int = Field(1_000_000_000, ge=0, alias="stage3_max_live_parameters")
    max_reuse_distance: int = Field(1_000_000_000, ge=0, alias="stage3_max_reuse_distance")
    gather_16bit_weights_on_model_save: bool = Field(
        False,
        validation_alias=AliasChoices(
            "gather_16bit_weights_on_model_save",
            "stage3_gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
        ),
    )
    module_granularity_threshold: int = Field(0, alias="stage3_module_granularity_threshold")
    use_all_reduce_for_fetch_params: bool = Field(
        False, alias="stage3_use_all_reduce_for_fetch_params"
    )
    allgather_sequential: bool = Field(False, alias="stage3_allgather_sequential")
    partition_stream_chunk_size: int = Field(0, ge=0, alias="stage3_partition_stream_chunk_size")

    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    round_robin_gradients: bool = False
    zero_hpz_partition_size: int = Field(1, ge=0)
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    zeropp_loco_param: dict[str, Any] | None = None
    mics_shard_size: int = -1
    mics_hierarchical_params_gather: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    leaf_module: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _fill_deepspeed_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("overlap_comm") is None:
            data["overlap_comm"] = data.get("stage", 0) in (3, "3")
        pin = bool(data.get("cpu_offload_use_pin_memory") or False)
        # The deprecated booleans ask for CPU offload; carry that into the modern sections
        # unless the user also wrote those, so later stages read one place.
        if data.get("cpu_offload") is True and data.get("offload_optimizer") is None:
            data["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
        if data.get("cpu_offload_param") is True and data.get("offload_param") is None:
            data["offload_param"] = {"device": "cpu", "pin_memory": pin}
        return data

    @field_validator("stage")
    @classmethod
    def _known_stage(cls, stage: int) -> int:
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"expected one of 0, 1, 2, 3, got {stage}")
        return stage

    @model_validator(mode="after")
    def _partial_offload_needs_stage3(self) -> ZeroConfig:
        if self.offload_optimizer is not None and self.offload_optimizer.ratio < 1.0:
            if self.stage != 3:
                raise ValueError(
                    f"offload_optimizer.ratio {self.offload_optimizer.ratio} < 1 (partial offload) "
                    f"needs stage 3, but stage is {self.stage}; set ratio to 1.0 or stage to 3"
                )
        return self


PositiveOrAuto = Annotated[int, Field(gt=0)] | Literal["auto"]
_AIO_PROBED = ("block_size", "queue_depth", "thread_count", "backend")


class AioConfig(Section):
    """``aio``: the asynchronous NVMe I/O engine (used only with NVMe offload).

    The defaults are terascale's, measured (``bench/aio.py``): 16 MiB pieces, 16 in flight;
    DeepSpeed's are 1 MiB and 8. ``"auto"`` for any of ``block_size``, ``queue_depth``,
    ``thread_count`` and ``backend`` (or ``"aio": "auto"`` for all four) measures them on
    the NVMe path at start-up ([Note: the aio probe]); ``"auto"`` here is data for the
    engine, not a value an integration fills.
    """

    block_size: PositiveOrAuto = 16 << 20
    queue_depth: PositiveOrAuto = 16
    thread_count: PositiveOrAuto = Field(1, alias="intra_op_parallelism")
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False
    # terascale's own: "threads" (thread_count x queue_depth threads in preadv/pwritev) or
    # "kernel" (the kernel's AIO queue, as DeepSpeed's op uses) ([Note: the kernel AIO backend]).
    backend: Literal["threads", "kernel", "auto"] = "threads"

    @model_validator(mode="before")
    @classmethod
    def _auto_and_number_strings(cls, data: Any) -> Any:
        if data == "auto":
            return dict.fromkeys(_AIO_PROBED, "auto")
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for key, value in data.items():  # "1e6" is a number here too, as in other sections
            if field_for_key(cls, key) in _AIO_PROBED[:3] and isinstance(value, str) and value != "auto":
                out[key] = parse_number(value, integer=True)
        return out
