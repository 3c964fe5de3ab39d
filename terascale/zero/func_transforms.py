"""Telling whether ``torch.func`` transforms are running, and stepping outside them.

[Note: torch.func through the engine]
``torch.func.grad(lambda x: engine(x))(x)`` (and ``grad_and_value``, ``jacrev``, ``vjp``,
``vmap`` of those) computes a gradient of the model as a pure function: the transform
calls ``torch.autograd.grad`` itself on tensors of its own level, so nothing accumulates
into a parameter's ``.grad``. Such a backward is no training backward: the engine opens no
bracket for it, scales nothing by the loss scale or the accumulation steps, reduces and
steps nothing; its gradients must equal the plain module's.

A plain ``vmap`` has no backward of its own: a backward of a vmapped forward's output runs
after the transform returns, at level 0, and is a training backward like any other. So
what matters is whether a *gradient* transform (``grad``, ``vjp``, ``jvp``) is on the
stack when the forward runs, not whether any transform is.

Inside a gradient transform every operator returns tensors wrapped for its level, even
on plain inputs: ZeRO-3's gather and free (slicing a flat buffer, reading data pointers,
swapping ``param.data``) must run on the raw tensors, with the transforms switched off
(:func:`outside_transforms`). The wrapped parameters the model's operators saved still
alias the raw ones, so a gather in the transform's backward reaches them.

There is no public spelling for any of this; these are the calls torch's own
``torch._functorch`` code uses, behind ``getattr`` so that a torch without them reads as
"no transform running".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_functorch = getattr(torch._C, "_functorch", None)


def transforms_active() -> bool:
    """Whether any ``torch.func`` transform (``vmap`` included) is running on this thread."""
    peek = getattr(_functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def grad_transform_active() -> bool:
    """Whether a gradient transform (``grad``, ``vjp``, ``jacrev``, ``jvp``, ``jacfwd``) is
    running: a backward of what is computed now is the transform's, not training's."""
    if not transforms_active():
        return False
    stack = getattr(_functorch, "get_interpreter_stack", None)
    kind = getattr(_functorch, "TransformType", None)
    if stack is None or kind is None:
        return True  # cannot tell the kinds apart: take the safe side (no training bracket)
    functional = {kind.Grad, kind.Jvp}
    return any(i.key() in functional for i in stack() or ())


@contextlib.contextmanager
def outside_transforms() -> Iterator[None]:
    """Run the body on raw tensors, as if no transform were running (a no-op when none is)."""
    disable = getattr(torch._C, "_DisableFuncTorch", None)
    if disable is None or not transforms_active():
        yield
        return
    with disable():
        yield
