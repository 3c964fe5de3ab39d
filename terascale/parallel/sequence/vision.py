"""Sequence parallelism over image patches: a vision encoder's attention on sharded patches
(DeepSpeed's AutoSP, ``deepspeed.sequence.autosp_vit`` / ``autosp_detector`` / ``auto_sp``).

[Note: vision attention under sequence parallelism]
A vision encoder's attention is bidirectional: every patch attends to every patch, so no
rank can attend over its slice alone. Ulysses' exchange (``exchange.py``) would need the
module's query/key/value projections, and an encoder taken from a model zoo is one opaque
module that maps hidden states to hidden states. So the wrapper gathers the patches from
every rank (:func:`~terascale.parallel.sequence.exchange.gather_slices`, uneven slices
allowed), runs the module on the whole sequence and keeps this rank's rows of the result.
What the split saves is everything outside attention (MLPs, norms and their activations
stored for backward), which runs on the slice; attention itself costs what it costs
unsplit, on every rank.

A CLS token, where the encoder has one, is position 0 of every rank's input: it belongs to
no slice, every rank holds it (and gets its output) whole.

Gradients follow [Note: gathering uneven slices]: a rank's patch gradient is its patches'
whole gradient; its gradients of the module's parameters and of the CLS input are its
share, the parts its outputs contribute, which the engine's reduction over the group
sums, as it does for every replicated weight under sequence parallelism. A rank's CLS
output gradient is therefore counted once per rank: where the ranks compute the same loss
on the CLS token, that loss belongs in one rank's share (or 1/P of it in each).

[Note: finding attention by class name]
``auto_wrap_model_for_sp`` recognises the attention modules of known multimodal families
by class name (Hugging Face's), as DeepSpeed does: a vision encoder's is wrapped, with the
CLS handling of its family; a language model's is only reported, because its
``hidden_states`` interface gives Ulysses no query/key/value to exchange (Hugging Face
language models take Ulysses through ``UlyssesSPAttentionHF``, which swaps the attention
function instead). The registries are read-only; a program adds its own classes through
the ``vision_classes``/``language_classes`` arguments rather than by editing them.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from terascale.parallel.sequence.exchange import gather_slices, slice_lengths

logger = logging.getLogger(__name__)

# Vision-encoder attention class -> whether its sequence starts with a CLS token.
VISION_ATTENTION: Mapping[str, bool] = types.MappingProxyType({
    "ViTAttention": True,
    "CLIPAttention": True,
    "SiglipAttention": False,
    "InternVisionAttention": False,
    "Qwen2VLVisionAttention": False,
    "Idefics2VisionAttention": False,
    "PaliGemmaVisionAttention": False,
})  # fmt: skip
VISION_ATTENTION_NAMES: frozenset[str] = frozenset(VISION_ATTENTION)
# Language-model attention classes: reported, not wrapped (see the note).
LANGUAGE_ATTENTION: frozenset[str] = frozenset({
    "LlamaAttention", "MistralAttention", "Qwen2Attention", "InternLM2Attention", "GemmaAttention",
    "Phi3Attention", "GPTNeoXAttention", "FalconAttention", "MptAttention",
})  # fmt: skip
# Module names that mark the vision-to-language projection (where a fusion adapter goes).
PROJECTION_KEYWORDS: tuple[str, ...] = (
    "visual_projection", "mm_projector", "vision_proj", "multi_modal_projector", "img_projection",
)  # fmt: skip


class UlyssesSPViTAttention(nn.Module):
    """A vision encoder's attention ``attn`` on this rank's patches (DeepSpeed's
    ``deepspeed.sequence.autosp_vit.UlyssesSPViTAttention``; see [Note: vision attention
    under sequence parallelism]).

    ``forward(hidden_states, **kwargs)`` takes ``[batch, seq, hidden]`` (``seq_dim`` names
    another sequence dim): the CLS token, where ``has_cls_token``, then this rank's
    consecutive patches, ranks holding the patches in group-rank order (their counts may
    differ). It returns the same rows of ``attn``'s output over the whole sequence; a tuple
    output keeps its other elements as ``attn`` returned them (attention weights over the
    whole sequence). ``kwargs`` go to ``attn`` unchanged, so masks and position tensors in
    them describe the whole sequence. Collective over ``process_group``."""

    def __init__(
        self, attn: nn.Module, process_group: ProcessGroup, has_cls_token: bool = True, *, seq_dim: int = 1
    ) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.has_cls_token = has_cls_token
        self.seq_dim = seq_dim

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> Any:
        dim = self.seq_dim % hidden_states.dim()
        lead = 1 if self.has_cls_token else 0
        if hidden_states.shape[dim] < lead:
            raise ValueError(f"has_cls_token is set but the input has no position along dim {dim}")
        cls, patches = hidden_states.split([lead, hidden_states.shape[dim] - lead], dim=dim)
        group = self.process_group
        # Asked every call: the patch count may change from batch to batch (image sizes).
        lengths = slice_lengths(patches.shape[dim], group, patches.device)
        whole = gather_slices(patches, group, dim=dim, lengths=lengths)
        out = self.attn(torch.cat([cls, whole], dim=dim) if lead else whole, **kwargs)
        first, rest = (out[0], tuple(out[1:])) if isinstance(out, (tuple, list)) else (out, None)
        start = lead + sum(lengths[: dist.get_rank(group)])
        mine = first.narrow(dim, start, patches.shape[dim]).contiguous()
        if lead:
            mine = torch.cat([first.narrow(dim, 0, lead), mine], dim=dim)
        if rest is None:
            return mine
        return [mine, *rest] if isinstance(out, list) else (mine, *rest)

    def extra_repr(self) -> str:
        return f"has_cls_token={self.has_cls_token}, seq_dim={self.seq_dim}"


@dataclasses.dataclass
class SPModelInfo:
    """What :func:`detect_model_sp_info` found: ``(dotted name, module)`` pairs of the
    vision-encoder and language-model attention modules, and the first module whose name
    marks the vision-to-language projection (None where none does)."""

    vit_attn_modules: list[tuple[str, nn.Module]] = dataclasses.field(default_factory=list)
    llm_attn_modules: list[tuple[str, nn.Module]] = dataclasses.field(default_factory=list)
    vision_projection_module: tuple[str, nn.Module] | None = None


def detect_model_sp_info(
    model: nn.Module,
    *,
    vision_classes: Mapping[str, bool] | None = None,
    language_classes: Iterable[str] = (),
) -> SPModelInfo:
    """The attention modules of ``model`` by class name ([Note: finding attention by class
    name]); ``vision_classes`` (class name -> has a CLS token) and ``language_classes`` add
    to the registries. Modules inside a found vision attention, or inside an
    :class:`UlyssesSPViTAttention` already, are not listed: the outermost one is wrapped."""
    vision = {**VISION_ATTENTION, **(vision_classes or {})}
    language = LANGUAGE_ATTENTION | frozenset(language_classes)
    info = SPModelInfo()
    inside: list[str] = []  # prefixes whose modules are not to be wrapped again
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in inside):
            continue
        kind = type(module).__name__
        if isinstance(module, UlyssesSPViTAttention):
            inside.append(f"{name}." if name else "")
        elif kind in vision:
            info.vit_attn_modules.append((name, module))
            inside.append(f"{name}." if name else "")
        elif kind in language:
            info.llm_attn_modules.append((name, module))
        if info.vision_projection_module is None and any(k in name for k in PROJECTION_KEYWORDS):
            info.vision_projection_module = (name, module)
    return info


def auto_wrap_model_for_sp(
    model: nn.Module,
    process_group: ProcessGroup,
    *,
    vision_classes: Mapping[str, bool] | None = None,
    language_classes: Iterable[str] = (),
) -> nn.Module:
    """Wrap ``model``'s vision-encoder attention modules in :class:`UlyssesSPViTAttention`
    over ``process_group``, in place, and return ``model`` (DeepSpeed's
    ``deepspeed.sequence.auto_sp.auto_wrap_model_for_sp``). Language-model attention and
    the vision projection are reported in the log, not changed: sequence parallelism for
    the language model and the fusion adapter at the projection
    (:mod:`terascale.parallel.sequence.fusion`) are the program's to set up. Raises
    ValueError when no known attention class is found (add yours through
    ``vision_classes``, class name -> has a CLS token, or ``language_classes``)."""
    info = detect_model_sp_info(model, vision_classes=vision_classes, language_classes=language_classes)
    if not info.vit_attn_modules and not info.llm_attn_modules:
        already = any(isinstance(m, UlyssesSPViTAttention) for m in model.modules())
        if already:
            return model
        raise ValueError(
            f"auto_wrap_model_for_sp found no attention module of a known class in {type(model).__name__}; "
            "name its vision attention class in vision_classes={'MyVisionAttention': has_cls_token} "
            "(or its language attention in language_classes)"
        )
    vision = {**VISION_ATTENTION, **(vision_classes or {})}
    for name, module in info.vit_attn_modules:
        wrapped = UlyssesSPViTAttention(module, process_group, has_cls_token=vision[type(module).__name__])
        if not name:
            return wrapped  # the model is the attention itself: nothing holds it to replace it in
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, wrapped)
    if info.vit_attn_modules:
        logger.info("AutoSP: %d vision attention module(s) split over the patches", len(info.vit_attn_modules))
    for name, module in info.llm_attn_modules:
        logger.warning(
            "AutoSP: left %s (%s) unwrapped: its hidden_states interface has no query/key/value for Ulysses' "
            "exchange; give the language model sequence parallelism itself (UlyssesSPAttentionHF for Hugging Face "
            "models, DistributedAttention for your own attention)", name, type(module).__name__,
        )  # fmt: skip
    if info.vision_projection_module is not None:
        logger.warning(
            "AutoSP: vision projection %s left as it is; wrap it in a fusion adapter "
            "(LlavaFusionAdapter, InternVLFusionAdapter, Qwen2VLFusionAdapter) to splice the gathered image "
            "features into the text and shard the result", info.vision_projection_module[0],
        )  # fmt: skip
    return model
