"""What a checkpoint records about this rank besides its parameters' spans, and the checks
that a checkpoint fits the model it is loaded into.

The module's persistent buffers and tied-parameter aliases, the optimizer-state keys of the
spans, every RNG this process draws from (as JSON-safe data in the manifest), and the
errors that name what differs when a checkpoint's parameters or optimizer do not match.
"""

from __future__ import annotations

import base64
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from terascale.checkpoint.manifest import CheckpointError, Manifest, dtype_name
from terascale.checkpoint.spans import BUFFER, OPTIM, ParamInfo, Slice, Span


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    keys = set(module.state_dict(keep_vars=True))
    return {n: b for n, b in module.named_buffers() if n in keys}


def aliases(module: nn.Module) -> dict[str, list[str]]:
    """A parameter's other names (tied inside this rank's module), by its first name."""
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return {ns[0]: ns[1:] for ns in names.values() if len(ns) > 1}


def buffer_infos(module: nn.Module) -> dict[str, ParamInfo]:
    return {n: ParamInfo(tuple(b.shape), b.dtype, -1) for n, b in persistent_buffers(module).items()}


def buffer_slices(module: nn.Module) -> list[Slice]:
    return [(Span(BUFFER, n, 0, b.numel()), b.detach().reshape(-1)) for n, b in persistent_buffers(module).items()]


def optim_keys(described: list[Slice]) -> dict[str, dict]:
    """The optimizer state keys among ``described``: dtype, and whether 0-d (a step count)."""
    keys: dict[str, dict] = {}
    for span, t in described:
        if span.key.startswith(OPTIM) and span.key not in keys:
            keys[span.key] = {"dtype": dtype_name(t.dtype), "scalar": t.dim() == 0}
    return keys


def check_fits(
    folder: Path, m: Manifest, params: dict[str, ParamInfo], buffers: dict[str, torch.Tensor], model_names: set[str]
) -> None:
    """A clear error when the checkpoint is of another model: names missing, unexpected,
    reshaped. ``params``/``buffers`` are this rank's; ``model_names`` every parameter and
    buffer name of the model (other pipeline stages hold the rest)."""
    mine = {**{n: p.shape for n, p in params.items()}, **{n: tuple(b.shape) for n, b in buffers.items()}}
    saved = {**{n: p.shape for n, p in m.params.items()}, **{n: p.shape for n, p in m.buffers.items()}}
    missing = sorted(set(mine) - set(saved))
    unexpected = sorted(set(saved) - model_names)
    reshaped = sorted(f"{n}: checkpoint {list(saved[n])}, model {list(mine[n])}" for n in set(mine) & set(saved)
                      if tuple(saved[n]) != tuple(mine[n]))  # fmt: skip
    if missing or unexpected or reshaped:
        def some(names: list[str]) -> str:
            return ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")

        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {some(missing)}")
        if unexpected:
            parts.append(f"unexpected (not in the model): {some(unexpected)}")
        if reshaped:
            parts.append(f"different shapes: {some(reshaped)}")
        raise CheckpointError(f"checkpoint '{folder}' is not of this model; " + "; ".join(parts))


def check_optimizer(folder: Path, m: Manifest, optimizer: torch.optim.Optimizer) -> None:
    saved = m.engine.get("optimizer", {})
    groups = saved.get("param_groups", [])
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint '{folder}' has {len(groups)} optimizer param groups, this optimizer has "
            f"{len(optimizer.param_groups)}; load with load_optimizer_states=False"
        )


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out = {
        "python": [version, list(mt), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])
