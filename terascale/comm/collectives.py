"""Collectives as plain functions over an explicit process group."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed import ProcessGroup

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
            dist.broadcast(flat, src=src, group=group)
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
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)


# torch 2.13 renamed the flat collectives (``*_single``) and deprecated the old names;
# torch 2.4, the oldest supported, has only the old ones.
_ALL_GATHER_FLAT = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_FLAT = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# [Note: flat collectives on gloo]
# gloo's reduce-scatter and all-gather are about twice as slow as its all-reduce of the
# same full tensor (2 ranks on one machine, 50M fp32 elements: all-reduce 152 ms,
# reduce-scatter 361 ms, all-gather 322 ms), so on gloo both run as an all-reduce: a
# reduce-scatter reduces the whole buffer in place and keeps its slice; an all-gather
# zeroes the buffer around this rank's shard and sums (adding zeros is exact, in every
# dtype). NCCL runs the real collectives, which move half the bytes of an all-reduce.
# DeepSpeed offers the same trade as ``stage3_use_all_reduce_for_fetch_params``.


def _emulate_with_all_reduce(group: ProcessGroup) -> bool:
    return dist.get_backend(group) == "gloo"


class _ThenCopy:
    """An in-flight all-reduce whose result still has to be copied into ``dst`` on wait()."""

    def __init__(self, work: dist.Work, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._work, self._dst, self._src = work, dst, src

    def wait(self) -> bool:
        self._work.wait()
        self._dst.copy_(self._src)
        return True


def all_gather_flat(
    output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, async_op: bool = False
) -> dist.Work | None:
    """Fill ``output`` (``world * shard.numel()`` elements) with every rank's ``shard``, in rank order.

    ``shard`` may be this rank's own slice of ``output`` (in place).
    """
    world = dist.get_world_size(group)
    assert output.numel() == shard.numel() * world
    if not _emulate_with_all_reduce(group):
        return _ALL_GATHER_FLAT(output, shard, group=group, async_op=async_op)
    n, rank = shard.numel(), dist.get_rank(group)
    own = output[rank * n : (rank + 1) * n]
    with torch.no_grad():
        if own.data_ptr() != shard.data_ptr():
            own.copy_(shard)
        output[: rank * n].zero_()
        output[(rank + 1) * n :].zero_()
    return dist.all_reduce(output, group=group, async_op=async_op)


def reduce_scatter_flat(
    output: torch.Tensor, full: torch.Tensor, group: ProcessGroup, async_op: bool = False
) -> dist.Work | None:
    """Sum ``full`` over the ranks of ``group``; this rank keeps its slice of the sum in ``output``.

    Rank r receives elements ``[r * n, (r + 1) * n)`` with ``n = output.numel()``. ``output``
    may be that slice of ``full`` (in place); ``full`` may be overwritten.
    """
    assert full.numel() == output.numel() * dist.get_world_size(group)
    if not _emulate_with_all_reduce(group):
        return _REDUCE_SCATTER_FLAT(output, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    n, rank = output.numel(), dist.get_rank(group)
    own = full[rank * n : (rank + 1) * n]
    work = dist.all_reduce(full, group=group, async_op=True)
    if own.data_ptr() == output.data_ptr():
        return work if async_op else work.wait() and None
    pending = _ThenCopy(work, output, own)
    return pending if async_op else pending.wait() and None


def global_grad_norm(
    grads: Sequence[torch.Tensor], group: ProcessGroup | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """The L2 norm of all ``grads`` taken together, as a float32 0-d tensor.

    ``group=None`` means every rank holds the same full gradients (no communication);
    otherwise each rank holds a disjoint piece and the squared norms are summed over
    ``group``. Non-finite gradients give a non-finite norm, which is how overflow shows.
    """
    if grads:
        if all(g.dtype == torch.float32 for g in grads):
            norms = torch._foreach_norm(list(grads), 2.0)
        else:  # accumulate low-precision gradients' norms in fp32
            norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
        total_sq = torch.stack([n.float() for n in norms]).square().sum()
    else:
        total_sq = torch.zeros((), dtype=torch.float32, device=device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total_sq, group=group)
    return total_sq.sqrt()
