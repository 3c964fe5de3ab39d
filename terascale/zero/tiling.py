"""Memory-centric tiling: one huge linear layer as a grid of small ones (ZeRO-Infinity).

[Note: tiled linear layers]
ZeRO-3 gathers a whole group before its module runs, so the largest layer sets the
working memory: a 16k x 16k fp32 linear needs 1 GiB gathered at once. :class:`TiledLinear`
splits the operator into ``out_splits x in_splits`` tiles, each its own ``nn.Linear``
and, by the wrap policy, its own ZeRO-3 group ([Note: group plan]): forward runs the
tiles one after another (the input split along features, partial outputs summed over the
in-splits, output chunks concatenated), so each tile is gathered just before it runs and
freed after; in backward autograd runs one tile's backward at a time and the tile's
gradients arrive (freeing it) before the next tile's backward starts. Peak gathered
parameter memory is one tile plus whatever prefetch and reuse distance allow
(``stage3_prefetch_bucket_size``, ``stage3_max_reuse_distance``,
``stage3_max_live_parameters``).

The arithmetic is the untiled layer's: y = x W^T + b with W's rows split by the
out-splits and its columns by the in-splits; the bias sits on the last in-split's tiles,
as in DeepSpeed. :func:`tile_linears` swaps every big ``nn.Linear`` of a model for a
``TiledLinear`` (``zero_optimization.tile_linear_above``); such a layer keeps the
untiled layer's state dict keys (``weight``, ``bias``) by joining and splitting tiles in
state dict hooks, so checkpoints and ``from_pretrained`` files see the original layout.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


def split_sizes(total: int, parts: int) -> list[int]:
    """``total`` features in ``parts`` contiguous pieces as even as possible (the first
    ``total % parts`` one larger)."""
    if not 1 <= parts <= total:
        raise ValueError(f"cannot split {total} features into {parts} tiles (need 1 <= splits <= features)")
    base, extra = divmod(total, parts)
    return [base + (k < extra) for k in range(parts)]


class TiledLinear(nn.Module):
    """``nn.Linear(in_features, out_features, bias)`` as ``out_splits x in_splits`` tiles.

    ``input_is_already_split``: forward takes a sequence of ``in_splits`` tensors (the
    input's feature chunks) instead of one; ``combine_out_splits=False`` returns the
    ``out_splits`` output chunks as a list. ``linear_cls`` builds each tile
    (``linear_cls(in_part, out_part, bias=..., **kwargs)``); ``init_linear`` copies the
    weights of an existing linear layer. ``linears[i][j]`` (DeepSpeed's name, so its
    state dict keys are DeepSpeed's too) maps input chunk j to output chunk i.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        in_splits: int = 1,
        out_splits: int = 1,
        input_is_already_split: bool = False,
        combine_out_splits: bool = True,
        linear_cls: Callable[..., nn.Module] = nn.Linear,
        init_linear: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.in_sizes = split_sizes(in_features, in_splits)
        self.out_sizes = split_sizes(out_features, out_splits)
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.use_bias = bias
        self.linears = nn.ModuleList(
            nn.ModuleList(
                linear_cls(n_in, n_out, bias=bias and j == in_splits - 1, **kwargs)
                for j, n_in in enumerate(self.in_sizes)
            )
            for n_out in self.out_sizes
        )
        self._untiled_keys = False
        if init_linear is not None:
            self.copy_params_from(init_linear)

    @property
    def in_splits(self) -> int:
        return len(self.in_sizes)

    @property
    def out_splits(self) -> int:
        return len(self.out_sizes)

    @property
    def in_parts(self) -> list[int]:
        """The input chunks' boundaries, ``in_splits + 1`` of them (DeepSpeed's)."""
        return [0, *itertools.accumulate(self.in_sizes)]

    @property
    def out_parts(self) -> list[int]:
        """The output chunks' boundaries, ``out_splits + 1`` of them (DeepSpeed's)."""
        return [0, *itertools.accumulate(self.out_sizes)]

    def forward(self, input_: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
        if self.input_is_already_split:
            inputs = list(input_)
            if len(inputs) != self.in_splits:
                raise ValueError(f"TiledLinear expects {self.in_splits} input chunks, got {len(inputs)}")
        elif self.in_splits > 1:
            inputs = list(torch.split(input_, self.in_sizes, dim=-1))
        else:
            inputs = [input_]
        outputs = []
        for row in self.linears:
            out = None
            for tile, x in zip(row, inputs):
                y = tile(x)
                out = y if out is None else out + y
            outputs.append(out)
        if not self.combine_out_splits:
            return outputs
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: nn.Module) -> None:
        """Take ``other``'s ``weight`` (out x in) and ``bias`` (``nn.Linear``'s layout)."""
        weight = other.weight
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"copy_params_from: weight of shape {tuple(weight.shape)} does not fit a TiledLinear "
                f"{self.in_features} -> {self.out_features}"
            )
        bias = getattr(other, "bias", None)
        if (bias is not None) != self.use_bias:
            raise ValueError("copy_params_from: the other layer has a bias and this one not, or the reverse")
        for i, rows in enumerate(weight.split(self.out_sizes, dim=0)):
            for j, block in enumerate(rows.split(self.in_sizes, dim=1)):
                self.linears[i][j].weight.copy_(block)
        if bias is not None:
            for i, part in enumerate(bias.split(self.out_sizes)):
                self.linears[i][-1].bias.copy_(part)

    def joined(self) -> dict[str, torch.Tensor]:
        """The untiled ``weight`` (and ``bias``), assembled from the tiles (copies)."""
        weight = torch.cat([torch.cat([t.weight for t in row], dim=1) for row in self.linears], dim=0)
        out = {"weight": weight}
        if self.use_bias:
            out["bias"] = torch.cat([row[-1].bias for row in self.linears])
        return out

    # -- the untiled layer's state dict keys (tile_linears) ------------------------------------

    def use_untiled_state_dict_keys(self) -> None:
        """State dicts of this module hold ``weight``/``bias`` as the untiled layer's, not the tiles'."""
        if self._untiled_keys:
            return
        self._untiled_keys = True
        self._register_state_dict_hook(_join_tiles)
        self._register_load_state_dict_pre_hook(_split_tiles, with_module=True)


def _join_tiles(module: TiledLinear, state: dict, prefix: str, local_metadata: Any) -> dict:
    keys = [k for k in state if k.startswith(prefix + "linears.")]
    if any(isinstance(state[k], nn.Parameter) for k in keys):
        # keep_vars=True: the caller wants the parameter objects (ZeRO engines resolve
        # their full values first and join with untiled_state_dict afterwards).
        return state
    return _join(module, state, prefix)


def _join(module: TiledLinear, state: dict, prefix: str) -> dict:
    """``state`` with ``module``'s tile entries replaced, where the first of them stood, by
    the joined ``weight`` and ``bias`` (in place: the caller's dict keeps its identity)."""
    tile = lambda i, j, kind: state[f"{prefix}linears.{i}.{j}.{kind}"]  # noqa: E731
    rows = [torch.cat([tile(i, j, "weight") for j in range(module.in_splits)], dim=1) for i in range(module.out_splits)]
    joined = {prefix + "weight": torch.cat(rows, dim=0)}
    if module.use_bias:
        joined[prefix + "bias"] = torch.cat([tile(i, module.in_splits - 1, "bias") for i in range(module.out_splits)])
    items = list(state.items())
    state.clear()
    for key, value in items:
        if not key.startswith(prefix + "linears."):
            state[key] = value
        elif joined:
            state.update(joined)
            joined = {}
    return state


def untiled_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a full state dict of ``model``, by its tiles' names) with the tiles of every
    layer :func:`tile_linears` made joined back under the untiled layer's keys."""
    for name, module in model.named_modules():
        if isinstance(module, TiledLinear) and module._untiled_keys and f"{name}.linears.0.0.weight" in state:
            _join(module, state, f"{name}." if name else "")
    return state


def _split_tiles(module: TiledLinear, state: dict, prefix: str, *args: Any) -> None:
    if prefix + "weight" not in state:
        return  # a state dict with the tiles' keys loads as it is
    weight = state.pop(prefix + "weight")
    bias = state.pop(prefix + "bias", None)
    for i, rows in enumerate(weight.split(module.out_sizes, dim=0)):
        for j, block in enumerate(rows.split(module.in_sizes, dim=1)):
            state[f"{prefix}linears.{i}.{j}.weight"] = block
    if bias is not None:
        for i, part in enumerate(bias.split(module.out_sizes)):
            state[f"{prefix}linears.{i}.{module.in_splits - 1}.bias"] = part


def tiles_of(model: nn.Module) -> list[nn.Module]:
    """Every tile of every :class:`TiledLinear` in ``model`` (each is a ZeRO group of its own)."""
    return [t for m in model.modules() if isinstance(m, TiledLinear) for row in m.linears for t in row]


def tile_linears(model: nn.Module, above: int, tile_numel: int | None = None) -> list[str]:
    """Replace every ``nn.Linear`` of ``model`` with more than ``above`` weight elements by a
    :class:`TiledLinear` holding its values, in place; returns the replaced names.

    Tiles are as square as the layer allows with at most ``tile_numel`` (default
    ``above``) weight elements each. The new modules keep the old state dict keys.
    """
    if above < 1:
        raise ValueError(f"zero_optimization.tile_linear_above must be positive, got {above}")
    limit = tile_numel or above
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    replaced = []
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or module.weight.numel() <= above:
            continue
        if uses[id(module.weight)] > 1:
            continue  # tied to another module (an output head sharing the embedding): keep the tie
        out_f, in_f = module.weight.shape
        splits = math.ceil(math.sqrt(module.weight.numel() / limit))
        in_splits, out_splits = min(splits, in_f), min(splits, out_f)
        while math.ceil(in_f / in_splits) * math.ceil(out_f / out_splits) > limit and (
            in_splits < in_f or out_splits < out_f
        ):
            if in_splits < in_f:
                in_splits += 1
            if out_splits < out_f:
                out_splits += 1
        tiled = TiledLinear(
            in_f, out_f, bias=module.bias is not None, in_splits=in_splits, out_splits=out_splits,
            device=module.weight.device, dtype=module.weight.dtype,
        )  # fmt: skip
        tiled.copy_params_from(module)
        tiled.use_untiled_state_dict_keys()
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, tiled)
        replaced.append(name)
    return replaced
