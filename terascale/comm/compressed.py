"""Error-compensated 1-bit all-reduce: the collective of the 1-bit optimizers.

[Note: 1-bit compressed all-reduce]
DeepSpeed's ``compressed_allreduce`` (1-bit Adam, 0/1 Adam, 1-bit Lamb) averages a tensor
over a group while sending about one bit per element, twice. For a tensor of ``n``
elements on ``w`` ranks, padded with zeros to ``N`` (:func:`padded_numel`):

1. worker: ``x = buffer + worker_error``; the scale ``ws = ||x|| / sqrt(N)`` (the RMS);
   ``worker_error = x - ws * sgn(x)``, where ``sgn`` maps ``x >= 0`` to +1 (zero too) and
   the rest to -1. The signs are packed 8 to a byte (MSB first, as ``numpy.packbits``) and
   cut into ``w`` chunks of ``N / w`` elements; chunk ``r`` goes to rank ``r``
   (all-to-all), with ``ws``.
2. server (every rank, for its chunk ``r``): ``y = sum_i ws_i / w * sgn_i[r] +
   server_error``; ``ss = ||y|| / sqrt(N / w)``; ``server_error = y - ss * sgn(y)``. The
   packed ``sgn(y)`` and ``ss`` go to every rank (all-gather).
3. every rank: ``result = concat_r ss_r * sgn_r``, un-padded. Every rank ends with the
   same result; each keeps its own ``worker_error`` (``N`` elements) and ``server_error``
   (``N / w``), which carry what the signs lost into the next call.

The padding is DeepSpeed's: a multiple of ``w * lcm(w, 8)`` (so each server chunk is a
whole number of bytes); the RMS divides by the padded length, as DeepSpeed's does, so
the same ``N`` is needed for the same numbers.

Two choices differ from DeepSpeed in the messages, not in the numbers: each scale rides
in the same byte message as its signs (4 bytes in front of them) rather than in a
collective of its own, and several tensors (each with its own scale, padding and error
buffers: the same numbers as separate calls) share one all-to-all and one all-gather
(:func:`compressed_allreduce_many`). On a slow link that is 2 messages a step instead of
4 per tensor. Each rank sends ``2 (w-1)/w * N/8`` bytes plus 8 per tensor, about 1/32
of a ring all-reduce of the fp32 tensor; :class:`CompressedStats` counts them.

The collectives are :func:`terascale.comm.ops.all_to_all_single` and
:func:`terascale.comm.collectives.all_gather_flat`, which a comms logger records with
their true byte payloads (the uint8 messages), so ``comms_logger`` shows the bytes a
1-bit step really moves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from terascale.comm import ops
from terascale.comm.collectives import all_gather_flat

_SCALE_BYTES = 4  # one float32 scale in front of each tensor's signs
# [Note: packing signs with one multiply]: 8 flag bytes (0/1) read as one little-endian
# int64 w = sum b_i 2^(8i); w * 0x8040201008040201 puts b_i at bit 63 - i (the term
# 2^(8i + 63 - 9i)) and every other product below bit 56 or above bit 63 (no two at one
# place, so no carries), so bits 56-63 of the product are the packed byte, MSB first.
_PACK_MAGIC = 0x8040201008040201 - (1 << 64)  # the same 64 bits as a signed int64
# Each byte value's 8 signs, +1.0 for a 1 bit: unpacking is one table lookup per byte.
_SIGN_TABLE = ((torch.arange(256).reshape(-1, 1) >> torch.arange(7, -1, -1)) & 1).float().mul_(2.0).sub_(1.0)


@dataclass
class CompressedStats:
    """Bytes this rank sent in compressed all-reduces since construction (or :meth:`reset`).

    Counted as the algorithm sends them: the all-to-all ``(w-1)`` of its ``w`` chunks, the
    all-gather this rank's message to each of the ``w-1`` others (w ranks).
    """

    bytes_sent: int = 0
    collectives: int = 0
    calls: int = 0

    def reset(self) -> None:
        self.bytes_sent = self.collectives = self.calls = 0


def padded_numel(numel: int, world: int) -> int:
    """``numel`` rounded up to a multiple of ``world * lcm(world, 8)`` (DeepSpeed's padding):
    the length of a worker error buffer; a server error buffer is that over ``world``."""
    unit = world * math.lcm(world, 8)
    return -(-numel // unit) * unit


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """The signs of ``x`` (a multiple of 8 elements) as bits, 8 to a uint8, first element
    in the most significant bit (``numpy.packbits`` order); a bit is 1 where ``x >= 0``
    ([Note: packing signs with one multiply])."""
    assert x.numel() % 8 == 0, x.numel()
    words = (x.reshape(-1) >= 0).view(torch.uint8).view(torch.int64)
    return ((words * _PACK_MAGIC) >> 56).bitwise_and_(0xFF).to(torch.uint8)


def unpack_signs(packed: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """The inverse of :func:`pack_signs`, times ``scale``: +scale for a 1 bit, -scale for
    a 0 bit (float32, ``8 * packed.numel()`` elements)."""
    table = _SIGN_TABLE.to(packed.device)
    if not (isinstance(scale, float) and scale == 1.0):
        table = table * scale
    return table.index_select(0, packed.reshape(-1).long()).reshape(-1)


def rms(x: torch.Tensor) -> torch.Tensor:
    """``||x|| / sqrt(x.numel())`` as a float32 0-d tensor."""
    return torch.linalg.vector_norm(x) / math.sqrt(x.numel())


def compressed_allreduce(
    buffer: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    group: ProcessGroup,
    stats: CompressedStats | None = None,
) -> torch.Tensor:
    """The 1-bit estimate of the average of ``buffer`` over the ranks of ``group``
    ([Note: 1-bit compressed all-reduce]): a new float32 tensor shaped like ``buffer``,
    the same on every rank. ``worker_error`` (``padded_numel(buffer.numel(), w)``
    elements) and ``server_error`` (that over ``w``) are this rank's error feedback,
    updated in place. Collective over ``group``; ``buffer`` is not changed."""
    return compressed_allreduce_many([buffer], [worker_error], [server_error], group, stats)[0]


@torch.no_grad()
def compressed_allreduce_many(
    buffers: Sequence[torch.Tensor],
    worker_errors: Sequence[torch.Tensor],
    server_errors: Sequence[torch.Tensor],
    group: ProcessGroup,
    stats: CompressedStats | None = None,
    in_place: bool = False,
) -> list[torch.Tensor]:
    """:func:`compressed_allreduce` of each of ``buffers`` with its own error buffers, in
    one all-to-all and one all-gather (the same numbers as one call per tensor).
    Collective over ``group``: every rank passes tensors of the same sizes, in the same order.
    ``in_place``: the results are written into ``buffers`` (float32, contiguous) and returned."""
    assert len(buffers) == len(worker_errors) == len(server_errors)
    world = dist.get_world_size(group)
    device = buffers[0].device if buffers else torch.device("cpu")

    # 1. worker: compensate, scale, keep the error, pack the signs by destination rank.
    to_send = []
    for buf, werr, serr in zip(buffers, worker_errors, server_errors):
        n, padded = buf.numel(), _checked_padding(werr, buf.numel(), world)
        assert serr.numel() == padded // world, (serr.numel(), padded, world)
        x = werr  # x = buffer + worker_error, built in the error buffer (its old value is read once)
        x[:n].add_(buf.reshape(-1))
        scale = rms(x)
        packed = pack_signs(x)
        _subtract_signs(x, packed, scale)  # worker_error = x - scale * sgn(x)
        to_send.append(torch.cat([scale.reshape(1).view(torch.uint8).expand(world, -1), packed.view(world, -1)], dim=1))
    sendbuf = torch.cat(to_send, dim=1).contiguous()
    recvbuf = torch.empty_like(sendbuf)
    if world > 1:
        ops.all_to_all_single(recvbuf, sendbuf, group=group)
    else:
        recvbuf.copy_(sendbuf)

    # 2. server: average this rank's chunk of every worker's signs, compress it again.
    out_parts, col = [], 0
    for buf, serr in zip(buffers, server_errors):
        chunk = serr.numel()
        worker_scales = recvbuf[:, col : col + _SCALE_BYTES].contiguous().view(torch.float32).reshape(world)
        signs_of = recvbuf[:, col + _SCALE_BYTES : col + _SCALE_BYTES + chunk // 8]
        col += _SCALE_BYTES + chunk // 8
        y = unpack_signs(signs_of[0], worker_scales[0] / world)
        for i in range(1, world):  # in rank order, as the sum over the stacked rows runs
            y.add_(unpack_signs(signs_of[i], worker_scales[i] / world))
        y.add_(serr)
        scale = rms(y)
        packed = pack_signs(y)
        out_parts.append(torch.cat([scale.reshape(1).view(torch.uint8), packed]))
        _subtract_signs(y, packed, scale)
        serr.copy_(y)
    own = torch.cat(out_parts)
    gathered = torch.empty(world * own.numel(), dtype=torch.uint8, device=device)
    if world > 1:
        all_gather_flat(gathered, own, group)
    else:
        gathered.copy_(own)

    # 3. every rank: every server's scaled signs, in rank order, un-padded.
    gathered = gathered.view(world, -1)
    results, col = [], 0
    for buf, serr in zip(buffers, server_errors):
        chunk = serr.numel()
        server_scales = gathered[:, col : col + _SCALE_BYTES].contiguous().view(torch.float32).reshape(world)
        out = buf.view(-1) if in_place else torch.empty(buf.numel(), dtype=torch.float32, device=device)
        for r in range(world):
            lo, hi = r * chunk, min((r + 1) * chunk, buf.numel())
            if lo < hi:  # the padding's signs are dropped
                packed = gathered[r, col + _SCALE_BYTES : col + _SCALE_BYTES + -(-(hi - lo) // 8)]
                out[lo:hi] = unpack_signs(packed, server_scales[r])[: hi - lo]
        col += _SCALE_BYTES + chunk // 8
        results.append(out.view(buf.shape))
    if stats is not None:
        stats.calls += 1
        if world > 1:
            stats.bytes_sent += (world - 1) * (sendbuf.shape[1] + own.numel())
            stats.collectives += 2
    return results


def _subtract_signs(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> None:
    """``x -= scale * sgn(x)`` in place, ``packed`` being ``x``'s packed signs: one table
    lookup per byte (``torch.where`` over a bool mask runs 2.5x slower on the CPU), and
    ``x - (±scale)`` is the formula's value to the bit."""
    x.sub_(unpack_signs(packed, scale))


def _checked_padding(worker_error: torch.Tensor, numel: int, world: int) -> int:
    """The padded length of a tensor of ``numel`` elements on ``world`` ranks, checked
    against its ``worker_error`` buffer (an invariant of the callers)."""
    padded = padded_numel(numel, world)
    assert worker_error.numel() == padded, (worker_error.numel(), padded, numel, world)
    return padded
