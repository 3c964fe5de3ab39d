"""Ulysses sequence parallelism: each rank holds a slice of every sequence, and attention
exchanges slices for heads so that each rank attends over whole sequences with some of the
heads (``exchange``: the all-to-alls; ``attention``: the attention step around them).
For multimodal models (DeepSpeed's AutoSP), ``vision`` runs a vision encoder's attention
on sharded image patches and ``fusion`` splices the image into the text and shards the result.

Not to be confused with Megatron's sequence parallelism inside tensor parallelism
(``terascale.parallel.tensor``: norms and dropout on sequence slices between the
tensor-parallel layers), which splits activations, not attention.
"""

from terascale.parallel.sequence.attention import DistributedAttention, ulysses_attention
from terascale.parallel.sequence.data import sequence_loss, slice_batch
from terascale.parallel.sequence.fusion import InternVLFusionAdapter, LlavaFusionAdapter, Qwen2VLFusionAdapter
from terascale.parallel.sequence.vision import UlyssesSPViTAttention, auto_wrap_model_for_sp

__all__ = [
    "DistributedAttention",
    "InternVLFusionAdapter",
    "LlavaFusionAdapter",
    "Qwen2VLFusionAdapter",
    "UlyssesSPViTAttention",
    "auto_wrap_model_for_sp",
    "sequence_loss",
    "slice_batch",
    "ulysses_attention",
]
