"""The engine's optimizer as the training framework's optimizer object.

Trainers hold "the optimizer" and call ``step()``, ``zero_grad()``, ``state_dict()`` on it,
and LR schedulers set ``lr`` on its ``param_groups``. :class:`EngineOptimizer` is that
object for an engine: its param groups and state are the engine optimizer's own (so a
framework's schedule acts on them directly), ``step()`` is the engine's update at the end
of an accumulation window, and ``zero_grad()`` does nothing because the engine clears each
window's gradients after its update.
"""

from __future__ import annotations

from typing import Any

import torch

from terascale.engine import Engine


class EngineOptimizer(torch.optim.Optimizer):
    """See the module docstring. Deliberately not ``Optimizer.__init__``: it has no
    parameters of its own (``isinstance(x, Optimizer)`` is what schedulers check)."""

    def __init__(self, engine: Engine) -> None:  # noqa: D107
        self.engine = engine
        self.lrs_of_last_step: list[float] | None = None  # the lr each group's last update used

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return self.engine.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.engine.optimizer.state

    @property
    def defaults(self) -> dict:  # type: ignore[override]
        return self.engine.optimizer.defaults

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Run ``closure`` (forward and backward) if given, then the engine's step."""
        result = closure() if closure is not None else None
        self.lrs_of_last_step = self.engine.get_lr()
        self.engine.step()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict:
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.engine.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"EngineOptimizer({type(self.engine.optimizer).__name__})"
