"""``pipeline`` and ``tensor_parallel``: DeepSpeed's model-parallel sections.

Both are read as DeepSpeed reads them: loosely (keys of DeepSpeed's own inference or
kernel-injection paths are ignored with a note, near-misspellings of the keys below are
errors). The sizes they give must agree with the topology the model is trained on: the
engine checks ``pipeline.stages`` against a ``PipelineModule``'s stages and the
tensor-parallel size against the mpu's group.

[Note: data-parallel size]
Batch sizes count data-parallel replicas, not ranks: the ranks of one tensor-parallel
group (and of one pipeline, one sequence-parallel group) work on the same samples, so
``train_batch_size = micro × accumulation × world / (tp × pp × sp)``, as DeepSpeed's
config divides the world by its mpu. Where the mpu exists (``terascale.initialize``) its
data-parallel group says it; before it does (the Trainer and Lightning integrations
resolve ``"auto"`` first) :func:`data_parallel_size` derives it from the config's sizes.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from terascale.config.errors import ConfigError
from terascale.config.section import Section

_PARTITIONS = ("best", "parameters", "uniform")


class PipelineConfig(Section):
    """``pipeline``: the settings of ``terascale.pipe.PipelineModule`` training.

    ``stages`` ("auto": the PipelineModule's own) and ``partition`` ("best" =
    "parameters", "uniform", or "type:REGEX") are DeepSpeed's; ``virtual_stages`` (model
    chunks per rank for the interleaved 1F1B schedule) is terascale's.
    ``pipe_partitioned``/``grad_partitioned`` (DeepSpeed: activations and gradients
    between stages split across tensor-parallel ranks and re-gathered) are accepted.
    """

    stages: int | Literal["auto"] = "auto"
    partition: str = "best"
    seed_layers: bool = False
    activation_checkpoint_interval: int = Field(0, ge=0)
    pipe_partitioned: bool = True
    grad_partitioned: bool = True
    use_reentrant: bool = True
    virtual_stages: int = Field(1, ge=1)

    @field_validator("stages")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"must be >= 1 or 'auto', got {value}")
        return value

    @field_validator("partition")
    @classmethod
    def _partition(cls, value: str) -> str:
        if value.lower() in _PARTITIONS:
            return value.lower()
        if value.startswith("type:"):
            try:
                re.compile(value[5:])
            except re.error as e:
                raise ValueError(f"'type:' must be followed by a regular expression: {e}") from None
            return value
        raise ValueError(f"expected one of {', '.join(_PARTITIONS)} or 'type:REGEX', got {value!r}")

    @property
    def partition_method(self) -> str:
        """The ``PipelineModule`` partition method this names ("best" is "parameters")."""
        return "parameters" if self.partition == "best" else self.partition


class TPInnerConfig(Section):
    """``tensor_parallel.tp`` (DeepSpeed's nested spelling)."""

    tp_size: int = Field(1, ge=1)
    tp_grain_size: int = Field(1, ge=1)


class TensorParallelConfig(Section):
    """``tensor_parallel``: the tensor-parallel size and automatic slicing.

    ``autotp_size: N`` slices a Hugging Face model's attention and MLP projections over N
    ranks inside ``terascale.initialize`` (``terascale.parallel.tensor.auto_tp``);
    ``tp_size`` (or ``tp.tp_size``) only states the size of a model that is already
    tensor-parallel (built from ``terascale.parallel.tensor`` layers with an mpu).
    """

    autotp_size: int = Field(0, ge=0)
    tp_size: int = Field(1, ge=1)
    tp: TPInnerConfig = Field(default_factory=TPInnerConfig)

    @model_validator(mode="after")
    def _one_size(self) -> TensorParallelConfig:
        given = {k: v for k, v in (("autotp_size", self.autotp_size), ("tp_size", self.tp_size), ("tp.tp_size", self.tp.tp_size)) if v > 1}
        if len(set(given.values())) > 1:
            raise ValueError(f"tensor-parallel sizes disagree: {', '.join(f'{k}={v}' for k, v in given.items())}")
        return self

    @property
    def size(self) -> int:
        """The tensor-parallel size asked for (1: none)."""
        return max(self.autotp_size, self.tp_size, self.tp.tp_size, 1)


def data_parallel_size(world_size: int, tp: int = 1, pp: int = 1, sp: int = 1) -> int:
    """The data-parallel replicas of ``world_size`` ranks with tensor-, pipeline- and
    sequence-parallel sizes ``tp``, ``pp`` and ``sp`` (see [Note: data-parallel size]).
    Raises ConfigError when they do not divide the world."""
    model_parallel = tp * pp * sp
    if world_size % model_parallel:
        raise ConfigError(
            f"{world_size} ranks do not split into tensor-parallel size {tp} × pipeline stages {pp} × "
            f"sequence-parallel size {sp} = {model_parallel}; run on a multiple of {model_parallel} ranks "
            "or change those sizes"
        )
    return world_size // model_parallel


class ExpertParallelConfig(Section):
    """``expert_parallel`` (DeepSpeed's AutoEP section; ``moe`` is terascale's shorter
    name for it): split the experts of a Hugging Face MoE model over expert-parallel
    groups of ``autoep_size`` ranks inside ``terascale.initialize`` (``ep_size`` is
    another spelling). On when ``enabled`` is true, or when it is left out and the size is
    above 1. Layers a program builds itself (``deepspeed.moe.layer.MoE``) take their
    ``ep_size`` from their constructor instead.

    ``use_grouped_mm``: all local experts in one grouped matmul where shapes allow;
    ``preset_model``: DeepSpeed's name for the model family, checked against the model;
    ``load_balance_coeff`` must stay null (as in DeepSpeed: the model's own auxiliary
    loss applies); ``expert_tensor_parallel_size`` must be 1.
    """

    enabled: bool | None = None
    autoep_size: int = Field(1, ge=1, validation_alias=AliasChoices("autoep_size", "ep_size"))
    preset_model: Literal["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "olmoe"] | None = None
    use_grouped_mm: bool = True
    load_balance_coeff: None = None
    expert_tensor_parallel_size: Literal[1] = 1

    @field_validator("load_balance_coeff", mode="before")
    @classmethod
    def _no_load_balance_coeff(cls, value: Any) -> None:
        if value is not None:  # DeepSpeed refuses every value too, in these words
            raise ValueError(
                f"expert_parallel.load_balance_coeff={value!r} is not supported: the model's own auxiliary "
                "loss balances the experts (there is no expert_bias balancing); set it to null or omit it"
            )
        return None

    @property
    def active(self) -> bool:
        return bool(self.enabled) if self.enabled is not None else self.autoep_size > 1


class SequenceParallelConfig(Section):
    """``sequence_parallel``: Ulysses sequence parallelism and tiled compute (terascale's
    section; DeepSpeed's top-level ``sequence_parallel_size`` gives the size too).

    ``size``: ranks that split each sequence between them ([Note: sequence-parallel
    groups]). ``tiled_mlp`` / ``tiled_loss``: compute a Hugging Face causal LM's MLPs and
    its loss (logits and cross-entropy) in sequence tiles ([Note: tiled compute]);
    ``"auto"`` tiles under sequence parallelism once a rank's slice reaches
    ``tile_above`` tokens, and never without it. ``mlp_tiles``: tiles per MLP call
    (``"auto"``: the slice's length over the hidden size, rounded up, as DeepSpeed's
    ``TiledMLP`` recipe does); ``loss_tile_bytes``: the fp32 logits one loss tile may hold.
    ``split_batches``: the engine's model cuts each whole batch into this rank's slice and
    returns the whole batch's loss; off, the program feeds slices itself (DeepSpeed's ALST
    data loader adapter) and gets the slice's loss.
    """

    size: int = Field(1, ge=1)
    split_batches: bool = True
    tiled_mlp: bool | Literal["auto"] = "auto"
    tiled_loss: bool | Literal["auto"] = "auto"
    tile_above: int = Field(8192, ge=1)
    mlp_tiles: int | Literal["auto"] = "auto"
    loss_tile_bytes: int = Field(64 << 20, ge=1)
