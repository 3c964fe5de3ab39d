"""The whole training config as one typed pydantic model, DeepSpeed-compatible.

An existing ``ds_config.json`` loads unchanged: every top-level key DeepSpeed reads is a
field here, with DeepSpeed's name, alias and default. Sections terascale acts on are typed
models (``cfg.fp16.enabled``, ``cfg.zero_optimization.offload_optimizer.device``); sections
it only has to recognise are kept as plain dicts. Loading validates everything and reports
all problems in one :class:`ConfigError`; :meth:`Config.require_built` then refuses any
setting that asks for a feature this version does not provide.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Literal

import torch
from pydantic import AliasChoices, Field, PrivateAttr, ValidationError, field_validator, model_validator

from terascale.config.auto import AutoContext, Resolved, find_autos, resolve_autos, without
from terascale.config.batch import BatchSizes, resolve_batch_sizes
from terascale.config.compat import upgrade
from terascale.config.elasticity import ElasticityConfig, resolve_elastic_batch
from terascale.config.errors import ConfigError, from_validation_error, key_names, submodel
from terascale.config.features import unbuilt_settings
from terascale.config.health import HealthConfig
from terascale.config.paths import MISSING
from terascale.config.paths import get as get_path
from terascale.config.parallel import (
    ExpertParallelConfig,
    PipelineConfig,
    SequenceParallelConfig,
    TensorParallelConfig,
    data_parallel_size,
)
from terascale.config.planner import PlannerConfig
from terascale.config.precision import (
    BOTH_PRECISIONS,
    Bf16Config,
    DataTypesConfig,
    Fp16Config,
    TorchAutocastConfig,
    both_precisions_raw,
    param_dtype_conflict,
)
from terascale.config.profiling import CommsLoggerConfig, FlopsProfilerConfig, TraceConfig
from terascale.config.section import TORCH_DTYPES, DtypeName, Section, normalize_dtype_name
from terascale.config.source import read_source
from terascale.config.zero import AioConfig, ZeroConfig

LooseSection = dict[str, Any] | None

class OptimizerConfig(Section):
    """``optimizer``: a name the optimizer factory resolves, and its keyword arguments."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)
    legacy_fusion: bool = False


