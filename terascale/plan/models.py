"""The models ``terascale plan --model`` names, built without launching ranks.

- ``gpt:layers=4,width=512,heads=8,vocab=8192,seq=64``: the GPT of the benchmarks
  (``examples/gpt`` in the repository), with a sample of ``seq`` token ids;
- ``path/to/config.json`` (or a folder holding one), or a Hugging Face model name that
  ``transformers`` can resolve (its cache, or the hub): built from its config with
  ``AutoModelForCausalLM`` (``AutoModel`` for other architectures), on the meta device when
  its fp32 weights would take more than ``REAL_LIMIT`` (then activations come from the
  formulas), else for real so that one sample of ``--seq`` tokens is measured;
- ``package.module:callable``: the callable's return value, an ``nn.Module`` or a pair
  ``(module, sample)`` (a sample: one batch of one, as the training loop passes it).
"""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

REAL_LIMIT = 2 << 30  # bytes of fp32 weights up to which a named model is built for real
_GPT_KEYS = {"layers": "n_layer", "width": "n_embd", "heads": "n_head", "vocab": "vocab_size", "seq": "block_size"}


@dataclass
class NamedModel:
    """A model to plan, one sample for it (or None) and how to call it."""

    module: nn.Module
    sample: Any = None
    call: Callable[[nn.Module, Any], Any] | None = None
    note: str = ""


def build_model(spec: str, seq: int | None = None) -> NamedModel:
    """The model ``spec`` names (see the module docstring). Raises ValueError for a spec
    that names nothing buildable, saying which forms are accepted."""
    if spec.startswith("gpt:") or spec == "gpt":
        return _gpt(spec[4:], seq)
    path = Path(spec)
    if path.suffix == ".json" or (path.is_dir() and (path / "config.json").exists()):
        return _hf(str(path if path.suffix == ".json" else path / "config.json"), seq)
    if ":" in spec and not path.exists():
        return _callable(spec)
    try:
        return _hf(spec, seq)
    except ValueError:
        raise
    except Exception as err:
        raise ValueError(
            f"--model {spec!r}: not a gpt:... shape, a config.json, a module:callable, or a Hugging Face model "
            f"name transformers could load ({type(err).__name__}: {err})"
        ) from None


def _gpt(args: str, seq: int | None) -> NamedModel:
    root = Path(__file__).resolve().parents[2] / "examples"
    if not (root / "gpt").is_dir():
        raise ValueError("--model gpt:... builds the GPT of the repository's examples/gpt, which is not here")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from gpt import GPT, GPTConfig

    values = {"layers": 4, "width": 512, "heads": 8, "vocab": 8192, "seq": 64}
    for item in filter(None, args.split(",")):
        key, _, value = item.partition("=")
        if key not in _GPT_KEYS or not value.isdigit():
            raise ValueError(f"--model gpt:{args}: expected key=integer with keys {', '.join(_GPT_KEYS)}; got {item!r}")
        values[key] = int(value)
    if seq is not None:
        values["seq"] = seq
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{_GPT_KEYS[k]: v for k, v in values.items()}))
    ids = torch.randint(0, values["vocab"], (1, values["seq"]))
    return NamedModel(model, (ids, ids), note=f"GPT {values}")


def _hf(name: str, seq: int | None) -> NamedModel:
    try:
        import transformers
    except ImportError:
        raise ValueError(f"--model {name}: building a Hugging Face model needs transformers "
                         "(pip install transformers)") from None  # fmt: skip
    if name.endswith(".json"):
        data = json.loads(Path(name).read_text())
        config = transformers.AutoConfig.for_model(**data)
    else:
        config = transformers.AutoConfig.from_pretrained(name)
    auto = transformers.AutoModelForCausalLM
    if type(config) not in auto._model_mapping:
        auto = transformers.AutoModel
    with torch.device("meta"):
        meta = auto.from_config(config)
    numel = sum(p.numel() for p in meta.parameters())
    names = ("max_position_embeddings", "n_positions")
    longest = next((getattr(config, k) for k in names if getattr(config, k, None)), 512)
    seq = min(seq or 512, int(longest))
    if 4 * numel > REAL_LIMIT:
        return NamedModel(meta, None, note=f"{name}: {numel / 1e6:.0f}M parameters, built on the meta device")
    torch.manual_seed(0)
    model = auto.from_config(config)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab <= 0:
        return NamedModel(model, None, note=f"{name}: no vocabulary to sample tokens from")
    ids = torch.randint(0, vocab, (1, seq))
    sample = {"input_ids": ids, "labels": ids} if auto is transformers.AutoModelForCausalLM else {"input_ids": ids}
    return NamedModel(model, sample, note=f"{name}: {numel / 1e6:.1f}M parameters, a sample of {seq} tokens")


def _callable(spec: str) -> NamedModel:
    module_name, _, attr = spec.partition(":")
    try:
        target = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--model {spec}: cannot import {module_name!r} ({err})") from None
    fn = target
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ValueError(f"--model {spec}: {module_name!r} has no {attr!r}")
    built = fn() if callable(fn) and not isinstance(fn, nn.Module) else fn
    if isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module):
        return NamedModel(built[0], built[1], note=spec)
    if not isinstance(built, nn.Module):
        raise ValueError(f"--model {spec}: expected an nn.Module or (module, sample), got {type(built).__name__}")
    return NamedModel(built, None, note=spec)
