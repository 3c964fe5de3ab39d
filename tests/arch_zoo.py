"""Tiny models of many architectures, and batches for them, for the architecture sweep.

Every entry builds, from a seed, a randomly initialised model small enough to train a
few steps in well under a second on a CPU (hidden 32, 2 layers, vocabulary 96) and
makes global batches for it; ``loss_of`` reads the training loss from its output. The
Hugging Face entries use the installed transformers' own model classes, so the sweep
exercises what those models really do in forward: tied and shared weights, frozen
position tables, weights read without calling their module, layers called through
``.forward``, experts that get no tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

VOCAB, SEQ, CLASSES = 96, 16, 5
# Special token ids below this are left out of the data: models give some of them
# meaning (a padding id masked out of the loss would make the ranks' token counts
# unequal, so the mean of their losses would no longer be the global batch's).
_FIRST_TOKEN = 4


@dataclass(frozen=True)
class Arch:
    """``config``: the transformers config class name and its arguments; ``model``: the
    model class name (or a builder of a plain-torch model); ``data``: the batch kind."""

    config: str | None
    model: str | Callable[[], nn.Module]
    data: str
    kwargs: tuple[tuple[str, object], ...] = ()


def _hf(config: str, model: str, data: str, **kwargs: object) -> Arch:
    return Arch(config, model, data, tuple(kwargs.items()))


_DEC = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=2 * SEQ)  # fmt: skip
_GQA = dict(_DEC, num_key_value_heads=2)
_GPT2 = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=2 * SEQ, bos_token_id=0, eos_token_id=2)
_BERT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=2 * SEQ, type_vocab_size=2)  # fmt: skip
_BART = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=2 * SEQ,
             pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)  # fmt: skip
_MOE = dict(_GQA, num_local_experts=4, num_experts_per_tok=2, output_router_logits=False)


# The sweep's architectures. Masked-LM entries predict every position (labels = inputs):
# each rank then has as many target tokens as any other (see _FIRST_TOKEN).
ARCHS: dict[str, Arch] = {
    # causal language models
    "gpt2": _hf("GPT2Config", "GPT2LMHeadModel", "causal", **_GPT2),
    "llama": _hf("LlamaConfig", "LlamaForCausalLM", "causal", **_GQA),
    "mistral": _hf("MistralConfig", "MistralForCausalLM", "causal", **_GQA, sliding_window=8),
    "qwen2": _hf("Qwen2Config", "Qwen2ForCausalLM", "causal", **_GQA),
    "qwen3": _hf("Qwen3Config", "Qwen3ForCausalLM", "causal", **_GQA, head_dim=8),
    "gemma": _hf("GemmaConfig", "GemmaForCausalLM", "causal", **_GQA, head_dim=8),
    "phi": _hf("PhiConfig", "PhiForCausalLM", "causal", **_DEC),
    "phi3": _hf("Phi3Config", "Phi3ForCausalLM", "causal", **_GQA, pad_token_id=1, eos_token_id=2),
    "gpt_neox": _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", "causal", **_DEC),
    "opt": _hf("OPTConfig", "OPTForCausalLM", "causal", vocab_size=VOCAB, hidden_size=32, ffn_dim=64,
               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=2 * SEQ, word_embed_proj_dim=32),
    "bloom": _hf("BloomConfig", "BloomForCausalLM", "causal", vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4),
    "falcon": _hf("FalconConfig", "FalconForCausalLM", "causal", vocab_size=VOCAB, hidden_size=32,
                  num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=2 * SEQ),
    "gptj": _hf("GPTJConfig", "GPTJForCausalLM", "causal", **_GPT2, rotary_dim=4),
    "codegen": _hf("CodeGenConfig", "CodeGenForCausalLM", "causal", **_GPT2, n_ctx=2 * SEQ, rotary_dim=4),
    "gpt_bigcode": _hf("GPTBigCodeConfig", "GPTBigCodeForCausalLM", "causal", **_GPT2),
    "starcoder2": _hf("Starcoder2Config", "Starcoder2ForCausalLM", "causal", **_GQA),
    "stablelm": _hf("StableLmConfig", "StableLmForCausalLM", "causal", **_GQA),
    "olmo": _hf("OlmoConfig", "OlmoForCausalLM", "causal", **_GQA, pad_token_id=1, eos_token_id=2),
    "mpt": _hf("MptConfig", "MptForCausalLM", "causal", vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2,
               max_seq_len=2 * SEQ),
    "xglm": _hf("XGLMConfig", "XGLMForCausalLM", "causal", vocab_size=VOCAB, d_model=32, ffn_dim=64, num_layers=2,
                attention_heads=4, max_position_embeddings=2 * SEQ),
    # masked language models
    "bert": _hf("BertConfig", "BertForMaskedLM", "masked", **_BERT),
    "roberta": _hf("RobertaConfig", "RobertaForMaskedLM", "masked", **dict(_BERT, max_position_embeddings=2 * SEQ + 2)),
    # ALBERT shares one layer's weights across all layers (the same group used twice a forward)
    "albert": _hf("AlbertConfig", "AlbertForMaskedLM", "masked", **_BERT, embedding_size=16),
    "distilbert": _hf("DistilBertConfig", "DistilBertForMaskedLM", "masked", vocab_size=VOCAB, dim=32,
                      hidden_dim=64, n_layers=2, n_heads=4, max_position_embeddings=2 * SEQ),
    "electra": _hf("ElectraConfig", "ElectraForMaskedLM", "masked", **_BERT, embedding_size=16),
    "deberta-v2": _hf("DebertaV2Config", "DebertaV2ForMaskedLM", "masked", **_BERT),
    "mpnet": _hf("MPNetConfig", "MPNetForMaskedLM", "masked", **_BERT),
    # SqueezeBERT calls its layers' .forward directly
    "squeezebert": _hf("SqueezeBertConfig", "SqueezeBertForMaskedLM", "masked", **_BERT, embedding_size=32),
    # Funnel's blocks are ModuleLists inside a ModuleList
    "funnel": _hf("FunnelConfig", "FunnelForMaskedLM", "masked", vocab_size=VOCAB, block_sizes=[1, 1],
                  num_decoder_layers=1, d_model=32, n_head=4, d_head=8, d_inner=64),
    # encoder-decoders (Pegasus, Marian and Whisper hold frozen sinusoidal position tables)
    "t5": _hf("T5Config", "T5ForConditionalGeneration", "seq2seq", vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64,
              num_layers=2, num_heads=4, decoder_start_token_id=0),
    "bart": _hf("BartConfig", "BartForConditionalGeneration", "seq2seq", **_BART),
    "mbart": _hf("MBartConfig", "MBartForConditionalGeneration", "seq2seq", **_BART),
    "pegasus": _hf("PegasusConfig", "PegasusForConditionalGeneration", "seq2seq", **_BART),
    "marian": _hf("MarianConfig", "MarianMTModel", "seq2seq", **dict(_BART, decoder_start_token_id=1)),
    "whisper": _hf("WhisperConfig", "WhisperForConditionalGeneration", "speech", vocab_size=VOCAB, d_model=32,
                   encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                   encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=SEQ,
                   max_target_positions=2 * SEQ, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                   decoder_start_token_id=3, suppress_tokens=[], begin_suppress_tokens=[]),
    # vision
    "vit": _hf("ViTConfig", "ViTForImageClassification", "image", image_size=16, patch_size=4, hidden_size=32,
               num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, num_labels=CLASSES),
    "deit": _hf("DeiTConfig", "DeiTForImageClassification", "image", image_size=16, patch_size=4, hidden_size=32,
                num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, num_labels=CLASSES),
    "convnext": _hf("ConvNextConfig", "ConvNextForImageClassification", "image", hidden_sizes=[8, 16],
                    depths=[1, 1], num_stages=2, patch_size=2, num_labels=CLASSES),
    "swin": _hf("SwinConfig", "SwinForImageClassification", "image", image_size=16, patch_size=2, embed_dim=16,
                depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=CLASSES),
    # mixture of experts (no auxiliary loss: it is not a mean over samples)
    "mixtral": _hf("MixtralConfig", "MixtralForCausalLM", "causal", **_MOE),
    "qwen2_moe": _hf("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "causal", **dict(_GQA, num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                     output_router_logits=False, decoder_sparse_step=1)),
    "olmoe": _hf("OlmoeConfig", "OlmoeForCausalLM", "causal", **dict(_GQA, num_experts=4, num_experts_per_tok=2,
                 output_router_logits=False)),
}


# -- plain torch models ---------------------------------------------------------------------------


class _TokenModel(nn.Module):
    """Embedding, a body over (batch, seq, 32) and a vocabulary head; returns the mean cross-entropy."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.body = body
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.body(self.embed(input_ids)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _torch_encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    return _TokenModel(nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False))


