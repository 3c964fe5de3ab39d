"""Ulysses sequence parallelism: each rank holds a slice of every sequence, and attention
exchanges slices for heads so that each rank attends over whole sequences with some of the
heads (``exchange``: the all-to-alls; ``attention``: the attention step around them).

Not to be confused with Megatron's sequence parallelism inside tensor parallelism
(``terascale.parallel.tensor``: norms and dropout on sequence slices between the
tensor-parallel layers), which splits activations, not attention.
"""

from terascale.parallel.sequence.attention import DistributedAttention, ulysses_attention
from terascale.parallel.sequence.data import sequence_loss, slice_batch

__all__ = ["DistributedAttention", "sequence_loss", "slice_batch", "ulysses_attention"]
