"""Checkpoint a model's blocks without changing the model: the ``policy`` of the config.

[Note: checkpointed blocks]
``blocks`` checkpoints every module the ZeRO wrap policy makes a group (the transformer
blocks), ``every_n`` every n-th of them, ``selective`` every block with torch's
selective checkpointing (matmul and attention outputs kept). A block is checkpointed by
giving the *instance* a forward that runs the class's forward under
:meth:`ActivationCheckpointing.run`: names, parameters and state dict keys do not
change, and :meth:`CheckpointedBlocks.remove` restores the class's forward.

The recompute calls the block as a module (``block(*args, **kwargs)``), not its bare
forward, so the block's hooks run again - among them ZeRO-3's, which gathers the
block's parameters for the recompute and keeps them for the backward that follows. The
instance forward sees that it is inside its own recompute and runs the class's forward
directly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from terascale.activation.checkpoint import ActivationCheckpointing

POLICIES = ("none", "blocks", "every_n", "selective")


class _CheckpointedForward:
    """The instance forward of one checkpointed block."""

    def __init__(self, module: nn.Module, label: str, checkpointing: ActivationCheckpointing, selective: bool) -> None:
        self.module = module
        self.label = label
        self.checkpointing = checkpointing
        self.selective = selective
        self.original = type(module).forward.__get__(module)
        self._state = "idle"  # "forward": the first run; "recompute": inside backward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._state != "idle" or not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        self._state = "forward"
        try:
            return self.checkpointing.run(self._body, args, kwargs, label=self.label, selective=self.selective)
        finally:
            self._state = "idle"

    def _body(self, *args: Any, **kwargs: Any) -> Any:
        if self._state == "forward":
            return self.original(*args, **kwargs)
        with self._recompute():
            return self.module(*args, **kwargs)

    @contextmanager
    def _recompute(self) -> Iterator[None]:
        self._state = "recompute"
        try:
            yield
        finally:
            self._state = "idle"


def select_blocks(blocks: dict[str, nn.Module], policy: str, every_n: int) -> dict[str, nn.Module]:
    """The blocks ``policy`` checkpoints: of ``blocks`` (name -> module, in module order)
    only the outermost ones (a block inside a checkpointed block is recomputed with it),
    every ``every_n``-th of them for ``every_n``."""
    if policy not in POLICIES:
        raise ValueError(f"activation_checkpointing.policy must be one of {', '.join(POLICIES)}; got '{policy}'")
    if policy == "none":
        return {}
    outer: dict[str, nn.Module] = {}
    for name, module in blocks.items():
        if name and not any(name.startswith(f"{o}.") for o in outer):
            outer[name] = module
    if policy == "every_n":
        return {name: m for k, (name, m) in enumerate(outer.items()) if k % every_n == 0}
    return outer


class CheckpointedBlocks:
    """``blocks`` checkpointed through ``checkpointing`` until :meth:`remove`."""

    def __init__(self, blocks: dict[str, nn.Module], checkpointing: ActivationCheckpointing, selective: bool) -> None:
        self.blocks = blocks
        for name, module in blocks.items():
            if "forward" in vars(module):
                raise ValueError(
                    f"module '{name}' already has its own forward attribute (another wrapper patched it); "
                    "activation_checkpointing.policy cannot wrap it - set policy 'none' and checkpoint it yourself"
                )
            module.forward = _CheckpointedForward(module, name, checkpointing, selective)

    def remove(self) -> None:
        for module in self.blocks.values():
            if isinstance(vars(module).get("forward"), _CheckpointedForward):
                del module.forward
        self.blocks = {}
