"""Reading and modifying sharded parameters in full: ``GatheredParameters``.

[Note: owner table]
``GatheredParameters(params)`` receives bare ``nn.Parameter`` objects (DeepSpeed's API),
so it must find who shards each one without anything attached to the parameter. The
owners - an engine's :class:`ShardedState` and a live :class:`terascale.zero.Init` -
enter their parameters in one process-wide table keyed weakly by parameter identity
(``torch.utils.weak.WeakIdKeyDictionary``: an entry dies with its parameter). It is the
only table of its kind in terascale, and it holds no tensors, only owners.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary


class ParamOwner(Protocol):
    def gather(self, params: list[nn.Parameter]) -> object:
        """Make ``params`` full on every rank (collective); return what :meth:`release` needs."""

    def release(self, params: list[nn.Parameter], token: object, modifier_rank: int | None) -> None:
        """Take ``modifier_rank``'s values of ``params`` (if not None) and shard them again."""


_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register_owner(params: Iterable[nn.Parameter], owner: ParamOwner) -> None:
    for p in params:
        _OWNERS[p] = owner


def unregister(params: Iterable[nn.Parameter]) -> None:
    for p in params:
        _OWNERS.pop(p, None)


def owner_of(param: nn.Parameter) -> ParamOwner | None:
    return _OWNERS.get(param)


def full_shape(param: nn.Parameter) -> torch.Size:
    """The shape of ``param``'s full value, also while an owner (a ``zero.Init``) holds it
    partitioned and ``param.shape`` is empty."""
    shape_of = getattr(owner_of(param), "shape_of", None)
    return param.shape if shape_of is None else shape_of(param)


def full_numel(param: nn.Parameter) -> int:
    """Elements of ``param``'s full value (see :func:`full_shape`)."""
    return full_shape(param).numel()


class GatheredParameters:
    """Context in which ``params`` are full on every rank, even when ZeRO shards them.

    Collective: every rank of the data-parallel group enters it with the same params.
    With ``modifier_rank`` set, the values that rank holds at exit are written back to
    every rank's shards (and to the fp32 masters an engine trains); otherwise changes are
    discarded. Parameters nobody shards pass through untouched. ``enabled=False`` makes
    the context a no-op (DeepSpeed's signature). ``fwd_module`` registers the sharded
    ``params`` as external parameters of that module (``register_external_parameter``).
    """

    def __init__(
        self,
        params: nn.Parameter | Iterable[nn.Parameter],
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = list(params)
        if fwd_module is not None and enabled:
            # DeepSpeed's meaning: fwd_module's forward uses these parameters from now on.
            from terascale.zero.external import register_external_parameter  # external imports this module

            for p in self.params:
                if owner_of(p) is not None:
                    register_external_parameter(fwd_module, p)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._held: list[tuple[ParamOwner, list[nn.Parameter], object]] = []

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        by_owner: dict[int, tuple[ParamOwner, list[nn.Parameter]]] = {}
        for p in self.params:
            owner = owner_of(p)
            if owner is not None:
                by_owner.setdefault(id(owner), (owner, []))[1].append(p)
        for owner, ps in by_owner.values():
            self._held.append((owner, ps, owner.gather(ps)))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, ps, token in reversed(self._held):
            owner.release(ps, token, self.modifier_rank)
        self._held = []
