"""Counting the activation bytes autograd keeps from forward to backward, block by block.

[Note: activation memory measured]
:class:`SavedBytes` wraps a forward in saved-tensor hooks that count (and keep, unchanged)
every tensor autograd saves, once per storage, leaving out parameters. Inside a
checkpointed block torch's own hooks take the block's tensors, so what is counted there
is what checkpointing really keeps: the block's inputs, counted by the input store on
whichever tier holds them. The block a tensor belongs to is the innermost block whose
forward is running (forward pre/post hooks on the blocks push and pop their names).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


class SavedBytes:
    """Bytes saved for backward by the last measured forward, by block (``""``: outside any)."""

    def __init__(self, model: nn.Module, blocks: dict[str, nn.Module]) -> None:
        self.model = model
        self.by_block: dict[str, int] = {}
        self._stack: list[str] = []
        self._seen: set[int] = set()
        self._params: set[int] = set()
        self._counts: dict[str, int] = defaultdict(int)
        self._handles = []
        for name, module in blocks.items():
            if name:
                self._handles.append(module.register_forward_pre_hook(self._push(name)))
                self._handles.append(module.register_forward_hook(self._pop))

    def _push(self, name: str):
        def hook(module: nn.Module, args: object) -> None:
            if self._measuring:
                self._stack.append(name)

        return hook

    def _pop(self, module: nn.Module, args: object, output: object) -> None:
        if self._measuring and self._stack:
            self._stack.pop()

    _measuring = False

    @property
    def total(self) -> int:
        return sum(self.by_block.values())

    @contextmanager
    def measuring(self) -> Iterator[None]:
        """Count what the forward run inside saves for backward."""
        self._params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        self._seen, self._counts, self._stack = set(), defaultdict(int), []
        self._measuring = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            self._measuring = False
            self.by_block = dict(self._counts)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._params and ptr not in self._seen and not isinstance(t, nn.Parameter):
            self._seen.add(ptr)
            self._counts[self._stack[-1] if self._stack else ""] += storage.nbytes()
        # An alias without the graph: the tensor itself would tie a saved output to its own
        # grad_fn in a cycle Python's collector cannot see, so a forward that is measured and
        # never backpropagated (the planner's) would keep its whole graph alive.
        return t.detach()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
