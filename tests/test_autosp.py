"""AutoSP for multimodal models ([Note: vision attention under sequence parallelism],
[Note: fusing a sharded image into the text]) against the same computation in one process:
the vision attention wrapper's outputs and gradients (patches, CLS, parameters) with and
without a CLS token and with uneven patch counts; each fusion adapter's shards reassembled
against a splice built by hand, and their gradients; and which modules the detector wraps."""

from __future__ import annotations

import logging

import pytest

from distributed import run_ranks


def _attention_class():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class SelfAttention(nn.Module):
        """Bidirectional multi-head attention returning (output, None), as Hugging Face's do."""

        def __init__(self, hidden: int = 16, heads: int = 4) -> None:
            super().__init__()
            self.heads = heads
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.out = nn.Linear(hidden, hidden)

        def forward(self, hidden_states: torch.Tensor, scale: float = 1.0):
            b, s, h = hidden_states.shape
            q, k, v = self.qkv(hidden_states).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q * scale, k, v)
            return self.out(o.transpose(1, 2).reshape(b, s, h)), None

    return SelfAttention


def _split(total: int, rank: int, p: int) -> tuple[int, int]:
    """(start, length) of rank's patches: the first total % p ranks take one more."""
    base, extra = divmod(total, p)
    return rank * base + min(rank, extra), base + (rank < extra)


def _vit_rank() -> None:
    import copy

    import torch
    import torch.distributed as dist

    from terascale.comm import init_distributed
    from terascale.parallel.sequence.vision import UlyssesSPViTAttention

    init_distributed()
    rank, p, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    for cls in (True, False):
        for patches in (8, 5):  # even, uneven (3 + 2)
            name = f"cls={cls} patches={patches}"
            g = torch.Generator().manual_seed(patches * 10 + cls)
            torch.manual_seed(patches)
            attn = _attention_class()()
            lead = int(cls)
            full = torch.randn(2, lead + patches, 16, generator=g)
            tangent = torch.randn(2, lead + patches, 16, generator=g)
            # One process: the whole sequence.
            ref_in = full.clone().requires_grad_(True)
            ref_attn = copy.deepcopy(attn)
            ref_out = ref_attn(ref_in, scale=0.5)[0]
            (ref_out * tangent).sum().backward()
            # This rank: CLS + its patches; the CLS term of the loss is rank 0's share.
            start, n = _split(patches, rank, p)
            rows = [*range(lead), *range(lead + start, lead + start + n)]
            mine = full[:, rows].clone().requires_grad_(True)
            wrapped = UlyssesSPViTAttention(copy.deepcopy(attn), group, has_cls_token=cls)
            out, weights = wrapped(mine, scale=0.5)
            assert weights is None, name
            torch.testing.assert_close(out, ref_out[:, rows], rtol=1e-5, atol=1e-6, msg=name)
            mine_tangent = tangent[:, rows].clone()
            if cls and rank != 0:
                mine_tangent[:, 0] = 0
            (out * mine_tangent).sum().backward()
            grad = mine.grad.clone()
            torch.testing.assert_close(grad[:, lead:], ref_in.grad[:, lead + start : lead + start + n],
                                       rtol=1e-5, atol=1e-6, msg=name)  # fmt: skip
            if cls:  # the replicated CLS input's gradient: the ranks' shares sum to it
                share = grad[:, :1].contiguous()
                dist.all_reduce(share)
                torch.testing.assert_close(share, ref_in.grad[:, :1], rtol=1e-5, atol=1e-6, msg=name)
            for (pname, got), want in zip(wrapped.attn.named_parameters(), ref_attn.parameters()):
                summed = got.grad.clone()
                dist.all_reduce(summed)
                torch.testing.assert_close(summed, want.grad, rtol=1e-5, atol=1e-6, msg=f"{name} {pname}")


def test_vision_attention_on_sharded_patches_equals_the_whole_sequence():
    run_ranks(_vit_rank, 2)


