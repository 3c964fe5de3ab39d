"""DeepSpeed's ZeRO-3 parameter attributes (``param.ds_status``, ``ds_numel``, ``ds_shape``,
``ds_id``, ``ds_tensor``, ``ds_persist``, ``ds_active_sub_modules``, ``is_external_param``,
``partition_numel()``),
answered by whoever partitions the parameter; and ``optimizer.parameter_offload``, the
parameter coordinator TRL reads around generation.

[Note: ZeRO-3 parameter attributes]
Libraries written for DeepSpeed read these on the parameters they get from
``model.parameters()``: TRL (``p.ds_status != ZeroParamStatus.AVAILABLE`` before gathering a
head it reads directly; ``ds_active_sub_modules`` around generation), transformers'
``get_model_param_count`` and PEFT's parameter counts (``ds_numel``), PEFT's tuners (the
unsharded ``ds_shape`` of a weight built under ``zero.Init``), Lightning's model summary
(``ds_numel``, ``partition_numel()``). Most test ``hasattr(p, "ds_numel")`` first and take a
wrong path without them (a ZeRO-3 model counted as 0 parameters); TRL does not test, and
fails. DeepSpeed stores them on each parameter and updates ``ds_status`` at every gather
and release. terascale keeps the sharded state in its own objects (the group's
``ShardState``, its layout and shard) and attaches nothing to parameters (DESIGN.md), so the
rule bends only this far:

- A parameter a ZeRO-3 owner partitions (a stage-3 :class:`~terascale.zero.ShardedState`,
  a live :class:`~terascale.zero.Init`) has its class set to :class:`ZeroParameter`, a
  subclass of ``nn.Parameter`` adding nothing but read-only properties. Each property asks
  the owner that the [Note: owner table] names for the parameter's :class:`Partition`,
  built from the owner's state at that moment: ``ds_status`` *is* the group's ShardState,
  never a copy that could go stale. The parameter itself holds no new state, and nothing
  runs in the training step: no hook, no update at gather or release, no per-access check
  (the properties cost only when read, by code that reads them). ``__torch_function__``
  stays disabled, as on ``nn.Parameter``, so operators see a plain parameter.
- The class is set back to ``nn.Parameter`` when the owner lets go (``engine.destroy()``,
  an Init whose parameters an engine takes over below stage 3), so ZeRO-1/2 parameters,
  like DeepSpeed's, have no ``ds_*`` attributes and ``hasattr`` probes stay truthful. A
  property read with no ZeRO-3 owner raises AttributeError. Copies (``copy.deepcopy``,
  pickling) are plain parameters: they are not partitioned.
- Only exact ``nn.Parameter`` objects change class; another subclass (a quantized
  parameter type) is left alone and has no ``ds_*`` attributes.

Why a class and not a wrapper: the libraries hold the parameter itself (``model.parameters()``),
so whatever answers must be that object; a ``__getattr__`` fallback would do the same work
less visibly. Why not real attributes, as DeepSpeed: ``ds_status`` would need writing at
every gather and free of every group (state in two places, in the hot path). Autograd,
``torch.compile``, ``state_dict`` and the optimizer (which steps fp32 masters, not these
parameters) see an ``nn.Parameter``; ``tests/test_trl_native.py`` checks each.

[Note: the parameter coordinator TRL reads]
TRL's ``unwrap_model_for_generation`` gathers every parameter (``GatheredParameters``), then
"removes the ZeRO-3 hooks" through ``engine.optimizer.parameter_offload`` (DeepSpeed's
``DeepSpeedZeRoOffload``: ``.module`` with ``named_parameters()`` and
``ds_external_parameters()``, the ``forward_hooks``/``backward_hooks`` handle lists it empties,
``_register_deepspeed_module`` to re-arm them) so that generation's many forwards neither
fetch nor free. terascale's gather schedule needs no removal for that: the groups a
``GatheredParameters`` holds are pinned ([Note: pinned groups]), so a forward inside frees
none of them and gathers nothing, and its hooks then cost a little Python per module.
:class:`ParameterOffload` answers TRL's reads with that: empty hook lists, a re-arm that
has nothing to do. The engine sets it on its optimizer at stage 3, the one attribute it
adds to an optimizer object, because that is where TRL looks.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from terascale.zero.external import registered_external_parameters
from terascale.zero.flat_group import FlatParamGroup, ShardState
from terascale.zero.gather import owner_of


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's ZeRO-3 parameter status (``param.ds_status``)."""

    AVAILABLE = 1  # full on this rank: a gathered group, or a persistent one
    NOT_AVAILABLE = 2  # only this rank's shard holds data; the parameter is an empty tensor
    INFLIGHT = 3  # an all-gather is on its way


STATUS_OF_STATE = {
    ShardState.UNSHARDED: ZeroParamStatus.AVAILABLE,
    ShardState.GATHERING: ZeroParamStatus.INFLIGHT,
    ShardState.SHARDED: ZeroParamStatus.NOT_AVAILABLE,
}


@dataclass(frozen=True)
class Partition:
    """What a ZeRO-3 owner says about one of its parameters, now."""

    shape: torch.Size  # the full (unsharded) shape
    status: ZeroParamStatus
    local: torch.Tensor  # this rank's elements of the flattened parameter (a view of its shard)
    index: int  # the parameter's number among its owner's parameters
    persistent: bool = False  # never freed between uses (stage3_param_persistence_threshold)
    active_modules: set[int] = field(default_factory=set)  # id() of the running modules holding it
    external: bool = False  # read by a module other than its owner ([Note: parameters read outside their owner])


