"""Where image features join the text: fusion adapters for sequence-parallel multimodal models
(DeepSpeed's AutoSP, ``deepspeed.sequence.autosp_fusion``).

[Note: fusing a sharded image into the text]
Under sequence parallelism the vision encoder runs on each rank's slice of the image
patches (``vision.py``) and the language model on each rank's slice of the fused sequence,
text and image tokens together. The two slicings do not line up: where the image lands in
the text is known only from the token ids. So the adapter between them projects this
rank's visual features, gathers every rank's (uneven slices allowed), splices the whole
image into the text embeddings at its placeholder tokens exactly as the model does on one
device, pads the fused sequence with zeros to a multiple of the group's size and returns
this rank's consecutive block of it. The text embeddings and ids are whole on every rank
(they are cheap next to the image), so every rank builds the same fused sequence.

Gradients: this rank's block is its share of the fused sequence; the gather's backward
sums the ranks' shares of the image's gradient ([Note: gathering uneven slices]), so each
rank's visual features get their whole gradient, while the text embeddings (replicated)
get this rank's share, which the engine's reduction over the group sums with the others.

Families differ only in the splice (:meth:`FusionAdapter._splice_visual_into_text`):
LLaVA replaces one placeholder per image by all of its tokens (the sequence grows);
InternVL replaces each IMG_CONTEXT token by one visual token and Qwen2-VL each token
between a vision_start/vision_end pair, both keeping the length. A sample without image
tokens is its text.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from terascale.parallel.sequence.exchange import gather_slices

LLAVA_IMAGE_TOKEN_ID = -200  # LLaVA's IMAGE_TOKEN_INDEX


def shard_padded(fused: torch.Tensor, group: ProcessGroup, *, dim: int = 1) -> torch.Tensor:
    """This rank's consecutive block of ``fused`` along ``dim`` after zero padding to a
    multiple of ``group``'s size, contiguous (collectives take it as it is); differentiable."""
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    length = fused.shape[dim]
    short = -length % p
    if short:
        pad = [0, 0] * (fused.dim() - 1 - dim % fused.dim()) + [0, short]
        fused = F.pad(fused, pad)
    block = fused.shape[dim] // p
    return fused.narrow(dim, rank * block, block).contiguous()


def _fill(text_embeds: torch.Tensor, visual_embeds: torch.Tensor, mask: torch.Tensor, what: str) -> torch.Tensor:
    """``text_embeds`` with the positions of ``mask`` [batch, seq] taken, in order, from each
    sample's visual tokens; raises ValueError when a sample has more positions than tokens."""
    counts = mask.sum(dim=1)
    available = visual_embeds.shape[1]
    if bool((counts > available).any()):
        raise ValueError(
            f"{what}: a sample has {int(counts.max())} image positions but the image has {available} visual tokens"
        )
    # Each sample's first counts[i] visual tokens, in sample order: the order in which
    # masked_scatter fills the masked rows of text_embeds.
    take = torch.arange(available, device=counts.device) < counts.unsqueeze(1)
    source = visual_embeds[take].to(text_embeds.dtype)
    return text_embeds.masked_scatter(mask.unsqueeze(-1), source)


