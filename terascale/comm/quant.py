"""Block quantization of flat tensors into byte messages (ZeRO++'s qwZ and qgZ).

[Note: block-quantized messages]
A flat tensor of ``n`` elements is cut into blocks of ``block`` elements (the last one
zero-padded) and each block is scaled by its own absolute maximum: ``q = round(x / s)``
with ``s = absmax / qmax``, ``qmax = 2^(bits-1) - 1`` (127 for int8, 7 for int4), rounded
half to even, so ``|x - q*s| <= s/2`` for every element (half a step of its block). The
largest magnitude maps to ±qmax exactly; DeepSpeed's kernels divide by 2^(bits-1) instead
and clip the top value (128 -> 127), a slightly larger error that buys nothing here. A
block of zeros has scale 0 and decodes to zeros; a block holding inf or NaN has a
non-finite scale and decodes to non-finite values, so an fp16 overflow still shows after
a quantized reduction.

One message holds the codes (padded to 4 bytes) and then the fp32 scales, as bytes (``BlockQuant.nbytes``), so
a quantized collective is one collective, not DeepSpeed's two (codes, then scales): on a
slow link each message costs a latency. int4 codes are stored as ``q + 8`` (1..15), two to
a byte, the even element in the high nibble (DeepSpeed's order too). Blocks never span two
messages: a caller quantizing a rank's shard quantizes exactly that shard, so the block grid
is the same on every rank and nothing depends on how the shards fall.

Pure torch: the same code runs on the CPU and on CUDA (where a fused kernel would do the
same in one pass; DESIGN.md keeps compiled kernels out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_SCALE_BYTES = 4  # one fp32 scale per block


@dataclass(frozen=True)
class BlockQuant:
    """``bits``-bit symmetric codes (8 or 4) with one scale per ``block`` elements."""

    bits: int
    block: int

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"block quantization supports 8 or 4 bits, got {self.bits}")
        if self.block < 2 or self.block % 2:
            raise ValueError(f"a quantization block must hold an even number (>= 2) of elements, got {self.block}")

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def blocks(self, numel: int) -> int:
        return max(1, math.ceil(numel / self.block))

    def code_nbytes(self, numel: int) -> int:
        """Bytes of the codes, padded to a multiple of 4 so that the scales after them (and
        the next message in a buffer of messages) stay 4-byte aligned."""
        return -(-self.blocks(numel) * self.block * self.bits // 32) * 4

    def nbytes(self, numel: int) -> int:
        """Bytes of the message holding ``numel`` elements: codes, then scales."""
        return self.code_nbytes(numel) + self.blocks(numel) * _SCALE_BYTES


def quantize(x: torch.Tensor, spec: BlockQuant, out: torch.Tensor | None = None) -> torch.Tensor:
    """Encode the flat tensor ``x`` (any float dtype) as one uint8 message of
    ``spec.nbytes(x.numel())`` bytes (into ``out`` when given); see [Note: block-quantized messages]."""
    n = x.numel()
    nb = spec.blocks(n)
    nbytes = spec.nbytes(n)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    assert out.dtype == torch.uint8 and out.numel() == nbytes, (out.dtype, out.numel(), nbytes)
    wide = torch.zeros(nb * spec.block, dtype=torch.float32, device=x.device)
    wide[:n].copy_(x.reshape(-1))
    blocks = wide.view(nb, spec.block)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    scale = absmax / spec.qmax
    # A zero block (and one so small that qmax / absmax overflows) keeps codes 0; a
    # non-finite one gets codes 0 and its non-finite scale carries the overflow through
    # (0 * inf = NaN on decode). |x| * qmax / absmax rounds to at most qmax: no clamp.
    inv = spec.qmax / absmax
    inv = torch.where(torch.isfinite(inv) & torch.isfinite(absmax), inv, torch.zeros_like(inv))
    q = blocks.mul_(inv).round_()
    codes = out[: nb * spec.block * spec.bits // 8]
    out[codes.numel() : spec.code_nbytes(n)].zero_()
    if spec.bits == 8:
        codes.view(torch.int8).copy_(q.view(-1))
    else:
        pairs = q.view(-1, 2).add_(8).to(torch.uint8)
        torch.bitwise_or(pairs[:, 0].bitwise_left_shift(4), pairs[:, 1], out=codes)
    out[spec.code_nbytes(n) :].view(torch.float32).copy_(scale.view(-1))
    return out


def dequantize(message: torch.Tensor, spec: BlockQuant, out: torch.Tensor) -> torch.Tensor:
    """Decode a message of :func:`quantize` into ``out`` (flat, any float dtype, its
    ``numel`` the encoded tensor's) and return ``out``."""
    n = out.numel()
    nb = spec.blocks(n)
    assert message.dtype == torch.uint8 and message.numel() == spec.nbytes(n), (message.numel(), spec.nbytes(n))
    codes = message[: nb * spec.block * spec.bits // 8]
    scale = message[spec.code_nbytes(n) :].view(torch.float32).view(nb, 1)
    if spec.bits == 8:
        q = codes.view(torch.int8)
    else:  # two codes a byte, high nibble first
        q = torch.empty(nb * spec.block, dtype=torch.float32, device=message.device)
        pairs = q.view(-1, 2)
        pairs[:, 0].copy_(codes.bitwise_right_shift(4))
        pairs[:, 1].copy_(codes.bitwise_and(15))
        q.sub_(8)
    flat = out.view(-1)
    whole = n // spec.block * spec.block
    if flat.dtype == torch.float32:  # decode straight into place (int8 x fp32 is fp32)
        if whole:
            torch.mul(q[:whole].view(-1, spec.block), scale[: whole // spec.block], out=flat[:whole].view(-1, spec.block))
        if whole < n:
            flat[whole:].copy_(q[whole:n] * scale[-1])
        return out
    values = q.view(nb, spec.block).to(torch.float32).mul_(scale).view(-1)
    flat.copy_(values[:n])
    return out


def dequantize_add(message: torch.Tensor, spec: BlockQuant, acc: torch.Tensor) -> torch.Tensor:
    """Add the decoded message to the flat fp32 accumulator ``acc`` in place."""
    decoded = torch.empty(acc.numel(), dtype=torch.float32, device=acc.device)
    return acc.add_(dequantize(message, spec, decoded))
