"""Quantized collectives: ZeRO++'s int8 parameter all-gather (qwZ) and int4 hierarchical
gradient reduce-scatter (qgZ), as plain functions over explicit groups.

[Note: the hierarchical quantized reduce-scatter]
A reduce-scatter over W = N nodes x L ranks sends most of its bytes across nodes. qgZ
(Wang et al., ZeRO++, 2023) reduces inside the node first and sends only int4 codes:

1. each rank quantizes, for every local peer l', the N chunks destined for ranks
   (m, l') of every node m, and exchanges them in the node (an all-to-all of L messages);
2. it decodes what it received and sums over the L local ranks in fp32: N partial sums,
   one per node, for the ranks with its own local index;
3. it quantizes those N partial sums and exchanges them with its counterparts on the other
   nodes (an all-to-all over the ``inter`` group of N ranks);
4. it decodes and sums the N pieces: its own chunk, summed over all W ranks.

Cross-node traffic per rank is (N-1)/N of one chunk-per-local-rank's worth of int4 codes
(plus scales), against a plain reduce-scatter's share of the full-precision buffer. The
result is the sum over ranks, exactly as :func:`reduce_scatter_flat` gives it (the caller
averages as it always does); DeepSpeed's kernel path divides only by N and so returns
L x the mean, which is one explanation offered for the loss blow-ups users report with
qgZ on two nodes. With one rank per node step 1 is skipped (nothing to reduce in the
node, no quantization round); with one node there is nothing to save and the caller uses
the plain reduce-scatter. No error feedback: each reduction's quantization error is
independent, as in ZeRO++.

Each message carries its codes and scales together ([Note: block-quantized messages]), so
each step is one collective. The work returned runs step 1 in the background; ``wait()``
finishes it, then runs steps 2-4 (step 3 needs step 2's sums). Every rank completes these
works in the order it launched them, as it does plain reduce-scatters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from terascale.comm import ops
from terascale.comm.collectives import all_gather_flat
from terascale.comm.hierarchy import NodeGroups
from terascale.comm.quant import BlockQuant, dequantize, dequantize_add, quantize


class _ThenWork:
    """A collective in flight (``work``, or None if it finished already) followed by local
    work ``then`` once it has completed."""

    def __init__(self, work: object | None, then: Callable[[], None]) -> None:
        self._work, self._then = work, then

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()
        return True

    def is_completed(self) -> bool:
        return self._then is None


def _finish(work: _ThenWork, async_op: bool) -> _ThenWork | None:
    if async_op:
        return work
    work.wait()
    return None


def all_gather_quantized(
    output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, spec: BlockQuant, async_op: bool = False
) -> _ThenWork | None:
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

    return _finish(_ThenWork(work, decode), async_op)


def reduce_scatter_quantized(
    output: torch.Tensor, full: torch.Tensor, nodes: NodeGroups, spec: BlockQuant, async_op: bool = False
) -> _ThenWork | None:
    """Sum ``full`` over the ranks of the group ``nodes`` splits; this rank keeps its chunk
    of the sum in ``output`` (chunk r = elements ``[r*n, (r+1)*n)``, r the group rank, as
    :func:`terascale.comm.collectives.reduce_scatter_flat`), exchanging ``spec``'s codes
    in and across nodes ([Note: the hierarchical quantized reduce-scatter]). ``output`` may be
    this rank's chunk of ``full``; ``full`` is left as it was."""
    n, big_n, big_l = output.numel(), nodes.num_nodes, nodes.local_size
    assert full.numel() == n * big_n * big_l
    chunks = full.view(-1)
    m = spec.nbytes(n)
    device = full.device

    def chunk(node: int, local: int) -> torch.Tensor:
        r = nodes.ranks[node][local]
        return chunks[r * n : (r + 1) * n]

    received: torch.Tensor | None = None
    work = None
    if big_l > 1:
        # Step 1: message (l', m) holds the chunk of rank (m, l'), for local peer l'.
        send = torch.empty(big_l * big_n * m, dtype=torch.uint8, device=device)
        for peer in range(big_l):
            for node in range(big_n):
                k = peer * big_n + node
                quantize(chunk(node, peer), spec, out=send[k * m : (k + 1) * m])
        received = torch.empty_like(send)
        work = ops.all_to_all_single(received, send, group=nodes.intra, async_op=True)

    @torch.no_grad()
    def reduce_rest() -> None:
        # Step 2: partial[node] = this node's sum for rank (node, own local index).
        partial = torch.zeros(big_n * n, dtype=torch.float32, device=device)
        for node in range(big_n):
            acc = partial[node * n : (node + 1) * n]
            if received is None:
                acc.copy_(chunk(node, nodes.local))
                continue
            for peer in range(big_l):
                k = peer * big_n + node
                dequantize_add(received[k * m : (k + 1) * m], spec, acc)
        # Steps 3-4: exchange the partial sums across nodes, add up this rank's chunk.
        send = torch.empty(big_n * m, dtype=torch.uint8, device=device)
        for j, node in enumerate(nodes.inter_nodes):
            quantize(partial[node * n : (node + 1) * n], spec, out=send[j * m : (j + 1) * m])
        across = torch.empty_like(send)
        ops.all_to_all_single(across, send, group=nodes.inter)
        total = torch.zeros(n, dtype=torch.float32, device=device)
        for j in range(big_n):
            dequantize_add(across[j * m : (j + 1) * m], spec, total)
        output.view(-1).copy_(total)

    return _finish(_ThenWork(work, reduce_rest), async_op)


def quantized_nbytes_sent(spec: BlockQuant, chunk_numel: int, nodes: NodeGroups) -> tuple[int, int]:
    """Bytes one rank sends in one :func:`reduce_scatter_quantized` of ``chunk_numel``-element
    chunks: (inside its node, across nodes)."""
    m = spec.nbytes(chunk_numel)
    intra = (nodes.local_size - 1) * nodes.num_nodes * m if nodes.local_size > 1 else 0
    return intra, (nodes.num_nodes - 1) * m