def _fusion_rank() -> None:
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from terascale.comm import init_distributed
    from terascale.parallel.sequence.fusion import InternVLFusionAdapter, LlavaFusionAdapter, Qwen2VLFusionAdapter

    init_distributed()
    rank, p, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    b, text_len, vis_hidden, hidden = 2, 9, 6, 4
    img, ctx, start_id, end_id = -200, 77, 90, 91

    def llava(text, visual, with_image):
        # sample 0: [t0, IMG, t2..] -> t0, every visual token, t2..; sample 1 (no image): its text, zero-padded
        ids = torch.zeros(b, text_len, dtype=torch.long)
        fused = torch.zeros(b, text_len - 1 + visual.shape[1], hidden)
        if with_image:
            ids[0, 1] = img
            fused[0] = torch.cat([text[0, :1], visual[0], text[0, 2:]])
            fused[1, :text_len] = text[1]
        else:
            fused = text
        return ids, fused

    def internvl(text, visual, with_image):
        ids = torch.zeros(b, text_len, dtype=torch.long)
        fused = text.clone()
        if with_image:
            v = visual.shape[1]
            ids[:, 2 : 2 + v] = ctx
            fused[:, 2 : 2 + v] = visual
        return ids, fused

    def qwen2vl(text, visual, with_image):
        ids = torch.zeros(b, text_len, dtype=torch.long)
        fused = text.clone()
        if with_image:
            v = visual.shape[1]
            ids[:, 1], ids[:, 2 + v] = start_id, end_id
            fused[:, 2 : 2 + v] = visual
        return ids, fused

    cases = {
        "llava": (lambda proj: LlavaFusionAdapter(proj, group, image_token_id=img), llava),
        "internvl": (lambda proj: InternVLFusionAdapter(proj, group, image_token_id=ctx), internvl),
        "qwen2vl": (lambda proj: Qwen2VLFusionAdapter(proj, group, vision_start_token_id=start_id,
                                                      vision_end_token_id=end_id), qwen2vl),
    }  # fmt: skip
    for name, (make, expected) in cases.items():
        for tokens in (6, 5):  # visual tokens: even, uneven over the ranks
            for with_image in (True, False):
                what = f"{name} tokens={tokens} image={with_image}"
                g = torch.Generator().manual_seed(tokens)
                torch.manual_seed(0)
                proj = torch.nn.Linear(vis_hidden, hidden)
                features = torch.randn(b, tokens, vis_hidden, generator=g)
                text = torch.randn(b, text_len, hidden, generator=g)
                # One process: project every token, splice by hand.
                ref_features = features.clone().requires_grad_(True)
                ref_proj = copy.deepcopy(proj)
                ids, ref_fused = expected(text, ref_proj(ref_features), with_image)
                length = ref_fused.shape[1]
                padded = F.pad(ref_fused, (0, 0, 0, -length % p))
                tangent = torch.randn(padded.shape, generator=g)
                if with_image:
                    (padded * tangent).sum().backward()
                # This rank: its slice of the visual features.
                start, n = _split(tokens, rank, p)
                mine = features[:, start : start + n].clone().requires_grad_(True)
                adapter = make(copy.deepcopy(proj))
                out = adapter(mine, text, ids)
                block = padded.shape[1] // p
                assert out.shape == (b, block, hidden), what
                every = [torch.empty_like(out) for _ in range(p)]
                dist.all_gather(every, out.detach().contiguous())
                torch.testing.assert_close(torch.cat(every, dim=1), padded.detach(), rtol=1e-5, atol=1e-6, msg=what)
                if with_image:
                    (out * tangent[:, rank * block : (rank + 1) * block]).sum().backward()
                    torch.testing.assert_close(mine.grad, ref_features.grad[:, start : start + n], rtol=1e-5,
                                               atol=1e-6, msg=what)  # fmt: skip
                    for got, want in zip(adapter.projection.parameters(), ref_proj.parameters()):
                        summed = got.grad.clone()
                        dist.all_reduce(summed)
                        torch.testing.assert_close(summed, want.grad, rtol=1e-5, atol=1e-6, msg=what)


def test_fusion_adapter_shards_reassemble_to_the_single_device_splice():
    run_ranks(_fusion_rank, 2)


