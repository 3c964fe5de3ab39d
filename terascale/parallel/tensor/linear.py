"""Linear layers whose weight is split over a tensor-parallel group.

A *column-parallel* layer splits the output features: rank ``r`` computes output columns
``[r * out/tp, (r + 1) * out/tp)`` from the full input. A *row-parallel* layer splits the
input features: each rank multiplies its input slice by its weight rows, and the partial
outputs are summed over the group. A column-parallel layer followed by a row-parallel one
(attention's q/k/v then o, an MLP's up then down) needs one all-reduce in forward and one
in backward (see [Note: regions] in ``collectives``).

Weights are stored in ``nn.Linear``'s ``[out, in]`` layout by default, or in Hugging Face
``Conv1D``'s ``[in, out]`` (GPT-2) with ``weight_layout="in_out"`` (initialised as
``Conv1D`` is: normal with std 0.02, zero bias); either way the
parameters are named ``weight`` and ``bias`` so state-dict keys equal the unsliced model's.

[Note: initialising the full weight]
Every rank draws the *full* weight from the default generator exactly as the unsliced
module would, then keeps its slice: ranks seeded alike hold the slices of one full
weight, the generator ends where an unsliced model's would, and a model built with the
same seed at any tensor-parallel size is the same model. The price is one full weight of
transient memory per layer at construction; build on ``device="meta"`` (no generator
draws) and load a checkpoint, or use ``from_linear`` on an existing module, where that
matters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from terascale.parallel.slicing import TensorSlice, take_slice
from terascale.parallel.tensor.collectives import (
    SEQUENCE_DIM,
    SharesOnCopy,
    copy_to_tensor_region,
    gather_from_sequence_region,
    gather_from_tensor_region,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
    scatter_to_tensor_region,
)

WeightLayout = Literal["out_in", "in_out"]  # nn.Linear's [out, in]; HF Conv1D's [in, out]
InitMethod = Callable[[torch.Tensor], object]


def check_divisible(owner: str, name: str, size: int, tp: int, fused: int = 1) -> None:
    """ValueError naming ``size`` and the tensor-parallel size ``tp`` unless ``tp`` (times
    ``fused`` blocks) divides it."""
    if size % (tp * fused):
        blocks = f" x {fused} fused blocks" if fused > 1 else ""
        raise ValueError(f"{owner}: {name}={size} is not divisible by tensor-parallel size {tp}{blocks}")


def _full_parameters(
    in_features: int,
    out_features: int,
    bias: bool,
    layout: WeightLayout,
    init_method: InitMethod | None,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The full weight (in ``layout``) and bias, initialised as the unsliced module would
    be (see [Note: initialising the full weight])."""
    if init_method is not None:
        shape = (out_features, in_features) if layout == "out_in" else (in_features, out_features)
        weight = torch.empty(shape, dtype=dtype, device=device)
        with torch.no_grad():
            init_method(weight)
        full_bias = torch.zeros(out_features, dtype=dtype, device=device) if bias else None
        return weight, full_bias
    if layout == "out_in":
        full = nn.Linear(in_features, out_features, bias=bias, dtype=dtype, device=device)
        return full.weight.detach(), (full.bias.detach() if bias else None)
    # Hugging Face Conv1D's initialisation (its module always has a bias)
    weight = torch.empty(in_features, out_features, dtype=dtype, device=device)
    nn.init.normal_(weight, std=0.02)
    return weight, (torch.zeros(out_features, dtype=dtype, device=device) if bias else None)


_Layer = TypeVar("_Layer", bound="_ParallelLinear")


