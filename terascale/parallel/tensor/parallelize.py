"""Swap a model's layers for tensor-parallel ones by a plan of module-name patterns.

In torchtitan's manner: ``parallelize_module(model, group, {"*.q_proj": Colwise(), ...})``
replaces every matching module, in place, under the same attribute name, so parameter
names and state-dict keys stay those of the unsliced model while each rank keeps only its
slices of the weights (see [Note: tensor slices]).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from torch import nn
from torch.distributed import ProcessGroup

from terascale.parallel.tensor.embedding import VocabParallelEmbedding
from terascale.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear
from terascale.parallel.tensor.norm import SequenceParallelNorm


@dataclass(frozen=True)
class Colwise:
    """``nn.Linear`` or Hugging Face ``Conv1D`` -> :class:`ColumnParallelLinear`."""

    fused: int = 1
    gather_output: bool = False
    sequence_parallel: bool = False


@dataclass(frozen=True)
class Rowwise:
    """``nn.Linear`` or Hugging Face ``Conv1D`` -> :class:`RowParallelLinear`."""

    input_is_parallel: bool = True
    sequence_parallel: bool = False


@dataclass(frozen=True)
class VocabParallel:
    """``nn.Embedding`` -> :class:`VocabParallelEmbedding`."""

    sequence_parallel: bool = False


@dataclass(frozen=True)
class SequenceParallel:
    """``nn.LayerNorm`` / ``nn.RMSNorm`` -> :class:`SequenceParallelNorm` (same parameters)."""


ParallelStyle = Colwise | Rowwise | VocabParallel | SequenceParallel


def is_hf_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is Hugging Face's ``Conv1D`` (a linear layer with weight ``[in, out]``)."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers is optional; without it there is no Conv1D to meet
        return False
    return isinstance(module, Conv1D)


def _convert(name: str, module: nn.Module, style: ParallelStyle, group: ProcessGroup) -> nn.Module:
    """The tensor-parallel replacement of ``module`` (called ``name``) in ``style``."""
    if isinstance(style, (Colwise, Rowwise)):
        cls = ColumnParallelLinear if isinstance(style, Colwise) else RowParallelLinear
        kwargs = asdict(style)
        if isinstance(module, nn.Linear):
            return cls.from_linear(module, group, **kwargs)
        if is_hf_conv1d(module):
            return cls.from_conv1d(module, group, **kwargs)
        expected = "nn.Linear or Conv1D"
    elif isinstance(style, VocabParallel):
        if isinstance(module, nn.Embedding):
            return VocabParallelEmbedding.from_embedding(module, group, sequence_parallel=style.sequence_parallel)
        expected = "nn.Embedding"
    else:
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            return SequenceParallelNorm.from_norm(module, group)
        expected = "nn.LayerNorm or nn.RMSNorm"
    raise ValueError(
        f"parallelize_module: '{name}' is a {type(module).__name__}; {type(style).__name__} takes {expected}"
    )


def parallelize_module(model: nn.Module, group: ProcessGroup, plan: Mapping[str, ParallelStyle]) -> nn.Module:
    """Replace, in place, every submodule whose dotted name matches a pattern of ``plan``
    (``fnmatch``: ``*`` spans dots) by its tensor-parallel version over ``group``; returns
    ``model``.

    Collective in effect: every rank of ``group`` must call it with the same model and
    plan. A pattern that matches nothing, or a module matched by two patterns, is a
    ValueError (a typo would otherwise leave layers silently replicated).
    """
    chosen: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        hits = [name for name, _ in model.named_modules() if name and fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            raise ValueError(f"parallelize_module: pattern '{pattern}' matches no submodule")
        for name in hits:
            if name in chosen:
                raise ValueError(f"parallelize_module: '{name}' matches more than one pattern of the plan")
            chosen[name] = style
    for name, style in chosen.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, _convert(name, getattr(parent, child), style, group))
    return model
