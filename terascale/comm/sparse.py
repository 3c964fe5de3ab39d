"""Sparse gradients: reduce row-sparse gradients as (row indices, row values) over a group.

[Note: sparse gradients]
With ``sparse_gradients: true`` the weight of an ``nn.Embedding(sparse=True)`` or
``nn.EmbeddingBag(sparse=True)`` receives a sparse COO gradient whose rows are the rows
looked up in this backward. Instead of an all-reduce of the dense ``rows x dim`` gradient,
every rank coalesces its rows (summing repeated lookups) and all-gathers them: first one
``(row count, used)`` pair per rank, then the row indices and the row values, each padded
to the largest count so that every rank sends the same number of elements (the flat
all-gather of :mod:`terascale.comm.collectives`, so gloo and NCCL alike). Each rank then
holds every rank's rows, in rank order, and sums them itself: at stage 0 into the dense
gradient the optimizer steps; at stages 1-3 only the rows (and parts of rows) inside its
own shard of the group's flat buffer, so no rank builds the parameter's dense gradient.
The bytes sent grow with the rows touched, not with the size of the table.

Which parameters take this path is fixed before training from the module tree
(:func:`sparse_gradient_params`), identically on every rank, so every rank issues the
same collectives even when one of them looked up no row at all (it sends a count of 0).

:class:`CommStats` counts the bytes this rank sends in gradient reduction, dense and
sparse, for benchmarks; it is an object the reducer owns, not global state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from terascale.comm.collectives import all_gather_flat

# Sparse gradients come from these modules when built with ``sparse=True``.
SPARSE_MODULES: tuple[type[nn.Module], ...] = (nn.Embedding, nn.EmbeddingBag)


@dataclass
class CommStats:
    """Bytes this rank sent in gradient reductions since construction (or :meth:`reset`).

    Counts follow the algorithm each collective stands for, whatever the backend runs: a
    ring all-reduce of ``n`` bytes sends ``2 (w-1)/w n``, a reduce-scatter ``(w-1)/w n``,
    an all-gather of a ``k``-byte contribution ``(w-1) k`` (w ranks).
    """

    dense_bytes: int = 0
    sparse_bytes: int = 0
    collectives: int = 0

    @property
    def bytes_sent(self) -> int:
        return self.dense_bytes + self.sparse_bytes

    def all_reduce(self, t: torch.Tensor, world: int) -> None:
        self.dense_bytes += 2 * (world - 1) * t.numel() * t.element_size() // world
        self.collectives += 1

    def reduce_scatter(self, t: torch.Tensor, world: int) -> None:
        """``t`` is the full input (``world`` chunks)."""
        self.dense_bytes += (world - 1) * t.numel() * t.element_size() // world
        self.collectives += 1

    def sent(self, nbytes: int) -> None:
        """A dense reduction whose algorithm sends ``nbytes`` from this rank (counted by the caller)."""
        self.dense_bytes += nbytes
        self.collectives += 1

    def all_gather(self, own: torch.Tensor, world: int) -> None:
        """``own`` is this rank's contribution (sparse traffic)."""
        self.sparse_bytes += (world - 1) * own.numel() * own.element_size()
        self.collectives += 1

    def reset(self) -> None:
        self.dense_bytes = self.sparse_bytes = self.collectives = 0


def sparse_gradient_params(module: nn.Module) -> frozenset[str]:
    """Names (every alias) of the trainable weights of ``module``'s sparse embeddings.

    A weight also registered on another module (tied, e.g. to an output head) is left
    out: its accumulated gradient is dense anyway, so the dense path is the right one.
    """
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    out: set[str] = set()
    for prefix, m in module.named_modules():
        if isinstance(m, SPARSE_MODULES) and m.sparse and m.weight.requires_grad:
            aliases = names.get(id(m.weight), [])
            if len(aliases) == 1 and aliases[0] == (f"{prefix}.weight" if prefix else "weight"):
                out.add(aliases[0])
    return frozenset(out)


