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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

CHUNK_NUMEL = 1 << 18  # 1 MiB of fp32 per tensor: the chunk's four tensors stay in L2/L3


def supports(optimizer: torch.optim.Optimizer) -> bool:
    """Whether :func:`step` gives exactly what ``optimizer.step()`` gives: torch's Adam or
    AdamW built with ``fused=True`` (terascale's optimizer factory builds them so)."""
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and all(
        g.get("fused") and not g.get("differentiable") and not g.get("capturable") for g in optimizer.param_groups
    )


@torch.no_grad()
def step(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.nn.Parameter],
    grads: Sequence[torch.Tensor],
    multiplier: torch.Tensor,
    outputs: Sequence[torch.Tensor | None] | None = None,
    chunk_numel: int = CHUNK_NUMEL,
) -> None:
    """One Adam(W) step of ``params`` (fp32, host, members of ``optimizer``'s groups) with
    gradients ``grads * multiplier`` (any float dtype, same shapes), as
    ``optimizer.step()`` would take it; then ``outputs[i]`` (if given) receives the new
    ``params[i]`` in its own dtype. The optimizer's state is created or advanced in place;
    fp32 ``grads`` are scaled in place (they are consumed).
    """
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    scale = float(multiplier)  # 1.0 (no loss scale, no clipping this step) skips a pass
    outputs = outputs if outputs is not None else [None] * len(params)
    scratch = torch.empty(min(chunk_numel, max((p.numel() for p in params), default=0)), dtype=torch.float32)
    for p, grad, out in zip(params, grads, outputs):
        group = group_of[id(p)]
        if grad.device != p.device:
            grad = grad.to(p.device)  # one copy of the whole piece, not one per chunk
        state = optimizer.state[p]
        if len(state) == 0 or state.get("exp_avg") is None or state["exp_avg"].numel() != p.numel():
            # As torch's Adam initialises it for fused=True (fp32 step counter on p's device).
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"].add_(1)
        kernel = torch._fused_adamw_ if _decoupled(optimizer, group) else torch._fused_adam_
        beta1, beta2 = (float(b) for b in group["betas"])
        flat = [t.view(-1) for t in (p, state["exp_avg"], state["exp_avg_sq"])]
        max_sq = state["max_exp_avg_sq"].view(-1) if group["amsgrad"] else None
        g_flat, o_flat = grad.reshape(-1), None if out is None else out.view(-1)
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
            kernel(
                [flat[0][lo:hi]],
                [g32],
                [flat[1][lo:hi]],
                [flat[2][lo:hi]],
                [] if max_sq is None else [max_sq[lo:hi]],
                [state["step"]],
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
            if o_flat is not None:
                o_flat[lo:hi].copy_(flat[0][lo:hi])


def _decoupled(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    return bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))
