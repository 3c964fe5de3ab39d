"""Sequence tiles: run a position-wise function over a long sequence a tile at a time.

[Note: tiled compute]
A transformer's MLP and its loss act on each position alone, yet autograd keeps their
whole-sequence intermediates: ``[s, 4h]`` for the MLP, ``[s, vocab]`` logits for the loss,
which at long sequence lengths outweigh everything else (the Arctic long-sequence
recipe's observation). :func:`tiled` runs such a function on tiles of the sequence with
nothing saved but its input, and in backward recomputes one tile at a time, so at most
one tile's intermediates exist at once.

The function's parameters are inputs of the tiled op, and backward returns their
gradients summed over the tiles, once: a parameter receives one gradient per backward, as
ZeRO's gradient hooks require ([Note: sharded gradients]) and as autograd's accumulation
expects. The function must be deterministic given its input (dropout inside would draw
differently in the recompute).

Under ZeRO-3 the recompute needs the parameters gathered in backward. A tiled op run
inside a module's forward gets that from the module's hooks: the module's unit gathers
its groups when the gradient of its output arrives ([Note: gather schedule]), before the
tiled op's backward runs. So the MLP is tiled by replacing its module's ``forward``
(:func:`tile_mlp`, parameter names unchanged), and a tiled loss runs inside the module
that owns the output layer's weight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, tiles: int, dim: int, total: bool, x: torch.Tensor, extra, *params: torch.Tensor):
        ctx.fn, ctx.tiles, ctx.dim, ctx.total, ctx.extra = fn, tiles, dim, total, extra
        # Parameters are held, not saved: ZeRO-3 frees and re-gathers their storage
        # between forward and backward ([Note: tiled compute]).
        ctx.params = params
        # The recompute runs as the forward ran: under its autocast (torch_autocast), if any.
        kind = x.device.type
        ctx.autocast = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        ctx.save_for_backward(x)
        with torch.no_grad():
            outs = [fn(xt, *et) for xt, et in _tile(x, extra, tiles, dim)]
        return torch.stack(outs).sum(0) if total else torch.cat(outs, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        params = ctx.params
        wanted = [p for p in params if p.requires_grad]
        x_grad = torch.empty_like(x) if ctx.needs_input_grad[4] else None
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        grads = [grad] * ctx.tiles if ctx.total else grad.tensor_split(_bounds(x, ctx.tiles, ctx.dim), dim=ctx.dim)
        offset = 0
        for (xt, et), gt in zip(_tile(x, ctx.extra, ctx.tiles, ctx.dim), grads):
            xt = xt.detach().requires_grad_(x_grad is not None)
            kind, enabled, dtype = ctx.autocast
            with torch.enable_grad(), torch.autocast(kind, dtype=dtype, enabled=enabled):
                out = ctx.fn(xt, *et)
            inputs = ([xt] if x_grad is not None else []) + wanted
            got = torch.autograd.grad(out, inputs, gt, allow_unused=True) if inputs else ()
            if x_grad is not None:
                x_grad.narrow(ctx.dim, offset, xt.shape[ctx.dim]).copy_(got[0])
                got = got[1:]
            for i, g in enumerate(got):
                if g is not None:
                    sums[i] = g if sums[i] is None else sums[i] + g
            offset += xt.shape[ctx.dim]
        it = iter(sums)
        param_grads = [next(it) if p.requires_grad else None for p in params]
        return (None, None, None, None, x_grad, None, *param_grads)


def _bounds(x: torch.Tensor, tiles: int, dim: int) -> list[int]:
    """Split points of ``x`` along ``dim`` into ``tiles`` tiles as even as can be."""
    size = x.shape[dim]
    return [size * i // tiles for i in range(1, tiles)]


def _tile(x: torch.Tensor, extra: Sequence[torch.Tensor], tiles: int, dim: int):
    bounds = _bounds(x, tiles, dim)
    parts = [t.tensor_split(bounds, dim=dim) for t in (x, *extra)]
    for i in range(tiles):
        yield parts[0][i], [p[i] for p in parts[1:]]


def tiled(
    fn: Callable[..., torch.Tensor],
    x: torch.Tensor,
    *,
    params: Sequence[torch.Tensor],
    tiles: int,
    dim: int = 1,
    extra: Sequence[torch.Tensor] = (),
    total: bool = False,
) -> torch.Tensor:
    """``fn`` applied to ``x`` in ``tiles`` tiles along ``dim`` (see [Note: tiled compute]).

    ``fn(x_tile, *extra_tiles)`` must act on each position alone; ``extra`` are
    non-differentiable tensors tiled alongside ``x`` (labels); ``params`` are every
    tensor ``fn`` reads that needs a gradient. Returns the tiles' results concatenated
    along ``dim``, or with ``total`` their sum (a loss summed over positions). Gradients
    reach ``x`` and ``params`` as if ``fn`` had run on the whole of ``x``."""
    if tiles < 1:
        raise ValueError(f"tiles must be >= 1, got {tiles}")
    tiles = min(tiles, max(1, x.shape[dim]))
    return _Tiled.apply(fn, tiles, dim % x.dim(), total, x, tuple(extra), *params)


class TiledForward:
    """``module``'s forward made tiled (see :func:`tile_mlp`) until :meth:`remove`.
    ``tiles``: a count, or a function of the input giving it per call (1: not tiled)."""

    def __init__(self, module: nn.Module, tiles: int | Callable[[torch.Tensor], int], dim: int = 1) -> None:
        if "forward" in vars(module):
            raise ValueError(f"{type(module).__name__} already has its own forward attribute (another wrapper patched it)")
        if isinstance(tiles, int) and tiles < 1:
            raise ValueError(f"tiles must be >= 1, got {tiles}")
        self.module, self.tiles, self.dim = module, tiles, dim
        inner = module.forward  # the class's forward, bound

        def forward(x: torch.Tensor) -> torch.Tensor:
            count = self.tiles(x) if callable(self.tiles) else self.tiles
            if count <= 1:
                return inner(x)
            params = [p for p in module.parameters() if p.requires_grad]
            return tiled(inner, x, params=params, tiles=count, dim=self.dim)

        module.forward = forward

    def remove(self) -> None:
        vars(self.module).pop("forward", None)


def tile_mlp(mlp: nn.Module, tiles: int | Callable[[torch.Tensor], int], dim: int = 1) -> TiledForward:
    """Compute ``mlp(x)`` ``tiles`` sequence tiles at a time from now on (dim ``dim`` of
    its one input is the sequence): its intermediate activations exist for one tile at
    once, in forward and in backward. Parameters and their names are unchanged."""
    return TiledForward(mlp, tiles, dim)


def tiled_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    tiles: int,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """The sum over positions of the cross-entropy of ``hidden @ weight.T (+ bias)``
    against ``labels`` (positions labelled ``ignore_index`` left out), computed in fp32
    ``tiles`` sequence tiles at a time: the ``[tokens, vocab]`` logits exist for one tile
    at once. ``hidden`` [b, s, h], ``weight`` [vocab, h], ``labels`` [b, s] (already
    shifted for next-token prediction); divide by the number of counted tokens for the
    mean."""

    def loss(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, weight, bias).float()
        return F.cross_entropy(logits.flatten(0, -2), y.reshape(-1), ignore_index=ignore_index, reduction="sum")

    params = [t for t in (weight, bias) if t is not None and t.requires_grad]
    return tiled(loss, hidden, params=params, tiles=tiles, dim=1, extra=(labels,), total=True)
