"""DeepSpeed's ALST programming interface for Hugging Face models
(``deepspeed.runtime.sequence_parallel.ulysses_sp``) over terascale's sequence parallelism.

A DeepSpeed ALST program registers the sequence-parallel attention before it builds the
engine, passes the returned ``mpu`` to ``initialize``, wraps its data loader in
:class:`UlyssesSPDataLoaderAdapter` (which hands every rank its slice of each sequence,
labels pre-shifted as ``shift_labels``) and combines the per-rank losses itself. Here:

- :meth:`UlyssesSPAttentionHF.register_with_transformers` builds the sequence-parallel
  groups ([Note: sequence-parallel groups]) and returns a :class:`SequenceParallelMpu`;
  ``initialize(mpu=...)`` adopts its groups, switches the model's attention to Ulysses
  attention (for that model only, where DeepSpeed swaps the attention of every model in
  the process) and, because the adapter already cut the batches, leaves the model's
  forward as it is (``sequence_parallel.split_batches`` off);
- the adapter behaves as DeepSpeed's: each rank's loader yields samples of its own; each
  batch is gathered over the group and the group trains on rank 0's, then rank 1's, ...,
  so an epoch has ``sp`` times the batches.

terascale's own interface needs none of this (``sequence_parallel_size`` in the config;
the engine cuts the batches and returns the whole batch's loss): see the README.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from terascale.comm import ops
from terascale.parallel.sequence.data import cut_sequences
from terascale.parallel.sequence.groups import sequence_groups


class SequenceParallelMpu:
    """The sequence-parallel groups of a world (contiguous groups of ``size`` ranks, data
    replicas strided), answering DeepSpeed's ``parallel_state_sp`` queries and Megatron's
    data-parallel ones. Built on every rank alike (collective over the world)."""

    def __init__(self, size: int) -> None:
        world = dist.get_world_size()
        if world % size:
            raise ValueError(
                f"sequence_parallel_size {size} does not divide the {world} ranks; run on a multiple of {size} ranks"
            )
        self.size = size
        self._sp_group, self._dp_group = sequence_groups(list(range(world)), size)

    def initialize_sequence_parallel(self, sequence_parallel_size: int) -> None:
        """DeepSpeed's marker of a sequence-parallel mpu; the groups exist already."""
        if sequence_parallel_size != self.size:
            raise ValueError(f"this mpu's sequence-parallel size is {self.size}, not {sequence_parallel_size}")

    def get_sequence_parallel_group(self) -> ProcessGroup:
        return self._sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.size

    def get_sequence_parallel_rank(self) -> int:
        return dist.get_rank(self._sp_group)

    def get_sequence_data_parallel_group(self) -> ProcessGroup:
        return dist.group.WORLD

    def get_sequence_data_parallel_world_size(self) -> int:
        return dist.get_world_size()

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank()

    # DeepSpeed answers model-parallel queries with the sequence-parallel group.
    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank

    def get_data_parallel_group(self) -> ProcessGroup:
        return self._dp_group

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self._dp_group)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self._dp_group)


class UlyssesSPAttentionHF:
    """DeepSpeed's class name; only its ``register_with_transformers`` entry point is used
    by programs (the attention itself is ``terascale.parallel.sequence.hf``'s)."""

    @staticmethod
    def register_with_transformers(
        model_name_or_path: Any,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
        max_length: int | None = None,
    ) -> SequenceParallelMpu | None:
        """The sequence-parallel ``mpu`` to pass to ``initialize`` (None at size 1, as
        DeepSpeed returns). The model's attention is switched by ``initialize``; a model
        object whose attention differs from ``core_attn_implementation`` is refused, as
        DeepSpeed refuses it. Collective over the world."""
        if sequence_parallel_size == 1:
            return None
        if core_attn_implementation not in ("sdpa", "eager", "flash_attention_2", "flash_attention_3"):
            raise ValueError(f"core_attn_implementation {core_attn_implementation!r} cannot be split by sequence")
        config = getattr(model_name_or_path, "config", None)
        impl = getattr(config, "_attn_implementation", None)
        if config is not None and impl != core_attn_implementation:
            raise ValueError(
                f"the model was loaded with attn_implementation={impl!r} but core_attn_implementation is "
                f"{core_attn_implementation!r}; load it with attn_implementation={core_attn_implementation!r}"
            )
        if not dist.is_initialized():
            from terascale.comm import init_distributed

            init_distributed()
        return SequenceParallelMpu(sequence_parallel_size)


