"""Layer specifications: what a pipeline layer is, built only on the stage that owns it.

A :class:`LayerSpec` stores a module class and its constructor arguments; the
:class:`~terascale.pipe.PipelineModule` builds it only on the stage the partition gives it
to, so no rank ever constructs the whole model. A :class:`TiedLayerSpec` names a layer
that several positions share (an embedding reused as the output head): it is built once
per stage that uses it. Both are DeepSpeed's, with the same arguments.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from terascale.activation.rng import RNGSnapshot


class LayerSpec:
    """``typename(*module_args, **module_kwargs)``, built later by :meth:`build`."""

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise ValueError(f"LayerSpec needs an nn.Module class, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        """Construct the module (on the current default device)."""
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer shared by every position that names the same ``key``.

    Each use runs ``forward_fn(module, x)`` (or ``module(x)`` without one). The parameters
    named by ``tied_weight_attr`` (an attribute path such as ``"weight"``, or a list of
    them) are the tied ones: their copies on different stages are kept equal
    ([Note: tied parameters across stages]). At ZeRO stage 3 a tied module used through
    ``forward_fn`` must stay in its stage's root parameter group (leave its class out of
    the wrap policy): ``forward_fn`` reads its weights without calling the module, so only
    the root group, gathered around every chunk, has them in place.
    """

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | Sequence[str] = "weight",
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        if not key or "." in key:
            raise ValueError(f"TiedLayerSpec key must be a non-empty name without dots, got {key!r}")
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = (tied_weight_attr,) if isinstance(tied_weight_attr, str) else tuple(tied_weight_attr)


Layer = LayerSpec | nn.Module | Callable[[Any], Any]


def layer_type_name(layer: Layer) -> str | None:
    """The class name partitioning by ``type:REGEX`` matches against (None: no name)."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def count_parameters(layer: Layer) -> int:
    """Trainable parameter elements of ``layer``, without building a LayerSpec for real.

    A spec is built on the meta device (no memory, no values); a class that cannot be
    built there is built on the CPU and dropped, as DeepSpeed counts.
    """
    if isinstance(layer, LayerSpec):
        try:
            with torch.device("meta"):
                module = layer.build()
        except Exception:  # noqa: BLE001 - constructors with data-dependent code need real tensors
            module = layer.build()
        return sum(p.numel() for p in module.parameters() if p.requires_grad)
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run the block with the CPU generator and ``device``'s generator seeded with
    ``seed``; both streams are put back afterwards, so the caller's draws are unchanged."""
    snapshot = RNGSnapshot.take(device, None)
    torch.default_generator.manual_seed(seed)
    if device.type != "cpu":
        getattr(torch, device.type).manual_seed(seed)
    try:
        yield
    finally:
        snapshot.restore(None)
