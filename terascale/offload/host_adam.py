"""The optimizer step on the host for offloaded optimizer state: Adam in cache-sized chunks.

[Note: host Adam]
On the host, Adam is bound by memory bandwidth, not arithmetic. A mixed-precision step
done as three whole-tensor passes (widen the bf16/fp16 gradient to fp32, the Adam
update, narrow the updated fp32 master into the bf16/fp16 parameter) moves about 40
bytes per element: 2 + 4 to widen, 4 + 24 for Adam (read and write master and two
moments, read the fp32 gradient), 4 + 2 to narrow. Doing the three per chunk of a few
MiB, while the chunk is still in the cache, leaves 28 bytes of memory traffic
(the low-precision gradient read once, the low-precision parameter written once). Each
chunk runs torch's own fused Adam kernel (``torch._fused_adam_`` / ``_fused_adamw_``, what
``torch.optim.Adam(W)(fused=True)`` calls) on views, and an elementwise kernel does not
care where a tensor is cut, so the result is bit-identical to the optimizer's own step.
The kernels are multi-threaded (torch's intra-op pool). DeepSpeed's C++ CPUAdam makes the
same three passes (its ZeRO-Offload widens and narrows outside the kernel).

The same chunked step serves bf16 master weights and bf16 moments on any device
([Note: bf16 masters and optimizer states] in ``terascale/optim/rounding.py``): a bf16
master or moment is widened into an fp32 chunk beside the gradient, the kernel runs in
fp32, and the results are narrowed back (stochastically by default).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from terascale.optim.rounding import StochasticRounding, narrow_

CHUNK_NUMEL = 1 << 18  # 1 MiB of fp32 per tensor: the chunk's four tensors stay in L2/L3
LOW_PRECISION_DEVICE_CHUNK_NUMEL = 1 << 22  # an accelerator: kernels launched per chunk, so fewer, larger
_ADAM_TYPES = (torch.optim.Adam, torch.optim.AdamW)


def supports(optimizer: torch.optim.Optimizer) -> bool:
    """Whether :func:`step` gives exactly what ``optimizer.step()`` gives: torch's Adam or
    AdamW built with ``fused=True`` (terascale's optimizer factory builds them so)."""
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and all(
        g.get("fused") and not g.get("differentiable") and not g.get("capturable") for g in optimizer.param_groups
    )


def supports_low_precision(optimizer: torch.optim.Optimizer) -> bool:
    """Whether :func:`step` can step ``optimizer``'s parameters with bf16 masters or
    moments: torch's Adam or AdamW however built (the arithmetic is the fused kernel's;
    a foreach or for-loop optimizer rounds its fp32 results alike, to the last bit or
    so), not differentiable, not capturable."""
    return type(optimizer) in _ADAM_TYPES and all(
        not g.get("differentiable") and not g.get("capturable") for g in optimizer.param_groups
    )


def chunk_numel_for(device: torch.device) -> int:
    """The chunk :func:`step` takes on ``device`` for bf16 masters or moments."""
    return CHUNK_NUMEL if device.type == "cpu" else LOW_PRECISION_DEVICE_CHUNK_NUMEL


@torch.no_grad()
def step(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.nn.Parameter],
    grads: Sequence[torch.Tensor],
    multiplier: torch.Tensor,
    outputs: Sequence[torch.Tensor | None] | None = None,
    chunk_numel: int = CHUNK_NUMEL,
    *,
    state_dtype: torch.dtype = torch.float32,
    rounding: StochasticRounding | None = None,
    positions: Sequence[int] | None = None,
    step_number: int | None = None,
) -> None:
    """One Adam(W) step of ``params`` (members of ``optimizer``'s groups, all on one
    device) with gradients ``grads * multiplier`` (any float dtype, same shapes), as
    ``optimizer.step()`` would take it; then ``outputs[i]`` (if given) receives the new
    ``params[i]`` in its own dtype. The optimizer's state is created (its moments in
    ``state_dtype``) or advanced in place; fp32 ``grads`` are scaled in place (they are
    consumed).

    fp32 ``params`` and moments: bit-identical to the fused optimizer's step. bf16 ones
    ([Note: bf16 masters and optimizer states]) are widened per chunk and narrowed back,
    stochastically with ``rounding``, where ``positions[i]`` is the model position of
    ``params[i]``'s first element (to nearest without ``rounding``) and ``step_number`` the
    step being taken (default: read from the state, a device sync on an accelerator).
    """
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    # 1.0 (no loss scale, no clipping this step) skips a pass; on an accelerator reading the
    # value would wait for the device, so there the gradient is always multiplied.
    scale = float(multiplier) if multiplier.device.type == "cpu" else None
    outputs = outputs if outputs is not None else [None] * len(params)
    chunk = min(chunk_numel, max((p.numel() for p in params), default=0))
    device = params[0].device if params else torch.device("cpu")
    low = any(p.dtype != torch.float32 for p in params) or state_dtype != torch.float32
    # fp32 path: one buffer for a widened low-precision gradient; bf16 path: the widened
    # master and moments (and amsgrad's maximum), then the gradient.
    buffers = [torch.empty(chunk, dtype=torch.float32, device=device) for _ in range(5 if low else 1)]
    scratch, wide = (None, buffers) if low else (buffers[0], [])
    multiplier = multiplier.to(device)
    for n, (p, grad, out) in enumerate(zip(params, grads, outputs)):
        group = group_of[id(p)]
        if grad.device != p.device:
            grad = grad.to(p.device)  # one copy of the whole piece, not one per chunk
        state = optimizer.state[p]
        if len(state) == 0 or state.get("exp_avg") is None or state["exp_avg"].numel() != p.numel():
            # As torch's Adam initialises it for fused=True (fp32 step counter on p's device).
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq"):
                state[key] = torch.zeros_like(p, dtype=state_dtype, memory_format=torch.preserve_format)
        state["step"].add_(1)
        kernel = torch._fused_adamw_ if _decoupled(optimizer, group) else torch._fused_adam_
        flat = [t.view(-1) for t in (p, state["exp_avg"], state["exp_avg_sq"])]
        max_sq = state["max_exp_avg_sq"].view(-1) if group["amsgrad"] else None
        g_flat, o_flat = grad.reshape(-1), None if out is None else out.view(-1)
        if low:
            step = int(state["step"]) if step_number is None else step_number  # its noise's seed
            _step_low_precision(kernel, group, flat, max_sq, state["step"], g_flat, o_flat, multiplier, scale,
                                wide, rounding, step, 0 if positions is None else positions[n], chunk)  # fmt: skip
            continue
        # Nothing to fuse (fp32 gradient, no low-precision copy): one call, no chunk overhead.
        step_numel = p.numel() if g_flat.dtype == torch.float32 and o_flat is None else chunk_numel
        for lo in range(0, p.numel(), max(1, step_numel)):
            hi = min(lo + step_numel, p.numel())
            if g_flat.dtype == torch.float32:
                g32 = g_flat[lo:hi]
                if scale != 1.0:
                    g32.mul_(multiplier)  # the gradient is consumed: scale in place
            else:
                g32 = scratch[: hi - lo]
                g32.copy_(g_flat[lo:hi])
                if scale != 1.0:
                    g32.mul_(multiplier)
            tensors = [flat[0][lo:hi], flat[1][lo:hi], flat[2][lo:hi]] + ([] if max_sq is None else [max_sq[lo:hi]])
            _adam(kernel, group, tensors, g32, state["step"])
            if o_flat is not None:
                o_flat[lo:hi].copy_(flat[0][lo:hi])


