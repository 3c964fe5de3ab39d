"""Quantized collectives: ZeRO++'s int8 parameter all-gather (qwZ) and int4 hierarchical
gradient reduce-scatter (qgZ), as plain functions over explicit groups.

[Note: the hierarchical quantized reduce-scatter]
A reduce-scatter over W = N nodes x L ranks sends most of its bytes across nodes. qgZ
(Wang et al., ZeRO++, 2023) reduces inside the node first and sends only int4 codes
across:

1. inside the node, a plain reduce-scatter of the chunks arranged by local peer: local peer
   l' ends with the node's sum of the N chunks destined for ranks (m, l'), one per node m;
2. each rank quantizes those N partial sums and exchanges them with its counterparts on
   the other nodes (an all-to-all over the ``inter`` group of N ranks);
3. it decodes and sums the N pieces: its own chunk, summed over all W ranks.

Cross-node traffic per rank is (N-1)/N of the chunk-sized partial sums as int4 codes
(plus scales), against a plain reduce-scatter's share of the full-precision buffer. ZeRO++
also codes step 1 (int4 inside the node, then decodes, sums and re-codes): that saves
in-node bytes on links that are fast anyway, rounds every gradient twice, and costs three
times the coding work, which on a CPU was most of the step (a 100M GPT on 2 x 2 ranks:
8.5 s a step with the in-node codes against 9.5 s for plain ZeRO-3 at 1 Gbit/s). Here each
gradient is rounded once. The result is the sum over ranks, exactly as
:func:`reduce_scatter_flat` gives it (the caller averages as it always does); DeepSpeed's
kernel path divides only by N and so returns L x the mean, which is one explanation
offered for the loss blow-ups users report with qgZ on two nodes. With one rank per node
step 1 is a copy; with one node there is nothing to save and the caller uses the plain
reduce-scatter. No error feedback: each reduction's quantization error is independent,
as in ZeRO++.

Each message carries its codes and scales together ([Note: block-quantized messages]), so
step 2 is one collective. The work returned runs step 1 in the background; ``wait()``
finishes it, then runs steps 2-3. Every rank completes these works in the order it
launched them, as it does plain reduce-scatters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from terascale.comm import ops
from terascale.comm.collectives import PendingWork, all_gather_flat, finish, reduce_scatter_flat
from terascale.comm.hierarchy import NodeGroups
from terascale.comm.quant import BlockQuant, dequantize, dequantize_add, quantize


def all_gather_quantized(
    output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, spec: BlockQuant, async_op: bool = False
) -> PendingWork | None:
    """Fill ``output`` (``world * shard.numel()`` elements) with every rank's ``shard`` in
    rank order, each sent as ``spec``'s block codes and decoded on arrival.

    This rank's own slice is replaced by its decoded codes too, so every rank of ``group``
    ends with the same ``output``. ``shard`` may be that slice (in place).
    """
    world, rank, n = dist.get_world_size(group), dist.get_rank(group), shard.numel()
    assert output.numel() == n * world
    m = spec.nbytes(n)
    messages = torch.empty(world * m, dtype=torch.uint8, device=shard.device)
    own = messages[rank * m : (rank + 1) * m]
    quantize(shard, spec, out=own)
    work = all_gather_flat(messages, own, group, async_op=True) if world > 1 else None

    @torch.no_grad()
    def decode() -> None:
        flat = output.view(-1)
        for r in range(world):
            dequantize(messages[r * m : (r + 1) * m], spec, flat[r * n : (r + 1) * n])

    return finish(PendingWork([] if work is None else [work], decode), async_op)


def reduce_scatter_quantized(
    output: torch.Tensor, full: torch.Tensor, nodes: NodeGroups, spec: BlockQuant, async_op: bool = False
) -> PendingWork | None:
    """Sum ``full`` over the ranks of the group ``nodes`` splits; this rank keeps its chunk
    of the sum in ``output`` (chunk r = elements ``[r*n, (r+1)*n)``, r the group rank, as
    :func:`terascale.comm.collectives.reduce_scatter_flat`), summing inside the node in full
    precision and exchanging ``spec``'s codes across nodes ([Note: the hierarchical quantized
    reduce-scatter]). ``output`` may be this rank's chunk of ``full``; ``full`` may be overwritten."""
    n, big_n, big_l = output.numel(), nodes.num_nodes, nodes.local_size
    assert full.numel() == n * big_n * big_l
    chunks = full.view(-1)
    device = full.device

    def chunk(node: int, local: int) -> torch.Tensor:
        r = nodes.ranks[node][local]
        return chunks[r * n : (r + 1) * n]

    # Step 1: local peer l' gets, summed over the node, the chunks of ranks (m, l') for
    # every node m: a plain reduce-scatter in the node over the chunks in [l'][m] order.
    partial = torch.empty(big_n * n, dtype=full.dtype, device=device)
    work = None
    if big_l > 1:
        ordered = torch.empty(big_l * big_n * n, dtype=full.dtype, device=device)
        for peer in range(big_l):
            for node in range(big_n):
                k = peer * big_n + node
                ordered[k * n : (k + 1) * n].copy_(chunk(node, peer))
        work = reduce_scatter_flat(partial, ordered, nodes.intra, async_op=True)
    else:
        for node in range(big_n):
            partial[node * n : (node + 1) * n].copy_(chunk(node, nodes.local))

    @torch.no_grad()
    def across_nodes() -> None:
        # Steps 2-3: exchange the partial sums across nodes as codes, add up this rank's chunk.
        m = spec.nbytes(n)
        send = torch.empty(big_n * m, dtype=torch.uint8, device=device)
        for j, node in enumerate(nodes.inter_nodes):
            quantize(partial[node * n : (node + 1) * n], spec, out=send[j * m : (j + 1) * m])
        received = torch.empty_like(send)
        ops.all_to_all_single(received, send, group=nodes.inter)
        total = torch.zeros(n, dtype=torch.float32, device=device)
        for j in range(big_n):
            dequantize_add(received[j * m : (j + 1) * m], spec, total)
        output.view(-1).copy_(total)

    return finish(PendingWork([] if work is None else [work], across_nodes), async_op)


def quantized_nbytes_sent(spec: BlockQuant, chunk_numel: int, nodes: NodeGroups, itemsize: int) -> tuple[int, int]:
    """Bytes one rank sends in one :func:`reduce_scatter_quantized` of ``chunk_numel``-element
    chunks of ``itemsize``-byte elements: (inside its node, across nodes)."""
    intra = (nodes.local_size - 1) * nodes.num_nodes * chunk_numel * itemsize
    return intra, (nodes.num_nodes - 1) * spec.nbytes(chunk_numel)
