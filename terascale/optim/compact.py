"""Adam and AdamW with 8-bit moments: about 2 bytes of optimizer state per parameter, not 8.

[Note: compact optimizer states]
``Adam8bit`` / ``AdamW8bit`` keep each parameter's first and second moments block-wise
quantized ([Note: block-wise state codes]): per parameter the state is ``step`` (0-d,
as torch's fused Adam keeps it), ``exp_avg_code`` and ``exp_avg_sq_code`` (one byte per
element) and ``exp_avg_scale`` and ``exp_avg_sq_scale`` (one fp32 per block of 256).
The master weights are whatever the optimizer is given (terascale's fp32 master pieces).
A step decodes the moments of a cache-sized chunk into fp32, runs torch's own fused
Adam(W) kernel on the chunk (so the arithmetic is the fp32 optimizer's, given the same
moments), and encodes them again. Everything that moves optimizer state moves these
tensors unchanged: the host tier holds them, the NVMe tier swaps them in its run files
(half the bytes of fp32 moments with the masters), the device keeps them.

Checkpoints store the moments *by value*, as the fp32 ``exp_avg`` / ``exp_avg_sq`` that
Adam saves (:meth:`CompactAdam.logical_state`), and loading encodes them again
(:meth:`CompactAdam.set_logical_state`). Because the code is idempotent, a resume on the
same layout gets the same bytes; a resume on another layout (other ranks, stage, block
boundaries) or from an fp32 Adam checkpoint re-blocks once; and an fp32 Adam resumes from
an 8-bit checkpoint. The price is a checkpoint as large as fp32 Adam's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from terascale.optim.closure import evaluate
from terascale.optim.quantize import DEFAULT_BLOCK, Code, blocks, decode, encode

MOMENTS = ("exp_avg", "exp_avg_sq")
_SIGNED = {"exp_avg": True, "exp_avg_sq": False}
CHUNK_NUMEL = 1 << 17  # elements per decode-step-encode pass on the host: stays in L2 (measured best)
DEVICE_CHUNK_NUMEL = 1 << 24  # on an accelerator kernels are launched per chunk: fewer, larger


def code_key(moment: str) -> str:
    return f"{moment}_code"


def scale_key(moment: str) -> str:
    return f"{moment}_scale"


class CompactAdam(Optimizer):
    """Adam (``decoupled_weight_decay=False``: L2 added to the gradient) or AdamW with
    block-wise 8-bit moments; see [Note: compact optimizer states].

    ``block_size`` elements share one scale; ``code`` is ``power`` (default), ``dynamic``
    or ``linear``. Parameters must be floating point; the update is computed in fp32.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        decoupled_weight_decay: bool = True,
        block_size: int = DEFAULT_BLOCK,
        code: str = "power",
        maximize: bool = False,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if block_size < 16 or block_size % 16:
            raise ValueError(f"block_size must be a multiple of 16 and at least 16, got {block_size}")
        if code == "linear":
            raise ValueError("code 'linear' loses Adam's small second moments (they round to zero); use 'power' or 'dynamic'")
        Code(code, True)  # validates the name
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=decoupled_weight_decay, block_size=block_size,
                        code=code, maximize=maximize)  # fmt: skip
        super().__init__(params, defaults)

    # -- the step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = evaluate(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or p.numel() == 0:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("Adam8bit/AdamW8bit do not take sparse gradients")
                self._step_param(p, p.grad, group)
        return loss

    @torch.no_grad()
    def step_with(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        multiplier: torch.Tensor | float = 1.0,
        outputs: list[torch.Tensor | None] | None = None,
    ) -> None:
        """Step ``params`` (members of this optimizer) with gradients ``grads * multiplier``
        (any float dtype, same numel; read, never modified), as :meth:`step` would with
        those as ``.grad``; then ``outputs[i]`` (if given) receives the new ``params[i]``
        in its own dtype. Chunk by chunk, so no fp32 copy of a whole gradient is made (the
        ZeRO step's path, like [Note: host Adam])."""
        outputs = outputs if outputs is not None else [None] * len(params)
        scale = float(multiplier)
        for p, g, out in zip(params, grads, outputs):
            if p.numel():
                self._step_param(p, g, self._group_of(p), scale, out)

    def _step_param(self, p: torch.Tensor, grad: torch.Tensor, group: dict, scale: float = 1.0,
                    output: torch.Tensor | None = None) -> None:  # fmt: skip
        state = self.state[p]
        block = group["block_size"]
        if "step" not in state:
            self._init_state(p, state, block)
        state["step"].add_(1)
        flat = p.view(-1)
        g_flat = grad.reshape(-1)
        if g_flat.device != p.device:
            g_flat = g_flat.to(p.device)
        o_flat = None if output is None else output.view(-1)
        chunk = CHUNK_NUMEL if p.device.type == "cpu" else DEVICE_CHUNK_NUMEL
        chunk -= chunk % block
        n = flat.numel()
        work = torch.empty(4, min(chunk, n), dtype=torch.float32, device=p.device)
        m32, v32, scratch, g32 = work
        codes = {name: (state[code_key(name)], state[scale_key(name)], Code(group["code"], _SIGNED[name])) for name in MOMENTS}
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            b0, b1 = lo // block, blocks(hi, block)
            m, v = m32[: hi - lo], v32[: hi - lo]
            for out, name in ((m, "exp_avg"), (v, "exp_avg_sq")):
                c, s, code = codes[name]
                decode(c[lo:hi], s[b0:b1], code, block, out, scratch=scratch)
            g = g_flat[lo:hi]
            if g.dtype != torch.float32 or scale != 1.0:
                g = g32[: hi - lo].copy_(g)
                if scale != 1.0:
                    g.mul_(scale)
            _adam(flat[lo:hi], g, m, v, state["step"], group)
            for value, name in ((m, "exp_avg"), (v, "exp_avg_sq")):
                c, s, code = codes[name]
                encode(value, code, block, c[lo:hi], s[b0:b1], scratch)
            if o_flat is not None:
                o_flat[lo:hi].copy_(flat[lo:hi])

    def _init_state(self, p: torch.Tensor, state: dict, block: int) -> None:
        if not torch.is_floating_point(p):
            raise ValueError(f"Adam8bit/AdamW8bit step floating-point parameters, got {p.dtype}")
        group = self._group_of(p)
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        for name in MOMENTS:
            state[code_key(name)] = torch.zeros(p.numel(), dtype=Code(group["code"], _SIGNED[name]).dtype, device=p.device)
            state[scale_key(name)] = torch.zeros(blocks(p.numel(), block), dtype=torch.float32, device=p.device)

    def _group_of(self, p: torch.Tensor) -> dict:
        index = self.__dict__.get("_group_index")
        if index is None or id(p) not in index:  # built once; again after add_param_group
            index = {id(q): g for g in self.param_groups for q in g["params"]}
            self.__dict__["_group_index"] = index
        if id(p) not in index:
            raise KeyError("the tensor is not a parameter of this optimizer")
        return index[id(p)]

    # -- state by value (checkpoints) ----------------------------------------------------------

    def logical_state(self, p: torch.Tensor, state: dict[str, Any] | None = None) -> dict[str, Any]:
        """``state`` (default: ``self.state[p]``) as fp32 Adam keeps it: ``step`` and the
        decoded ``exp_avg`` / ``exp_avg_sq`` shaped like ``p`` (new tensors). Meta codes give
        meta moments (a checkpoint describing a run it has not read)."""
        state = self.state.get(p, {}) if state is None else state
        out: dict[str, Any] = {k: v for k, v in state.items() if not _is_compact_key(k)}
        if code_key("exp_avg") not in state:
            return out
        group = self._group_of(p)
        for name in MOMENTS:
            codes, scale = state[code_key(name)], state[scale_key(name)]
            # ``p`` may be an unbound placeholder (its run on NVMe): the codes know the size.
            shape = p.shape if p.numel() == codes.numel() else codes.shape
            if codes.is_meta:
                out[name] = torch.empty(shape, dtype=torch.float32, device="meta")
                continue
            value = torch.empty(codes.numel(), dtype=torch.float32, device=codes.device)
            decode(codes, scale, Code(group["code"], _SIGNED[name]), group["block_size"], value, exact=True)
            out[name] = value.view(shape)
        return out

    def set_logical_state(self, p: torch.Tensor) -> None:
        """Encode fp32 ``exp_avg`` / ``exp_avg_sq`` entries of ``self.state[p]`` (loaded from
        a checkpoint) into its codes, in place where the code tensors exist, and drop them."""
        state = self.state[p]
        if not all(isinstance(state.get(name), torch.Tensor) and state[name].dim() > 0 for name in MOMENTS):
            return
        group = self._group_of(p)
        block = group["block_size"]
        for name in MOMENTS:
            value = state.pop(name).reshape(-1).to(device=p.device, dtype=torch.float32)
            code = Code(group["code"], _SIGNED[name])
            codes, scale = state.get(code_key(name)), state.get(scale_key(name))
            if codes is None or codes.numel() != value.numel():
                codes = torch.empty(value.numel(), dtype=code.dtype, device=p.device)
                scale = torch.empty(blocks(value.numel(), block), dtype=torch.float32, device=p.device)
                state[code_key(name)], state[scale_key(name)] = codes, scale
            encode(value, code, block, codes, scale)
        step = state.get("step")
        # The fused kernel wants the count on the parameter's device (a loader makes it on the CPU).
        state["step"] = (step if isinstance(step, torch.Tensor) else torch.zeros(())).to(p.device, torch.float32)

    def state_nbytes_per_element(self) -> float:
        """Bytes of state per parameter element (two bytes of codes and the block scales)."""
        block = min((g["block_size"] for g in self.param_groups), default=DEFAULT_BLOCK)
        return 2.0 + 8.0 / block


