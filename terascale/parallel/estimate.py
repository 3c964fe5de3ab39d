"""Memory per rank and bytes communicated per step for every pp x tp x dp layout.

[Note: 3D layout estimates]
For a transformer of L layers, hidden h, a heads, sequence s, Ψ parameters, trained on
W ranks with a global batch of B sequences in micro-batches of b, each layout
(pp stages x tp slices x dp replicas, ZeRO stage z over dp) costs, per rank:

- model states: ZeRO's formulas ([Note: memory formulas]) over the Ψ/(pp·tp)
  parameters a rank's stage and slice hold, sharded over dp;
- activations (no checkpointing; 16-bit): one layer keeps
  s·b·h·(10 + 24/tp + 5·a·s/(h·tp)) bytes (Korthikanti et al. 2022: the tp-sliced parts
  divide by tp, norms and dropout inputs do not; fused attention drops the last term).
  1F1B keeps at most pp micro-batches in flight on the first stage, each through L/pp
  layers: L layers' worth, as without pipelining (without pipelining each rank's
  micro-batch is b too);
- communication, with m = B/(b·dp) micro-batches per step and bytes at 2 per element:
  dp: ZeRO stage 0/1 all-reduce the gradients once per step (2·(dp-1)/dp·P bytes for P
  the rank's parameter bytes), stage 2 reduce-scatters every micro-batch
  (m·(dp-1)/dp·P) and all-gathers the updated parameters once ((dp-1)/dp·P), stage 3
  also all-gathers parameters twice per micro-batch (forward and backward);
  tp: 4 all-reduces of s·b·h per layer per micro-batch (2 forward, 2 backward), each
  2·(tp-1)/tp of its size; pp: each boundary sends an activation forward and a gradient
  back per micro-batch, s·b·h each.

This is what the ZeRO paper's and Megatron's own back-of-envelope arguments use: which
layouts fit, and which move the fewest bytes over the slowest links (dp and pp may
cross machines; tp should stay inside one).
"""

from __future__ import annotations

from dataclasses import dataclass

_GIB = 2**30


@dataclass(frozen=True)
class LayoutEstimate:
    """One layout's bytes per rank."""

    pp: int
    tp: int
    dp: int
    stage: int
    micro_batches: int
    model_states: float
    activations: float
    dp_bytes: float
    tp_bytes: float
    pp_bytes: float

    @property
    def memory(self) -> float:
        return self.model_states + self.activations

    @property
    def comm(self) -> float:
        return self.dp_bytes + self.tp_bytes + self.pp_bytes

    def row(self) -> str:
        gib = [x / _GIB for x in (self.model_states, self.activations, self.memory, self.dp_bytes, self.tp_bytes, self.pp_bytes, self.comm)]
        return (
            f"{self.pp:>3} {self.tp:>3} {self.dp:>4} {self.stage:>5} {self.micro_batches:>4}  "
            + "  ".join(f"{x:>8.2f}" for x in gib)
        )


def _model_states(psi: float, stage: int, dp: int) -> float:
    if stage == 0:
        return 18 * psi
    return {1: 4 * psi + 12 * psi / dp, 2: 2 * psi + 14 * psi / dp, 3: 16 * psi / dp}[stage]


def dp_bytes(param_bytes: float, stage: int, dp: int, m: int) -> float:
    """Bytes a rank sends per step over the data-parallel group at ZeRO ``stage`` for
    ``param_bytes`` of parameters and ``m`` micro-batches (see [Note: 3D layout estimates])."""
    share = (dp - 1) / dp * param_bytes
    if stage <= 1:
        return 2 * share
    if stage == 2:
        return m * share + share
    return m * 3 * share  # reduce-scatter + two all-gathers per micro-batch


def estimate_layouts(
    *,
    params: float,
    world: int,
    layers: int,
    hidden: int,
    heads: int,
    seq: int,
    global_batch: int,
    micro_batch: int = 1,
    stages: tuple[int, ...] = (0, 1, 2, 3),
    fused_attention: bool = True,
) -> list[LayoutEstimate]:
    """Every layout of ``world`` ranks that divides the model (pp | layers, tp | heads and
    hidden) and the batch (micro-batches per step a whole number), for each ZeRO stage;
    see [Note: 3D layout estimates]."""
    for name, value in (("params", params), ("world", world), ("layers", layers), ("hidden", hidden), ("heads", heads),
                        ("seq", seq), ("global_batch", global_batch), ("micro_batch", micro_batch)):  # fmt: skip
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    out = []
    sbh = seq * micro_batch * hidden
    for pp in _divisors(world):
        for tp in _divisors(world // pp):
            dp = world // (pp * tp)
            if layers % pp or heads % tp or hidden % tp or global_batch % (micro_batch * dp):
                continue
            m = global_batch // (micro_batch * dp)
            psi = params / (pp * tp)
            scores = 0 if fused_attention else 5 * heads * seq / (hidden * tp)
            activations = layers * sbh * (10 + 24 / tp + scores)
            tp_bytes = 0.0 if tp == 1 else m * (layers / pp) * 4 * 2 * (tp - 1) / tp * 2 * sbh
            pp_bytes = 0.0 if pp == 1 else m * 2 * 2 * sbh
            for stage in stages:
                out.append(LayoutEstimate(pp, tp, dp, stage, m, _model_states(psi, stage, dp), activations,
                                          dp_bytes(2 * psi, stage, dp, m) if dp > 1 else 0.0, tp_bytes, pp_bytes))  # fmt: skip
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def format_layouts(rows: list[LayoutEstimate], device_gib: float | None = None) -> str:
    """A table of ``rows`` (GiB per rank), the fewest bytes first among those that fit
    ``device_gib`` (all of them without a limit)."""
    fits = [r for r in rows if device_gib is None or r.memory <= device_gib * _GIB]
    fits.sort(key=lambda r: (r.comm, r.memory))
    head = [
        "pp x tp x dp layouts, per rank (GiB; activations without checkpointing; comm = bytes sent per step):",
        " pp  tp   dp stage    m    states  activat.    memory   dp comm   tp comm   pp comm  all comm",
    ]
    body = [r.row() for r in fits]
    if device_gib is not None:
        body.append(f"({len(rows) - len(fits)} layout(s) need more than {device_gib:g} GiB per rank and are not listed)")
    return "\n".join(head + body)
