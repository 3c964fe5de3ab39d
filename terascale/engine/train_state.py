"""Where training is: step counters and the accumulation window, as one object.

[Note: the accumulation window]
An optimizer step consumes one *window* of ``gradient_accumulation_steps`` micro-steps
(or the micro-steps up to ``set_gradient_accumulation_boundary(True)``). The window's
gradients pass through three states, in this order only:

- ``EMPTY``: no backward since the last step or ``zero_grad``;
- ``ACCUMULATING``: one or more backwards added their gradients; the model state may
  still be reducing them over the data-parallel ranks;
- ``FINAL``: the gradients are complete (reduced, tied copies summed over their pipeline
  stages); the unscaled global norm, once taken, is kept in ``window_norm`` so that
  clipping, the overflow check and ``engine.window_grad_norm()`` agree on one value.

With ``managed_gradient_accumulation: false`` in the config the caller owns the windows:
every ``engine.step()`` ends one, whatever the number of backwards before it, and a
micro-step is a window's boundary only while that step runs. Inside
``engine.coalesce_grad_reduction()`` (``deferring``) no backward synchronises; the
block's exit reduces the window ([Note: deferred reduction] in :mod:`terascale.zero.grads`).

``step()`` at the window's end, ``zero_grad()`` and a rollback return it to ``EMPTY``. A
backward in ``FINAL`` is an error: the norm and the summed ties would no longer describe
the gradients. Only this class's methods change the counters: the engine calls them, the
checkpointer saves and restores them with :meth:`TrainState.state_dict`, and a script that
sets ``engine.global_steps`` goes through :meth:`TrainState.set_counters`.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from typing import Any

import torch

from terascale.errors import UsageError


_COUNTERS = ("global_steps", "micro_steps", "global_samples", "skipped_steps")


class WindowState(enum.Enum):
    EMPTY = enum.auto()
    ACCUMULATING = enum.auto()
    FINAL = enum.auto()


class TrainState:
    """Counters of one run (``global_steps``, ``micro_steps``, ``global_samples``,
    ``skipped_steps``) and the current window (its state, summed loss, gradient norm,
    boundary override). Attributes are for reading; the methods move them."""

    def __init__(self, gradient_accumulation_steps: int, device: torch.device, managed: bool = True) -> None:
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.managed = managed  # False: every engine.step() ends a window (managed_gradient_accumulation)
        self.in_step = False  # engine.step() is running (the boundary when not managed)
        self.block: str | None = None  # the open "no_sync" or "coalesce_grad_reduction" block
        self.synced = False  # the window's last backward reduced its gradients
        self.window_backwards = 0  # backwards in the current window
        self.global_steps = 0
        self.micro_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None  # of the last optimizer step (None: not computed)
        self.step_applied = False  # the last boundary updated the parameters (no fp16 overflow/skip)
        self.window = WindowState.EMPTY
        self.window_norm: torch.Tensor | None = None  # FINAL only: the unscaled global norm, once taken
        # The window's losses summed over its micro-steps, on the device: reading it syncs,
        # so it is read only at the steps that report it.
        self.window_loss = torch.zeros((), device=device)
        # None: a window is gradient_accumulation_steps micro-steps; True/False: the
        # caller decides (set_gradient_accumulation_boundary).
        self.boundary: bool | None = None

    # -- the window -----------------------------------------------------------------------------

    def is_boundary(self) -> bool:
        """True when the current micro-step is the last of its window."""
        if not self.managed:
            return self.in_step
        if self.boundary is not None:
            return self.boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    @property
    def at_window_start(self) -> bool:
        """No micro-step of the current window has been counted, and the window's length is
        the configured one (no boundary override)."""
        return self.boundary is None and self.micro_steps % self.gradient_accumulation_steps == 0

    def set_boundary(self, is_boundary: bool | None) -> None:
        if not self.managed and is_boundary is not None:
            raise UsageError(
                "set_gradient_accumulation_boundary() with managed_gradient_accumulation false: every "
                "engine.step() ends the accumulation window already; leave the boundary to it"
            )
        self.boundary = None if is_boundary is None else bool(is_boundary)

    def add_loss(self, loss: torch.Tensor, weight: float) -> None:
        """Add ``loss * weight`` (detached, fp32) to the window's loss."""
        self.window_loss += loss.detach().float() * weight

    def backward_ran(self, synced: bool) -> None:
        """A backward starts; ``synced``: it reduces the window's gradients (its last)."""
        if self.window is WindowState.FINAL:
            raise ValueError(
                "a backward after engine.window_grad_norm() completed this window's gradients: call "
                "engine.step() to end the window first (or engine.zero_grad() to drop its gradients)"
            )
        self.window = WindowState.ACCUMULATING
        self.synced = synced
        self.window_backwards += 1

    @property
    def deferring(self) -> bool:
        """Inside ``engine.coalesce_grad_reduction()``: no backward synchronises."""
        return self.block == "coalesce_grad_reduction"

    @contextlib.contextmanager
    def inside(self, block: str) -> Iterator[None]:
        """Around ``engine.no_sync()`` / ``engine.coalesce_grad_reduction()`` (``block``): one
        such block at a time, since each is one accumulation window."""
        if self.block is not None:
            if block == self.block == "no_sync":  # DeepSpeed's words, which programs match
                raise UsageError("engine.no_sync() inside engine.no_sync(): no_sync context manager reentry is unsupported")
            raise UsageError(
                f"engine.{block}() nested in another one, engine.{self.block}(): one block is one accumulation "
                "window; use one of them"
            )
        self.block = block
        try:
            yield
        finally:
            self.block = None

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """Around ``engine.step()``: the window's boundary where the caller owns the windows."""
        self.in_step = True
        try:
            yield
        finally:
            self.in_step = False

    @property
    def needs_reduction(self) -> bool:
        """The window has gradients that no backward of it reduced yet."""
        return self.window is WindowState.ACCUMULATING and not self.synced

    def reduced(self) -> None:
        """The window's gradients were reduced without a backward (``finish_window``)."""
        self.synced = True

    def finalize(self, norm: torch.Tensor | None = None) -> None:
        """The window's gradients are complete; ``norm`` is their unscaled global norm, if taken."""
        self.window = WindowState.FINAL
        if norm is not None:
            self.window_norm = norm

    def clear_window(self) -> None:
        """Gradients dropped (``zero_grad``): the window is empty again; its loss is kept."""
        self.window = WindowState.EMPTY
        self.window_norm = None
        self.synced = False
        self.window_backwards = 0

    def count_micro_step(self) -> None:
        """A micro-step inside the window ended (no update)."""
        self.micro_steps += 1
        self.step_applied = False

    def window_ran(self, mean_loss: torch.Tensor) -> None:
        """A schedule ran the whole window at once (a pipeline's ``train_batch``): its mean
        loss stands for the window's, and its micro-steps but the last are counted (the
        engine's ``step`` counts that one)."""
        assert self.at_window_start, "a schedule's window must start at a window boundary"
        self.window_loss.copy_(mean_loss.detach() * self.gradient_accumulation_steps)
        self.micro_steps += self.gradient_accumulation_steps - 1

    def reset_window_loss(self) -> None:
        """The finished window's loss has been reported (or dropped): start the next sum."""
        self.window_loss.zero_()

    def step_done(self, *, applied: bool, grad_norm: float | None, samples: int) -> None:
        """The optimizer step at the window's end ran (``applied``) or was skipped: count it
        and its ``samples``, and start the next window."""
        self.step_applied = applied
        if not applied:
            self.skipped_steps += 1
        self.last_grad_norm = grad_norm
        self.global_steps += 1
        self.global_samples += samples
        self.micro_steps += 1
        self.clear_window()

    def rolled_back(self) -> None:
        """The window was abandoned for a checkpoint (its counters come from there)."""
        self.clear_window()
        self.reset_window_loss()

    def set_counters(self, **counters: int) -> None:
        """Set counters by name (``global_steps``, ``micro_steps``, ``global_samples``,
        ``skipped_steps``) as a script does that resumes from its own checkpoints."""
        for name, value in counters.items():
            if name not in _COUNTERS:
                raise AttributeError(f"TrainState has no counter {name!r}; counters: {', '.join(_COUNTERS)}")
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"engine.{name} must be a non-negative int, got {value!r}")
            setattr(self, name, value)

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        return {
            "global_steps": self.global_steps,
            "micro_steps": self.micro_steps,
            "global_samples": self.global_samples,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters of :meth:`state_dict` (extra keys are ignored).

        Checkpoints are taken at window boundaries; the resumed job may accumulate over
        another number of micro-steps (the same global batch on fewer ranks), so its first
        window starts here and spans its own ``gradient_accumulation_steps``.
        """
        self.global_steps = int(state["global_steps"])
        self.micro_steps = self.global_steps * self.gradient_accumulation_steps
        self.global_samples = int(state["global_samples"])
        self.skipped_steps = int(state["skipped_steps"])


class TrainCounter:
    """An engine attribute that is one :class:`TrainState` counter, read and written through
    ``engine.train_state``: DeepSpeed's engines expose their counters as plain attributes,
    and scripts that resume from their own checkpoints set them
    (``engine.global_steps = iteration``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        assert name in _COUNTERS, name
        self.name = name

    def __get__(self, engine: Any, owner: type | None = None) -> Any:
        return self if engine is None else getattr(engine.train_state, self.name)

    def __set__(self, engine: Any, value: int) -> None:
        engine.train_state.set_counters(**{self.name: value})