def as_row_sparse(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``grad`` as a coalesced sparse COO tensor of ``dtype`` with one sparse dimension
    (rows of dim 0). A dense gradient (a sparse embedding's weight also used densely)
    keeps only its non-zero rows: the same sum, without the zero rows' traffic."""
    if not grad.is_sparse:
        grad = grad.to_sparse(1)
    elif grad.sparse_dim() != 1:
        grad = grad.to_dense().to_sparse(1)  # rare (not what embeddings produce); keeps it simple
    return grad.to(dtype).coalesce()


def accumulate_sparse(acc: torch.Tensor | None, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``acc + grad`` as a coalesced row-sparse tensor of ``dtype`` (``acc`` may be None).

    Coalescing at each micro-step bounds the accumulator by the distinct rows touched."""
    grad = as_row_sparse(grad, dtype)
    return grad if acc is None else (acc + grad).coalesce()


class SparseGather:
    """An all-gather of row-sparse gradients in flight; :meth:`wait` gives its result."""

    def __init__(
        self, works: list, counts: list[int], max_count: int, indices: torch.Tensor, values: torch.Tensor,
        row_shape: torch.Size, used: bool,
    ) -> None:  # fmt: skip
        self._works = works
        self._counts, self._max = counts, max_count
        self._indices, self._values = indices, values
        self._row_shape = row_shape
        self.used = used  # some rank produced a gradient (even one with no rows)

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's ``(indices [n], values [n, *row_shape])``, rank after rank, unpadded
        and not coalesced across ranks (a row two ranks touched appears twice)."""
        for work in self._works:
            if work is not None:
                work.wait()
        self._works = []
        m = self._max
        values = self._values.reshape(-1, *self._row_shape)
        keep = [(r * m, r * m + c) for r, c in enumerate(self._counts) if c > 0]
        if len(keep) == 1:
            lo, hi = keep[0]
            return self._indices[lo:hi], values[lo:hi]
        if not keep:
            return self._indices[:0], values[:0]
        return torch.cat([self._indices[lo:hi] for lo, hi in keep]), torch.cat([values[lo:hi] for lo, hi in keep])


def all_gather_sparse(
    grad: torch.Tensor | None,
    row_shape: torch.Size,
    group: ProcessGroup,
    *,
    dtype: torch.dtype,
    device: torch.device,
    stats: CommStats | None = None,
) -> SparseGather:
    """Start gathering every rank's rows of a row-sparse gradient; ``.wait()`` returns them.

    ``grad`` is this rank's coalesced row-sparse gradient (see :func:`as_row_sparse`), or
    None where this rank produced none; ``row_shape`` is the shape of one row (the
    parameter's shape without dim 0), the same on every rank. Values are sent in ``dtype``
    on ``device``. Collective over ``group``: every rank calls it, in the same order as
    its other collectives. The row counts are exchanged at once (the sizes must be known
    to post the rest); indices and values run asynchronously.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    row_numel = 1
    for d in row_shape:
        row_numel *= d
    if grad is None:
        indices = torch.zeros(0, dtype=torch.int64, device=device)
        values = torch.zeros(0, row_numel, dtype=dtype, device=device)
    else:
        indices = grad.indices()[0].to(device)
        values = grad.values().to(device=device, dtype=dtype).reshape(-1, row_numel)
    if world == 1:
        return SparseGather([], [indices.numel()], indices.numel(), indices, values, row_shape, grad is not None)
    counts = torch.zeros(2 * world, dtype=torch.int64, device=device)
    own = counts[2 * rank : 2 * rank + 2]
    own[0], own[1] = indices.numel(), int(grad is not None)
    all_gather_flat(counts, own, group)
    if stats is not None:
        stats.all_gather(own, world)
    pairs = counts.view(world, 2).tolist()
    per_rank = [c for c, _ in pairs]
    m = max(per_rank)
    used = any(u for _, u in pairs)
    n = indices.numel()
    # Each rank's rows go into its own slot of the padded outputs, gathered in place.
    all_indices = torch.zeros(world * m, dtype=torch.int64, device=device)
    all_values = torch.zeros(world * m * row_numel, dtype=dtype, device=device)
    works = []
    if m > 0:
        all_indices[rank * m : rank * m + n] = indices
        all_values[rank * m * row_numel : (rank * m + n) * row_numel] = values.reshape(-1)
        own_indices = all_indices[rank * m : (rank + 1) * m]
        own_values = all_values[rank * m * row_numel : (rank + 1) * m * row_numel]
        works.append(all_gather_flat(all_indices, own_indices, group, async_op=True))
        works.append(all_gather_flat(all_values, own_values, group, async_op=True))
        if stats is not None:
            stats.all_gather(own_indices, world)
            stats.all_gather(own_values, world)
    return SparseGather(works, per_rank, m, all_indices, all_values, row_shape, used)


def coalesce_rows(indices: torch.Tensor, values: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the values of repeated rows: unique sorted ``indices`` and their summed values."""
    if indices.numel() == 0:
        return indices, values
    size = (num_rows, *values.shape[1:])
    t = torch.sparse_coo_tensor(indices.unsqueeze(0), values, size, check_invariants=False).coalesce()
    return t.indices()[0], t.values()


@torch.no_grad()
def add_rows_to_range(out: torch.Tensor, start: int, indices: torch.Tensor, values: torch.Tensor) -> None:
    """Add rows into a window of a row-major tensor, ignoring the rows outside it.

    ``out`` (1-D) holds elements ``[start, start + out.numel())`` of the flattened
    tensor; row ``indices[k]`` (``values[k].numel()`` elements each) is added to the part
    of it inside the window. ``out`` may begin or end inside a row (a shard boundary).
    """
    if indices.numel() == 0 or out.numel() == 0:
        return
    r = values[0].numel()
    values = values.reshape(-1, r).to(out.dtype)
    end = start + out.numel()
    first_full, last_full = -(-start // r), end // r  # rows [first_full, last_full) lie wholly inside
    if last_full > first_full:
        inside = (indices >= first_full) & (indices < last_full)
        rows = out[first_full * r - start : last_full * r - start].view(-1, r)
        rows.index_add_(0, indices[inside] - first_full, values[inside])
    # The (at most two) rows cut by the window's edges, element ranges clipped to it.
    for row in sorted({start // r, (end - 1) // r}):
        if first_full <= row < last_full:
            continue
        hits = (indices == row).nonzero().flatten()
        if hits.numel() == 0:
            continue
        part = values[hits].sum(0)
        lo, hi = max(start, row * r), min(end, (row + 1) * r)
        out[lo - start : hi - start].add_(part[lo - row * r : hi - row * r])
