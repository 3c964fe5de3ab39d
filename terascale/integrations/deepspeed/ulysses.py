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
