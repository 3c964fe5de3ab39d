"""PEFT adapters on a terascale engine: the adapter alone, or the base model merged.

A ``peft.get_peft_model`` model trains at any ZeRO stage with no special handling: its
frozen base weights are parameters without an optimizer group, so they are sharded (stage
3) and get no optimizer state, and only the adapters are stepped. Saving needs the full
values, which the engine holds sharded:

- the adapter alone, in PEFT's format: ``engine.save_pretrained(dir)`` (or the Trainer's
  ``save_model``) hands the full state to ``PeftModel.save_pretrained``, which keeps the
  adapter's tensors;
- the base model with every LoRA adapter merged in: :func:`save_merged` writes a folder
  that ``AutoModel*.from_pretrained`` loads with no PEFT installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from terascale.zero import GatheredParameters

if TYPE_CHECKING:
    from terascale.engine import Engine

# Parameters PEFT's LoRA layers add (all named lora_*); they vanish from a merged model.
_ADAPTER_MARK = "lora_"
_BASE_PREFIX = "base_model.model."


def _lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


@torch.no_grad()
def merged_state_dict(engine: Engine) -> dict[str, torch.Tensor]:
    """The base model's weights by its own names, fp32 on CPU, with the active LoRA
    adapters merged in (``W + ΔW``, ΔW from PEFT's ``get_delta_weight`` on the adapter
    weights the model computes with). Collective: call on every rank.

    Raises ValueError when the engine's module is not a PEFT model or an adapter is a
    DoRA one (whose merge rescales ``W``; merge it with PEFT from the saved adapter).
    """
    from peft import PeftModel

    model = engine.module
    if not isinstance(model, PeftModel):
        raise ValueError(f"merged_state_dict needs a PEFT model, this engine wraps a {type(model).__name__}")
    full = engine.full_state_dict()
    deltas: dict[str, torch.Tensor] = {}
    for name, layer in _lora_layers(model).items():
        if any(getattr(layer, "use_dora", {}).get(a, False) for a in layer.active_adapters):
            raise ValueError(f"{name}: DoRA adapters are merged with W rescaled; save the adapter and merge with PEFT")
        with GatheredParameters(list(layer.parameters())):  # every rank, same layers, same order
            delta = None
            for adapter in layer.active_adapters:
                if adapter in layer.scaling:
                    d = layer.get_delta_weight(adapter).float().cpu()
                    delta = d if delta is None else delta + d
        if delta is not None:
            deltas[f"{name}.base_layer.weight"] = delta
    out = {}
    for key, value in full.items():
        if _ADAPTER_MARK in key:
            continue
        if key in deltas:
            value = value + deltas[key].reshape(value.shape)
        out[key.removeprefix(_BASE_PREFIX).replace(".base_layer.", ".")] = value
    return out


def save_merged(engine: Engine, save_dir: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write the base model with its LoRA adapters merged (:func:`merged_state_dict`) as a
    Hugging Face folder on rank 0, in ``dtype`` (default fp32). Collective: every rank
    returns once the folder is written."""
    state = merged_state_dict(engine)
    base = engine.module.get_base_model()
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}

    def write() -> None:
        base.save_pretrained(str(save_dir), state_dict=state)

    engine.write_on_ranks(write if engine.rank == 0 else None, f"save_merged to {save_dir}")
