"""The chunked host Adam step is bit-identical to torch's fused Adam/AdamW step."""

from __future__ import annotations

import pytest
import torch

from terascale.offload import host_adam


@pytest.mark.parametrize(
    "cls,kw",
    [
        (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
        (torch.optim.Adam, dict(lr=3e-3, weight_decay=0.05, amsgrad=True)),
        (torch.optim.Adam, dict(lr=1e-3, betas=(0.8, 0.95), eps=1e-6, maximize=True)),
    ],
)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_matches_the_fused_optimizer_bit_for_bit(cls, kw, grad_dtype):
    torch.manual_seed(0)
    shapes = [(1000,), (37, 53), (5,)]  # chunks of 256 elements: ragged ends everywhere
    ref = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    # Two param groups with different learning rates.
    ref_opt = cls([{"params": ref[:2]}, {"params": ref[2:], "lr": 0.5 * kw["lr"]}], fused=True, **kw)
    our_opt = cls([{"params": ours[:2]}, {"params": ours[2:], "lr": 0.5 * kw["lr"]}], fused=True, **kw)
    assert host_adam.supports(our_opt)
    multiplier = torch.tensor(0.37)
    outs = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
    for _ in range(4):
        grads = [torch.randn(s).to(grad_dtype) for s in shapes]
        for p, g in zip(ref, grads):
            p.grad = g.float() * multiplier
        ref_opt.step()
        host_adam.step(our_opt, ours, grads, multiplier, outs, chunk_numel=256)
        for a, b, out in zip(ref, ours, outs):
            assert torch.equal(a, b)
            assert torch.equal(out, a.detach().to(torch.bfloat16))
    for a, b in zip(ref, ours):
        for key in ref_opt.state[a]:
            assert torch.equal(ref_opt.state[a][key], our_opt.state[b][key]), key


def test_only_fused_torch_adam_is_taken_over():
    p = [torch.nn.Parameter(torch.zeros(3))]
    assert not host_adam.supports(torch.optim.AdamW(p, foreach=True))
    assert not host_adam.supports(torch.optim.SGD(p, lr=0.1))