def _adam(kernel, group: dict, tensors: Sequence[torch.Tensor], grad: torch.Tensor, step_count: torch.Tensor) -> None:
    """torch's fused Adam(W) ``kernel`` on one chunk: ``tensors`` are the fp32 master, first
    and second moments (and amsgrad's maximum), ``grad`` its fp32 gradient."""
    beta1, beta2 = (float(b) for b in group["betas"])
    kernel(
        [tensors[0]],
        [grad],
        [tensors[1]],
        [tensors[2]],
        list(tensors[3:]),
        [step_count],
        amsgrad=group["amsgrad"],
        lr=float(group["lr"]),
        beta1=beta1,
        beta2=beta2,
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group["maximize"],
        grad_scale=None,
        found_inf=None,
    )


def _step_low_precision(
    kernel,
    group: dict,
    flat: list[torch.Tensor],
    max_sq: torch.Tensor | None,
    step_count: torch.Tensor,
    g_flat: torch.Tensor,
    o_flat: torch.Tensor | None,
    multiplier: torch.Tensor,
    scale: float | None,
    wide: list[torch.Tensor],
    rounding: StochasticRounding | None,
    step: int,
    position: int,
    chunk: int,
) -> None:
    """:func:`step` for one parameter whose master or moments are bf16: per chunk, widen
    what is bf16 into ``wide`` (fp32), run ``kernel``, narrow back."""
    tensors = flat + ([] if max_sq is None else [max_sq])  # master, moments: roles 0, 1, 2, (3)
    for lo in range(0, flat[0].numel(), max(1, chunk)):
        hi = min(lo + chunk, flat[0].numel())
        views = [t[lo:hi] for t in tensors]
        work = [v if v.dtype == torch.float32 else w[: hi - lo].copy_(v) for v, w in zip(views, wide)]
        g32 = wide[4][: hi - lo].copy_(g_flat[lo:hi])
        if scale != 1.0:
            g32.mul_(multiplier)
        _adam(kernel, group, work, g32, step_count)
        for role, (view, w) in enumerate(zip(views, work)):
            if view.dtype != torch.float32:
                noise = None if rounding is None else rounding.noise(step, w.device, position + lo, hi - lo, role)
                narrow_(w, view, noise)
        if o_flat is not None:
            o_flat[lo:hi].copy_(views[0])  # the parameter is the master, narrowed as it is


def _decoupled(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    return bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))