def test_malformed_image_tokens_are_refused():
    import torch

    from terascale.parallel.sequence.fusion import InternVLFusionAdapter, LlavaFusionAdapter, Qwen2VLFusionAdapter

    text, visual = torch.zeros(1, 6, 4), torch.zeros(1, 3, 4)
    ids = torch.zeros(1, 6, dtype=torch.long)
    qwen = Qwen2VLFusionAdapter(torch.nn.Identity(), None, vision_start_token_id=1, vision_end_token_id=2)
    ids[0, 4] = 1  # a start without its end
    with pytest.raises(ValueError, match="pairs"):
        qwen._splice_visual_into_text(text, visual, ids)
    ids[0, :] = 5
    with pytest.raises(ValueError, match="6 image positions but the image has 3"):
        InternVLFusionAdapter(torch.nn.Identity(), None, image_token_id=5)._splice_visual_into_text(text, visual, ids)
    ids[0, :2] = 7
    with pytest.raises(ValueError, match="3 visual tokens do not divide between the 2"):
        LlavaFusionAdapter(torch.nn.Identity(), None, image_token_id=7)._splice_visual_into_text(text, visual, ids)


def test_detector_wraps_vision_attention_and_only_reports_language_attention(caplog):
    from torch import nn

    from terascale.parallel.sequence.vision import UlyssesSPViTAttention, auto_wrap_model_for_sp

    def attention(name: str) -> type:
        return type(name, (nn.Module,), {"forward": lambda self, x: x})

    names = ("ViTAttention", "CLIPAttention", "SiglipAttention", "LlamaAttention", "Mine")
    vit, clip, siglip, llama, mine = (attention(n) for n in names)
    model = nn.Module()
    model.vision = nn.ModuleList([vit(), siglip(), mine()])
    model.vision[0].inner = clip()  # inside a wrapped one: not wrapped again
    model.mm_projector = nn.Linear(2, 2)
    model.language = nn.ModuleList([llama()])
    group = object()  # read only when the wrappers run
    with caplog.at_level(logging.WARNING, logger="terascale"):
        assert auto_wrap_model_for_sp(model, group, vision_classes={"Mine": True}) is model
    wrapped = [model.vision[i] for i in range(3)]
    assert all(isinstance(w, UlyssesSPViTAttention) and w.process_group is group for w in wrapped)
    assert [w.has_cls_token for w in wrapped] == [True, False, True]
    assert type(wrapped[0].attn).__name__ == "ViTAttention" and type(wrapped[0].attn.inner) is clip
    assert type(model.language[0]) is llama
    assert "language.0" in caplog.text and "mm_projector" in caplog.text
    # A second call finds the wrappers and leaves them as they are.
    auto_wrap_model_for_sp(model, group, vision_classes={"Mine": True})
    assert all(model.vision[i] is wrapped[i] and not isinstance(wrapped[i].attn, UlyssesSPViTAttention)
               for i in range(3))  # fmt: skip
    with pytest.raises(ValueError, match="no attention module of a known class"):
        auto_wrap_model_for_sp(nn.Sequential(nn.Linear(2, 2)), group)
    # The whole model an attention module: the wrapper is returned.
    assert isinstance(auto_wrap_model_for_sp(siglip(), group), UlyssesSPViTAttention)
    # DeepSpeed's module paths (names.py), and its registry read-only.
    from terascale.sequence.auto_sp import auto_wrap_model_for_sp as ds_wrap
    from terascale.sequence.autosp_detector import _VIT_HAS_CLS_TOKEN, detect_model_sp_info
    from terascale.sequence.autosp_fusion import InternVLFusionAdapter, LlavaFusionAdapter, Qwen2VLFusionAdapter
    from terascale.sequence.autosp_vit import UlyssesSPViTAttention as ds_vit

    assert ds_wrap is auto_wrap_model_for_sp and ds_vit is UlyssesSPViTAttention
    assert callable(detect_model_sp_info) and all(map(callable, (InternVLFusionAdapter, LlavaFusionAdapter,
                                                                 Qwen2VLFusionAdapter)))  # fmt: skip
    assert _VIT_HAS_CLS_TOKEN["CLIPAttention"] and not _VIT_HAS_CLS_TOKEN["SiglipAttention"]
    with pytest.raises(TypeError):
        _VIT_HAS_CLS_TOKEN["Mine"] = True
