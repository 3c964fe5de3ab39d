"""Block-wise 8-bit codes for optimizer state: one byte per element, one fp32 scale per block.

[Note: block-wise state codes]
A tensor is cut into blocks of ``block`` consecutive elements (the last one may be
short); each block stores its absolute maximum ``a`` in fp32 and every element as one
byte, the index of a code value ``c`` in ``[-1, 1]`` (``[0, 1]`` for non-negative
state), so that the element reads back as ``c * a``. The block's largest element is
always exactly representable (code value ±1), which makes the round trip *idempotent*:
decoding a block and encoding it again gives the same bytes and the same scale. That is
what lets a checkpoint store state by value (fp32) and a resume at the same layout get
the very bytes it saved; a resume on another layout re-blocks it once.

Codes (how the byte maps to ``[-1, 1]``):

- ``power`` (the default): ``c = sign(q) * (|q| / Q) ** k`` for the byte ``q`` in
  ``[-Q, Q]`` (``Q`` = 127 signed, 255 unsigned), with ``k = 2`` for signed state (Adam's
  first moment) and ``k = 4`` for non-negative state (the second moment). Small values
  get finer steps, as with the dynamic code, over a range of ``Q**-k`` (6e-5 and 2e-10 of
  the block maximum); encoding and decoding are a handful of vectorised elementwise
  passes (square roots and squares), which keeps the 8-bit step close to the fp32 one on
  a CPU, where a table lookup per element costs several times more.
- ``dynamic``: 8-bit Adam's dynamic tree code (Dettmers et al., 2016 and 2022): after the
  sign, the number of leading zero bits is a decimal exponent, the bit after them an
  indicator, the rest a linear fraction in ``[0.1, 1]``; a range of about 1e-7. Encoding
  looks each value up in a 2**20-entry table indexed by the top bits of its fp32 pattern.
- ``linear``: ``c = q / Q``, uniform steps (``k = 1``); only sensible for signed state.

All functions work on any device and take pre-allocated outputs, so a step can run them
chunk by chunk in cache-sized pieces.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

CODES = ("power", "dynamic", "linear")
DEFAULT_BLOCK = 256


@dataclass(frozen=True)
class Code:
    """One of :data:`CODES` for signed or non-negative state."""

    name: str
    signed: bool

    def __post_init__(self) -> None:
        if self.name not in CODES:
            raise ValueError(f"unknown state code {self.name!r}; choose one of {', '.join(CODES)}")

    @property
    def dtype(self) -> torch.dtype:
        """The stored byte: int8 for a signed power/linear code, uint8 otherwise."""
        return torch.int8 if self.signed and self.name != "dynamic" else torch.uint8

    @property
    def levels(self) -> int:
        """Q: the largest stored magnitude of a power or linear code."""
        return 127 if self.signed else 255

    @property
    def exponent(self) -> int:
        """k of a power or linear code."""
        if self.name == "linear":
            return 1
        return 2 if self.signed else 4


def blocks(numel: int, block: int) -> int:
    """Number of blocks (and scales) of a tensor of ``numel`` elements."""
    return -(-numel // block)


def encode(x: torch.Tensor, code: Code, block: int, out: torch.Tensor, scale: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
    """Write ``x`` (1-D float32, any length) as bytes ``out`` (``code.dtype``, same length)
    and per-block maxima ``scale`` (fp32, ``blocks(len(x), block)``). ``x`` is left
    unchanged; ``scratch`` (fp32, at least ``len(x)``) avoids an allocation."""
    n = x.numel()
    full = n - n % block
    if full:
        _encode_blocks(x[:full].view(-1, block), code, out[:full].view(-1, block), scale[: full // block], scratch)
    if full < n:
        _encode_blocks(x[full:].view(1, -1), code, out[full:].view(1, -1), scale[full // block :], None)


def decode(codes: torch.Tensor, scale: torch.Tensor, code: Code, block: int, out: torch.Tensor, *, exact: bool = False,
           scratch: torch.Tensor | None = None) -> None:  # fmt: skip
    """Write the values of bytes ``codes`` with per-block maxima ``scale`` into ``out``
    (1-D float32, same length). ``exact`` gives each block's maximum back as exactly its
    scale (what makes encoding the result idempotent, for checkpoints); without it the
    scale is folded into one multiply, a few ulps apart, for the step. ``scratch`` (fp32,
    at least ``len(codes)``) avoids an allocation."""
    n = codes.numel()
    full = n - n % block
    if full:
        _decode_blocks(codes[:full].view(-1, block), scale[: full // block], code, out[:full].view(-1, block), exact,
                       scratch)  # fmt: skip
    if full < n:
        _decode_blocks(codes[full:].view(1, -1), scale[full // block :], code, out[full:].view(1, -1), exact, None)


def _encode_blocks(x: torch.Tensor, code: Code, out: torch.Tensor, scale: torch.Tensor, scratch: torch.Tensor | None) -> None:
    t = scratch[: x.numel()].view_as(x) if scratch is not None else torch.empty_like(x)
    # |x| into t for signed state; non-negative state (a second moment) is its own |x|.
    magnitude = torch.abs(x, out=t) if code.signed else x
    torch.amax(magnitude, dim=1, out=scale)
    if code.name == "dynamic":
        inv = scale.reciprocal().masked_fill_(scale == 0, 0.0)  # an all-zero block stays zero
        torch.mul(magnitude, inv[:, None], out=t)
        if code.signed:
            t.copysign_(x)
        lut = _dynamic_lut(code.signed, t.device)
        index = t.view(torch.int32).bitwise_right_shift(_LUT_SHIFT).bitwise_and_((1 << _LUT_BITS) - 1)
        torch.index_select(lut, 0, index.view(-1), out=out.view(-1))
        return
    # q = round(Q * (|x| / a) ** (1/k)) = round((|x| * Q**k / a) ** (1/k)): one multiply by a
    # per-block factor, then the roots; the block's largest element maps to Q exactly.
    k = code.exponent
    factor = (float(code.levels) ** k / scale).masked_fill_(scale == 0, 0.0)
    torch.mul(magnitude, factor[:, None], out=t)
    for _ in range(k.bit_length() - 1):
        t.sqrt_()
    t.round_()
    if code.signed:
        t.mul_(torch.sign(x))
    out.copy_(t)


def _decode_blocks(codes: torch.Tensor, scale: torch.Tensor, code: Code, out: torch.Tensor, exact: bool,
                   scratch: torch.Tensor | None) -> None:  # fmt: skip
    if code.name == "dynamic":
        table = _dynamic_table(code.signed, out.device)
        torch.index_select(table, 0, codes.reshape(-1).to(torch.int32), out=out.view(-1))
        out.mul_(scale[:, None])
        return
    k = code.exponent
    if exact:  # q / Q is exactly 1.0 for the block's maximum, so it decodes to a exactly
        out.copy_(codes).div_(code.levels)
        if k == 2:
            out.mul_(out.abs())
        elif k == 4:
            out.square_().square_()
        out.mul_(scale[:, None])
        return
    # The step's decode: the scale folded into one multiply, a few ulps apart. The bytes are
    # widened by a plain copy first: a multiply that mixes int8 and fp32 operands costs
    # about three times as much on a CPU.
    out.copy_(codes)
    if k == 2:  # (c * |c|) * (a / Q**2); c * |c| is an exact integer in fp32
        t = scratch[: out.numel()].view_as(out) if scratch is not None else torch.empty_like(out)
        out.mul_(torch.abs(out, out=t) if code.signed else out)
        out.mul_((scale / float(code.levels) ** 2)[:, None])
    elif k == 4:  # (c * (a / Q**4) ** (1/4)) ** 4
        out.mul_((scale.sqrt().sqrt() / float(code.levels))[:, None])
        out.square_().square_()
    else:
        out.mul_((scale / float(code.levels))[:, None])


# -- the dynamic tree code ------------------------------------------------------------------

_LUT_BITS = 20  # sign, 8 exponent bits and the top 11 mantissa bits of an fp32 value
_LUT_SHIFT = 32 - _LUT_BITS


def dynamic_values(signed: bool) -> torch.Tensor:
    """The 256 values of the dynamic tree code, indexed by byte (see [Note: block-wise
    state codes]); ``±1`` and ``0`` are among them."""
    bits = 7 if signed else 8  # bits after the sign
    magnitudes = []
    for e in range(bits):  # e leading zeros, an indicator bit, bits - 1 - e fraction bits
        n = 2 ** (bits - 1 - e)
        edges = torch.linspace(0.1, 1.0, n + 1, dtype=torch.float64)
        magnitudes.append(10.0 ** (-e) * (edges[:-1] + edges[1:]) / 2)
    mags = torch.cat(magnitudes).sort().values
    mags[-1] = 1.0  # the block maximum must be exact
    if signed:  # 127 magnitudes each side, zero, and one smaller magnitude to fill the byte
        values = torch.cat([-mags.flip(0), torch.zeros(1, dtype=torch.float64), mags[:1] / 2, mags])
    else:
        values = torch.cat([torch.zeros(1, dtype=torch.float64), mags])
    assert values.numel() == 256 and bool((values[1:] > values[:-1]).all())
    return values.to(torch.float32)


@functools.lru_cache(maxsize=8)
def _dynamic_table(signed: bool, device: torch.device) -> torch.Tensor:
    return dynamic_values(signed).to(device)


@functools.lru_cache(maxsize=8)
def _dynamic_lut(signed: bool, device: torch.device) -> torch.Tensor:
    """Byte of the nearest code value for every fp32 pattern's top :data:`_LUT_BITS`
    bits, judged at the middle of the range of values sharing those bits."""
    values = dynamic_values(signed).to(torch.float64)
    top = torch.arange(1 << _LUT_BITS, dtype=torch.int64)
    pattern = (top << _LUT_SHIFT) | (1 << (_LUT_SHIFT - 1))
    middle = torch.tensor(pattern.to(torch.int32).numpy().view("float32")).to(torch.float64)
    middle = torch.nan_to_num(middle, nan=0.0, posinf=1.0, neginf=-1.0).clamp(-1.0, 1.0)
    if not signed:
        middle = middle.clamp_min(0.0)
    above = torch.searchsorted(values, middle).clamp(1, 255)
    below = above - 1
    nearer_below = (middle - values[below]) <= (values[above] - middle)
    lut = torch.where(nearer_below, below, above).to(torch.uint8)
    # Exact zeros (either sign) map to the zero code.
    zero = int(torch.nonzero(values == 0)[0])
    lut[0] = zero
    lut[1 << (_LUT_BITS - 1)] = zero
    return lut.to(device)