class UlyssesSPDataLoaderAdapter:
    """DeepSpeed's data loader adapter: this rank's slice of every sequence of the group.

    Each rank's ``dl`` yields batches of its own (dicts with ``input_ids``, ``labels`` and
    ``position_ids``, ``[b, S]``); every batch is gathered over ``sp_group`` and the group
    then trains on rank 0's, rank 1's, ... in turn: for each, this rank gets its slice of
    every tensor on dim 1 and ``shift_labels`` (labels shifted on the whole sequence, -100
    at the end) in place of ``labels``. ``len`` is ``sp_world_size`` times ``dl``'s."""

    def __init__(self, dl: Any, sp_rank: int, sp_group: ProcessGroup, sp_world_size: int, device: Any) -> None:
        self.dl, self.sp_rank, self.sp_group, self.sp_world_size = dl, sp_rank, sp_group, sp_world_size
        self.device = device

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.dl:
            if "position_ids" not in batch:
                raise ValueError(
                    "UlyssesSPDataLoaderAdapter needs position_ids in every batch (each rank would make local "
                    "ones for its slice otherwise): add them in the collate function"
                )
            gathered: list[Any] = [None] * self.sp_world_size
            ops.all_gather_object(gathered, {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()},
                                  group=self.sp_group)  # fmt: skip
            for sample in gathered:
                yield self._slice(sample)

    def _slice(self, batch: dict[str, Any]) -> dict[str, Any]:
        out = cut_sequences(batch, self.sp_rank, self.sp_world_size)
        # Copies: with several rows a slice is not contiguous, and the model's loss views the
        # labels flat.
        return {k: v.contiguous().to(self.device) if isinstance(v, torch.Tensor) else v for k, v in out.items()}


# -- DeepSpeed's tiled compute (ALST's TiledMLP and tiled loss) over terascale's tiles -----------------


def _trainable(owner: Any, compute_params: Any) -> list[torch.Tensor]:
    # Every tensor the function reads that needs a gradient: the owning module's parameters
    # (DeepSpeed's compute_params are only those whose ZeRO hooks it holds back).
    if isinstance(owner, torch.nn.Module):
        return [p for p in owner.parameters() if p.requires_grad]
    return [p for p in (compute_params or []) if p.requires_grad]


class TiledMLP:
    """``TiledMLP.apply(fn, self, x, shards, compute_params)``: ``fn(self, x)`` (a position-wise
    MLP) on ``shards`` tiles of ``x``'s sequence (dim 1), one tile's intermediates alive at a
    time in forward and backward (:func:`terascale.activation.tiled.tiled`)."""

    @staticmethod
    def apply(fn: Any, self: Any, x: torch.Tensor, shards: int, compute_params: Any = None) -> torch.Tensor:
        from terascale.activation.tiled import tiled

        return tiled(lambda t: fn(self, t), x, params=_trainable(self, compute_params), tiles=shards, dim=1)


def sequence_tiled_compute(fn: Any, seqlen: int, shards: int, kwargs_to_shard: dict[str, torch.Tensor],
                           kwargs_to_pass: dict[str, Any], grad_requiring_tensor_key: str, compute_params: Any = None,
                           output_unshard_dimension: int = 1, output_reduction: str | None = "mean") -> torch.Tensor:  # fmt: skip
    """``fn(**kwargs_to_pass, **shards_of(kwargs_to_shard))`` over ``shards`` tiles of the
    sequence (dim 1 of every tensor in ``kwargs_to_shard``); the outputs concatenated along
    ``output_unshard_dimension``, then reduced by ``output_reduction`` (None, "mean", "sum")."""
    from terascale.activation.tiled import tiled

    if output_reduction not in (None, "mean", "sum"):
        raise ValueError(f"unknown output_reduction {output_reduction!r}: valid values are None, 'mean', 'sum'")
    x = kwargs_to_shard[grad_requiring_tensor_key]
    if x.shape[1] != seqlen:
        raise ValueError(f"seqlen {seqlen} but {grad_requiring_tensor_key} has {x.shape[1]} positions")
    others = [k for k in kwargs_to_shard if k != grad_requiring_tensor_key]

    def run(xt: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        return fn(**kwargs_to_pass, **{grad_requiring_tensor_key: xt}, **dict(zip(others, extra)))

    owner = kwargs_to_pass.get("self")
    out = tiled(run, x, params=_trainable(owner, compute_params), tiles=shards, dim=output_unshard_dimension,
                extra=[kwargs_to_shard[k] for k in others])  # fmt: skip
    if output_reduction is None:
        return out
    return out.mean() if output_reduction == "mean" else out.sum()


class TiledFusedLogitsLoss:
    """``TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params, output_reduction)``:
    ``fn(self, x_tile, y_tile[, mask_tile])`` (logits and loss) over ``shards`` tiles of the
    flattened batch and sequence, the ``[tokens, vocab]`` logits alive for one tile at a time;
    the tiles' losses summed ("sum") or averaged over the tiles ("mean"), as DeepSpeed's."""

    @staticmethod
    def apply(fn: Any, self: Any, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None, shards: int,
              compute_params: Any = None, output_reduction: str = "mean") -> torch.Tensor:  # fmt: skip
        from terascale.activation.tiled import tiled

        if output_reduction not in ("mean", "sum"):
            raise ValueError(f"unknown reduction {output_reduction!r}: valid values are 'mean', 'sum'")
        if mask is not None and (mask.dim() != 2 or mask.shape != x.shape[:2]):
            raise ValueError("mask must be [batch_size, seq_len], matching x and y")
        flat_x = x.reshape(-1, *x.shape[2:])
        extra = [y.reshape(-1, *y.shape[2:])] + ([mask.reshape(-1)] if mask is not None else [])
        total = tiled(lambda xt, *et: fn(self, xt, *et), flat_x, params=_trainable(self, compute_params),
                      tiles=shards, dim=0, extra=extra, total=True)  # fmt: skip
        return total / shards if output_reduction == "mean" else total
