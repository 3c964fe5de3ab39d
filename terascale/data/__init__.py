"""Token datasets: preparation into memory-mapped shards, samples, blending, a global order.

- ``tokenizer``: bytes or a local Hugging Face tokenizer, with an identity for manifests;
- ``sources`` and ``prepare``: ``terascale data prepare`` (text, JSONL, HF datasets → shards);
- ``shards``: the on-disk format and its reader (:class:`TokenStore`);
- ``samples``: packed windows or one document per sample; ``blend``: exact proportions;
- ``order``: the global sample order (seed and position alone); ``loader``: one replica's
  micro-batches of it, read ahead, with a data position that resumes on any world size.
"""

from terascale.data.blend import Blend
from terascale.data.loader import GlobalBatches, is_global
from terascale.data.order import Permutation, SampleOrder
from terascale.data.prepare import Prepared, prepare
from terascale.data.samples import DocumentSamples, PackedSamples
from terascale.data.shards import ShardError, TokenStore
from terascale.data.tokenizer import ByteTokenizer, HuggingFaceTokenizer, load_tokenizer

__all__ = [
    "Blend",
    "ByteTokenizer",
    "DocumentSamples",
    "GlobalBatches",
    "HuggingFaceTokenizer",
    "PackedSamples",
    "Permutation",
    "Prepared",
    "SampleOrder",
    "ShardError",
    "TokenStore",
    "is_global",
    "load_tokenizer",
    "prepare",
]