class _Attention(nn.Module):
    """A bare nn.MultiheadAttention: its forward reads ``out_proj.weight`` without calling ``out_proj``."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.attn(h, h, h, need_weights=False)[0]


class _ViTLike(nn.Module):
    """Layers as ``ModuleList([ModuleList([attention, feed-forward])])``, as vit-pytorch writes them."""

    def __init__(self) -> None:
        super().__init__()
        ff = lambda: nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))  # noqa: E731
        self.layers = nn.ModuleList([nn.ModuleList([_Attention(), ff()]) for _ in range(2)])
        self.norm = nn.LayerNorm(32)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for attn, ff in self.layers:
            h = attn(h)
            h = h + ff(h)
        return self.norm(h)


ARCHS.update({
    "torch_encoder": Arch(None, _torch_encoder, "tokens"),
    "torch_mha": Arch(None, lambda: _TokenModel(_Attention()), "tokens"),
    "vit_like": Arch(None, lambda: _TokenModel(_ViTLike()), "tokens"),
})  # fmt: skip


def missing(name: str) -> str | None:
    """Why the installed transformers cannot build ``name`` (None: it can)."""
    arch = ARCHS[name]
    if arch.config is None:
        return None
    import transformers

    absent = [n for n in (arch.config, arch.model) if not hasattr(transformers, n)]
    return f"transformers {transformers.__version__} has no {', '.join(absent)}" if absent else None


def build(name: str, seed: int = 0) -> nn.Module:
    """``name``'s model, randomly initialised from ``seed``, in eval mode: dropout and
    batch statistics would differ between two half batches and their whole."""
    arch = ARCHS[name]
    torch.manual_seed(seed)
    if arch.config is None:
        assert callable(arch.model)
        model = arch.model()
    else:
        import transformers

        config = getattr(transformers, arch.config)(**dict(arch.kwargs))
        model = getattr(transformers, arch.model)(config)
    return model.eval()


def make_batches(name: str, steps: int, global_batch: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``steps`` global batches of ``global_batch`` rows for ``name``'s model."""
    g = torch.Generator().manual_seed(seed)
    kind = ARCHS[name].data

    def tokens(n: int = SEQ) -> torch.Tensor:
        return torch.randint(_FIRST_TOKEN, VOCAB, (global_batch, n), generator=g)

    out = []
    for _ in range(steps):
        if kind in ("causal", "masked", "tokens"):
            ids = tokens()
            batch = {"input_ids": ids, "labels": ids}
        elif kind == "seq2seq":
            batch = {"input_ids": tokens(), "labels": tokens(SEQ // 2)}
        elif kind == "speech":  # 8 mel bins, 2 x max_source_positions frames
            batch = {"input_features": torch.randn(global_batch, 8, 2 * SEQ, generator=g), "labels": tokens(SEQ // 2)}
        else:
            assert kind == "image", kind
            batch = {"pixel_values": torch.randn(global_batch, 3, 16, 16, generator=g),
                     "labels": torch.randint(0, CLASSES, (global_batch,), generator=g)}  # fmt: skip
        out.append(batch)
    return out


def loss_of(output: object) -> torch.Tensor:
    """The training loss in a model's output (a Hugging Face output's ``loss``, or the tensor)."""
    return output if isinstance(output, torch.Tensor) else output.loss  # type: ignore[attr-defined]
