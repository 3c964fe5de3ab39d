"""The engine's optimizer as the training framework's optimizer object.

Trainers hold "the optimizer" and call ``step()``, ``zero_grad()``, ``state_dict()`` on it,
and LR schedulers set ``lr`` on its ``param_groups``. :class:`EngineOptimizer` is that
object for an engine: the handle ``initialize`` returns
(:class:`~terascale.engine.optimizer_handle.OptimizerHandle`: param groups and state are the
engine optimizer's own, so a framework's schedule acts on them directly, and ``zero_grad()``
does nothing because the engine clears each window's gradients after its update), except
that ``step()`` is the engine's whole step, the engine's LR scheduler included: the
framework steps the schedule through the engine, not by itself.
"""

from __future__ import annotations

from typing import Any

from terascale.engine import Engine
from terascale.engine.optimizer_handle import OptimizerHandle


class EngineOptimizer(OptimizerHandle):
    """See the module docstring."""

    def __init__(self, engine: Engine) -> None:  # noqa: D107
        super().__init__(engine)
        self.lrs_of_last_step: list[float] | None = None  # the lr each group's last update used

    @property
    def engine(self) -> Engine:
        return self._engine

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Run ``closure`` (forward and backward) if given, then the engine's step."""
        result = closure() if closure is not None else None
        self.lrs_of_last_step = self.engine.get_lr()
        self.engine.step()
        return result

    def __repr__(self) -> str:
        return f"EngineOptimizer({type(self.optimizer).__name__})"