class PartitioningOwner(Protocol):
    def zero3_partition(self, param: nn.Parameter) -> Partition:
        """``param``'s :class:`Partition` as of now."""


def _partition(param: nn.Parameter) -> Partition:
    describe = getattr(owner_of(param), "zero3_partition", None)
    if describe is None:
        raise AttributeError("no ZeRO-3 owner partitions this parameter, so it has no ds_* attributes")
    return describe(param)


class ZeroParameter(nn.Parameter):
    """An ``nn.Parameter`` that a ZeRO-3 owner partitions: DeepSpeed's ``ds_*`` attributes,
    read-only, answered by the owner (see [Note: ZeRO-3 parameter attributes]). Never
    constructed: :func:`expose` sets an existing parameter's class."""

    @property
    def ds_shape(self) -> torch.Size:
        return _partition(self).shape

    @property
    def ds_numel(self) -> int:
        return _partition(self).shape.numel()

    @property
    def ds_status(self) -> ZeroParamStatus:
        return _partition(self).status

    @property
    def ds_id(self) -> int:
        return _partition(self).index

    @property
    def ds_tensor(self) -> torch.Tensor:
        """This rank's elements, flattened: a view of the shard in the compute dtype (the
        optimizer steps fp32 masters of its own; write through ``safe_set_full_fp32_param``)."""
        return _partition(self).local

    @property
    def ds_persist(self) -> bool:
        return _partition(self).persistent

    @property
    def ds_active_sub_modules(self) -> set[int]:
        """``id()`` of the modules whose forward holds the parameter gathered now; a new set
        at each read (clearing it changes nothing: the gather schedule keeps its own)."""
        return set(_partition(self).active_modules)

    @property
    def is_external_param(self) -> bool:
        """Its group is gathered for a module other than its owner (DeepSpeed marks the one
        parameter read; terascale gathers, and answers, by group)."""
        return _partition(self).external

    def partition_numel(self) -> int:
        return _partition(self).local.numel()

    def ds_summary(self) -> dict[str, Any]:
        """DeepSpeed's one-line picture of a ZeRO-3 parameter (what its assertions print)."""
        return {"id": self.ds_id, "status": self.ds_status.name, "numel": self.numel(), "ds_numel": self.ds_numel,
                "shape": tuple(self.shape), "ds_shape": tuple(self.ds_shape), "requires_grad": self.requires_grad,
                "grad_shape": tuple(self.grad.shape) if self.grad is not None else None, "persist": self.ds_persist,
                "active_sub_modules": self.ds_active_sub_modules, "ds_tensor.shape": tuple(self.ds_tensor.shape)}  # fmt: skip

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Parameter:
        if id(self) not in memo:  # a copy is not partitioned: a plain parameter
            memo[id(self)] = nn.Parameter(copy.deepcopy(self.data, memo), self.requires_grad)
        return memo[id(self)]


def expose(params: Iterable[nn.Parameter]) -> None:
    """Give ``params`` (each entered in the owner table by a ZeRO-3 owner) the ``ds_*`` attributes."""
    for p in params:
        if type(p) is nn.Parameter:
            p.__class__ = ZeroParameter


def withdraw(params: Iterable[nn.Parameter]) -> None:
    """Make ``params`` plain ``nn.Parameter`` objects again (their owner let go)."""
    for p in params:
        if type(p) is ZeroParameter:
            p.__class__ = nn.Parameter


def group_partition(
    fg: FlatParamGroup, param: nn.Parameter, index: int, active_modules: set[int], external: bool = False
) -> Partition:
    """The :class:`Partition` of ``param`` in the flat group ``fg`` (see ``FlatLayout``)."""
    k = next(i for i, p in enumerate(fg.params) if p is param)  # by identity (== compares tensors)
    local = fg.shard[:0]
    for frag in fg.layout.fragments(fg.rank):
        if frag.slot == k and fg.shard.numel() >= frag.shard_offset + frag.numel:  # empty while on NVMe
            local = fg.shard[frag.shard_offset : frag.shard_offset + frag.numel]
    return Partition(
        fg.layout.slots[k].shape, STATUS_OF_STATE[fg.state], local, index, fg.persistent, active_modules, external
    )  # fmt: skip


class _ModuleParameters:
    """``parameter_offload.module``: the model's parameters and its registered externals."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterable[tuple[str, nn.Parameter]]:
        return self._module.named_parameters(*args, **kwargs)

    def parameters(self, *args: Any, **kwargs: Any) -> Iterable[nn.Parameter]:
        return self._module.parameters(*args, **kwargs)

    def ds_external_parameters(self) -> list[tuple[int, nn.Parameter]]:
        """``(id, parameter)`` of the parameters registered on the model itself
        (``register_external_parameter``), as DeepSpeed's module method lists them."""
        return [(id(p), p) for p in registered_external_parameters(self._module)]


class ParameterOffload:
    """``engine.optimizer.parameter_offload`` at stage 3 (see [Note: the parameter
    coordinator TRL reads]): nothing to remove, nothing to re-arm."""

    def __init__(self, module: nn.Module) -> None:
        self.module = _ModuleParameters(module)
        self.forward_hooks: list[Any] = []
        self.backward_hooks: list[Any] = []

    def _register_deepspeed_module(self, module: Any) -> None:
        """Nothing: the gather schedule's hooks were never removed."""
