"""The demo's GPT: a small decoder-only transformer and a byte-level stdlib corpus."""

from gpt.corpus import VOCAB_SIZE, ByteBlocks, Corpus, decode, encode, load_stdlib_corpus
from gpt.model import DEMO_CONFIG, GPT, GPTConfig, flops_per_iteration

__all__ = [
    "DEMO_CONFIG",
    "GPT",
    "VOCAB_SIZE",
    "ByteBlocks",
    "Corpus",
    "GPTConfig",
    "decode",
    "encode",
    "flops_per_iteration",
    "load_stdlib_corpus",
]
