"""Moving routed tokens to their experts and the results back, across an expert-parallel group.

[Note: expert-parallel dispatch]
``E`` experts are split over the ``P`` ranks of an expert-parallel group in contiguous
blocks: rank ``p`` holds experts ``[p * E / P, (p + 1) * E / P)``. A layer's forward:

1. **dispatch**: the kept routes ([Note: routing]) are sorted by expert (ties in route
   order) and their tokens gathered; the per-expert counts go to every rank (one
   all-to-all of ``E`` integers), then the tokens themselves, each rank receiving from
   every peer the tokens of its own experts (one uneven all-to-all). Received tokens come
   grouped by source rank, then expert; they are regrouped by expert, then source, so that
   each local expert sees one contiguous batch.
2. the local experts run on their batches (every expert runs, with zero tokens if none
   came: its parameters may be gathered with its data-parallel peers, which must all
   take part);
3. **combine**: the inverse regrouping, the reverse all-to-all, and a weighted sum of
   each token's routes in fp32, cast back to the tokens' dtype.

Nothing is padded to a capacity: with a capacity the router has already dropped the
routes beyond it, and only the kept ones travel. Both all-to-alls are autograd functions
whose backward is the reverse exchange, so gradients reach the tokens' ranks, the
router's weights and the experts' parameters on their owners.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from terascale.comm import ops
from terascale.comm.collectives import all_to_all_rows


@dataclass
class Dispatched:
    """What :func:`combine` needs to bring one dispatch's results back."""

    order: torch.Tensor  # [R] flat route indices (token * k + choice), sorted by expert
    k: int
    tokens: int  # S
    group: ProcessGroup | None
    send_splits: list[int]  # rows sent to each peer
    recv_splits: list[int]  # rows received from each peer
    regroup: torch.Tensor | None  # received row of each expert-major row


def dispatch(
    x: torch.Tensor,
    expert: torch.Tensor,
    num_experts: int,
    group: ProcessGroup | None = None,
    kept: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[int], Dispatched]:
    """Send the tokens ``x`` ([S, M]) of the routes ``expert`` ([S, k]: each route's
    expert) that are ``kept`` ([S, k] bool, default all) to the ranks of their experts in
    ``group`` (``None`` or one rank: all experts are local). Returns the rows for this
    rank's experts, expert by expert ([N, M]), each local expert's row count, and the
    record :func:`combine` takes. Every rank of ``group`` must call it together."""
    s, k = expert.shape
    if x.shape[0] != s:
        raise ValueError(f"{x.shape[0]} tokens but routes for {s}")
    size = 1 if group is None else dist.get_world_size(group)
    if num_experts % size:
        raise ValueError(f"{num_experts} experts do not split over an expert-parallel group of {size} ranks")
    flat = expert.reshape(-1)
    kept = torch.arange(flat.numel(), device=flat.device) if kept is None else torch.nonzero(kept.reshape(-1)).squeeze(1)
    order = kept[torch.argsort(flat[kept], stable=True)]
    rows = x.index_select(0, order // k)
    counts = torch.bincount(flat[order], minlength=num_experts)
    if size == 1:
        return rows, counts.tolist(), Dispatched(order, k, s, None, [], [], None)
    local = num_experts // size
    incoming = torch.empty_like(counts)
    ops.all_to_all_single(incoming, counts, group=group)  # [P * local]: peer p's rows for my expert i
    incoming = incoming.view(size, local)
    send = counts.view(size, local).sum(1).tolist()
    recv = incoming.sum(1).tolist()
    received = all_to_all_rows(rows, recv, send, group)
    # Rows arrive (source, expert)-major; the experts want (expert, source)-major.
    starts = torch.cumsum(incoming.reshape(-1), 0) - incoming.reshape(-1)
    sizes_t, starts_t = incoming.t().reshape(-1), starts.view(size, local).t().reshape(-1)
    offsets = torch.cumsum(sizes_t, 0) - sizes_t
    within = torch.arange(int(sizes_t.sum()), device=counts.device) - torch.repeat_interleave(offsets, sizes_t)
    regroup = torch.repeat_interleave(starts_t, sizes_t) + within
    per_expert = incoming.sum(0).tolist()
    return received.index_select(0, regroup), per_expert, Dispatched(order, k, s, group, send, recv, regroup)


def run_experts(rows: torch.Tensor, per_expert: Sequence[int], experts: Sequence[nn.Module]) -> torch.Tensor:
    """Apply ``experts[i]`` to its ``per_expert[i]`` consecutive rows of ``rows``; every
    expert runs, on zero rows if none came (see [Note: expert-parallel dispatch]). An
    expert returning a tuple contributes its first element, as DeepSpeed's do."""
    if len(per_expert) != len(experts):
        raise ValueError(f"{len(per_expert)} row counts for {len(experts)} local experts")
    outs = []
    for chunk, expert in zip(rows.split(list(per_expert)), experts):
        out = expert(chunk)
        outs.append(out[0] if isinstance(out, tuple) else out)
    return torch.cat(outs)


def combine(y: torch.Tensor, weight: torch.Tensor, record: Dispatched) -> torch.Tensor:
    """Bring the experts' results ``y`` (rows as :func:`dispatch` returned them) back to
    their tokens and sum each token's routes weighted by ``weight`` ([S, k]), in fp32:
    [S, M] in ``y``'s dtype (zero for a token with no kept route)."""
    if record.group is not None:
        back = torch.empty_like(record.regroup)
        back[record.regroup] = torch.arange(record.regroup.numel(), device=record.regroup.device)
        y = all_to_all_rows(y.index_select(0, back), record.send_splits, record.recv_splits, record.group)
    weight = weight.float().reshape(-1).index_select(0, record.order)
    contrib = y.float() * weight.unsqueeze(1)
    out = torch.zeros((record.tokens, y.shape[1]), dtype=torch.float32, device=y.device)
    return out.index_add(0, record.order // record.k, contrib).to(y.dtype)