class SchedulerConfig(Section):
    """``scheduler``: a name the scheduler factory resolves, and its keyword arguments."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class ActivationCheckpointingConfig(Section):
    """``activation_checkpointing``: DeepSpeed's keys for its checkpointing API, and
    ``policy`` / ``every_n`` / ``nvme_path`` (beyond DeepSpeed) for checkpointing a model's
    blocks without model changes and spilling checkpoints to disk."""

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: int | None = Field(None, gt=0)
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    # "auto" (the planner's choice) is read as absent, like every "auto" ([Note: planned values]).
    policy: Literal["none", "blocks", "every_n", "selective"] = "none"
    every_n: int = Field(2, gt=0)
    nvme_path: str | None = None

    @model_validator(mode="after")
    def _nvme_needs_offload(self) -> ActivationCheckpointingConfig:
        if self.nvme_path is not None and not self.cpu_checkpointing:
            raise ValueError(
                "activation_checkpointing.nvme_path spills the checkpoints that cpu_checkpointing moves off the "
                "device; set activation_checkpointing.cpu_checkpointing: true (or remove nvme_path)"
            )
        if self.nvme_path == "":
            raise ValueError("activation_checkpointing.nvme_path is empty; name a directory on the NVMe disk")
        return self


class TensorBoardConfig(Section):
    """``tensorboard``: scalar logging with ``torch.utils.tensorboard``."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class CsvMonitorConfig(Section):
    """``csv_monitor``: scalar logging to one CSV file per metric."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class WandbConfig(Section):
    """``wandb``: scalar logging to Weights & Biases."""

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


class ParallelWriteConfig(Section):
    """``checkpoint.parallel_write``."""

    pipeline_stage: bool = False


class LeaseConfig(Section):
    """``checkpoint.lease``: one writer per checkpoint directory ([Note: checkpoint directory
    lease] in ``terascale.checkpoint.lease``). Rank 0 renews the lease every ``heartbeat_s``;
    another job may take over a directory whose holder was silent for ``expiry_s``."""

    enabled: bool = True
    heartbeat_s: float = Field(1.0, gt=0)
    expiry_s: float = Field(6.0, gt=0)

    @model_validator(mode="after")
    def _expiry_covers_heartbeats(self) -> LeaseConfig:
        if self.expiry_s < 3 * self.heartbeat_s:
            raise ValueError(
                f"checkpoint.lease.expiry_s ({self.expiry_s}) must be at least 3 x heartbeat_s ({self.heartbeat_s}): "
                "a holder late by one heartbeat would lose its directory"
            )
        return self


class CheckpointConfig(Section):
    """``checkpoint``: DeepSpeed's checkpoint keys plus terascale's retention and async save."""

    tag_validation: Literal["WARN", "IGNORE", "FAIL"] = "WARN"
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    checkpoint_serialization: bool = True
    writer: LooseSection = None
    keep_last_n: int | None = Field(None, ge=1)
    async_save: bool = Field(False, alias="async")
    # terascale's runs that save and resume by themselves ("Long runs" in the README):
    # interval saves (always asynchronous) into save_dir, through local_dir when given;
    # initialize() loads the newest complete checkpoint when auto_resume is on; SIGTERM
    # saves before the process exits, within signal_deadline_s.
    save_dir: str | None = None
    interval_steps: int | None = Field(None, ge=1)
    interval_seconds: float | None = Field(None, gt=0)
    auto_resume: bool = False
    local_dir: str | None = None
    save_on_signal: bool = True
    signal_deadline_s: float = Field(25.0, gt=0)
    # Load a checkpoint's client_state.pt (written before client state was saved as data,
    # [Note: client state as data]): unpickling it can run any code the file names, so only
    # for checkpoints you trust. engine.load_checkpoint(allow_pickled_client_state=) overrides.
    allow_pickled_client_state: bool = False
    # Re-read a checkpoint's files and compare their checksums before loading it (auto_resume
    # passes over a corrupted one; load_checkpoint raises): one more read of the checkpoint,
    # split over the ranks ([Note: checkpoint checksums] in terascale.checkpoint.integrity).
    verify_content: bool = True
    lease: LeaseConfig = Field(default_factory=LeaseConfig)
    # Interval saves that may fail in a row (a full disk) before the job stops: training
    # goes on meanwhile and the newest complete checkpoint is kept.
    max_failed_saves: int = Field(3, ge=1)

    @model_validator(mode="after")
    def _needs_save_dir(self) -> CheckpointConfig:
        if self.save_dir is None:
            asked = [
                key
                for key, value in (
                    ("interval_steps", self.interval_steps),
                    ("interval_seconds", self.interval_seconds),
                    ("auto_resume", self.auto_resume or None),
                    ("local_dir", self.local_dir),
                )
                if value is not None
            ]
            if asked:
                raise ValueError(
                    f"checkpoint.{asked[0]} needs checkpoint.save_dir: the directory the run saves to and resumes from"
                )
        for key in ("save_dir", "local_dir"):
            if getattr(self, key) == "":
                raise ValueError(f"checkpoint.{key} is empty; name a directory")
        if self.local_dir is not None and Path(self.local_dir).resolve() == Path(str(self.save_dir)).resolve():
            raise ValueError(
                "checkpoint.local_dir is the same directory as checkpoint.save_dir; local_dir is a faster "
                "node-local disk that saves go to first (remove it, or name another directory)"
            )
        return self

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        # DeepSpeed documents "Ignore"/"Warn"/"Fail" and compares upper-cased.
        if isinstance(value, str) and value.upper() in ("WARN", "IGNORE", "FAIL"):
            return value.upper()
        raise ValueError(f"expected one of 'Warn', 'Ignore', 'Fail', got {value!r}")


class Config(Section):
    """A training config; see the module docstring. Build one with :meth:`Config.load`."""

    # Batch triplet: resolved against the data-parallel world size by resolve_batch().
    train_batch_size: int | None = Field(None, gt=0)
    train_micro_batch_size_per_gpu: int | None = Field(None, gt=0)
    gradient_accumulation_steps: int | None = Field(None, gt=0)

    gradient_clipping: float = Field(0.0, ge=0.0)
    steps_per_print: int | None = Field(10, ge=1)  # None (or infinity): never
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    prescale_gradients: bool = False
    gradient_predivide_factor: float = Field(1.0, gt=0.0)
    sparse_gradients: bool = False
    communication_data_type: DtypeName | None = None
    seq_parallel_communication_data_type: DtypeName = Field(
        "fp32", alias="seq_parallel_comm_data_type"
    )

    fp16: Fp16Config = Field(default_factory=Fp16Config)
    bf16: Bf16Config = Field(
        default_factory=Bf16Config, validation_alias=AliasChoices("bf16", "bfloat16")
    )
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)

    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True

    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    aio: AioConfig = Field(default_factory=AioConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig
    )
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    profiler: TraceConfig = Field(default_factory=TraceConfig)
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    csv_monitor: CsvMonitorConfig = Field(default_factory=CsvMonitorConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)

    health: HealthConfig = Field(default_factory=HealthConfig)
    # terascale's memory planner ("auto" stage, offload, micro-batch, checkpointing; caps).
    planner: PlannerConfig = Field(default_factory=PlannerConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    # Recognised so DeepSpeed configs load; their inner keys are not modelled, and
    # features.py refuses any that switch something on.
    comet: LooseSection = None
    trackio: LooseSection = None
    timers: LooseSection = None
    amp: LooseSection = None
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    elasticity: ElasticityConfig = Field(default_factory=ElasticityConfig)
    autotuning: LooseSection = None
    compression_training: LooseSection = None
    data_efficiency: LooseSection = None
    curriculum_learning: LooseSection = None
    progressive_layer_drop: LooseSection = None
    eigenvalue: LooseSection = None
    quantize_training: LooseSection = None
    sparse_attention: LooseSection = None
    hybrid_engine: LooseSection = None
    nebula: LooseSection = None
    datastates: LooseSection = None
    compile: LooseSection = None
    expert_parallel: ExpertParallelConfig = Field(
        default_factory=ExpertParallelConfig, validation_alias=AliasChoices("expert_parallel", "moe")
    )
    weight_quantization: LooseSection = None

    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    managed_gradient_accumulation: bool = True
    disable_python_gc: bool = False
    log_level: str | None = None
    dump_state: bool = False
    disable_allgather: bool = False
    graph_harvesting: bool = False
    dataloader_drop_last: bool = False
    vocabulary_size: int | None = Field(None, gt=0)
    use_data_before_expert_parallelism: bool = False
    sequence_parallel_size: int = Field(1, ge=1)
    sequence_parallel: SequenceParallelConfig = Field(default_factory=SequenceParallelConfig)

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _never_print(cls, value: Any) -> Any:
        # accelerate hands DeepSpeed float("inf") to mean "never".
        return None if isinstance(value, float) and value == float("inf") else value

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str | None) -> str | None:
        if value is not None and value.upper() not in ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL"):
            raise ValueError(f"expected one of 'debug', 'info', 'warning', 'error', 'critical', got {value!r}")
        return value

    @field_validator("communication_data_type", mode="before")
    @classmethod
    def _comm_dtype(cls, value: Any) -> Any:
        return normalize_dtype_name(value)

    @field_validator("seq_parallel_communication_data_type", mode="before")
    @classmethod
    def _seq_comm_dtype(cls, value: Any) -> Any:
        return normalize_dtype_name(value, allow_none=False)

    @model_validator(mode="after")
    def _one_sequence_parallel_size(self) -> Config:
        top, section = self.sequence_parallel_size, self.sequence_parallel.size
        if top > 1 and section > 1 and top != section:
            raise ValueError(
                f"sequence_parallel_size is {top} but sequence_parallel.size is {section}: they name the same "
                "size; give one of them"
            )
        return self

    @property
    def sp_size(self) -> int:
        """The sequence-parallel size asked for (1: none), by either spelling."""
        return max(self.sequence_parallel_size, self.sequence_parallel.size)

    def with_sp_size(self, size: int, given_by: str) -> Config:
        """This config with sequence-parallel size ``size``, which ``given_by`` (an mpu, the
        Trainer's arguments) asks for; raises ``ValueError`` when the config names another."""
        if self.sp_size > 1 and self.sp_size != size:
            raise ValueError(
                f"{given_by} is {size} but the config's sequence-parallel size is {self.sp_size}; make them agree "
                "(or give it in one place)"
            )
        return self.with_values(sequence_parallel_size=size)

    @model_validator(mode="after")
    def _one_precision(self) -> Config:
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError(BOTH_PRECISIONS)
        return self

    # What loading saw besides the typed values (see [Note: auto values]).
    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)
    _autos: tuple[str, ...] = PrivateAttr(default=())
    _notes: tuple[str, ...] = PrivateAttr(default=())
    _resolved: tuple[Resolved, ...] = PrivateAttr(default=())
    _label: str | None = PrivateAttr(default=None)

    # ---- loading -------------------------------------------------------------------

    @classmethod
    def load(cls, source: Config | Mapping[str, Any] | str | os.PathLike[str]) -> Config:
        """Validate ``source`` into a Config.

        ``source`` is a Config (returned as is), a dict, a path to a JSON (or hjson) file,
        a JSON string, or base64-encoded JSON (what DeepSpeed's launcher passes). Legacy
        spellings are rewritten (:attr:`notes` says how); ``"auto"`` values are read as
        absent and listed in :attr:`auto_keys` until :meth:`resolve` gives them values.
        Raises ConfigError listing every problem, each with its full key path.
        """
        if isinstance(source, Config):
            return source
        data, label = read_source(source)
        try:
            data, notes = upgrade(data, _LENIENT_SECTIONS)
        except ConfigError as err:
            raise ConfigError(err.problems, source=label) from None
        autos = find_autos(data, skip=_LOOSE_SECTIONS)
        cfg = cls._validate(without(data, autos), label)
        cfg._raw, cfg._autos, cfg._notes, cfg._label = data, tuple(autos), tuple(notes), label
        return cfg

    @classmethod
    def _validate(cls, data: dict[str, Any], label: str | None) -> Config:
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            # pydantic skips whole-model checks when a field fails; run the one that matters
            # on the raw dict so the user still sees every problem in one pass.
            extra = [BOTH_PRECISIONS] if both_precisions_raw(data) else []
            raise from_validation_error(cls, err, source=label, extra=extra) from None

    def resolve(self, context: AutoContext) -> Config:
        """This config with every ``"auto"`` given its value (``[Note: auto values]``), and
        explicit values checked against those an integration gives.

        Returns ``self`` when there is nothing to resolve. Raises ConfigError naming each
        ``"auto"`` that cannot be derived and what would set it.
        """
        if not self._autos and not context.given:
            return self
        try:
            data, done = resolve_autos(self._raw, self._autos, context)
            data, notes = upgrade(data)  # what a resolved value (a stage, say) makes moot
        except ConfigError as err:
            raise ConfigError(err.problems, source=self._label) from None
        left = tuple(p for p in self._autos if get_path(data, p) == "auto")  # deferred ([Note: auto values])
        cfg = type(self)._validate(without(data, left), self._label)
        cfg._raw, cfg._notes, cfg._label = data, self._notes + tuple(notes), self._label
        cfg._autos, cfg._resolved = left, self._resolved + tuple(done)
        return cfg

    def __eq__(self, other: object) -> bool:
        # Equal settings are equal configs, whatever file or spelling they came from.
        return type(other) is type(self) and self.__dict__ == other.__dict__ and self._autos == other._autos

    __hash__ = Section.__hash__

    def with_values(self, **values: Any) -> Config:
        """This config with top-level ``values`` set, kept through a later :meth:`resolve`
        (which validates the raw config again)."""
        cfg = self.model_copy(update=values)
        cfg._raw = {**self._raw, **values}
        return cfg

    def with_section(self, name: str, **values: Any) -> Config:
        """This config with ``values`` set inside section ``name``, kept through a later
        :meth:`resolve` as :meth:`with_values` keeps top-level ones."""
        cfg = self.model_copy(update={name: getattr(self, name).model_copy(update=values)})
        cfg._raw = {**self._raw, name: {**(self._raw.get(name) or {}), **values}}
        return cfg

    def written(self, path: str) -> Any:
        """The value the config wrote at the dotted ``path`` (``"auto"`` included, as
        written), or None where it wrote nothing."""
        value = get_path(self._raw, path)
        return None if value is MISSING else value

    @property
    def auto_keys(self) -> tuple[str, ...]:
        """Key paths whose value is still ``"auto"`` (empty once :meth:`resolve` ran)."""
        return self._autos

    @property
    def notes(self) -> tuple[str, ...]:
        """One line per legacy spelling that loading rewrote."""
        return self._notes

    @property
    def resolved(self) -> tuple[Resolved, ...]:
        """Every ``"auto"`` that :meth:`resolve` gave a value, with why that value."""
        return self._resolved

    def to_dict(self) -> dict[str, Any]:
        """The config as a JSON-ready dict with DeepSpeed's key names (aliases)."""
        return self.model_dump(mode="json", by_alias=True)

    # [Note: the config read as DeepSpeed's dict]
    # DeepSpeed's ``engine.config`` is the dict the engine was given, and the tools read it
    # as one (the Trainer's ``engine.config.get("zero_optimization", {}).get("stage")``).
    # ``get``, ``[key]`` and ``in`` read this config the same way: the keys as written (in
    # DeepSpeed's spelling, legacy ones rewritten), each "auto" as resolved, a default
    # where nothing was written; each answer is a copy, so the typed config stays as loaded.

    def get(self, key: str, default: Any = None) -> Any:
        """The top-level ``key`` as the config dict holds it, else ``default``."""
        return copy.deepcopy(self._raw.get(key, default))

    def __getitem__(self, key: str) -> Any:
        if key not in self._raw:
            raise KeyError(key)
        return copy.deepcopy(self._raw[key])

    def __contains__(self, key: object) -> bool:
        return key in self._raw

    # ---- derived values ------------------------------------------------------------

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype of forward/backward compute: fp16 or bf16 when enabled, else fp32."""
        if self.fp16.enabled:
            return torch.float16
        if self.bf16.enabled:
            return torch.bfloat16
        return torch.float32

    @property
    def buffer_dtype(self) -> torch.dtype | None:
        """dtype floating buffers are cast to (``data_types.buffer_dtype``), or None: each
        keeps its own ([Note: buffer dtypes] in ``terascale/config/precision.py``)."""
        name = self.data_types.buffer_dtype
        return TORCH_DTYPES[name] if name else None

    @property
    def grad_accum_dtype(self) -> torch.dtype:
        """dtype gradients accumulate in across micro-steps (``data_types``; default fp32)."""
        return TORCH_DTYPES[self.data_types.grad_accum_dtype or "fp32"]

    @property
    def communication_dtype(self) -> torch.dtype | None:
        """dtype gradients are reduced in, or None to reduce in the gradients' own dtype."""
        if self.communication_data_type is None:
            # DeepSpeed reduces gradients in seq_parallel_communication_data_type under
            # sequence parallelism (fp32 unless set).
            return TORCH_DTYPES[self.seq_parallel_communication_data_type] if self.sp_size > 1 else None
        return TORCH_DTYPES[self.communication_data_type]

    def data_parallel_size(self, world_size: int, pipeline_stages: int | None = None) -> int:
        """The data-parallel replicas of ``world_size`` ranks under this config's
        tensor-parallel, pipeline and sequence-parallel sizes (``pipeline_stages``: the
        model's, where ``pipeline.stages`` is "auto"); see [Note: data-parallel size]."""
        stages = self.pipeline.stages if isinstance(self.pipeline.stages, int) else (pipeline_stages or 1)
        return data_parallel_size(world_size, self.tensor_parallel.size, stages, self.sp_size)

    def data_parallel_replica(self, world_size: int, rank: int) -> tuple[int, int]:
        """(data-parallel replicas, the replica global ``rank`` belongs to), for splitting
        data before the engine exists: a tensor-parallel group, whose ranks are consecutive
        ([Note: topology]), is one replica and sees the same samples; so is a
        sequence-parallel group ([Note: sequence-parallel groups])."""
        replicas = self.data_parallel_size(world_size)
        return replicas, rank // (self.tensor_parallel.size * self.sp_size) % replicas

    def resolve_batch(self, world_size: int) -> BatchSizes:
        """The batch triplet for ``world_size`` data-parallel ranks (DeepSpeed's rules).

        An enabled ``elasticity`` section decides all three instead (see
        ``terascale.config.elasticity``). Raises ConfigError showing the arithmetic when the
        values disagree or don't divide, or naming the valid elastic world sizes.
        """
        if self.elasticity.enabled:
            return resolve_elastic_batch(
                self.elasticity,
                {
                    "train_batch_size": self.train_batch_size,
                    "train_micro_batch_size_per_gpu": self.train_micro_batch_size_per_gpu,
                    "gradient_accumulation_steps": self.gradient_accumulation_steps,
                },
                world_size,
            )
        return resolve_batch_sizes(
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
            world_size,
        )

    def unbuilt_settings(self) -> list[str]:
        """One line per setting that asks for a feature this version does not provide."""
        return unbuilt_settings(self)

    def require_built(self) -> Config:
        """Raise ConfigError listing every setting that asks for an unbuilt feature.

        Returns ``self`` so a caller can write ``cfg = Config.load(src).require_built()``.
        """
        problems = self.unbuilt_settings()
        if problems:
            raise ConfigError(problems)
        return self

    def require_agreeing_precision(self) -> Config:
        """Raise ConfigError when ``data_types.param_dtype`` names another dtype than fp16/bf16
        choose ([Note: param_dtype names the mode]). For the resolved config, at initialize:
        until then an integration may still give the flags (Lightning's ``precision`` fills
        ``bf16.enabled`` where the config has none). Returns ``self``."""
        problem = param_dtype_conflict(self.data_types.param_dtype, self.fp16.enabled, self.bf16.enabled)
        if problem:
            raise ConfigError(problem, source=self._label)
        return self


# Sections kept as plain dicts: an "auto" inside one is data (ZenFlow's and the pipeline's
# settings take "auto" as a value), not a request for a value.
_LOOSE_SECTIONS = frozenset(
    [name for name, f in Config.model_fields.items() if f.annotation == LooseSection]
    + [f"zero_optimization.{name}" for name in ("zenflow", "zeropp_loco_param", "leaf_module")]
    + ["checkpoint.writer", "pipeline"]
    # "auto" tiling decides per call, from the sequence length ([Note: tiled compute]).
    + ["sequence_parallel"]
    # "auto" in aio asks the engine to measure the value on the NVMe path ([Note: the aio probe]).
    + ["aio"]
)


def _lenient_sections() -> dict[str, list[str]]:
    """The sections DeepSpeed reads loosely (ignoring keys it does not know), with their
    valid keys: see ``[Note: DeepSpeed compatibility]``."""
    sections = {"": Config}
    for name in ("activation_checkpointing", "flops_profiler", "aio", "checkpoint", "data_types", "pipeline", "tensor_parallel",
                 "expert_parallel"):
        sections[name] = submodel(Config.model_fields[name].annotation)
    return {name: key_names(model) for name, model in sections.items()}


_LENIENT_SECTIONS = _lenient_sections()
