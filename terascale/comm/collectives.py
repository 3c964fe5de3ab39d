"""Collectives as plain functions over an explicit process group."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed import ProcessGroup

from terascale.comm import ops

# Broadcast in chunks so start-up never needs a second copy of the whole model.
_BROADCAST_BUCKET_BYTES = 64 * 1024 * 1024


def broadcast_tensors(tensors: Sequence[torch.Tensor], group: ProcessGroup, src_group_rank: int = 0) -> None:
    """Overwrite ``tensors`` on every rank of ``group`` with ``src_group_rank``'s values.

    Tensors are coalesced by dtype into flat buckets of at most 64 MiB, so a model of many
    small parameters costs a few collectives rather than one per tensor.
    """
    if dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, src_group_rank)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same_dtype in by_dtype.values():
        for bucket in _chunks(same_dtype, _BROADCAST_BUCKET_BYTES):
            flat = _flatten_dense_tensors([t.detach() for t in bucket])
            ops.broadcast(flat, src=src, group=group)
            with torch.no_grad():
                for dst, val in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                    dst.copy_(val)


def _chunks(tensors: list[torch.Tensor], max_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of ``tensors`` of at most ``max_bytes`` (a larger tensor is alone)."""
    bucket: list[torch.Tensor] = []
    nbytes = 0
    for t in tensors:
        size = t.numel() * t.element_size()
        if bucket and nbytes + size > max_bytes:
            yield bucket
            bucket, nbytes = [], 0
        bucket.append(t)
        nbytes += size
    if bucket:
        yield bucket


def all_reduce_flag(flag: bool | torch.Tensor, group: ProcessGroup, device: torch.device) -> bool:
    """True on every rank of ``group`` if ``flag`` is true on any rank (logical OR)."""
    t = flag.to(device=device, dtype=torch.float32).reshape(1) if isinstance(flag, torch.Tensor) else torch.tensor(
        [1.0 if flag else 0.0], device=device
    )
    if dist.get_world_size(group) > 1:
        ops.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)


# [Note: flat collectives on gloo]
# gloo's reduce-scatter and all-gather are slower than its all-reduce of the same full
# tensor, though they should move half its bytes (2 ranks on one machine, 50M fp32
# elements: all-reduce 102 ms, reduce-scatter 361 ms, all-gather 293 ms). On gloo both
# therefore run as direct point-to-point exchanges, every pair at once: an all-gather
# sends this rank's shard to each peer and receives theirs into place (55 ms); a
# reduce-scatter sends each peer its slice of the full tensor, receives this rank's slice
# from each peer and sums them on wait() (83 ms). At 4 ranks: all-gather 101 ms and
# reduce-scatter 160 ms against all-reduce 270 ms. Each rank moves (world-1)/world of the
# tensor, as a ring does. Messages between one pair on one group match in posting order,
# so every rank must issue these collectives in the same order, as with any collective.
# NCCL runs its own collectives. A comms logger sees each exchange as the one collective it
# stands for (``ops.composed``), completed when its ``wait()`` returns: gloo's
# point-to-point works have no future to tell it sooner.


def _use_point_to_point(group: ProcessGroup) -> bool:
    return dist.get_backend(group) == "gloo"


class PendingWork:
    """Works of one collective in flight (the sends and receives of a point-to-point
    exchange, or the collectives a composed one is made of); ``wait()`` finishes them, then
    ``then()`` (local work that completes the collective), then tells a recorder the
    collective is done (``done``)."""

    def __init__(
        self, works: list[dist.Work], then: Callable[[], None] | None = None, done: Callable[[], None] | None = None
    ) -> None:
        self._works, self._then, self._done = works, then, done

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        self._works = []
        if self._then is not None:
            then, self._then = self._then, None
            then()
        if self._done is not None:
            done, self._done = self._done, None
            done()
        return True


def _exchange(
    group: ProcessGroup, send: Callable[[int], torch.Tensor], recv: Callable[[int], torch.Tensor]
) -> list[dist.Work]:
    """Post ``send(peer)`` to and ``recv(peer)`` from every other rank of ``group``, all at once.

    Rank r sends to r+i while receiving from r-i, so at each distance every rank has one
    partner on each side and no link carries two messages at the same time.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    works = []
    for i in range(1, world):
        dst, src = (rank + i) % world, (rank - i) % world
        works.append(ops.isend(send(dst), dist.get_global_rank(group, dst), group=group))
        works.append(ops.irecv(recv(src), dist.get_global_rank(group, src), group=group))
    return works


def finish(work: PendingWork, async_op: bool) -> PendingWork | None:
    """``work`` for an asynchronous caller; otherwise wait for it here and return None."""
    if async_op:
        return work
    work.wait()
    return None


class _AllToAllRows(torch.autograd.Function):
    """Uneven all-to-all of rows; backward sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        ops.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        ops.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup) -> torch.Tensor:
    """Send ``in_splits[p]`` consecutive rows of ``x`` to rank ``p`` of ``group`` and
    receive ``out_splits[p]`` rows from each, concatenated in rank order; differentiable
    (the gradient of the result goes back to the rows' owners). Collective over ``group``."""
    return _AllToAllRows.apply(x, list(out_splits), list(in_splits), group)