def _is_compact_key(key: str) -> bool:
    return any(key in (code_key(n), scale_key(n)) for n in MOMENTS)


def is_compact(optimizer: object) -> bool:
    return isinstance(optimizer, CompactAdam)


def _adam(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor, group: dict) -> None:
    """One Adam(W) update of ``p`` (fp32 view) with fp32 moments ``m``, ``v`` (updated in
    place) and the already-advanced ``step``: torch's fused kernel where the device has
    one, else the same arithmetic with torch ops."""
    beta1, beta2 = group["betas"]
    decoupled = group["decoupled_weight_decay"]
    if p.dtype == torch.float32 and g.dtype == torch.float32 and _has_fused(p.device.type):
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        kernel([p], [g], [m], [v], [], [step], amsgrad=False, lr=float(group["lr"]), beta1=float(beta1),
               beta2=float(beta2), weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
               maximize=bool(group["maximize"]), grad_scale=None, found_inf=None)  # fmt: skip
        return
    g = -g if group["maximize"] else g
    lr, wd, t = float(group["lr"]), float(group["weight_decay"]), float(step)
    p32 = p.float()
    if wd:
        if decoupled:
            p32.mul_(1 - lr * wd)
        else:
            g = g.add(p32, alpha=wd)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v.sqrt() / (1 - beta2**t) ** 0.5).add_(group["eps"])
    p32.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
    if p32 is not p:
        p.copy_(p32)


def _has_fused(device_type: str) -> bool:
    return device_type in ("cpu", "cuda", "xpu", "mps")
