"""The optional ``closure`` of ``torch.optim.Optimizer.step``, as every optimizer here takes it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def evaluate(closure: Callable[[], Any] | None) -> Any:
    """The loss ``closure()`` returns, computed with gradients on (``step`` runs without
    them); None without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
