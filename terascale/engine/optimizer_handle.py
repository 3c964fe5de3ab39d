"""The optimizer object ``initialize`` returns: a handle whose ``step()`` updates the model.

[Note: the optimizer initialize returns]
DeepSpeed's ``initialize`` returns its engine's optimizer, which at ZeRO stages is DeepSpeed's
own wrapper: its ``step()`` updates the parameters from the gradients ``engine.backward``
reduced, and some programs train that way instead of with ``engine.step()`` (Ray Train's
DeepSpeed guide: ``model.backward(loss); optimizer.step(); lr_scheduler.step();
optimizer.zero_grad()``). The engine's own optimizer steps fp32 masters, or shards of them,
only inside the engine's update (which hands it the gradients and writes the new values back
into the parameters): called by the program it would do nothing. So ``initialize`` returns
:class:`OptimizerHandle`: ``step()`` is the engine's step without the LR scheduler (the
program steps that itself, as with DeepSpeed's wrapper), ``zero_grad()`` nothing (the update
clears its window's gradients; such a loop calls ``zero_grad()`` after every ``step()``, also
inside an accumulation window, whose gradients must stay: ``engine.zero_grad()`` drops them), and
everything else (``param_groups``, ``state``, ``state_dict``, an optimizer's own methods) the
engine optimizer's, which ``handle.optimizer`` (DeepSpeed's wrappers' name) and
``engine.optimizer`` are. A program that calls ``engine.step()`` never calls ``step()`` here.

Programs check what they got back as they would the optimizer they passed: DeepSpeed returns
that very object where it needs no wrapper, so ``returned == optimizer`` and
``isinstance(returned, AdamW)`` must hold. :func:`optimizer_handle` makes the handle an
instance of a subclass of both :class:`OptimizerHandle` and the engine optimizer's class
(made once per class, as FSDP2's ``fully_shard`` makes ``FSDP<Module>``), and the handle
compares equal to the engine optimizer. The handle's own methods come first in that class;
the optimizer class's methods, found through it, read ``param_groups``/``state``/``defaults``,
which are the engine optimizer's.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from terascale.engine.engine import Engine


class OptimizerHandle(torch.optim.Optimizer):
    """See ``[Note: the optimizer initialize returns]``. Deliberately not
    ``Optimizer.__init__``: it has no parameters of its own (``isinstance(x, Optimizer)`` is
    what schedulers and frameworks check)."""

    def __init__(self, engine: Engine) -> None:  # noqa: D107
        self._engine = engine

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The engine's optimizer (over the fp32 masters or this rank's shards of them)."""
        return self._engine.optimizer

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict:  # type: ignore[override]
        return self.optimizer.defaults

    @property
    def overflow(self) -> bool:
        """The last optimizer step was skipped (an fp16 overflow), as DeepSpeed's wrappers say."""
        return self._engine.global_steps > 0 and not self._engine.was_step_applied()

    # DeepSpeed's wrappers carry the fp16 loss scaler; programs log ``optimizer.cur_scale``.
    @property
    def loss_scaler(self) -> Any:
        """The engine's loss scaler (a static 1.0 without fp16); it answers DeepSpeed's
        ``LossScaleConfig`` names too (``loss_scale_config``, DeepSpeed 0.19's)."""
        return self._engine.loss_scaler

    loss_scale_config = loss_scaler

    @property
    def cur_scale(self) -> float:
        return self._engine.loss_scaler.scale

    loss_scale = cur_scale

    @property
    def dynamic_loss_scale(self) -> bool:
        return self._engine.loss_scaler.dynamic

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Run ``closure`` if given, then the engine's step without the LR scheduler: at the
        end of an accumulation window, the update from the window's gradients."""
        result = closure() if closure is not None else None
        self._engine.step_without_scheduler()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the update cleared its gradients, and a window's are kept until its update."""

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        # Only for what the class lacks: an optimizer's own methods (Lamb's coefficients, ...).
        if name == "_engine":  # not yet set (unpickling, copying)
            raise AttributeError(name)
        return getattr(self._engine.optimizer, name)

    def __eq__(self, other: object) -> bool:
        return other is self or other is self._engine.optimizer

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"OptimizerHandle({type(self.optimizer).__name__})"


@functools.cache
def _handle_class(handle: type[OptimizerHandle], optimizer: type[torch.optim.Optimizer]) -> type[OptimizerHandle]:
    if issubclass(handle, optimizer):
        return handle
    return type(f"{handle.__name__}[{optimizer.__name__}]", (handle, optimizer), {"__module__": handle.__module__})


def optimizer_handle(engine: Engine, handle: type[OptimizerHandle] = OptimizerHandle) -> OptimizerHandle:
    """``handle(engine)``, an instance of the engine optimizer's class too ([Note: the optimizer
    initialize returns])."""
    return _handle_class(handle, type(engine.optimizer))(engine)
