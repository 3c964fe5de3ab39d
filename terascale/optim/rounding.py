"""Narrowing fp32 to bf16 for state kept in bf16: stochastic rounding by element position.

[Note: bf16 masters and optimizer states]
With ``bf16.bf16_master_weights_and_grads`` the optimizer's master weights are bf16 (the
model's own bf16 shards where they lie on the optimizer's device, nothing kept twice),
and with ``bf16.bf16_optimizer_states`` Adam's moments are bf16 too: 2 + 4 bytes of
optimizer state an element instead of 4 + 8. A step widens each cache-sized chunk of
master, moments and gradient to fp32, runs torch's fused Adam(W) kernel on it, and
narrows the results back (``terascale/offload/host_adam.py``).

Narrowing by round-to-nearest loses every update smaller than half a bf16 step (2^-9 of
the value): late in training most of a master's updates (lr × a normalised step of ~1)
are that small, and the second moment, moved by (1 - beta2) = 0.1% of itself a step,
could never fall. So the narrowing is *stochastic*: a value between two bf16 neighbours
rounds up with probability equal to its distance from the lower one, which keeps every
update in expectation. It adds a 16-bit uniform integer to the fp32 bit pattern and
clears the low 16 bits (for either sign, since the pattern is sign and magnitude).
``bf16.stochastic_rounding: false`` narrows to nearest instead, as DeepSpeed does (its
measured cost is in bench/RESULTS.md).

The noise of an element is a function of the step and of the element's *position* in
the model (its group's base plus its offset in the group's flat layout), not of how a
rank cuts its shard into pieces, runs and chunks: so stages 1 and 2 and every offload
tier give bit-identical results, and a resume from a checkpoint continues exactly. An
element at position ``e`` of tensor role ``r`` at step ``s`` takes entry ``(e + r·ROLE_STRIDE
+ s·STEP_STRIDE) mod P`` of one table of ``P`` uniform 16-bit integers, drawn once from a
fixed seed (``P``: the model's elements, at most ``TABLE_NUMEL``). A chunk is then a contiguous view of the
table (it is ``P`` plus a chunk long), so the noise costs no pass of its own, and a step
draws nothing: drawing the table anew each step cost 24–34 ms a step on this project's
CPU (4M integers from the CPU's Mersenne Twister), half of what bf16 states added to the
16.8M GPT's step. Elements ``P`` apart share their noise within a step, and element e at
step s shares it with element ``e + STEP_STRIDE`` at step s - 1: correlations between
the rounding errors of different parameters, harmless for training (each element's
rounding stays unbiased, with noise that changes from step to step), and what keeps the
cost at three elementwise passes a tensor.
"""

from __future__ import annotations

import torch

TABLE_NUMEL = 1 << 22
ROLE_STRIDE = 0x9E3779B  # tensors of one element (master, moments) take unrelated entries
STEP_STRIDE = 0x2545F49  # and so do consecutive steps
_SEED = 0x5EED_B16
_LOW_HALF = -65536  # 0xFFFF0000 as an int32: keeps sign, exponent and bf16's 7 mantissa bits


class StochasticRounding:
    """The noise table (one per device), drawn once, when a step first asks for it.

    ``period``: the table's length, at most ``TABLE_NUMEL``; a model of fewer elements
    passes its size (the same at every layout), so no two of its elements share noise and
    a small model's step draws no more than it needs."""

    def __init__(self, max_chunk_numel: int, period: int = TABLE_NUMEL) -> None:
        self.max_chunk_numel = max_chunk_numel
        self.period = max(1, min(period, TABLE_NUMEL))
        self._tables: dict[torch.device, torch.Tensor] = {}

    def noise(self, step: int, device: torch.device, position: int, numel: int, role: int) -> torch.Tensor:
        """Uniform int32 noise in [0, 2^16) for ``numel`` elements from ``position`` (of
        tensor ``role``) at optimizer step ``step``: a view of the step's table."""
        assert numel <= self.max_chunk_numel, (numel, self.max_chunk_numel)
        table = self._tables.get(device)
        if table is None:
            table = torch.empty(self.period + self.max_chunk_numel, dtype=torch.int32, device=device)
            generator = torch.Generator(device=device)
            generator.manual_seed(_SEED)
            table.random_(0, 1 << 16, generator=generator)
            self._tables[device] = table
        start = (position + role * ROLE_STRIDE + step * STEP_STRIDE) % self.period
        return table[start : start + numel]


@torch.no_grad()
def narrow_(scratch: torch.Tensor, out: torch.Tensor, noise: torch.Tensor | None) -> None:
    """Write fp32 ``scratch`` into bf16 ``out``: stochastically rounded with ``noise``
    (``scratch`` is consumed), or to nearest without it."""
    if noise is not None:
        bits = scratch.view(torch.int32)
        bits.add_(noise)
        bits.bitwise_and_(_LOW_HALF)  # now exactly representable in bf16: the copy only truncates
    out.copy_(scratch)
