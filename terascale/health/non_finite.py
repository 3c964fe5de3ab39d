"""What a NaN or Inf in the loss or the gradients does to a run (``health.non_finite``).

The engine detects it once per optimizer step, on every rank alike, from the global
gradient norm: the same number everywhere, non-finite if any rank's gradients are, and
made NaN by any rank whose loss is not finite (each rank adds 0 or NaN for its loss to the
norm's sum, so one all-reduce carries both). Only then do the ranks exchange their loss
flags, to name the ranks. :class:`NonFinitePolicy` turns that into
the step's fate: ``skip`` (the update is not applied, as an fp16 overflow is),
``stop`` (:class:`NonFiniteError`), or ``rollback`` (back to the last checkpoint; the
data that caused it stays consumed, so the run does not meet it again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Verdict = Literal["ok", "skip", "rollback"]


class NonFiniteError(RuntimeError):
    """The run met a NaN/Inf with ``health.non_finite.policy`` ``stop`` (or too many rollbacks)."""


@dataclass(frozen=True)
class NonFiniteEvent:
    """Where a step's non-finite values were: the gradient norm, and the ranks whose loss was."""

    step: int
    grad_norm: float
    loss_ranks: tuple[int, ...]

    def describe(self) -> str:
        if self.loss_ranks:  # the norm carries the loss flags then: its value says nothing more
            where = (f"the loss is not finite on rank{'s' if len(self.loss_ranks) > 1 else ''} "
                     + ", ".join(map(str, self.loss_ranks)))
        else:
            where = f"the global gradient norm is {self.grad_norm}"
        return f"non-finite values at step {self.step}: {where}"


class NonFinitePolicy:
    """Decides a step's fate from its :class:`NonFiniteEvent` (or None when all is finite)."""

    def __init__(self, policy: str, max_rollbacks: int) -> None:
        self.policy = policy
        self.max_rollbacks = max_rollbacks
        self._rollbacks = 0  # consecutive, without a finite step between them

    def verdict(self, event: NonFiniteEvent | None) -> Verdict:
        """``ok`` for a finite step; ``skip``/``rollback`` per policy; raises
        :class:`NonFiniteError` for ``stop``, or for a rollback beyond ``max_rollbacks``."""
        if event is None:
            self._rollbacks = 0
            return "ok"
        if self.policy == "skip":
            return "skip"
        if self.policy == "rollback":
            self._rollbacks += 1
            if self._rollbacks <= self.max_rollbacks:
                return "rollback"
            raise NonFiniteError(
                f"{event.describe()}; {self.max_rollbacks} rollbacks in a row did not get past it "
                "(health.non_finite.max_rollbacks): stopping"
            )
        raise NonFiniteError(f"{event.describe()} (health.non_finite.policy is 'stop')")
