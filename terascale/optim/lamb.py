"""LAMB with DeepSpeed FusedLamb semantics, written with torch ``_foreach`` ops."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from terascale.optim.closure import evaluate

__all__ = ["Lamb"]

# DeepSpeed adds this to the unscaled gradient norm before comparing it with
# max_grad_norm, so a norm exactly at the limit is (slightly) clipped.
_CLIP_EPS = 1e-6


def _check_range(name: str, value: float, low: float, high: float | None = None,
                 high_open: bool = False) -> None:
    if value < low or (high is not None and (value >= high if high_open else value > high)):
        bound = "" if high is None else (f" and {'<' if high_open else '<='} {high}")
        raise ValueError(f"Lamb {name} must be >= {low}{bound}, got {value}")


class Lamb(Optimizer):
    r"""Layer-wise Adaptive Moments (LAMB, arXiv:1904.00962) as DeepSpeed's FusedLamb.

    For every parameter tensor ``w`` with gradient ``g`` at its step ``t`` (counted per
    tensor), with ``c`` the gradient divisor (see ``step``):

    .. code-block:: text

        g      = g / c
        m      = beta1 * m + (1 - beta1) * g
        v      = beta2 * v + (1 - beta2) * g * g
        m_hat  = m / (1 - beta1**t)           # both only when bias_correction,
        v_hat  = v / (1 - beta2**t)           # else m_hat = m, v_hat = v
        denom  = sqrt(v_hat) + eps            # eps_inside_sqrt: sqrt(v_hat + eps)
        u      = m_hat / denom + weight_decay * w
        ratio  = clamp(||w|| / ||u||, min_coeff, max_coeff)   # 1 if ||w|| or ||u|| is 0
        w      = w - lr * ratio * u

    Norms are per tensor (one "layer" = one parameter tensor) and use ``w`` before the
    update. This follows DeepSpeed's current kernel, which bias-corrects ``m`` and ``v``
    themselves (LAMB Algorithm 2); older DeepSpeed releases instead scaled the step by
    ``sqrt(1 - beta2**t) / (1 - beta1**t)`` after the trust ratio.

    ``max_grad_norm > 0`` clips like FusedLamb: with ``n`` the L2 norm of the gradients as
    stored (still multiplied by ``scale``) over every parameter that has a gradient, the
    divisor is ``c = scale * max(1, (n / scale + 1e-6) / max_grad_norm)``; otherwise
    ``c = scale``. DeepSpeed configs reject ``max_grad_norm`` in favour of the engine's
    ``gradient_clipping``; here it is available when using the class directly.

    The trust ratios of the last step are kept as tensors (no host sync) and returned as
    floats by :meth:`get_lamb_coeffs`.

    Args:
        params: tensors or param-group dicts to optimise (floating point, dense grads).
        lr: learning rate.
        bias_correction: divide the moments by ``1 - beta**t``.
        betas: decay rates ``(beta1, beta2)`` of the moment estimates.
        eps: denominator term, see ``eps_inside_sqrt``.
        eps_inside_sqrt: put ``eps`` under the square root instead of after it.
        weight_decay: coefficient of ``w`` added to the update (inside the trust ratio).
        max_grad_norm: global gradient-norm clip, 0 disables.
        max_coeff, min_coeff: bounds of the trust ratio.
        amsgrad: accepted for DeepSpeed compatibility; ``True`` is an error.
    """

    # The trust ratio needs each parameter's whole norm: on ZeRO's flat pieces the engine
    # runs the two-pass step (accumulate_norms, apply_norms) of [Note: optimizers on shards].
    needs_whole_parameters = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise ValueError("Lamb does not support the AMSGrad variant; set amsgrad to false")
        if len(betas) != 2:
            raise ValueError(f"Lamb betas must be two numbers (beta1, beta2), got {betas!r}")
        if not isinstance(lr, torch.Tensor):
            _check_range("lr", lr, 0.0)
        _check_range("betas[0]", betas[0], 0.0, 1.0, high_open=True)
        _check_range("betas[1]", betas[1], 0.0, 1.0, high_open=True)
        _check_range("eps", eps, 0.0)
        _check_range("weight_decay", weight_decay, 0.0)
        _check_range("max_grad_norm", max_grad_norm, 0.0)
        _check_range("min_coeff", min_coeff, 0.0, max_coeff)
        defaults = dict(
            lr=lr,
            bias_correction=bool(bias_correction),
            betas=(float(betas[0]), float(betas[1])),
            eps=eps,
            eps_inside_sqrt=bool(eps_inside_sqrt),
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        # (group index, positions in group["params"], trust-ratio tensor) per bucket.
        self._last_coeffs: list[tuple[int, list[int], torch.Tensor]] = []
        # On pieces of parameters (ZeRO stages 1-3): the ratio of each whole parameter.
        self._piece_coeffs: torch.Tensor | None = None

    @property
    def clips(self) -> bool:
        """Whether some group clips by ``max_grad_norm``: by the norm of the gradients this
        optimizer is given, which is the model's only when it steps whole parameters."""
        return any(g["max_grad_norm"] > 0 for g in self.param_groups)

    def get_lamb_coeffs(self) -> list[float]:
        """Trust ratios of the last step, in param-group then parameter order (host sync);
        after a step on pieces (ZeRO stages 1-3), one per whole parameter in the order of the
        engine's parameter numbering (the model's trainable parameters in module order)."""
        if self._piece_coeffs is not None:
            return self._piece_coeffs.tolist()
        ordered: dict[tuple[int, int], float] = {}
        for group_idx, positions, coeffs in self._last_coeffs:
            for pos, value in zip(positions, coeffs.tolist()):
                ordered[(group_idx, pos)] = value
        return [ordered[key] for key in sorted(ordered)]

    @staticmethod
    def _grad_divisor(scale: float | torch.Tensor, grad_norm: torch.Tensor | None,
                      max_grad_norm: float) -> float | torch.Tensor:
        """Return ``c``: the loss scale, grown so the unscaled grad norm is clipped."""
        if max_grad_norm <= 0 or grad_norm is None:
            return scale
        clip = (grad_norm / scale + _CLIP_EPS) / max_grad_norm
        return scale * torch.clamp(clip, min=1.0)

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], float] | None = None,
        *,
        scale: float | torch.Tensor = 1.0,
        grad_norm: float | torch.Tensor | None = None,
        sum_norms: Callable[[torch.Tensor, Sequence[torch.Tensor]], None] | None = None,
    ) -> float | None:
        """Update every parameter that has a ``.grad``; tensors in a group are batched.

        Args:
            closure: re-evaluates the model and returns the loss.
            scale: the gradients are divided by this (e.g. a loss scale).
            grad_norm: the global L2 norm of the stored (scaled) gradients when the caller
                already has it; computed here only if some group clips (max_grad_norm > 0).
            sum_norms: for parameters that are parts of larger ones (tensor-parallel
                slices): ``sum_norms(rows, params)`` gets ``rows[k] = (||w_k||², ||u_k||²)``
                for each batch of ``params`` and sums, in place, those of parts over the
                ranks holding the others (collective), so the trust ratio is the whole's.
        """
        loss = evaluate(closure)

        all_grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        for grad in all_grads:
            if grad.is_sparse:
                raise ValueError("Lamb does not support sparse gradients; use dense gradients")
        norm: torch.Tensor | None = None
        if self.clips and all_grads:
            # One global norm shared by every clipping group, computed once.
            if grad_norm is None:
                norm = _global_norm(all_grads)
            elif isinstance(grad_norm, torch.Tensor):
                norm = grad_norm
            else:
                norm = torch.tensor(float(grad_norm), dtype=torch.float64)

        self._last_coeffs = []
        for group_idx, group in enumerate(self.param_groups):
            divisor = self._grad_divisor(scale, norm, group["max_grad_norm"])
            buckets: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
            for pos, p in enumerate(group["params"]):
                if p.grad is not None:
                    buckets[(p.device, p.dtype)].append(pos)
            for (device, _), positions in buckets.items():
                params = [group["params"][i] for i in positions]
                coeffs = self._update_bucket(group, params, divisor, device, sum_norms)
                self._last_coeffs.append((group_idx, positions, coeffs))
        return loss

    # -- the two-pass step on pieces of parameters (ZeRO stages 1-3) ---------------------------

    def _group_of(self) -> dict[int, dict[str, Any]]:
        return {id(p): g for g in self.param_groups for p in g["params"]}

    @staticmethod
    def _direction(group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        """The update ``u`` of ``p`` from its moments (a new tensor): m̂ / (√v̂ + eps) + wd·w."""
        beta1, beta2 = group["betas"]
        t = int(state["step"])
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if group["bias_correction"]:
            m, v = m / (1.0 - beta1**t), v / (1.0 - beta2**t)
        denom = (v + group["eps"]).sqrt_() if group["eps_inside_sqrt"] else v.sqrt().add_(group["eps"])
        u = m / denom
        if group["weight_decay"] != 0:
            u.add_(p, alpha=group["weight_decay"])
        return u

    @torch.no_grad()
    def accumulate_norms(
        self, params: Sequence[torch.Tensor], segments: Sequence[Sequence[tuple[int, int, int]]], rows: torch.Tensor
    ) -> None:
        """Pass 1 of a step on pieces: update the moments of ``params`` (each with its
        ``.grad``, already unscaled) and add, for each part ``(k, start, end)`` of
        ``segments[i]``, ``||w||²`` and ``||u||²`` of ``params[i][start:end]`` to
        ``rows[k]``. ``rows`` is then summed over the ranks and passed to :meth:`apply_norms`."""
        group_of = self._group_of()
        for p, parts in zip(params, segments):
            group = group_of[id(p)]
            beta1, beta2 = group["betas"]
            state = self.state[p]
            if not state:
                state["step"] = _new_step_count()
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            grad = p.grad.to(p.dtype)
            state["exp_avg"].mul_(beta1).add_(grad, alpha=1.0 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
            if not parts:
                continue
            u = self._direction(group, p, state)
            views_w = [p[a:b] for _, a, b in parts]
            views_u = [u[a:b] for _, a, b in parts]
            squares = torch.stack(torch._foreach_norm(views_w + views_u)).to(rows.dtype).square()
            index = torch.tensor([k for k, _, _ in parts], device=rows.device)
            rows[:, 0].index_add_(0, index, squares[: len(parts)].to(rows.device))
            rows[:, 1].index_add_(0, index, squares[len(parts) :].to(rows.device))

    @torch.no_grad()
    def apply_norms(
        self,
        params: Sequence[torch.Tensor],
        segments: Sequence[Sequence[tuple[int, int, int]]],
        rows: torch.Tensor,
        param_groups: Sequence[int],
    ) -> None:
        """Pass 2: ``w -= lr · ratio_k · u`` on each part of parameter ``k``, with ``u`` from
        the moments pass 1 updated and ``ratio_k = clamp(||w_k|| / ||u_k||)`` of the whole
        parameter (1 where either norm is 0). ``rows`` holds the squares summed over the
        ranks; ``param_groups[k]`` is parameter ``k``'s param-group index (its clamp bounds)."""
        norms = rows.sqrt()
        low = torch.tensor([self.param_groups[g]["min_coeff"] for g in param_groups], dtype=rows.dtype, device=rows.device)
        high = torch.tensor([self.param_groups[g]["max_coeff"] for g in param_groups], dtype=rows.dtype, device=rows.device)
        ratio = torch.minimum(torch.maximum(norms[:, 0] / norms[:, 1], low), high)
        self._piece_coeffs = torch.where((norms[:, 0] > 0) & (norms[:, 1] > 0), ratio, torch.ones_like(ratio))
        group_of = self._group_of()
        for p, parts in zip(params, segments):
            if not parts:
                continue
            group = group_of[id(p)]
            index = torch.tensor([k for k, _, _ in parts], device=rows.device)
            step_sizes = (self._piece_coeffs[index] * group["lr"]).to(device=p.device, dtype=p.dtype)
            u = self._direction(group, p, self.state[p])
            torch._foreach_mul_([u[a:b] for _, a, b in parts], list(step_sizes.unbind()))
            p.sub_(u)

    def _update_bucket(self, group: dict[str, Any], params: list[torch.Tensor], divisor: float | torch.Tensor,
                       device: torch.device, sum_norms: Callable | None = None) -> torch.Tensor:
        """Apply the LAMB update to same-device, same-dtype ``params``; return the ratios."""
        beta1, beta2 = group["betas"]
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = _new_step_count()
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(int(state["step"]))

        grads = [p.grad if p.grad.dtype == p.dtype else p.grad.to(p.dtype) for p in params]
        if isinstance(divisor, torch.Tensor) or divisor != 1.0:
            inv = 1.0 / torch.as_tensor(divisor, dtype=params[0].dtype, device=device)
            grads = torch._foreach_mul(grads, inv)

        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        del grads

        if group["bias_correction"]:
            bc1 = [1.0 - beta1**t for t in steps]
            bc2 = [1.0 - beta2**t for t in steps]
            update = torch._foreach_div(exp_avgs, bc1)
            denom = torch._foreach_div(exp_avg_sqs, bc2)
        else:
            # Batched copies: the moments themselves must not be modified below.
            update = torch._foreach_mul(exp_avgs, 1.0)
            denom = torch._foreach_mul(exp_avg_sqs, 1.0)
        if group["eps_inside_sqrt"]:
            torch._foreach_add_(denom, group["eps"])
            torch._foreach_sqrt_(denom)
        else:
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, group["eps"])
        torch._foreach_div_(update, denom)
        del denom
        if group["weight_decay"] != 0:
            torch._foreach_add_(update, params, alpha=group["weight_decay"])

        w_norm = torch.stack(torch._foreach_norm(params))
        u_norm = torch.stack(torch._foreach_norm(update))
        if sum_norms is not None:
            rows = torch.stack([w_norm, u_norm], dim=1).to(torch.float32).square()
            sum_norms(rows, params)
            w_norm, u_norm = (col.to(w_norm.dtype) for col in rows.sqrt().unbind(1))
        ratio = (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"])
        coeffs = torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))
        # lr may be a tensor (capturable schedules); folding it into the per-tensor
        # factor keeps the whole update free of host syncs either way.
        step_sizes = (coeffs * group["lr"]).to(params[0].dtype)
        torch._foreach_mul_(update, list(step_sizes.unbind()))
        torch._foreach_sub_(params, update)
        return coeffs


def _new_step_count() -> torch.Tensor:
    # A tensor on the host, as torch's own optimizers keep it: checkpoints store tensors,
    # and reading it for the bias correction costs no device sync.
    return torch.zeros((), dtype=torch.float32)


def _global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm over all ``tensors`` (any devices/dtypes), on the first one's device, in at
    least fp32 (fp64 when some tensor is fp64)."""
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        buckets[(t.device, t.dtype)].append(t)
    device = tensors[0].device
    dtype = torch.float32
    for _, t_dtype in buckets:
        dtype = torch.promote_types(dtype, t_dtype)
    partial = [torch.stack(torch._foreach_norm(ts)).to(device, dtype) for ts in buckets.values()]
    return torch.linalg.vector_norm(torch.cat(partial))
