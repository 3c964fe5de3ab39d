"""``loss.backward()`` on the engine's output, as well as ``engine.backward(loss)``.

[Note: direct backward]
DeepSpeed (since 0.18.3) lets a script call ``loss.backward()`` itself instead of
``engine.backward(loss)``; newer scripts do. A backward then needs what the engine's
gives it: the model state's bracket (``prepare_backward(sync)`` before the first
gradient, ``post_backward()`` after the last: ZeRO reduces and frees there), the train
state's window, and the gradients scaled by ``loss_scale / gradient_accumulation_steps``.

The engine wraps every tensor of its forward's output (nested in tuples, lists, named
tuples and dicts, Hugging Face's ``ModelOutput`` included) in one autograd node,
:class:`_Entry`, whose forward returns aliases of the tensors. Every gradient that reaches
the model from outside passes that node exactly once, whichever outputs the loss was
computed from and however they depend on each other (a Hugging Face model's ``loss`` is
computed from its ``logits``: a hook on both tensors would scale the gradient twice, a
separate branch per output does not). In its backward the node:

- inside ``engine.backward`` (or a pipeline schedule's ``run_backward``) passes the
  gradients through unchanged: the engine scaled the loss and holds the bracket;
- in a backward the script started, once per autograd graph task, opens the bracket and
  queues its close on the autograd engine (``queue_callback``: run when that backward
  finishes, as FSDP and DeepSpeed end theirs), then multiplies the gradients by the
  factor. Backpropagation is linear, so scaling there equals scaling the loss (exactly
  for a power-of-two loss scale, within rounding for the division by the steps);
- in ``torch.autograd.grad`` (a gradient penalty), which accumulates into no parameter,
  does nothing: it is not a training backward; nor in the backward of a ``torch.func``
  gradient transform (``torch.func.grad(engine)``: [Note: torch.func through the engine]
  in ``terascale/zero/func_transforms.py``).

With fp16 the loss scale is applied at the model's outputs; a loss computed outside the
model from fp16 outputs may underflow before it gets there, so such scripts scale it
themselves with ``engine.scale(loss).backward()`` (DeepSpeed's API); the node then
applies only the division by the steps. The loss of a direct backward is not seen by the
engine, so the monitors' training loss counts only ``engine.backward``'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from terascale.zero.func_transforms import outside_transforms, transforms_active


class _Entry(torch.autograd.Function):
    """Identity on the engine's output tensors; its backward is :meth:`DirectBackward.entered`.

    In the form with ``setup_context`` (forward without ``ctx``), which ``torch.func``
    transforms require of a Function; its forward is pure (aliases), so the transforms can
    derive its ``vmap`` rule themselves ([Note: torch.func through the engine]).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(owner: DirectBackward, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Aliases, not views: a view made in a custom Function may not be modified in
        # place, and scripts do modify outputs (the Trainer's ``loss *= world``).
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.owner = inputs[0]
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not zeros

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        return (None, *ctx.owner.entered(grads))


class DirectBackward:
    """Routes a backward that reaches the engine's outputs without ``engine.backward``
    through the engine's bracket (see ``[Note: direct backward]``).

    ``bracket()`` is the engine's backward bracket for the current micro-step;
    ``loss_scale()`` the current loss scale; ``steps`` the gradient accumulation steps;
    ``params`` the trainable parameters (a backward that accumulates into none of them is
    not a training backward).
    """

    def __init__(
        self,
        bracket: Callable[[], contextlib.AbstractContextManager],
        loss_scale: Callable[[], float],
        steps: int,
        params: Sequence[nn.Parameter],
    ) -> None:
        self._bracket = bracket
        self._loss_scale = loss_scale
        self._steps = steps
        self._params = list(params)
        self._in_engine_backward = False
        self._open: contextlib.ExitStack | None = None  # the bracket of the direct backward running
        self._task = -1  # its autograd graph task
        self._multiplier = 1.0
        self._prescaled = False  # engine.scale(loss) was called for the coming backward

    def wrap(self, output: Any) -> Any:
        """``output`` with its tensors that have a gradient function passed through :class:`_Entry`."""
        if not torch.is_grad_enabled():
            return output
        tensors: dict[int, torch.Tensor] = {}
        # Under a torch.func transform the tensors seen here are the transform's wrappers,
        # which hide the level-0 graph (a vmapped output shows no grad_fn), yet a backward
        # of what the transform returns is a training one: wrap every floating tensor; the
        # node is recorded only where the raw tensor needs a gradient.
        _collect(output, tensors, every=transforms_active())
        if not tensors:
            return output
        aliases = dict(zip(tensors, _Entry.apply(self, *tensors.values())))
        return _replace(output, aliases)

    @contextlib.contextmanager
    def engine_backward(self) -> Iterator[None]:
        """The engine runs this backward itself (it scaled the loss and holds the bracket)."""
        self._in_engine_backward = True
        try:
            yield
        finally:
            self._in_engine_backward = False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale, for ``engine.scale(loss).backward()``."""
        self._prescaled = True
        return loss.float() * self._loss_scale()

    def entered(self, grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        """The backward reached the model's outputs: ``grads``, scaled where it is the script's."""
        if self._in_engine_backward:
            return grads
        task = torch._C._current_graph_task_id()
        if task != self._task:
            if not self._accumulates():
                return grads  # torch.autograd.grad: not a training backward
            self._begin(task)
        m = self._multiplier
        if m == 1.0:
            return grads
        return tuple(None if g is None else g * m for g in grads)

    def _accumulates(self) -> bool:
        """Whether the running backward accumulates into a trainable parameter's ``.grad``.

        False in a ``torch.func`` transform's backward (it differentiates with respect to
        its own wrapped tensors), True in a level-0 backward of what a transform returned.
        The parameters' gradient edges are read outside the transforms: inside one,
        ``get_gradient_edge`` would see a wrapper of the parameter, which has no edge."""
        with outside_transforms():
            for p in self._params:
                try:
                    if torch._C._will_engine_execute_node(get_gradient_edge(p).node):
                        return True
                except RuntimeError:  # asked about a leaf under torch.autograd.grad
                    return False
        return False

    def _begin(self, task: int) -> None:
        if self._open is not None:
            # A backward that failed half-way never ran its callback: close its bracket as
            # failed (no reductions after it: its peers may not have run them).
            stale, self._open = self._open, None
            failed = RuntimeError("an earlier backward on the engine's output did not finish")
            stale.__exit__(RuntimeError, failed, None)
        self._multiplier = (1.0 if self._prescaled else self._loss_scale()) / self._steps
        self._prescaled = False
        opened = contextlib.ExitStack()
        opened.enter_context(self._bracket())
        self._open, self._task = opened, task
        torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        opened, self._open, self._task = self._open, None, -1
        if opened is not None:
            opened.close()


def _collect(obj: Any, out: dict[int, torch.Tensor], every: bool = False) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.grad_fn is not None or (every and (obj.is_floating_point() or obj.is_complex())):
            out.setdefault(id(obj), obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _collect(o, out, every)
    elif isinstance(obj, dict):
        for o in obj.values():
            _collect(o, out, every)


def _replace(obj: Any, aliases: dict[int, torch.Tensor]) -> Any:
    """``obj`` with each tensor in ``aliases`` (by id) replaced; containers rebuilt, a dict
    (a ``ModelOutput`` keeps its class and attributes) updated in place."""
    if isinstance(obj, torch.Tensor):
        return aliases.get(id(obj), obj)
    if isinstance(obj, (list, tuple)):
        items = [_replace(o, aliases) for o in obj]
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            new = _replace(v, aliases)
            if new is not v:
                obj[k] = new
        return obj
    return obj
