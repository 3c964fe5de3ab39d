"""Which optimizers may step ZeRO's flat shards, and the pieces of parameters they see.

[Note: optimizers on shards]
At stages 1-3 each rank steps flat *pieces* of its shards (``[Note: master pieces]``): a
piece holds parts of several parameters, and a parameter may be split between ranks. An
optimizer whose update is elementwise (Adam, SGD, ...) gives on pieces exactly what it
gives on whole parameters. One that needs a whole parameter (its shape, its rows and
columns, or a norm of all of it) does not:

- terascale's ``Lamb`` takes per-parameter norms through a two-pass step
  (:class:`Segments`): pass 1 updates the moments and adds each piece's squared partial
  norms of ``w`` and of the update to its parameter's row, one all-reduce sums the rows
  over the ranks, pass 2 applies the whole parameter's trust ratio. The result is the
  trust ratio of stage 0 (DeepSpeed instead computes it per partition). A tensor-parallel
  slice is a part of its parameter too: the engine's ``SumNorms`` (the model parallel
  layout's) then sums the slices' rows over the tensor-parallel group, at every stage;
- terascale's ``Muon`` gives each matrix one owner rank, which orthogonalizes it whole
  ([Note: whole matrices on shards]);
- an optimizer known to need whole tensors (Adafactor, Shampoo, other Muons, LARS/LAMB of other
  libraries, ...) or declaring ``needs_whole_parameters = True`` is refused, by name;
- torch's elementwise optimizers are accepted; any other class needs DeepSpeed's
  ``"zero_allow_untested_optimizer": true``, which says that its update is elementwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from terascale.errors import UsageError

# torch.optim classes whose update of an element depends on that element alone.
_ELEMENTWISE = frozenset({"Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop"})
# Class names (lower-case, any base class) of updates that need the whole tensor.
_WHOLE_TENSOR = ("adafactor", "shampoo", "muon", "soap", "galore", "lars", "lamb", "adammini", "adam_mini",
                 "lomo", "adalomo", "sm3", "kron", "psgd", "sparseadam")  # fmt: skip

# ``sum_norms(rows, params)``: ``rows[k]`` holds squared norms of what this rank has of
# ``params[k]`` (a model parameter, in the same order on every rank that calls it); the
# call sums, in place, the rows of parameters other ranks hold parts of, so each becomes
# its whole parameter's. Collective over those ranks.
SumNorms = Callable[[torch.Tensor, Sequence[torch.Tensor]], None]


def _class_names(optimizer: torch.optim.Optimizer) -> list[str]:
    return [cls.__name__ for cls in type(optimizer).__mro__ if cls not in (torch.optim.Optimizer, object)]


def check_shardable(optimizer: torch.optim.Optimizer, stage: int, allow_untested: bool) -> None:
    """Raise ValueError unless ``optimizer`` may step flat shards at ZeRO ``stage`` (1-3)
    (see ``[Note: optimizers on shards]``)."""
    from terascale.optim.compact import is_compact
    from terascale.optim.lamb import Lamb
    from terascale.optim.lion import Lion
    from terascale.optim.muon import Muon

    name = type(optimizer).__name__
    if is_compact(optimizer):  # elementwise: blocks are cut per piece, [Note: compact optimizer states]
        return
    if isinstance(optimizer, Muon):  # whole matrices by owner: [Note: whole matrices on shards]
        return
    if isinstance(optimizer, Lion):  # elementwise
        return
    if isinstance(optimizer, Lamb):
        if optimizer.clips:
            raise ValueError(
                "Lamb(max_grad_norm=...) clips inside the optimizer, which at ZeRO stage "
                f"{stage} sees shards only; set max_grad_norm=0 and the config's gradient_clipping instead"
            )
        return
    names = _class_names(optimizer)
    whole = getattr(optimizer, "needs_whole_parameters", False) or any(
        marker in n.lower() for n in names for marker in _WHOLE_TENSOR
    )
    if whole:
        raise ValueError(
            f"{name} needs whole parameters (their shapes or norms), but at ZeRO stage {stage} each rank steps "
            "flat pieces of its shards; use zero_optimization.stage 0 with it, or an elementwise optimizer "
            "(Adam, AdamW, SGD, ...) or terascale's Lamb"
        )
    if type(optimizer).__module__.startswith("torch.optim") and name in _ELEMENTWISE:
        return
    if not allow_untested:
        raise UsageError(
            f"{name} is not known to terascale: at ZeRO stage {stage} it would step flat pieces of parameters, "
            "which is right only if its update is elementwise. If it is, add \"zero_allow_untested_optimizer\": true "
            "to the config (DeepSpeed's key); if it needs whole tensors, use stage 0"
        )


@dataclass(frozen=True)
class Segments:
    """Where the parameters lie in the pieces an optimizer steps, for per-parameter norms.

    ``of[i]`` lists ``(parameter, start, end)`` for master piece ``i``: elements
    ``[start, end)`` of the piece belong to parameter number ``parameter`` (an index every
    rank gives the same parameter); ``num_params`` is the number of parameters.
    ``group`` is the process group whose ranks hold the other parts.
    """

    of: Sequence[Sequence[tuple[int, int, int]]]
    num_params: int
    group: object
    # (group, parameter numbers): parameters whose parts lie on that group's ranks instead
    # (experts': [Note: expert parameters]); each rank holds the same numbers.
    apart: tuple[tuple[object, tuple[int, ...]], ...] = ()

    def reduce(self, rows: torch.Tensor) -> None:
        """Sum ``rows`` (``[num_params, k]``) over the ranks, in place."""
        import torch.distributed as dist

        from terascale.comm import ops

        kept = []
        for group, numbers in self.apart:
            at = torch.tensor(numbers, device=rows.device)
            part = rows.index_select(0, at)
            if dist.get_world_size(group) > 1:
                ops.all_reduce(part, group=group)
            kept.append((at, part))
        if dist.get_world_size(self.group) > 1:
            ops.all_reduce(rows, group=self.group)
        for at, part in kept:
            rows.index_copy_(0, at, part)
