"""Sequence parallelism and tiled compute applied to a model at ``terascale.initialize``.

A Hugging Face causal LM (Llama, Qwen2, Mistral and the models written like them) is
changed in place, its parameters and their names untouched:

- its attention becomes Ulysses attention over the sequence-parallel group
  (:func:`terascale.parallel.sequence.hf.use_ulysses_attention`);
- its ``forward`` takes the whole micro-batch, as every rank of the group reads it, and
  runs on this rank's slice (:func:`slice_batch`: global position ids, labels shifted on
  the whole sequence); ``loss`` is the micro-batch's mean over all its targets on every
  rank, its gradient this rank's share ([Note: the loss under sequence parallelism]);
  ``logits`` are this rank's slice of them (None when the loss is tiled). A
  ``num_items_in_batch`` argument (the Hugging Face Trainer's count of the accumulation
  window's targets) divides the summed losses instead, as the model's own loss does;
- with tiling on ([Note: tiled compute]), each decoder MLP runs in sequence tiles and the
  loss is computed by the output layer tile by tile, so neither the ``[s, 4h]`` MLP
  activations nor the ``[s, vocab]`` logits exist whole.

A model of the program's own uses :class:`DistributedAttention` for its attention (its
group, left None, is set here) and :func:`slice_batch` / :func:`sequence_loss` in its loop.
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from terascale.activation.tiled import tile_mlp, tiled_cross_entropy
from terascale.parallel.sequence.attention import DistributedAttention
from terascale.parallel.sequence.data import sequence_loss, sequence_mean, slice_batch
from terascale.parallel.sequence.hf import MASK_KWARG, use_ulysses_attention

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TilePolicy:
    """When the MLPs and the loss run in sequence tiles (the config's ``sequence_parallel``
    section): ``True``/``False``, or ``"auto"`` (under sequence parallelism, from ``above``
    tokens a slice); ``mlp_tiles`` per call (``"auto"``: ceil(slice / hidden)); one loss
    tile holds at most ``loss_tile_bytes`` of fp32 logits."""

    mlp: bool | Literal["auto"] = "auto"
    loss: bool | Literal["auto"] = "auto"
    above: int = 8192
    mlp_tiles: int | Literal["auto"] = "auto"
    loss_tile_bytes: int = 64 << 20

    def _on(self, switch: bool | str, length: int, sp: int) -> bool:
        return switch is True or (switch == "auto" and sp > 1 and length >= self.above)

    def mlp_count(self, x: torch.Tensor, sp: int) -> int:
        """Tiles for an MLP call on ``x`` ([b, s, h]); 1: untiled."""
        if not self._on(self.mlp, x.shape[1], sp):
            return 1
        return self.mlp_tiles if isinstance(self.mlp_tiles, int) else max(1, math.ceil(x.shape[1] / x.shape[-1]))

    def loss_count(self, batch: int, length: int, vocab: int, sp: int) -> int:
        """Loss tiles for ``batch`` x ``length`` positions over ``vocab``; 0: untiled."""
        if not self._on(self.loss, length, sp):
            return 0
        return max(1, math.ceil(batch * length * vocab * 4 / self.loss_tile_bytes))

    def tiles_mlps(self, sp: int) -> bool:
        """Whether MLP calls may be tiled at sequence-parallel size ``sp``."""
        return self.mlp is True or (self.mlp == "auto" and sp > 1)

    @property
    def ever(self) -> bool:
        """Whether tiling can turn on without sequence parallelism."""
        return self.mlp is True or self.loss is True


def apply_sequence_parallel(
    module: nn.Module, group: ProcessGroup | None, tiles: TilePolicy, *, split_batches: bool = True
) -> None:
    """Make ``module`` train on sequence slices over ``group`` (None: no sequence
    parallelism) with ``tiles``' tiling, in place (see the module docstring). Without
    ``split_batches`` the program feeds each rank its slices (DeepSpeed's ALST data loader
    adapter) and computes the loss: only the attention (and the MLP tiling) change. Raises
    ``ValueError`` where its attention cannot be split; a model with no attention it knows
    is left to split its sequences itself (a warning says so)."""
    sp = 1 if group is None else dist.get_world_size(group)
    if _is_causal_lm(module):
        if sp > 1:
            _check_heads(module, sp)
            use_ulysses_attention(module, group)
        if split_batches and (sp > 1 or tiles.ever):
            _SequenceCausalLM(module, group, tiles)
        elif tiles.tiles_mlps(sp):
            _tile_mlps(module, tiles, sp)
        return
    if tiles.ever:
        raise ValueError(
            f"sequence_parallel.tiled_mlp / tiled_loss tile a Hugging Face causal LM's MLPs and loss; "
            f"{type(module).__name__} is not one: tile your own with terascale.activation.tiled.tile_mlp and "
            "tiled_cross_entropy, and set both options to false or \"auto\""
        )
    if sp == 1:
        return
    wrappers = [m for m in module.modules() if isinstance(m, DistributedAttention)]
    if not wrappers and dist.get_rank() == 0:
        # As in DeepSpeed: the groups are built (engine.seq_parallel_group) and splitting the
        # sequence is the program's; unsplit, the ranks of a group compute the same thing.
        logger.warning(
            "sequence_parallel_size %d: %s is not a Hugging Face causal LM (whose attention terascale switches "
            "itself) and holds no terascale.parallel.sequence.DistributedAttention, so nothing splits its "
            "sequences: wrap its attention in one (deepspeed.sequence.layer.DistributedAttention is the same "
            "class) or split them with engine.seq_parallel_group yourself",
            sp, type(module).__name__,
        )  # fmt: skip
    for wrapper in wrappers:
        if wrapper.spg is None:
            wrapper.spg = group


def _tile_mlps(model: nn.Module, tiles: TilePolicy, sp: int) -> None:
    """Each decoder MLP (a ``*.mlp`` module) computed in sequence tiles when ``tiles`` says so."""
    for name, child in model.named_modules():
        if name.endswith(".mlp") and not isinstance(child, nn.Linear):
            tile_mlp(child, lambda x: tiles.mlp_count(x, sp))


def _check_heads(model: nn.Module, sp: int) -> None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(config, "num_attention_heads", None)
    if isinstance(heads, int) and heads % sp:
        raise ValueError(
            f"sequence_parallel_size {sp} does not divide the {heads} attention heads of {type(model).__name__}: "
            f"Ulysses gives each rank whole heads; choose a size that divides {heads}"
        )


def _is_causal_lm(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return (
        type(module).__name__.endswith("ForCausalLM")
        and isinstance(getattr(module, "lm_head", None), nn.Linear)
        and hasattr(config, "_attn_implementation")
        and isinstance(getattr(module, getattr(module, "base_model_prefix", ""), None), nn.Module)
    )


class _SequenceCausalLM:
    """The forward of a Hugging Face causal LM on sequence slices (module docstring)."""

    def __init__(self, model: nn.Module, group: ProcessGroup | None, tiles: TilePolicy) -> None:
        if "forward" in vars(model):
            raise ValueError(f"{type(model).__name__} already has its own forward attribute (another wrapper patched it)")
        self.model, self.group, self.tiles = model, group, tiles
        self.sp = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.inner = model.forward  # the class's, bound
        self.signature = inspect.signature(self.inner)
        self.var_keyword = [n for n, p in self.signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD]
        self.base = getattr(model, model.base_model_prefix)
        if tiles.tiles_mlps(self.sp):
            _tile_mlps(model, tiles, self.sp)
        head = model.lm_head
        linear = head.forward

        def head_forward(hidden: torch.Tensor, shift_labels: torch.Tensor | None = None, tiles: int = 0) -> torch.Tensor:
            # The loss runs inside the output layer's own forward, so ZeRO-3 gathers its
            # weight for the tiles' recompute in backward ([Note: tiled compute]).
            if shift_labels is None:
                return linear(hidden)
            return tiled_cross_entropy(hidden, head.weight, shift_labels, tiles, bias=head.bias)

        head.forward = head_forward
        model.forward = self.forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        bound = dict(self.signature.bind_partial(*args, **kwargs).arguments)
        for name in self.var_keyword:  # **kwargs arrive bound as one dict
            bound.update(bound.pop(name, {}))
        batch = {k: v for k, v in bound.items() if v is not None}
        num_items = batch.pop("num_items_in_batch", None)
        logits_to_keep = batch.pop("logits_to_keep", 0)
        if logits_to_keep:
            raise ValueError("sequence parallelism: logits_to_keep (generation) is not supported on sequence slices")
        part = slice_batch(batch, self.rank, self.sp)
        inputs = dict(part.inputs)
        shift = inputs.pop("shift_labels", None)
        count = num_items if num_items is not None else part.num_targets
        inputs["use_cache"] = False
        if self.sp > 1:
            inputs[MASK_KWARG] = part.mask  # the attention's mask over whole sequences
        elif "attention_mask" in batch:  # whole sequences (tiling alone): the model's own mask
            inputs["attention_mask"] = batch["attention_mask"]
        n_tiles = 0
        if shift is not None:
            ids = inputs["input_ids"]
            n_tiles = self.tiles.loss_count(ids.shape[0], ids.shape[1], self.model.lm_head.out_features, self.sp)
        if not n_tiles:
            out = self.inner(**inputs)
            if shift is not None:
                out.loss = sequence_loss(out.logits, shift, count, self.group)
            return out
        from transformers.modeling_outputs import CausalLMOutputWithPast

        hidden = self.base(**inputs)
        summed = self.model.lm_head(hidden.last_hidden_state, shift_labels=shift, tiles=n_tiles)
        return CausalLMOutputWithPast(loss=sequence_mean(summed, count, self.group), logits=None,
                                      hidden_states=hidden.hidden_states, attentions=hidden.attentions)  # fmt: skip

