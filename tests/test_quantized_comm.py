"""ZeRO++'s quantized collectives: block codes, the int8 all-gather, the int4 hierarchical
reduce-scatter, against one-process references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distributed import run_ranks
from terascale.comm.quant import BlockQuant, dequantize, quantize


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [1, 7, 64, 1000])
def test_round_trip_is_within_half_a_step_of_each_block(bits: int, numel: int) -> None:
    spec = BlockQuant(bits, 64)
    torch.manual_seed(numel)
    x = torch.randn(numel) * torch.logspace(-3, 3, numel)  # blocks of very different ranges
    msg = quantize(x, spec)
    assert msg.numel() == spec.nbytes(numel)
    back = dequantize(msg, spec, torch.empty(numel))
    padded = torch.zeros(spec.blocks(numel) * spec.block)
    padded[:numel] = x
    step = padded.view(-1, spec.block).abs().amax(1, keepdim=True) / spec.qmax
    bound = (step / 2).expand(-1, spec.block).reshape(-1)[:numel]
    assert torch.all((back - x).abs() <= bound * (1 + 1e-6))
    # The largest magnitude of each block comes back exactly (it is ±qmax steps).
    i = x.abs().argmax()
    assert back[i] == pytest.approx(x[i].item(), rel=1e-6)
    assert torch.equal(quantize(x, spec), msg)  # the same bytes for the same input


def test_zero_and_non_finite_blocks() -> None:
    spec = BlockQuant(8, 4)
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, float("inf"), 2.0, 3.0, 1.0, float("nan"), 0.0, 1.0])
    back = dequantize(quantize(x, spec), spec, torch.empty(12))
    assert torch.equal(back[:4], torch.zeros(4))
    assert not torch.isfinite(back[4:8]).any() and not torch.isfinite(back[8:]).any()


def test_int4_codes_put_the_even_element_in_the_high_nibble() -> None:
    spec = BlockQuant(4, 4)
    x = torch.tensor([7.0, -7.0, 1.0, 0.0])  # scale 1: codes 7, -7, 1, 0 stored as q + 8
    msg = quantize(x, spec)
    assert msg[:2].tolist() == [(15 << 4) | 1, (9 << 4) | 8]
    assert msg[2:4].tolist() == [0, 0]  # codes padded to 4 bytes
    assert msg[4:].view(torch.float32).item() == 1.0
    assert torch.equal(dequantize(msg, spec, torch.empty(4)), x)


def test_bf16_input_and_output() -> None:
    spec = BlockQuant(8, 32)
    x = torch.randn(100).to(torch.bfloat16)
    back = dequantize(quantize(x, spec), spec, torch.empty(100, dtype=torch.bfloat16))
    assert back.dtype == torch.bfloat16
    assert (back.float() - x.float()).abs().max() <= x.float().abs().max() / 127


def _simulated_reduce_scatter(fulls: list[torch.Tensor], ranks: list[list[int]], n: int, spec: BlockQuant) -> list:
    """The hierarchical quantized reduce-scatter of every rank's ``fulls``, in one process,
    written from the algorithm's statement (not the implementation's loops)."""

    def qd(t: torch.Tensor) -> torch.Tensor:
        return dequantize(quantize(t, spec), spec, torch.empty(t.numel()))

    big_n, big_l = len(ranks), len(ranks[0])
    out = {}
    for dest_node in range(big_n):
        for local in range(big_l):
            dest = ranks[dest_node][local]
            total = torch.zeros(n)
            for src_node in range(big_n):
                # the rank (src_node, local) holds its node's exact sum of the chunks for
                # ``dest``... (two ranks a node in these tests: the order of a sum of two
                # does not change it)
                partial = sum(fulls[ranks[src_node][peer]][dest * n : (dest + 1) * n] for peer in range(big_l))
                total += qd(partial)  # ...and sends it across nodes, quantized
            out[dest] = total
    return [out[r] for r in range(big_n * big_l)]


def _reduce_scatter_rank(node_of: list[int], n: int, exact: bool) -> tuple:
    import os

    import torch.distributed as dist

    from terascale.comm import init_distributed, ops
    from terascale.comm.hierarchy import node_groups
    from terascale.comm.quantized import quantized_nbytes_sent, reduce_scatter_quantized

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ["GROUP_RANK"] = str(node_of[rank])
    nodes = node_groups(dist.group.WORLD)
    spec = BlockQuant(4, 16)
    gen = torch.Generator().manual_seed(rank)
    if exact:
        # Codes that every step represents exactly (every rank the same tensor, each block
        # holding ±7 steps): the result must be exactly world x the input.
        base = torch.randint(-7, 8, (world * n,), generator=gen.manual_seed(0)).float()
        base.view(-1, 16)[:, 0] = 7.0
        full = base * torch.arange(1, world + 1).repeat_interleave(n)  # chunks differ
    else:
        full = torch.randn(world * n, generator=gen)
    fulls = [torch.empty_like(full) for _ in range(world)]
    dist.all_gather(fulls, full)
    sent: list[tuple[str, int, int]] = []

    class Recorder:
        def record(self, op, payload, group, async_op, call):
            sent.append((op, payload.numel() * payload.element_size(), dist.get_world_size(group)))
            return call()

        def start(self, op, payload, group):
            sent.append((op, payload.numel() * payload.element_size(), dist.get_world_size(group)))
            return None

    out = torch.empty(n)
    keep = full.clone()
    with ops.recording(Recorder()):
        work = reduce_scatter_quantized(out, full, nodes, spec, async_op=True)
        work.wait()
    assert torch.equal(full, keep)
    ref = _simulated_reduce_scatter(fulls, [list(r) for r in nodes.ranks], n, spec)[rank]
    plain = torch.stack(fulls).sum(0)[rank * n : (rank + 1) * n]
    return out, ref, plain, sent, quantized_nbytes_sent(spec, n, nodes, 4), nodes.num_nodes, nodes.local_size


@pytest.mark.parametrize(
    "node_of", [[0, 0, 1, 1], [0, 1, 0, 1], [0, 1]], ids=["2x2", "2x2-interleaved", "2x1"]
)
def test_hierarchical_quantized_reduce_scatter_matches_the_algorithm(node_of: list[int]) -> None:
    n = 40  # 2.5 blocks a chunk: a partial last block
    for out, ref, plain, sent, (intra, across), big_n, big_l in run_ranks(
        _reduce_scatter_rank, len(node_of), node_of, n, False
    ):
        assert torch.equal(out, ref)
        # within the int4 error of the exact sum, and its scale (the sum, not L x the mean)
        assert (out - plain).norm() < 0.25 * plain.norm()
        spec = BlockQuant(4, 16)
        ops = [(op, nbytes) for op, nbytes, _ in sent]
        # in the node: a full-precision reduce-scatter; across nodes: one message of codes
        expect = ([("reduce_scatter_tensor", big_l * big_n * n * 4)] if big_l > 1 else []) + [
            ("all_to_all_single", big_n * spec.nbytes(n))
        ]
        assert ops == expect
        assert across == (big_n - 1) * spec.nbytes(n) < (big_n - 1) * n * 4 / 4  # int4 codes + scales, not fp32
        assert intra == (big_l - 1) * big_n * n * 4


def test_hierarchical_quantized_reduce_scatter_is_exact_on_representable_values() -> None:
    for out, _, plain, *_ in run_ranks(_reduce_scatter_rank, 4, [0, 0, 1, 1], 32, True):
        assert torch.equal(out, plain)


def _all_gather_rank(n: int) -> tuple:
    import torch.distributed as dist

    from terascale.comm import init_distributed
    from terascale.comm.quantized import all_gather_quantized

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = BlockQuant(8, 32)
    shard = torch.randn(n, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    out = torch.empty(world * n)
    all_gather_quantized(out, shard, dist.group.WORLD, spec)
    # in place: the shard is this rank's slice of the output
    inplace = torch.empty(world * n)
    inplace[rank * n : (rank + 1) * n] = shard
    all_gather_quantized(inplace, inplace[rank * n : (rank + 1) * n], dist.group.WORLD, spec)
    return shard, out, inplace


def test_quantized_all_gather_gives_every_rank_the_same_decoded_shards() -> None:
    results = run_ranks(_all_gather_rank, 2, 50)
    spec = BlockQuant(8, 32)
    expect = torch.cat([dequantize(quantize(s, spec), spec, torch.empty(50)) for s, _, _ in results])
    for shard, out, inplace in results:
        assert torch.equal(out, expect) and torch.equal(inplace, expect)
    assert (expect - torch.cat([s for s, _, _ in results])).abs().max() < 2 * 4 / 127  # shards ~N(0, 2^2)


def test_pack_order_matches_numpy_for_reference() -> None:
    # The int4 byte layout written out with numpy, independently of torch's bit operations.
    q = np.array([3, -2, -7, 7], dtype=np.int16) + 8
    expect = (q[0::2] << 4) | q[1::2]
    spec = BlockQuant(4, 4)
    msg = quantize(torch.tensor([3.0, -2.0, -7.0, 7.0]), spec)
    assert msg[:2].numpy().tolist() == expect.tolist()