def all_gather_flat(
    output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, async_op: bool = False
) -> dist.Work | PendingWork | None:
    """Fill ``output`` (``world * shard.numel()`` elements) with every rank's ``shard``, in rank order.

    ``shard`` may be this rank's own slice of ``output`` (in place).
    """
    world = dist.get_world_size(group)
    assert output.numel() == shard.numel() * world
    if not _use_point_to_point(group):
        return ops.all_gather_into_tensor(output, shard, group=group, async_op=async_op)
    n, rank = shard.numel(), dist.get_rank(group)
    own = output[rank * n : (rank + 1) * n]
    if own.data_ptr() != shard.data_ptr():
        with torch.no_grad():
            own.copy_(shard)
    with ops.composed("all_gather_into_tensor", shard, group) as done:
        works = _exchange(group, send=lambda _: own, recv=lambda src: output[src * n : (src + 1) * n])
    return finish(PendingWork(works, done=done), async_op)


def reduce_scatter_flat(
    output: torch.Tensor, full: torch.Tensor, group: ProcessGroup, async_op: bool = False
) -> dist.Work | PendingWork | None:
    """Sum ``full`` over the ranks of ``group``; this rank keeps its slice of the sum in ``output``.

    Rank r receives elements ``[r * n, (r + 1) * n)`` with ``n = output.numel()``. ``output``
    may be that slice of ``full`` (in place); ``full`` may be overwritten.
    """
    world = dist.get_world_size(group)
    assert full.numel() == output.numel() * world
    if not _use_point_to_point(group):
        return ops.reduce_scatter_tensor(output, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    n, rank = output.numel(), dist.get_rank(group)
    own = full[rank * n : (rank + 1) * n]
    received = torch.empty((world - 1) * n, dtype=full.dtype, device=full.device)
    with ops.composed("reduce_scatter_tensor", full, group) as done:
        works = _exchange(
            group,
            send=lambda dst: full[dst * n : (dst + 1) * n],
            recv=lambda src: received[((src - rank) % world - 1) * n : ((src - rank) % world) * n],
        )

    @torch.no_grad()
    def accumulate() -> None:
        for piece in received.view(world - 1, n):
            own.add_(piece)
        if own.data_ptr() != output.data_ptr():
            output.copy_(own)

    return finish(PendingWork(works, accumulate, done), async_op)


def global_grad_norm(
    grads: Sequence[torch.Tensor], group: ProcessGroup | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """The L2 norm of all ``grads`` taken together, as a float32 0-d tensor.

    ``group=None`` means every rank holds the same full gradients (no communication);
    otherwise each rank holds a disjoint piece and the squared norms are summed over
    ``group``. Non-finite gradients give a non-finite norm, which is how overflow shows.
    """
    return global_grad_sq_norm(grads, group, device).sqrt()


def global_grad_sq_norm(
    grads: Sequence[torch.Tensor],
    group: ProcessGroup | None = None,
    device: torch.device | None = None,
    extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """The squared L2 norm of all ``grads`` taken together (see :func:`global_grad_norm`);
    ``extra`` (0-d) is added to this rank's part before the sum over ``group``."""
    if grads:
        fp32 = [g for g in grads if g.dtype == torch.float32]
        norms = [*_chunk_norms(fp32), *(l2_norm(g) for g in grads if g.dtype != torch.float32)]
        total_sq = torch.stack([n.float() for n in norms]).square().sum()
    else:
        total_sq = torch.zeros((), dtype=torch.float32, device=device)
    if extra is not None:
        total_sq = total_sq + extra
    if group is not None and dist.get_world_size(group) > 1:
        ops.all_reduce(total_sq, group=group)
    return total_sq


# [Note: chunked norms]
# On CPU one reduction over a tensor of tens of millions of elements loses accuracy: the
# fp32 norm of 50M bf16 N(0,1) values comes out 7043.8 where float64 says 7072.0 (0.4%
# low, enough to change what clipping does). Norms of 256Ki-element chunks, combined,
# are within 1e-5. For bf16/fp16 the chunks are widened into an fp32 scratch first: a
# low-precision norm with dtype=float32 runs 20x slower on CPU than widen-then-norm.
_NORM_CHUNK = 1 << 18


def _chunk_norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 L2 norms of the ``_NORM_CHUNK``-element chunks of fp32 ``tensors`` (one foreach call)."""
    chunks = [c for t in tensors for c in t.reshape(-1).split(_NORM_CHUNK)]
    return list(torch._foreach_norm(chunks, 2.0)) if chunks else []


def l2_norm(t: torch.Tensor) -> torch.Tensor:
    """The L2 norm of ``t`` as a float32 0-d tensor on ``t``'s device, accumulated in
    fp32 (chunk by chunk on CPU, see [Note: chunked norms])."""
    flat = t.reshape(-1)
    if flat.device.type != "cpu":
        return torch.linalg.vector_norm(flat, dtype=torch.float32)
    if flat.dtype == torch.float32:
        parts = _chunk_norms([flat])
    else:
        scratch = torch.empty(min(flat.numel(), _NORM_CHUNK), dtype=torch.float32)
        parts = []
        for c in flat.split(_NORM_CHUNK):
            wide = scratch[: c.numel()]
            wide.copy_(c)
            parts.append(torch.linalg.vector_norm(wide))
    # ``split`` gives an empty tensor one (empty) chunk, so there is always a part.
    return parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts))
