"""Hugging Face models with Ulysses attention over two ranks, each holding half of every
sequence, against the unchanged model on whole sequences: the loss over all tokens and every
parameter's gradient (averaged over the sequence-parallel ranks, as the engine reduces
them), with and without GQA, SDPA and eager attention."""

from __future__ import annotations

import pytest

from distributed import run_ranks

VOCAB, SEQ = 64, 16
MODELS = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen2-mqa": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=1)),
    "mistral-mha": ("MistralConfig", "MistralForCausalLM", dict(num_attention_heads=4, num_key_value_heads=4,
                                                               sliding_window=None)),
}  # fmt: skip


def _model(name: str, impl: str):
    import torch
    import transformers

    config_cls, model_cls, kw = MODELS[name]
    config = getattr(transformers, config_cls)(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                               num_hidden_layers=2, max_position_embeddings=64, **kw)  # fmt: skip
    config._attn_implementation = impl
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).float()


def _rank(name: str, impl: str) -> None:
    import torch
    import torch.distributed as dist

    from terascale.comm import init_distributed
    from terascale.parallel.sequence.data import sequence_loss, slice_batch
    from terascale.parallel.sequence.hf import use_ulysses_attention

    init_distributed()
    rank, sp = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[0, 3:6] = -100  # some ignored targets, unevenly over the slices
    # Whole sequences, one process.
    ref = _model(name, impl)
    ref_loss = ref(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    # This rank's half of every sequence, its global positions, its share of the loss.
    model = _model(name, impl)
    use_ulysses_attention(model, dist.group.WORLD)
    piece = slice_batch({"input_ids": ids, "labels": labels}, rank, sp)
    assert piece.num_targets == 2 * (SEQ - 1) - 3
    out = model(input_ids=piece.inputs["input_ids"], position_ids=piece.inputs["position_ids"])
    loss = sequence_loss(out.logits, piece.inputs["shift_labels"], piece.num_targets, dist.group.WORLD)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-6)  # the whole mean, every rank
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        grad /= sp  # the engine's average over the ranks holding the parameters
        torch.testing.assert_close(grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"{name} {impl} {n}")
    assert ref.config._attn_implementation == impl  # the reference kept its own attention


@pytest.mark.parametrize("name, impl", [("llama-gqa", "sdpa"), ("qwen2-mqa", "eager"), ("mistral-mha", "sdpa")])
def test_hf_model_with_ulysses_attention_equals_whole_sequences(name, impl):
    run_ranks(_rank, 2, name, impl)


def test_a_batch_that_cannot_be_cut_is_refused():
    import torch

    from terascale.parallel.sequence.data import slice_batch

    ids = torch.zeros(2, 10, dtype=torch.long)
    with pytest.raises(ValueError, match="sequences of 10 tokens do not split over 4 sequence-parallel ranks"):
        slice_batch({"input_ids": ids}, 0, 4)
    piece = slice_batch({"input_ids": ids, "attention_mask": torch.ones(2, 10)}, 1, 2)
    assert "attention_mask" not in piece.inputs and piece.inputs["position_ids"][0].tolist() == [5, 6, 7, 8, 9]
    assert piece.mask is None  # plain causal: nothing to build


def test_whole_sequence_masks_for_padding_and_packed_sequences():
    import torch

    from terascale.parallel.sequence.data import slice_batch

    ids = torch.zeros(2, 6, dtype=torch.long)
    padding = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    mask = slice_batch({"input_ids": ids, "attention_mask": padding}, 0, 2).mask
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    assert mask.shape == (2, 1, 6, 6) and torch.equal(mask[1, 0], causal)
    assert torch.equal(mask[0, 0, :4], causal[:4] & padding[0].bool())  # real queries skip padded keys
    assert mask[0, 0, 5].tolist() == [True] * 4 + [False, False]  # a padded query: the real keys
    packed = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])  # two documents in row 0
    mask = slice_batch({"input_ids": ids, "position_ids": packed}, 1, 2).mask
    assert mask[0, 0, 4].tolist() == [False, False, False, True, True, False]
    assert torch.equal(mask[1, 0], causal)
