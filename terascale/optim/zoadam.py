"""0/1 Adam (DeepSpeed's ``ZeroOneAdam``, arXiv 2202.06009): 1-bit Adam with an adaptive
variance schedule and, once the variance is frozen, local steps between synchronisations.

[Note: the 0/1 Adam schedule]
Counters (alike in every parameter's state, so checkpoints carry them): ``var_interval``
(starts at 1), ``var_counter``, ``local_step_interval`` (1), ``local_step_counter``, and
``lrs``, the learning rates summed since the last synchronisation. Step ``t`` (1-based):

- *variance phase* (``t <= var_freeze_step + 1``): if ``t % var_interval == 0`` the
  engine averaged the gradient over the group and both moments are updated with it;
  otherwise the gradient is this rank's and only the momentum is updated, with its 1-bit
  average. Then ``p -= lr * (m / (sqrt(v) + eps) + wd * p)``. Each variance update counts
  in ``var_counter``; after ``var_update_scaler`` of them ``var_interval`` doubles.
- *local phase* (``t > var_freeze_step + 1``; ``v`` frozen, no gradient averaged):
  ``m = b1 m + (1 - b1) g`` with this rank's ``g``, the update ``d = m / (sqrt(v) + eps)
  + wd * p`` applied locally (``p -= lr d``) and summed into ``u -= lr d``; ``lrs += lr``.
  Every ``local_step_interval`` steps the ranks synchronise: ``p += -u`` (undo the local
  steps), ``u = compressed_allreduce(u * (sqrt(v) + eps))``, ``m = -u / lrs``,
  ``p += u / (sqrt(v) + eps)``, ``u = 0``, ``lrs = 0``. After ``local_step_scaler`` local
  steps ``local_step_interval`` doubles, up to ``local_step_clipper``.

The error feedback is zeroed once, at the end of step ``var_freeze_step + 1``: it carried
gradients until then, accumulated momenta after. The engine's gradient all-reduce runs
exactly for the steps ``t`` with ``t % var_interval == 0`` in the variance phase
(``reduces_gradients``). Between synchronisations parameters, momenta and ``u`` differ
between ranks; checkpoints save them per rank ([Note: rank-local checkpoint state]).

DeepSpeed's schedule, step for step, but for its set-up first step (see ``[Note:
optimizers that reduce their own gradients]``) and its load, which also resets these
counters and ``u``; here a resume continues them exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed import ProcessGroup

from terascale.optim.closure import evaluate
from terascale.optim.onebit import OneBitOptimizer

__all__ = ["ZeroOneAdam"]

_COUNTERS = ("var_interval", "var_counter", "local_step_interval", "local_step_counter")


class ZeroOneAdam(OneBitOptimizer):
    """0/1 Adam ([Note: the 0/1 Adam schedule]). Args are DeepSpeed's (defaults included);
    ``deepspeed`` is accepted and unused; ``group``: the data-parallel process group (None:
    the default group)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        deepspeed: Any = None,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        *,
        group: ProcessGroup | None = None,
    ) -> None:
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, name="ZeroOneAdam", group=group, amsgrad=amsgrad,
                         max_grad_norm=max_grad_norm, cuda_aware=cuda_aware,
                         comm_backend_name=comm_backend_name)  # fmt: skip
        for key, value in (("var_update_scaler", var_update_scaler), ("local_step_scaler", local_step_scaler),
                           ("local_step_clipper", local_step_clipper)):  # fmt: skip
            if value < 1:
                raise ValueError(f"ZeroOneAdam {key} must be >= 1, got {value}")
        self.var_freeze_step = int(var_freeze_step)
        self.var_update_scaler = int(var_update_scaler)
        self.local_step_scaler = int(local_step_scaler)
        self.local_step_clipper = int(local_step_clipper)

    # -- the schedule --------------------------------------------------------------------------

    def schedule(self) -> dict[str, int]:
        """The counters of [Note: the 0/1 Adam schedule] before the next step, and ``step``."""
        return {"step": self.steps_done(), **{k: self._counter(k, 1 if k.endswith("interval") else 0) for k in _COUNTERS}}

    def frozen(self) -> bool:
        """Whether the next step is in the local phase (variance frozen)."""
        return self.steps_done() > self.var_freeze_step

    def reduces_gradients(self) -> bool:
        done = self.steps_done()
        return done <= self.var_freeze_step and (done + 1) % self._counter("var_interval", 1) == 0

    def _expected_errors(self) -> list[tuple[str, int]]:
        return [(key, p.numel()) for key, _, p in self._keyed_params()] if self.steps_done() > 0 else []

    def _local_extras(self) -> dict[str, torch.Tensor]:
        """In the local phase: every parameter, momentum and ``u``, which differ between ranks."""
        if not self.frozen():
            return {}
        out = {}
        for key, _, p in self._keyed_params():
            state = self.state[p]
            if "momentum_accumulator" in state:
                out.update({f"{key}/param": p, f"{key}/exp_avg": state["exp_avg"],
                            f"{key}/momentum_accumulator": state["momentum_accumulator"]})  # fmt: skip
        return out

    # -- the update ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One update of every parameter ([Note: the 0/1 Adam schedule]); collective over
        the group on the steps that compress."""
        loss = evaluate(closure)
        done = self.steps_done()
        keyed = self._keyed_params()
        states = [self._init_state(p, done) for _, _, p in keyed]
        counters = {k: int(states[0][k]) for k in _COUNTERS} if states else {}
        t = done + 1
        if t > self.var_freeze_step + 1:
            self._local_step(keyed, states, t % counters["local_step_interval"] == 0)
            counters["local_step_counter"] += 1
            if counters["local_step_counter"] == self.local_step_scaler:
                counters["local_step_counter"] = 0
                counters["local_step_interval"] = min(self.local_step_clipper, counters["local_step_interval"] * 2)
        else:
            variance_step = t % counters["var_interval"] == 0
            self._variance_phase_step(keyed, states, variance_step)
            if variance_step:
                counters["var_counter"] += 1
                if counters["var_counter"] == self.var_update_scaler:
                    counters["var_counter"] = 0
                    counters["var_interval"] *= 2
        for state in states:
            state["step"].fill_(t)
            for k, v in counters.items():
                state[k].fill_(v)
        if t == self.var_freeze_step + 1:
            self.zero_errors()  # they carried gradients; from now on accumulated momenta
        return loss

    def _variance_phase_step(self, keyed: list, states: list[dict], variance_step: bool) -> None:
        if variance_step:  # the engine averaged the gradients
            grads = [p.grad for _, _, p in keyed]
        else:
            grads = self._compress([(key, self._local_grad(p)) for key, _, p in keyed])
        for (_, group, p), state, g in zip(keyed, states, grads):
            if g is None:
                continue  # no rank had a gradient: untouched, as torch's Adam leaves it
            b1, b2 = group["betas"]
            if variance_step:
                state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
            else:
                g = self._masked(group, g.clone())
            state["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
            p.add_(self._update(group, state, p), alpha=-group["lr"])

    def _local_step(self, keyed: list, states: list[dict], synchronise: bool) -> None:
        for (_, group, p), state in zip(keyed, states):
            b1 = group["betas"][0]
            state["exp_avg"].mul_(b1).add_(self._local_grad(p), alpha=1 - b1)
            state["lrs"] += group["lr"]
            update = self._update(group, state, p)
            p.add_(update, alpha=-group["lr"])
            state["momentum_accumulator"].add_(update, alpha=-group["lr"])
        if not synchronise:
            return
        denoms = []
        for (_, group, p), state in zip(keyed, states):
            u = state["momentum_accumulator"]
            p.sub_(u)
            denoms.append(state["exp_avg_sq"].sqrt() + group["eps"])
            u.mul_(denoms[-1])
        averaged = self._compress([(key, state["momentum_accumulator"]) for (key, _, _), state in zip(keyed, states)])
        for (_, group, p), state, u, denom in zip(keyed, states, averaged, denoms):
            u = self._masked(group, u if u is not state["momentum_accumulator"] else u.clone())
            state["exp_avg"].copy_(u / state["lrs"]).neg_()
            p.add_(u / denom)
            state["momentum_accumulator"].zero_()
            state["lrs"].zero_()

    @staticmethod
    def _update(group: dict[str, Any], state: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
        """``m / (sqrt(v) + eps) + wd * p``."""
        update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"])
        if group["weight_decay"] > 0.0:
            update.add_(p, alpha=group["weight_decay"])
        return update

    def _init_state(self, p: torch.Tensor, done: int) -> dict[str, Any]:
        """``p``'s state, created where missing: zero moments and ``u``, ``done`` steps,
        the counters of the other parameters (their starting values before any)."""
        state = self.state[p]
        if "step" not in state:
            schedule = self.schedule()
            state["step"] = self._scalar(done, torch.int64)
            for k in _COUNTERS:
                state[k] = self._scalar(schedule[k], torch.int64)
            state["lrs"] = self._scalar(0.0, torch.float64)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["momentum_accumulator"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state