class FusionAdapter(nn.Module):
    """Projects this rank's visual features, splices the whole image into the text and
    returns this rank's block of the fused sequence ([Note: fusing a sharded image into
    the text]). Subclasses give the splice.

    ``forward(visual_features, text_embeds, input_ids)``: ``visual_features``
    [batch, local visual tokens, vision hidden] (this rank's, ranks in group-rank order),
    ``text_embeds`` [batch, text length, hidden] and ``input_ids`` [batch, text length]
    whole on every rank; returns [batch, ceil(fused length / P), hidden]. Collective over
    ``process_group``."""

    def __init__(self, projection: nn.Module, process_group: ProcessGroup) -> None:
        super().__init__()
        self.projection = projection
        self.process_group = process_group

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def forward(
        self, visual_features: torch.Tensor, text_embeds: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        visual = self.projection(visual_features)
        whole = gather_slices(visual, self.process_group, dim=1)
        return shard_padded(self._splice_visual_into_text(text_embeds, whole, input_ids), self.process_group)

    def _splice_visual_into_text(
        self, text_embeds: torch.Tensor, visual_embeds: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        """The fused sequence [batch, fused length, hidden] of one device: ``visual_embeds``
        [batch, visual tokens, hidden] (the whole image) placed in ``text_embeds`` where
        ``input_ids`` mark it. DeepSpeed's name, kept: its tests call it as the reference."""
        raise NotImplementedError(
            f"{type(self).__name__} does not say where the image goes in the text: use LlavaFusionAdapter, "
            "InternVLFusionAdapter or Qwen2VLFusionAdapter, or subclass and give _splice_visual_into_text"
        )


class ModalityFusionSPAdapter(FusionAdapter):
    """A fusion adapter whose image positions are marked by ``image_token_id`` (DeepSpeed's
    ``ModalityFusionSPAdapter``, the base of its LLaVA and InternVL adapters)."""

    def __init__(
        self, projection: nn.Module, process_group: ProcessGroup, image_token_id: int = LLAVA_IMAGE_TOKEN_ID
    ) -> None:
        super().__init__(projection, process_group)
        self.image_token_id = image_token_id


class LlavaFusionAdapter(ModalityFusionSPAdapter):
    """LLaVA: each ``image_token_id`` placeholder becomes one image's visual tokens, a
    sample's tokens divided equally between its placeholders (the sequence grows by
    ``tokens - 1`` per image). Samples of different fused lengths are zero-padded at the
    end to the longest."""

    def _splice_visual_into_text(
        self, text_embeds: torch.Tensor, visual_embeds: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        samples = []
        for i in range(text_embeds.shape[0]):
            places = (input_ids[i] == self.image_token_id).nonzero().flatten().tolist()
            if not places:
                samples.append(text_embeds[i])
                continue
            tokens = visual_embeds.shape[1]
            if tokens % len(places):
                raise ValueError(
                    f"LlavaFusionAdapter: {tokens} visual tokens do not divide between the {len(places)} image "
                    f"placeholders of sample {i}"
                )
            images = visual_embeds[i].to(text_embeds.dtype).split(tokens // len(places))
            pieces, after = [], 0
            for place, image in zip(places, images):
                pieces += [text_embeds[i, after:place], image]
                after = place + 1  # the placeholder itself is dropped
            pieces.append(text_embeds[i, after:])
            samples.append(torch.cat(pieces))
        longest = max(s.shape[0] for s in samples)
        return torch.stack([F.pad(s, (0, 0, 0, longest - s.shape[0])) for s in samples])


class InternVLFusionAdapter(ModalityFusionSPAdapter):
    """InternVL: each IMG_CONTEXT token (``image_token_id``) is replaced, in order, by one
    visual token; the IMG_START/IMG_END tokens around them stay text. The length is kept;
    a sample with fewer context tokens than visual tokens takes the first ones (batch
    padding), one with more is refused."""

    def _splice_visual_into_text(
        self, text_embeds: torch.Tensor, visual_embeds: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        return _fill(text_embeds, visual_embeds, input_ids == self.image_token_id, type(self).__name__)


class Qwen2VLFusionAdapter(FusionAdapter):
    """Qwen2-VL: the tokens strictly between each ``vision_start_token_id`` and the next
    ``vision_end_token_id`` are replaced, in order, by the visual tokens; the boundary tokens
    stay text and the length is kept. Unpaired or nested boundaries are refused."""

    def __init__(
        self, projection: nn.Module, process_group: ProcessGroup, vision_start_token_id: int, vision_end_token_id: int
    ) -> None:
        super().__init__(projection, process_group)
        self.vision_start_token_id = vision_start_token_id
        self.vision_end_token_id = vision_end_token_id

    def _splice_visual_into_text(
        self, text_embeds: torch.Tensor, visual_embeds: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        starts = input_ids == self.vision_start_token_id
        ends = input_ids == self.vision_end_token_id
        # depth 1 from a start up to (not including) its end; a start itself is not inside.
        depth = starts.long().cumsum(dim=1) - ends.long().cumsum(dim=1)
        if bool((depth < 0).any() or (depth > 1).any() or (depth[:, -1] != 0).any()):
            raise ValueError(
                "Qwen2VLFusionAdapter: the vision_start/vision_end tokens of a sample do not form "
                "non-nested pairs, each start before its end"
            )
        inside = (depth == 1) & ~starts
        return _fill(text_embeds, visual_embeds, inside, type(self).__name__)
