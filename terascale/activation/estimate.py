"""Activation memory of a transformer per rank, by checkpointing policy.

[Note: activation formulas]
With sequence s, micro-batch b, hidden h, a heads, L layers and 16-bit activations, one
transformer layer keeps s·b·h·(34 + 5·a·s/h) bytes for backward (Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models", 2022; the 5·a·s/h term is
the attention scores, which fused attention does not keep). Per policy:

- ``none``: L layers' worth;
- ``selective``: the outputs of the matrix products and of attention are kept (q, k, v,
  attention, output projection, the 4h MLP and its projection: 20·s·b·h) with the
  layer's input (2·s·b·h); norms, activations and dropout are recomputed: 22·s·b·h;
- ``every_n``: the unchecked layers in full, the checked ones their input (2·s·b·h);
- ``blocks``: every layer keeps its input, plus one layer's full working set while it is
  recomputed;
- ``blocks`` + ``cpu_checkpointing``: the inputs go to host memory; the device holds the
  recompute's working set and the inputs of the prefetch window.

The measured counterpart is ``engine.memory_breakdown()["activations"]`` and
``engine.activation_report()`` ([Note: activation memory measured]).
"""

from __future__ import annotations

from dataclasses import dataclass

_GIB = 2**30
PREFETCH = 2  # checkpoints fetched ahead in backward (InputStore's default)


@dataclass(frozen=True)
class ActivationEstimate:
    policy: str
    device: float  # bytes on the device
    host: float  # bytes in host memory (offloaded checkpoints)

    def row(self) -> str:
        return f"{self.policy:>22}  {self.device / _GIB:>10.2f}  {self.host / _GIB:>10.2f}"


def estimate_activations(
    *, layers: int, hidden: int, heads: int, seq: int, micro_batch: int, every_n: int = 2, fused_attention: bool = True
) -> list[ActivationEstimate]:
    """Activation bytes per rank for each policy (see [Note: activation formulas])."""
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("seq", seq),
                        ("micro_batch", micro_batch), ("every_n", every_n)):  # fmt: skip
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    sbh = seq * micro_batch * hidden
    scores = 0 if fused_attention else 5 * heads * seq / hidden
    layer = sbh * (34 + scores)
    inputs = 2 * sbh
    checked = -(-layers // every_n)
    return [
        ActivationEstimate("none", layers * layer, 0),
        ActivationEstimate("selective", layers * 22 * sbh, 0),
        ActivationEstimate(f"every_n (n={every_n})", checked * inputs + (layers - checked) * layer + layer, 0),
        ActivationEstimate("blocks", layers * inputs + layer, 0),
        ActivationEstimate("blocks + cpu", (PREFETCH + 1) * inputs + layer, layers * inputs),
    ]


def format_activation_estimates(estimates: list[ActivationEstimate], seq: int, micro_batch: int) -> str:
    lines = [
        f"activations per rank, sequence {seq} x micro-batch {micro_batch} (16-bit; GiB):",
        "                policy      device        host",
    ]
    lines += [e.row() for e in estimates]
    return "\n".join(lines)