class _ParallelLinear(SharesOnCopy):
    """What column- and row-parallel layers share: sizes, group, layout, parameters."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group: ProcessGroup,
        *,
        sliced_in: bool,
        fused: int,
        sequence_parallel: bool,
        sequence_dim: int,
        weight_layout: WeightLayout,
        init_method: InitMethod | None,
        dtype: torch.dtype | None,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        if weight_layout not in ("out_in", "in_out"):
            raise ValueError(
                f"{type(self).__name__}: weight_layout must be 'out_in' or 'in_out', got {weight_layout!r}"
            )
        self.in_features, self.out_features = in_features, out_features
        self.group = group
        self.tp_size, self.tp_rank = dist.get_world_size(group), dist.get_rank(group)
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.weight_layout: WeightLayout = weight_layout
        self.fused = fused
        sliced_name, sliced_size = ("in_features", in_features) if sliced_in else ("out_features", out_features)
        check_divisible(type(self).__name__, sliced_name, sliced_size, self.tp_size, fused)
        out_dim = 0 if weight_layout == "out_in" else 1
        self._weight_slice = TensorSlice(1 - out_dim if sliced_in else out_dim, self.tp_size, self.tp_rank, fused)
        self._bias_slice = None if sliced_in else TensorSlice(0, self.tp_size, self.tp_rank, fused)

        weight, full_bias = _full_parameters(
            in_features, out_features, bias, weight_layout, init_method, dtype, device
        )
        self.weight = nn.Parameter(take_slice(weight, self._weight_slice))
        if full_bias is None:
            self.register_parameter("bias", None)
        else:
            local = full_bias if self._bias_slice is None else take_slice(full_bias, self._bias_slice)
            self.bias = nn.Parameter(local)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = self.weight if self.weight_layout == "out_in" else self.weight.t()
        return F.linear(x, weight, bias)

    def tensor_parallel_slices(self) -> dict[str, TensorSlice]:
        """The slices of this layer's sliced parameters (see ``sliced_parameters``)."""
        out = {"weight": self._weight_slice}
        if self.bias is not None and self._bias_slice is not None:
            out["bias"] = self._bias_slice
        return out

    def _load_full(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Replace the parameters with this rank's slices of ``weight``/``bias`` (full, in
        ``weight_layout``), on their device and dtype, keeping ``requires_grad``."""
        self.weight = nn.Parameter(take_slice(weight.detach(), self._weight_slice), requires_grad=weight.requires_grad)
        if bias is None:
            self.register_parameter("bias", None)
        else:
            local = bias.detach().clone() if self._bias_slice is None else take_slice(bias.detach(), self._bias_slice)
            self.bias = nn.Parameter(local, requires_grad=bias.requires_grad)

    @classmethod
    def from_linear(cls: type[_Layer], linear: nn.Linear, group: ProcessGroup, **kwargs: Any) -> _Layer:
        """This rank's slice of an existing ``nn.Linear`` (its weights, device, dtype);
        ``kwargs`` are the constructor's keywords (``gather_output``, ``fused``, ...)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                    dtype=linear.weight.dtype, device="meta", **kwargs)  # fmt: skip
        layer._load_full(linear.weight, linear.bias)
        return layer

    @classmethod
    def from_conv1d(cls: type[_Layer], conv: nn.Module, group: ProcessGroup, **kwargs: Any) -> _Layer:
        """This rank's slice of a Hugging Face ``Conv1D`` (weight ``[in, out]``)."""
        in_features, out_features = conv.weight.shape
        layer = cls(in_features, out_features, conv.bias is not None, group=group, weight_layout="in_out",
                    dtype=conv.weight.dtype, device="meta", **kwargs)  # fmt: skip
        layer._load_full(conv.weight, conv.bias)
        return layer

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"tp={self.tp_rank}/{self.tp_size}, fused={self.fused}, layout={self.weight_layout}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class ColumnParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with ``W``'s output features split over ``group``.

    Parameters: ``weight`` ``[out/tp, in]`` (``[in, out/tp]`` in the ``in_out`` layout),
    ``bias`` ``[out/tp]``. Input: the full (replicated) ``x``, or with ``sequence_parallel``
    this rank's positions along ``sequence_dim`` (all-gathered here). Output: this rank's
    ``out/tp`` features, or all ``out`` with ``gather_output``.

    ``fused``: the output features are ``fused`` equal blocks (q, k, v: 3), each split on
    its own so every rank holds part of each (see [Note: tensor slices]); the local
    output is then this rank's part of each block, concatenated.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: ProcessGroup,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = SEQUENCE_DIM,
        fused: int = 1,
        weight_layout: WeightLayout = "out_in",
        init_method: InitMethod | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if gather_output and fused > 1:
            raise ValueError("ColumnParallelLinear: gather_output would interleave the fused blocks; use fused=1")
        super().__init__(
            in_features, out_features, bias, group, sliced_in=False, fused=fused,
            sequence_parallel=sequence_parallel, sequence_dim=sequence_dim, weight_layout=weight_layout,
            init_method=init_method, dtype=dtype, device=device,
        )  # fmt: skip
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_region(x, self.group, self.sequence_dim)
        else:
            x = copy_to_tensor_region(x, self.group)
        y = self._matmul(x, self.bias)
        return gather_from_tensor_region(y, self.group) if self.gather_output else y


class RowParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with ``W``'s input features split over ``group``.

    Parameters: ``weight`` ``[out, in/tp]`` (``[in/tp, out]`` in the ``in_out`` layout),
    ``bias`` ``[out]``, replicated and added once, after the sum over ranks. Input: this
    rank's ``in/tp`` features (``input_is_parallel``) or the full ``x`` (split here).
    Output: the full ``y`` on every rank, or with ``sequence_parallel`` this rank's
    positions of it along ``sequence_dim`` (reduce-scattered).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: ProcessGroup,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        sequence_dim: int = SEQUENCE_DIM,
        weight_layout: WeightLayout = "out_in",
        init_method: InitMethod | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        super().__init__(
            in_features, out_features, bias, group, sliced_in=True, fused=1,
            sequence_parallel=sequence_parallel, sequence_dim=sequence_dim, weight_layout=weight_layout,
            init_method=init_method, dtype=dtype, device=device,
        )  # fmt: skip
        self.input_is_parallel = input_is_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_region(x, self.group)
        partial = self._matmul(x, None)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(partial, self.group, self.sequence_dim)
        else:
            y = reduce_from_tensor_region(partial, self.group)
        if self.bias is None:
            return y
        # Under sequence parallelism each rank adds the bias to its own positions only, so
        # its gradient is partial: the backward all-reduce makes it whole on every rank.
        bias = copy_to_tensor_region(self.bias, self.group) if self.sequence_parallel else self.bias
        return y + bias

