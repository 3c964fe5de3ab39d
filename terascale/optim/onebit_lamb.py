"""1-bit LAMB (DeepSpeed's ``OnebitLamb``, arXiv 2104.06069): LAMB whose momenta, after a
warm-up, are averaged with one fused 1-bit compressed all-reduce, the trust ratio frozen
and corrected by how far the fresh variance drifts from the frozen one.

[Note: 1-bit LAMB]
Per parameter ``p`` at step ``t`` (1-based), ``lr``, ``(b1, b2)``, ``eps``, ``wd`` of its
group and the optimizer's ``coeff_beta``, ``factor_min/max/threshold``:

- *warm-up* (``t <= freeze_step``; ``g`` averaged by the engine): LAMB without bias
  correction: ``m``, ``v`` as Adam; ``update = m / (sqrt(v) + eps) + wd p``; ``coeff =
  clamp(||p|| / ||update||, min_coeff, max_coeff)`` (1 if either norm is 0); ``p -= lr
  coeff update``. Where ``coeff != 1`` it enters the running ``lamb_coeff_freeze = coeff_beta
  lamb_coeff_freeze + (1 - coeff_beta) coeff``. At ``t == freeze_step``: ``v_fresh = v``.
- *compressed* (``g`` this rank's, ``v`` frozen): at the first such step each momentum
  gets ``scaling_coeff = mean_q(rms(m_q)) / rms(m_p)`` (so all momenta have about the same
  scale in the one buffer). Then ``m_prev = m``; ``m = (b1 m + (1 - b1) g) scaling_coeff``;
  all momenta, flattened into one buffer, go through one compressed all-reduce; ``m /=
  scaling_coeff`` (times ``exp_avg_mask``); the gradient it implies, ``(m - b1 m_prev) /
  (1 - b1)``, updates ``v_fresh``. ``factor = max(denom / denom_fresh)`` (``denom =
  sqrt(v) + eps``), blended with ``ratio = min(1, ||m / denom|| / ||update||)`` as ``factor
  ratio + 1 - ratio`` where ``wd > 0``, clamped to ``[factor_min, factor_max]`` and to within
  ``factor_threshold`` of the last factor (relative); ``p -= lr lamb_coeff_freeze factor
  update`` (``update`` with the frozen ``v``).

DeepSpeed's rule step for step but for its set-up first step (``[Note: optimizers that
reduce their own gradients]``), and for a momentum whose rms is 0 at the first compressed
step, which gets ``scaling_coeff`` 1 here (DeepSpeed divides by 0).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed import ProcessGroup

from terascale.optim.closure import evaluate
from terascale.optim.onebit import OneBitOptimizer

__all__ = ["OneBitLamb"]

_FLAT = "momenta"  # the name of the one fused buffer's error feedback


class OneBitLamb(OneBitOptimizer):
    """1-bit LAMB ([Note: 1-bit LAMB]). Args are DeepSpeed's (defaults included);
    ``deepspeed`` is accepted and unused; ``group``: the data-parallel process group
    (None: the default group). :meth:`get_lamb_coeffs` gives the last step's coefficients."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        deepspeed: Any = None,
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        *,
        group: ProcessGroup | None = None,
    ) -> None:
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, max_coeff=max_coeff, min_coeff=min_coeff)  # fmt: skip
        super().__init__(params, defaults, name="OneBitLamb", group=group, amsgrad=amsgrad,
                         max_grad_norm=max_grad_norm, cuda_aware=cuda_aware,
                         comm_backend_name=comm_backend_name)  # fmt: skip
        if freeze_step < 0:
            raise ValueError(f"OneBitLamb freeze_step must be >= 0, got {freeze_step}")
        if not 0 < factor_min <= factor_max:
            raise ValueError(f"OneBitLamb needs 0 < factor_min <= factor_max, got {factor_min}, {factor_max}")
        self.freeze_step = int(freeze_step)
        self.coeff_beta = float(coeff_beta)
        self.factor_max, self.factor_min = float(factor_max), float(factor_min)
        self.factor_threshold = float(factor_threshold)
        self.lamb_coeffs: list[float] = []

    def get_lamb_coeffs(self) -> list[float]:
        """The coefficients of the last step, one per parameter stepped (DeepSpeed's method)."""
        return list(self.lamb_coeffs)

    def compressing(self) -> bool:
        """Whether the next step is a compressed one (its gradients stay local)."""
        return self.steps_done() >= self.freeze_step

    def reduces_gradients(self) -> bool:
        return not self.compressing()

    def _expected_errors(self) -> list[tuple[str, int]]:
        return [(_FLAT, sum(p.numel() for _, _, p in self._keyed_params()))] if self.compressing() else []

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One update of every parameter ([Note: 1-bit LAMB]); collective over the group
        in a compressed step."""
        loss = evaluate(closure)
        done = self.steps_done()
        keyed = self._keyed_params()
        states = [self._init_state(p, done) for _, _, p in keyed]
        self.lamb_coeffs = []
        if done >= self.freeze_step:
            self._compressed_step(keyed, states)
        else:
            self._warmup_step(keyed, states, done + 1)
        for state in states:
            state["step"].fill_(done + 1)
        return loss

    def _warmup_step(self, keyed: list, states: list[dict], t: int) -> None:
        for (_, group, p), state in zip(keyed, states):
            if p.grad is None:
                continue  # no rank had a gradient: untouched
            b1, b2 = group["betas"]
            m, v = state["exp_avg"], state["exp_avg_sq"]
            m.mul_(b1).add_(p.grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            if t == self.freeze_step:
                state["exp_avg_sq_fresh"].copy_(v)
            update = m / (v.sqrt() + group["eps"])
            if group["weight_decay"] > 0.0:
                update.add_(p, alpha=group["weight_decay"])
            weight_norm, update_norm = float(p.norm()), float(update.norm())
            coeff = 1.0
            if weight_norm != 0 and update_norm != 0:
                coeff = min(max(weight_norm / update_norm, group["min_coeff"]), group["max_coeff"])
            if coeff != 1.0:
                state["lamb_coeff_freeze"].mul_(self.coeff_beta).add_((1 - self.coeff_beta) * coeff)
            self.lamb_coeffs.append(coeff)
            p.add_(update, alpha=-group["lr"] * coeff)

    def _compressed_step(self, keyed: list, states: list[dict]) -> None:
        if "scaling_coeff" not in states[0]:
            scales = [float(state["exp_avg"].norm()) / math.sqrt(p.numel()) for (_, _, p), state in zip(keyed, states)]
            united = sum(scales) / len(scales)
            for state, scale in zip(states, scales):
                state["scaling_coeff"] = self._scalar(united / scale if scale > 0 else 1.0, torch.float64)
        previous = []
        for (_, group, p), state in zip(keyed, states):
            b1 = group["betas"][0]
            m = state["exp_avg"]
            previous.append(m.clone())
            m.mul_(b1).add_(self._local_grad(p), alpha=1 - b1).mul_(float(state["scaling_coeff"]))
        flat = torch.cat([state["exp_avg"].reshape(-1) for state in states])
        (averaged,) = self._compress([(_FLAT, flat)])
        offset = 0
        for (_, group, p), state, m_prev in zip(keyed, states, previous):
            b1, b2 = group["betas"]
            m, v, fresh = state["exp_avg"], state["exp_avg_sq"], state["exp_avg_sq_fresh"]
            m.copy_(averaged[offset : offset + p.numel()].view_as(m))
            offset += p.numel()
            m.div_(float(state["scaling_coeff"]))
            self._masked(group, m)
            grad = (m - m_prev * b1) / (1 - b1)
            fresh.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            denom = v.sqrt() + group["eps"]
            prelim = m / denom
            update = prelim + group["weight_decay"] * p if group["weight_decay"] > 0.0 else prelim
            update_norm = float(update.norm())
            factor = float((denom / (fresh.sqrt() + group["eps"])).max())
            if group["weight_decay"] > 0.0:
                ratio = min(1.0, float(prelim.norm()) / update_norm)
                factor = factor * ratio + (1.0 - ratio)
            factor = min(max(factor, self.factor_min), self.factor_max)
            last = float(state["last_factor"])
            factor = min(max(factor, last * (1.0 - self.factor_threshold)), last * (1.0 + self.factor_threshold))
            state["last_factor"].fill_(factor)
            coeff = float(state["lamb_coeff_freeze"]) * factor
            self.lamb_coeffs.append(coeff)
            p.add_(update, alpha=-group["lr"] * coeff)

    def _init_state(self, p: torch.Tensor, done: int) -> dict[str, Any]:
        """``p``'s state, created where missing (zero moments, ``done`` steps)."""
        state = self.state[p]
        if "step" not in state:
            state["step"] = self._scalar(done, torch.int64)
            state["lamb_coeff_freeze"] = self._scalar(0.0, torch.float64)
            state["last_factor"] = self._scalar(1.0, torch.float64)
            for key in ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh"):
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state
