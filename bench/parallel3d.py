"""Pipeline, tensor and data parallelism on 4 ranks: terascale against DeepSpeed and FSDP2.

    python bench/parallel3d.py                                  # every system, 3 interleaved repeats
    python bench/parallel3d.py --systems terascale-pp2dp2-z1,deepspeed-pp2dp2-z1 --repeats 5
    python bench/parallel3d.py --layers 2 --hidden 128 --heads 4 --vocab 1024 --seq 32 \\
        --steps 3 --warmup 1 --repeats 1                        # smoke test

One GPT (``examples/gpt/layers.py``: embedding, ``--layers`` blocks, final norm + untied
head; fp32) trained on the same global batch (``--global-batch`` sequences of ``--seq``
tokens of stdlib text, the same rows every step for every system) in each layout of
``--nproc`` ranks (default 4, one torch thread each, gloo):

| system | layout | how |
| --- | --- | --- |
| terascale-dp4-z3 | dp=4 | ``terascale.initialize``, ZeRO-3 |
| terascale-pp2dp2-z1 / -z2 | pp=2 x dp=2 | ``terascale.pipe.PipelineModule`` + ``engine.train_batch``, ZeRO-1 / 2 |
| terascale-tp2dp2-z1 / -z2 | tp=2 x dp=2 | tensor-parallel blocks (``terascale.parallel.tensor``), ZeRO-1 / 2 |
| terascale-pp2tp2-z1 | pp=2 x tp=2 | tensor-parallel layers in a pipeline, dp=1 |
| deepspeed-dp4-z3 | dp=4 | DeepSpeed ZeRO-3 |
| deepspeed-pp2dp2-z1 | pp=2 x dp=2 | ``deepspeed.pipe.PipelineModule`` + ``train_batch``, ZeRO-1 (the most it allows) |
| deepspeed-tp2dp2-z1 | tp=2 x dp=2 | DeepSpeed AutoTP training (``tensor_parallel.autotp_size: 2``), ZeRO-1 |
| fsdp2-dp4 | dp=4 | ``fully_shard`` per block + root |

Pipeline layouts run ``--micro-batches`` (m) micro-batches per step, each of
``global-batch / (dp * m)`` sequences (gradient_accumulation_steps = m); the other layouts
run one micro-batch of ``global-batch / dp`` sequences per rank. Every layout starts from
the same weights: each layer is initialised from its own generator seeded by (seed, layer
index), so a pipeline stage building its layers, or a tensor-parallel rank slicing them,
gets exactly the one-process model's weights. Every system steps ``torch.optim.AdamW``
(fused, lr 1e-3, no weight decay); terascale builds it from its config, DeepSpeed and
FSDP2 get torch's directly.

Measured per job (``--steps`` steps, the first ``--warmup`` left out of the timing):

- step time: each step's wall time, the slowest rank's (the ranks are synchronised by the
  loss all-reduce between steps, outside the timing);
- losses: the mean loss over the global batch at every step (from the last pipeline stage
  in pipeline layouts). Every system must agree with the reference (terascale ZeRO-3, else
  FSDP2) within 1e-4 at step 1 (the same model on the same data) and within 1e-3 over the
  curve, or the run fails after printing the table. No system clips gradients
  (``gradient_clipping: 0`` is explicit: DeepSpeed 0.19.8 clips at 1.0 by default, which
  alone made its curves drift from torch's);
- pipeline bubble: terascale's ``engine.pipeline_stats()["bubble"]`` (1 - busy / wall of
  the forward/backward schedule); for DeepSpeed the same quantity, with busy = the time in
  its ForwardPass and BackwardPass instructions (timed by wrapping the engine's
  instruction map, in this script only) and wall = from the start of ``train_batch`` to
  the end of its last of them; both next to the ideal 1F1B bubble ``(p - 1) / (m + p - 1)``;
- bytes communicated: one extra step after the timed ones with every call on
  ``torch.distributed.ProcessGroup`` counted (its methods wrapped, in this script only:
  every system here goes through them). Each call is attributed to the layout's group it
  ran on (``tp``/``dp``/``pp``; point-to-point calls by the peer's position) and turned
  into bytes this rank sends on a bandwidth-optimal algorithm: all-reduce 2(g-1)/g x size,
  all-gather / reduce-scatter / broadcast (g-1)/g x the full tensor, send its size;
- memory: each rank's peak RSS (``getrusage``), the bytes of live tensors after the last
  step (unique storages reachable from Python: parameters, gradients, optimizer state,
  buffers), and terascale's ``engine.memory_breakdown()["model_states"]`` where available.

The driver runs one ``torchrun`` job per (system, repeat) with ``step_time.run_job``,
systems interleaved and their order rotated each repeat; a system that cannot be imported
is skipped, and one that fails is reported, with the reason in its row. It prints a
markdown table with the median ms/step, the ratio to the strongest peer measured in the
same layout (DeepSpeed or FSDP2: the faster), bubble, bytes and memory, and writes every
job's raw numbers to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import chosen_systems, run_job  # noqa: E402  (torchrun job from the right python, results back as JSON)

ROOT = Path(__file__).resolve().parent.parent
LR = 1e-3
STEP1_TOLERANCE = 1e-4  # the same model on the same data: fp32 rounding only
CURVE_TOLERANCE = 1e-3  # later steps: rounding differences that Adam has amplified


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp: int = 1
    tp: int = 1

    @property
    def name(self) -> str:
        return "".join(f"{d}{getattr(self, d)}" for d in ("pp", "tp", "dp") if getattr(self, d) > 1) or "1"

    def describe(self) -> str:
        return " x ".join(f"{d}={getattr(self, d)}" for d in ("pp", "tp", "dp") if getattr(self, d) > 1) or "1 rank"


@dataclass(frozen=True)
class System:
    family: str  # terascale | deepspeed | fsdp2
    layout: Layout
    stage: int  # ZeRO stage (FSDP2: 3)
    requires: tuple[str, ...] = ()  # "module[:name,...]" that must import (else the system is skipped)
    virtual: int = 1  # pipeline chunks per rank (interleaved 1F1B)

    @property
    def pipelined(self) -> bool:
        return self.layout.pp > 1


SYSTEMS: dict[str, System] = {
    "terascale-dp4-z3": System("terascale", Layout(dp=4), 3),
    "terascale-pp2dp2-z1": System("terascale", Layout(pp=2, dp=2), 1),
    "terascale-pp2dp2-z2": System("terascale", Layout(pp=2, dp=2), 2),
    "terascale-pp2dp2-z1-v2": System("terascale", Layout(pp=2, dp=2), 1, virtual=2),
    "terascale-tp2dp2-z1": System("terascale", Layout(tp=2, dp=2), 1),
    "terascale-tp2dp2-z2": System("terascale", Layout(tp=2, dp=2), 2),
    "terascale-pp2tp2-z1": System("terascale", Layout(pp=2, tp=2), 1),
    "deepspeed-dp4-z3": System("deepspeed", Layout(dp=4), 3, ("deepspeed",)),
    "deepspeed-pp2dp2-z1": System("deepspeed", Layout(pp=2, dp=2), 1, ("deepspeed.pipe",)),
    "deepspeed-tp2dp2-z1": System("deepspeed", Layout(tp=2, dp=2), 1, ("deepspeed",)),
    "fsdp2-dp4": System("fsdp2", Layout(dp=4), 3),
}
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s not in ("terascale-tp2dp2-z2", "terascale-pp2dp2-z1-v2"))
LOSS_REFERENCES = ("terascale-dp4-z3", "fsdp2-dp4", "deepspeed-dp4-z3")  # first that ran is the reference


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma-separated subset of {tuple(SYSTEMS)}")
    p.add_argument("--peers-python", default="/tmp/peers/bin/python",
                   help="python of the environment with DeepSpeed installed (../shared/BENCHMARKING.md)")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step, all ranks together")
    p.add_argument("--micro-batches", type=int, default=4,
                   help="micro-batches per step in pipeline layouts (= gradient_accumulation_steps)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--partition", default="parameters", help="pipeline partition_method (both pipeline engines)")
    p.add_argument("--json", default="runs/bench/parallel3d.json", help="where to write every job's raw numbers")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: system to run
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)  # internal: JSON path
    return p.parse_args(argv)


def _config(args: argparse.Namespace):
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt.model import GPTConfig

    return GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                     n_embd=args.hidden)  # fmt: skip


def batch_shape(args: argparse.Namespace, system: System) -> tuple[int, int]:
    """(micro-batches per step, sequences per micro-batch) on each rank of ``system``."""
    m = args.micro_batches if system.pipelined else 1
    per_replica, rest = divmod(args.global_batch, system.layout.dp)
    if rest or per_replica % m:
        raise SystemExit(f"--global-batch {args.global_batch} does not split into dp={system.layout.dp} x "
                         f"{m} micro-batches")  # fmt: skip
    return m, per_replica // m


# -- communication counted on ProcessGroup ------------------------------------------------

# ProcessGroup method -> (operation, index of the positional argument holding the full tensor(s))
_COMM_METHODS = {
    "allreduce": ("all_reduce", 0), "allreduce_coalesced": ("all_reduce", 0),
    "broadcast": ("broadcast", 0), "reduce": ("reduce", 0),
    "allgather": ("all_gather", 0), "all_gather_single": ("all_gather", 0), "_allgather_base": ("all_gather", 0),
    "allgather_coalesced": ("all_gather", 0), "allgather_into_tensor_coalesced": ("all_gather", 0),
    "all_gather_single_coalesced": ("all_gather", 0),
    "reduce_scatter": ("reduce_scatter", 1), "reduce_scatter_single": ("reduce_scatter", 1),
    "_reduce_scatter_base": ("reduce_scatter", 1), "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1),
    "reduce_scatter_single_coalesced": ("reduce_scatter", 1),
    "gather": ("gather", 0), "scatter": ("scatter", 1),
    "alltoall": ("all_to_all", 1), "alltoall_base": ("all_to_all", 1), "all_to_all_single": ("all_to_all", 1),
    "send": ("send", 0), "recv": ("recv", 0), "recv_anysource": ("recv", 0),
}  # fmt: skip


def _nbytes(obj) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


def wire_bytes(op: str, payload: int, group_size: int) -> float:
    """Bytes one rank sends for ``op`` over ``payload`` bytes (the full tensor) among
    ``group_size`` ranks, on a bandwidth-optimal algorithm (ring / direct exchange)."""
    g = group_size
    if op == "send":
        return float(payload)
    if op == "recv" or g <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (g - 1) / g * payload
    return (g - 1) / g * payload


class CommCounter:
    """Counts this rank's calls on every ``ProcessGroup`` by (group dim, operation).

    ``groups`` maps ``tp``/``dp``/``pp`` to the global ranks of this rank's group along that
    dim. A collective is attributed to the dim whose ranks its group has; a point-to-point
    call to the dim whose group holds the peer; anything else to ``other``.
    """

    def __init__(self, groups: dict[str, list[int]]) -> None:
        import torch.distributed as dist

        self.rank = dist.get_rank()
        self.world = list(range(dist.get_world_size()))
        self.groups = {d: sorted(r) for d, r in groups.items()}
        self.counts: dict[str, dict[str, list[float]]] = {}
        self._originals: dict[str, object] = {}
        self._lock = threading.Lock()
        self._ranks_of: dict[int, list[int]] = {}

    def _group_ranks(self, pg) -> list[int]:
        import torch.distributed as dist

        key = id(pg)
        if key not in self._ranks_of:
            try:
                self._ranks_of[key] = sorted(dist.get_process_group_ranks(pg))
            except Exception:  # not registered with torch.distributed
                self._ranks_of[key] = []
        return self._ranks_of[key]

    def _dim(self, pg, op: str, args: tuple) -> tuple[str, int]:
        import torch.distributed as dist

        ranks = self._group_ranks(pg)
        if op in ("send", "recv") and len(args) > 1 and isinstance(args[1], int) and ranks:
            try:
                peer = dist.get_global_rank(pg, args[1])
            except Exception:
                peer = ranks[args[1]] if args[1] < len(ranks) else -1
            for d in ("pp", "dp", "tp"):
                if peer != self.rank and peer in self.groups.get(d, ()):
                    return d, 2
            return "other", 2
        if len(ranks) == 1:
            return "self", 1
        for d in ("tp", "dp", "pp"):
            if ranks == self.groups.get(d):
                return d, len(ranks)
        if ranks == self.world:
            return "world", len(ranks)
        return ("other" if ranks else "unknown"), max(len(ranks), 1)

    def _record(self, pg, method: str, args: tuple) -> None:
        op, at = _COMM_METHODS[method]
        payload = _nbytes(args[at]) if len(args) > at else 0
        dim, size = self._dim(pg, op, args)
        if op in ("gather",):
            payload *= size
        with self._lock:
            entry = self.counts.setdefault(dim, {}).setdefault(op, [0, 0, 0.0])
            entry[0] += 1
            entry[1] += payload
            entry[2] += wire_bytes(op, payload, size)

    def __enter__(self) -> CommCounter:
        from torch.distributed import ProcessGroup

        for method in _COMM_METHODS:
            if method not in vars(ProcessGroup):
                continue
            # vars() holds pybind's instancemethod (restored as is on exit); getattr gives the
            # plain function that the wrapper calls with the group as its first argument.
            self._originals[method] = vars(ProcessGroup)[method]
            original = getattr(ProcessGroup, method)

            def counted(pg, *args, _method=method, _original=original, **kwargs):
                self._record(pg, _method, args)
                return _original(pg, *args, **kwargs)

            setattr(ProcessGroup, method, counted)
        return self

    def __exit__(self, *exc) -> None:
        from torch.distributed import ProcessGroup

        for method, original in self._originals.items():
            setattr(ProcessGroup, method, original)
        self._originals.clear()

    def sent_by_dim(self) -> dict[str, float]:
        return {d: sum(e[2] for e in ops.values()) for d, ops in self.counts.items()}


def live_tensor_bytes() -> int:
    """Bytes of the distinct tensor storages reachable from Python objects."""
    import gc

    import torch

    seen, total = set(), 0
    with warnings.catch_warnings():  # isinstance() on deprecated torch objects warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        try:
            storage = obj.untyped_storage()
            ptr = storage.data_ptr()
        except Exception:  # wrapper subclasses (DTensor) hold their local tensor, counted on its own
            continue
        if storage.device.type == "meta" or ptr == 0 or ptr in seen:
            continue
        seen.add(ptr)
        total += storage.nbytes()
    return total


# -- tensor-parallel GPT layers (terascale.parallel.tensor) -------------------------------


def _tp_coords(group) -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def _load(param, value) -> None:
    import torch

    if tuple(param.shape) != tuple(value.shape):
        raise RuntimeError(f"tensor-parallel slice has shape {tuple(value.shape)}, the layer's parameter "
                           f"{tuple(param.shape)}")  # fmt: skip
    with torch.no_grad():
        param.copy_(value)


def _rows(t, r: int, n: int):
    size = t.shape[0] // n
    return t[r * size : (r + 1) * size]


def _column_parallel(linear, group, blocks: int = 1, **kwargs):
    """``ColumnParallelLinear`` holding this rank's output features of ``linear``; with
    ``blocks`` > 1 the output is that many equal blocks (q, k, v) each split on its own."""
    from terascale.parallel.tensor import ColumnParallelLinear

    r, n = _tp_coords(group)
    layer = ColumnParallelLinear(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                                 **kwargs)  # fmt: skip
    weight = linear.weight.detach().view(blocks, -1, linear.in_features)
    _load(layer.weight, _rows(weight.transpose(0, 1), r, n).transpose(0, 1).reshape(-1, linear.in_features))
    if linear.bias is not None:
        bias = linear.bias.detach().view(blocks, -1)
        _load(layer.bias, _rows(bias.t(), r, n).t().reshape(-1))
    return layer


def _row_parallel(linear, group):
    """``RowParallelLinear`` holding this rank's input features of ``linear`` (bias whole)."""
    from terascale.parallel.tensor import RowParallelLinear

    r, n = _tp_coords(group)
    layer = RowParallelLinear(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                              input_is_parallel=True)  # fmt: skip
    _load(layer.weight, _rows(linear.weight.detach().t(), r, n).t())
    if linear.bias is not None:
        _load(layer.bias, linear.bias.detach())
    return layer


def _tp_classes():
    """The tensor-parallel Embed/Block/Head/loss (built lazily: ``gpt.layers`` is on the path only in a worker)."""
    import torch
    from torch import nn

    from gpt.layers import Block, Embed, Head

    class TPEmbed(Embed):
        """Token embedding split over the vocabulary (``VocabParallelEmbedding``); positions replicated."""

        def __init__(self, config, seed, group) -> None:
            super().__init__(config, seed)
            from terascale.parallel.tensor import VocabParallelEmbedding

            r, n = _tp_coords(group)
            full = self.wte
            self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd, group=group)
            _load(self.wte.weight, _rows(full.weight.detach(), r, n))

    class TPBlock(Block):
        """Heads split over tp: q/k/v and fc column-parallel, the two projections row-parallel."""

        def __init__(self, config, index, seed, group) -> None:
            super().__init__(config, index, seed)
            if config.n_head % _tp_coords(group)[1]:
                raise SystemExit(f"--heads {config.n_head} is not divisible by tp={_tp_coords(group)[1]}")
            self.attn.qkv = _column_parallel(self.attn.qkv, group, blocks=3)
            self.attn.proj = _row_parallel(self.attn.proj, group)
            self.mlp.fc = _column_parallel(self.mlp.fc, group)
            self.mlp.proj = _row_parallel(self.mlp.proj, group)

    class TPHead(Head):
        """Output projection split over the vocabulary; logits stay split (vocab-parallel loss)."""

        def __init__(self, config, seed, group) -> None:
            super().__init__(config, seed)
            self.lm_head = _column_parallel(self.lm_head, group, gather_output=False)

    class TPLoss:
        """Mean cross-entropy of vocabulary-split logits (``vocab_parallel_cross_entropy``)."""

        def __init__(self, group) -> None:
            self.group = group

        def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            from terascale.parallel.tensor import vocab_parallel_cross_entropy

            loss = vocab_parallel_cross_entropy(logits.float(), labels, self.group)
            return loss.mean() if loss.dim() else loss

    class TPLayeredGPT(nn.Module):
        def __init__(self, config, seed, group) -> None:
            super().__init__()
            self.embed = TPEmbed(config, seed, group)
            self.blocks = nn.ModuleList(TPBlock(config, i, seed, group) for i in range(1, config.n_layer + 1))
            self.head = TPHead(config, seed, group)
            self.loss_fn = TPLoss(group)

        def forward(self, ids, labels):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            return self.loss_fn(self.head(x), labels)

    return TPEmbed, TPBlock, TPHead, TPLoss, TPLayeredGPT


def tp_layer_specs(config, seed: int, group) -> list[tuple[type, tuple]]:
    TPEmbed, TPBlock, TPHead, _, _ = _tp_classes()
    blocks = [(TPBlock, (config, i, seed, group)) for i in range(1, config.n_layer + 1)]
    return [(TPEmbed, (config, seed, group)), *blocks, (TPHead, (config, seed, group))]


# -- one training job (runs under torchrun) ------------------------------------------------


class Runner:
    """One system, built: ``step(micro_batches)`` trains one global step on this rank's
    micro-batches [(inputs, labels), ...] and returns the mean loss (meaningful only where
    ``has_loss``: a pipeline's last stage); the other attributes describe where the rank sits."""

    def __init__(self, step, *, replica: int, groups: dict[str, list[int]], has_loss: bool = True,
                 pipeline_stats=None, model_states=None, info: dict | None = None) -> None:  # fmt: skip
        self.step, self.replica, self.groups, self.has_loss = step, replica, groups, has_loss
        self.pipeline_stats = pipeline_stats  # () -> {"step_s", "busy_s", "bubble"} of the last step, or None
        self.model_states = model_states  # () -> bytes, or None
        self.info = info or {}


def _grid_groups(layout: Layout, rank: int) -> dict[str, list[int]]:
    """This rank's groups in a (pp, dp, tp) grid with tp innermost (terascale's Topology and
    DeepSpeed's pipe-data grid order)."""
    p, rest = divmod(rank, layout.dp * layout.tp)
    d, t = divmod(rest, layout.tp)
    at = lambda p, d, t: (p * layout.dp + d) * layout.tp + t  # noqa: E731
    return {"pp": [at(i, d, t) for i in range(layout.pp)], "dp": [at(p, i, t) for i in range(layout.dp)],
            "tp": [at(p, d, i) for i in range(layout.tp)]}  # fmt: skip


def _topology_groups(topo) -> dict[str, list[int]]:
    return {d: topo.ranks(d) for d in ("pp", "dp", "tp")}


def _engine_config(args, system: System) -> dict:
    m, micro = batch_shape(args, system)
    return {
        "train_batch_size": args.global_batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": m,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": system.stage},
        # No clipping anywhere (FSDP2's loop has none). Said explicitly because DeepSpeed
        # 0.19.8 clips at 1.0 unless told otherwise (GRADIENT_CLIPPING_DEFAULT = 1.0).
        "gradient_clipping": 0.0,
    }


def _adamw(params):
    import torch

    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=True)


def _engine_micro_steps(engine):
    def step(micro_batches):
        total = 0.0
        for x, y in micro_batches:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        return total / len(micro_batches)

    return step


def build_terascale(args, name: str, system: System, config) -> Runner:
    import torch.distributed as dist

    import terascale

    layout, rank = system.layout, dist.get_rank()
    adamw = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}
    ts_config = {**_engine_config(args, system), "optimizer": adamw}
    if layout == Layout(dp=layout.dp):  # data parallel only: no topology needed
        from gpt.layers import LayeredGPT

        engine, *_ = terascale.initialize(model=LayeredGPT(config, args.seed), config=ts_config)
        return Runner(_engine_micro_steps(engine), replica=rank, groups=_grid_groups(layout, rank),
                      model_states=lambda: engine.memory_breakdown().get("model_states"))  # fmt: skip

    from terascale.parallel import Topology

    topo = Topology(pp=layout.pp, tp=layout.tp, dp=layout.dp)
    groups, replica = _topology_groups(topo), topo.rank("dp")
    tp_group = topo.group("tp")
    if not system.pipelined:
        *_, TPLayeredGPT = _tp_classes()
        model = TPLayeredGPT(config, args.seed, tp_group)
        info = {"local_params": sum(p.numel() for p in model.parameters())}
        engine, *_ = terascale.initialize(model=model, config=ts_config, mpu=topo.mpu())
        return Runner(_engine_micro_steps(engine), replica=replica, groups=groups, info=info,
                      model_states=lambda: engine.memory_breakdown().get("model_states"))  # fmt: skip

    from terascale.pipe import LayerSpec, PipelineModule

    if layout.tp > 1:
        specs, loss = tp_layer_specs(config, args.seed, tp_group), _tp_classes()[3](tp_group)
    else:
        from gpt.layers import layer_specs, loss_fn

        specs, loss = layer_specs(config, args.seed), loss_fn
    module = PipelineModule(layers=[LayerSpec(cls, *a) for cls, a in specs], topology=topo, loss_fn=loss,
                            partition_method=args.partition, virtual_stages=system.virtual)  # fmt: skip
    engine, *_ = terascale.initialize(model=module, config=ts_config, mpu=topo.mpu())

    def step(micro_batches):
        return float(engine.train_batch(iter(micro_batches)))

    def stats():
        return dict(engine.pipeline_stats())

    def model_states():
        return engine.memory_breakdown()["model_states"]

    return Runner(step, replica=replica, groups=groups, has_loss=topo.rank("pp") == layout.pp - 1,
                  pipeline_stats=stats, model_states=model_states,
                  info={"parts": module.parts})  # fmt: skip


def build_deepspeed(args, name: str, system: System, config) -> Runner:
    import deepspeed
    import torch.distributed as dist

    from gpt.layers import LayeredGPT, layer_specs, loss_fn

    layout, rank = system.layout, dist.get_rank()
    ds_config = _engine_config(args, system)
    if system.pipelined:
        from deepspeed.pipe import LayerSpec, PipelineModule
        from deepspeed.runtime.pipe import schedule

        module = PipelineModule(layers=[LayerSpec(cls, *a) for cls, a in layer_specs(config, args.seed)],
                                num_stages=layout.pp, loss_fn=loss_fn, partition_method=args.partition,
                                activation_checkpoint_interval=0)  # fmt: skip
        engine, *_ = deepspeed.initialize(model=module, optimizer=_adamw, config=ds_config,
                                          model_parameters=[p for p in module.parameters() if p.requires_grad])
        # The bubble as terascale's runner measures it: busy = the stage's forward and
        # backward instructions, wall = from the start of the batch to the end of its last
        # forward/backward (the gradient reduction and optimizer step after it left out;
        # ``train_batch_s`` has the whole call).
        clock = {"busy": 0.0, "start": 0.0, "end": 0.0}
        imap = dict(type(engine)._INSTRUCTION_MAP)

        def timed(fn):
            def run(self, *a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(self, *a, **k)
                finally:
                    clock["end"] = time.perf_counter()
                    clock["busy"] += clock["end"] - t0

            return run

        for cls in (schedule.ForwardPass, schedule.BackwardPass):
            imap[cls] = timed(imap[cls])
        engine._INSTRUCTION_MAP = imap  # the engine looks instructions up on itself

        def step(micro_batches):
            clock["busy"], clock["start"] = 0.0, time.perf_counter()
            loss = engine.train_batch(iter(micro_batches))
            clock["train_batch_s"] = time.perf_counter() - clock["start"]
            return float(loss)

        def stats():
            wall = clock["end"] - clock["start"]
            return {"step_s": wall, "busy_s": clock["busy"], "bubble": 1.0 - clock["busy"] / wall,
                    "train_batch_s": clock["train_batch_s"]}  # fmt: skip

        grid = engine.grid
        groups = {"pp": list(grid.pp_group), "dp": list(grid.dp_group), "tp": [rank]}
        return Runner(step, replica=grid.get_data_parallel_rank(), groups=groups, has_loss=engine.is_last_stage(),
                      pipeline_stats=stats, info={"parts": list(module.parts)})  # fmt: skip

    model = LayeredGPT(config, args.seed)
    if layout.tp > 1:
        # DeepSpeed 0.19.8 checks train_batch_size against micro x accumulation x *world*
        # size (tensor-parallel ranks counted as replicas) at config time; leave it out and
        # let DeepSpeed derive it: the micro-batch per rank is what sets the work.
        del ds_config["train_batch_size"]
        # AutoTP's training path with our layer names: q/k/v fused (3 blocks, each split),
        # fc column-parallel, projections row-parallel, head column-parallel with its output
        # gathered (DeepSpeed's vocab-parallel loss is wired to Hugging Face models only).
        ds_config["tensor_parallel"] = {"autotp_size": layout.tp, "partition_config": {
            "use_default_specs": False,
            "layer_specs": [
                {"patterns": [r".*\.attn\.qkv\.weight$"], "partition_type": "column", "shape": [3, -1],
                 "partition_dim": 0},
                {"patterns": [r".*\.mlp\.fc\.weight$"], "partition_type": "column"},
                {"patterns": [r".*\.attn\.proj\.weight$", r".*\.mlp\.proj\.weight$"], "partition_type": "row"},
                {"patterns": [r".*lm_head\.weight$"], "partition_type": "column", "gather_output": True},
            ],
        }}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, optimizer=_adamw, config=ds_config,
                                      model_parameters=list(model.parameters()))  # fmt: skip
    if layout.tp > 1:
        from deepspeed.utils import groups as ds_groups

        groups = {"pp": [rank], "tp": dist.get_process_group_ranks(ds_groups.get_tensor_model_parallel_group()),
                  "dp": dist.get_process_group_ranks(ds_groups.get_data_parallel_group())}  # fmt: skip
        replica = ds_groups.get_data_parallel_rank()
    else:
        groups, replica = _grid_groups(layout, rank), rank
    info = {"local_params": sum(p.numel() for p in engine.module.parameters())} if layout.tp > 1 else {}
    return Runner(_engine_micro_steps(engine), replica=replica, groups=groups, info=info)


def build_fsdp2(args, name: str, system: System, config) -> Runner:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gpt.layers import LayeredGPT

    model = LayeredGPT(config, args.seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = _adamw(model.parameters())

    def step(micro_batches):
        total = 0.0
        for x, y in micro_batches:
            loss = model(x, y) / len(micro_batches)
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    rank = dist.get_rank()
    return Runner(step, replica=rank, groups=_grid_groups(system.layout, rank))


BUILDERS = {"terascale": build_terascale, "deepspeed": build_deepspeed, "fsdp2": build_fsdp2}


def _tokens(args: argparse.Namespace, steps: int):
    """``steps`` global batches of next-token rows (stdlib text bytes), ``(steps, G, seq + 1)``."""
    from gpt import load_stdlib_corpus

    need = steps * args.global_batch * (args.seq + 1)
    text = load_stdlib_corpus(max_bytes=need * 2, seed=1).train.long()
    if text.numel() < need:  # whole files are sampled: a small budget can come back short
        text = load_stdlib_corpus(max_bytes=max(need * 2, 1 << 20), seed=1).train.long()
    return text[:need].view(steps, args.global_batch, args.seq + 1)


def _jsonable(obj):
    """Numbers of numpy/torch types as Python numbers, anything else as its repr."""
    try:
        return obj.item() if hasattr(obj, "item") and obj.numel() == 1 else obj.tolist()
    except Exception:
        try:
            return obj.item()
        except Exception:
            return repr(obj)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    system = SYSTEMS[args.worker]
    config = _config(args)
    if system.family == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        from terascale.comm import init_distributed

        init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    lay = system.layout
    if lay.pp * lay.dp * lay.tp != world:
        raise SystemExit(f"{args.worker} needs {lay.pp * lay.dp * lay.tp} ranks, got {world} (--nproc)")
    runner = BUILDERS[system.family](args, args.worker, system, config)
    m, micro = batch_shape(args, system)
    tokens = _tokens(args, args.steps + 1)

    def micro_batches(s: int):
        rows = tokens[s, runner.replica * m * micro : (runner.replica + 1) * m * micro]
        return [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows.split(micro)]

    times, losses, stats = [], [], []
    for s in range(args.steps):
        batches = micro_batches(s)
        t0 = time.perf_counter()
        loss = runner.step(batches)
        seconds = time.perf_counter() - t0
        if runner.pipeline_stats is not None:
            stats.append(runner.pipeline_stats())
        both = torch.tensor([loss if runner.has_loss else 0.0, 1.0 if runner.has_loss else 0.0], dtype=torch.float64)
        dist.all_reduce(both)
        slowest = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times.append(slowest.item())
        losses.append((both[0] / both[1]).item())

    # One more step with every ProcessGroup call counted (not timed, not in the loss curve).
    batches = micro_batches(args.steps)
    dist.barrier()
    with CommCounter(runner.groups) as counter:
        runner.step(batches)
    mine = {
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "live_tensor_mib": live_tensor_bytes() / 2**20,
        "model_states_mib": (runner.model_states() or 0) / 2**20 if runner.model_states else None,
        "comm": counter.counts,
        "sent_bytes": counter.sent_by_dim(),
        "groups": runner.groups,
        "pipeline_stats": stats,
        "info": runner.info,
    }
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        Path(args.result).write_text(json.dumps({
            "times": times, "losses": losses, "ranks": everyone, "micro_batches": m, "micro_batch": micro,
            "layout": {"pp": lay.pp, "dp": lay.dp, "tp": lay.tp}, "stage": system.stage,
        }, default=_jsonable))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


# -- the driver -----------------------------------------------------------------------------


def _missing(system: System, args: argparse.Namespace) -> str | None:
    """Why ``system`` cannot run here (a module it needs does not import), or None."""
    if system.family == "deepspeed" and not Path(args.peers_python).exists():
        return f"{args.peers_python} not found (see ../shared/BENCHMARKING.md)"
    if not system.requires:
        return None
    python = args.peers_python if system.family == "deepspeed" else sys.executable
    code = (
        "import importlib, sys\n"
        "for need in sys.argv[1:]:\n"
        "    module, _, names = need.partition(':')\n"
        "    m = importlib.import_module(module)\n"
        "    missing = [n for n in names.split(',') if n and not hasattr(m, n)]\n"
        "    if missing:\n"
        "        sys.exit(f'ImportError: {module} has no {\", \".join(missing)}')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}  # fmt: skip
    probe = subprocess.run([python, "-c", code, *system.requires], capture_output=True, text=True, env=env)
    if probe.returncode == 0:
        return None
    lines = [ln for ln in probe.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"import of {system.requires} failed"


def _failure_reason(message: str) -> str:
    """The most telling line of a failed job's output."""
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip()]
    lines = [ln for ln in lines if "ChildFailedError" not in ln and "Traceback" not in ln]
    for pattern in (r"^\[rank\d+\]: [\w.]*(Error|Exception)\b", r"^[\w.]*(Error|Exception)\b.*:", r"Error", r"error"):
        hits = [ln for ln in lines if re.search(pattern, ln)]
        if hits:
            return hits[-1][:300]
    return lines[-1][:300] if lines else "failed"


def run_all(args: argparse.Namespace, systems: list[str]) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """Every system ``args.repeats`` times, rotated as ``step_time.run_interleaved`` does;
    a system that fails is dropped from later repeats with its reason."""
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            order = systems[r % len(systems):] + systems[: r % len(systems)]
            for name in order:
                if name in failed:
                    continue
                try:
                    res = run_job(args, name, Path(tmp) / f"{name}-{r}.json", __file__)
                except SystemExit as exc:
                    failed[name] = _failure_reason(str(exc))
                    print(f"repeat {r} {name:22s} FAILED: {failed[name]}", file=sys.stderr, flush=True)
                    continue
                runs[name].append(res)
                med = statistics.median(res["times"][args.warmup:]) * 1e3
                print(f"repeat {r} {name:22s} median {med:9.1f} ms/step  loss {res['losses'][0]:.5f}",
                      file=sys.stderr, flush=True)  # fmt: skip
    return {s: v for s, v in runs.items() if v}, failed


def _median_ms(results: list[dict], warmup: int) -> float:
    return statistics.median(t for res in results for t in res["times"][warmup:]) * 1e3


def _per_repeat_ms(results: list[dict], warmup: int) -> list[float]:
    return [statistics.median(res["times"][warmup:]) * 1e3 for res in results]


def _bubble(results: list[dict], warmup: int) -> float | None:
    """Median over timed steps (and repeats) of the ranks' mean bubble fraction."""
    per_step = []
    for res in results:
        stats = [rk["pipeline_stats"] for rk in res["ranks"]]
        if not all(stats):
            return None
        for s in range(warmup, min(len(st) for st in stats)):
            values = [st[s].get("bubble") for st in stats]
            if any(v is None for v in values):
                return None
            per_step.append(sum(values) / len(values))
    return statistics.median(per_step) if per_step else None


def _sent_mib(results: list[dict]) -> dict[str, float]:
    """Mean over ranks of the bytes each sent per step, by group dim (first repeat)."""
    ranks = results[0]["ranks"]
    dims = sorted({d for rk in ranks for d in rk["sent_bytes"]})
    return {d: sum(rk["sent_bytes"].get(d, 0.0) for rk in ranks) / len(ranks) / 2**20 for d in dims}


def report(args: argparse.Namespace, systems: list[str], runs: dict[str, list[dict]], failed: dict[str, str],
           skipped: dict[str, str]) -> list[str]:  # fmt: skip
    """Print the table; return the problems that should fail the run."""
    w = args.warmup
    ms = {s: _median_ms(runs[s], w) for s in runs}
    reference = next((s for s in LOSS_REFERENCES if s in runs), next(iter(runs), None))
    config = _config(args)
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt.layers import LayeredGPT

    params = sum(p.numel() for p in LayeredGPT(config, args.seed).parameters())
    print(f"\nGPT {args.layers} layers x {args.hidden}, {args.heads} heads, vocab {args.vocab}, untied head, "
          f"{params / 1e6:.1f}M params, fp32; global batch {args.global_batch} x {args.seq} tokens; pipeline "
          f"layouts {args.micro_batches} micro-batches/step; {args.nproc} ranks x {args.threads} thread(s), gloo, "
          f"cpu; {args.repeats} interleaved repeats x {args.steps - w} timed steps (+{w} warm-up)\n")  # fmt: skip
    print("| system | layout | ZeRO | m x micro | ms/step (median) | per-repeat medians | peer | ratio to peer | "
          "per-repeat ratios (median) | bubble (ideal) | sent MiB/step/rank tp / dp / pp / other | "
          "peak RSS MiB/rank | live tensors MiB/rank (model states) | loss step 1 → last | "
          f"Δloss step 1 / max vs {reference} |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    problems = []
    ref_losses = runs[reference][0]["losses"] if reference else None
    for name in systems:
        system = SYSTEMS[name]
        lay = system.layout
        zero = "FSDP" if system.family == "fsdp2" else str(system.stage)
        if name in skipped or name in failed:
            why = f"skipped: {skipped[name]}" if name in skipped else f"failed: {failed[name]}"
            print(f"| {name} | {lay.describe()} | {zero} | {why} |" + " |" * 11)
            continue
        results = runs[name]
        m, micro = results[0]["micro_batches"], results[0]["micro_batch"]
        per_rep = _per_repeat_ms(results, w)
        peers = [s for s in runs if SYSTEMS[s].family != "terascale" and SYSTEMS[s].layout == lay]
        peer = min(peers, key=ms.get) if peers and system.family == "terascale" else None
        if peer:
            ratio = f"{ms[name] / ms[peer]:.3f}"
            rep_ratios = [a / b for a, b in zip(per_rep, _per_repeat_ms(runs[peer], w))]
            rep_ratio = f"{statistics.median(rep_ratios):.3f}"
        else:
            ratio = rep_ratio = "—"
        bubble = _bubble(results, w)
        ideal = (lay.pp - 1) / (system.virtual * m + lay.pp - 1)
        bubble_cell = f"{bubble:.2f} ({ideal:.2f})" if bubble is not None else (
            f"— ({ideal:.2f})" if system.pipelined else "—")  # fmt: skip
        sent = _sent_mib(results)
        sent_cell = " / ".join(f"{sent.get(d, 0.0):.1f}" for d in ("tp", "dp", "pp")) + " / " + (
            f"{sum(v for d, v in sent.items() if d not in ('tp', 'dp', 'pp')):.1f}")  # fmt: skip
        ranks = [rk for res in results for rk in res["ranks"]]
        peak = [max(res["ranks"][i]["peak_rss_mib"] for res in results) for i in range(len(results[0]["ranks"]))]
        live = max(rk["live_tensor_mib"] for rk in ranks)
        states = [rk["model_states_mib"] for rk in ranks if rk["model_states_mib"]]
        live_cell = f"{live:.0f}" + (f" ({max(states):.0f})" if states else "")
        losses = results[0]["losses"]
        if ref_losses:
            d1 = max(abs(res["losses"][0] - ref_losses[0]) for res in results)
            dmax = max(abs(a - b) for res in results for a, b in zip(res["losses"], ref_losses))
            delta = f"{d1:.1e} / {dmax:.1e}"
            if d1 > STEP1_TOLERANCE:
                problems.append(f"{name}: step-1 loss differs from {reference}'s by {d1:.2e} (> {STEP1_TOLERANCE})")
            elif dmax > CURVE_TOLERANCE:
                problems.append(f"{name}: loss curve differs from {reference}'s by {dmax:.2e} (> {CURVE_TOLERANCE})")
        else:
            delta = "—"
        print(f"| {name} | {lay.describe()} | {zero} | {m} x {micro} | {ms[name]:.1f} | "
              f"{min(per_rep):.1f}–{max(per_rep):.1f} | {peer or '—'} | {ratio} | {rep_ratio} | {bubble_cell} | "
              f"{sent_cell} | {' / '.join(f'{p:.0f}' for p in peak)} | {live_cell} | "
              f"{losses[0]:.5f} → {losses[-1]:.5f} | {delta} |")  # fmt: skip
    pp_ts, pp_ds = "terascale-pp2dp2-z1", "deepspeed-pp2dp2-z1"
    if pp_ts in runs and pp_ds in runs:
        print(f"\npp=2 x dp=2: {pp_ts} / {pp_ds} = {ms[pp_ts] / ms[pp_ds]:.3f} (target <= 0.9)")
    parts = {s: runs[s][0]["ranks"][0]["info"].get("parts") for s in runs if SYSTEMS[s].pipelined}
    if any(parts.values()):
        print("pipeline partitions (layer boundaries): " + ", ".join(f"{s} {p}" for s, p in parts.items() if p))
    return problems


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    systems = chosen_systems(args, SYSTEMS)
    for name in systems:
        batch_shape(args, SYSTEMS[name])  # the global batch must split in every layout
    skipped = {s: why for s in systems if (why := _missing(SYSTEMS[s], args))}
    for name, why in skipped.items():
        print(f"{name}: skipped: {why}", file=sys.stderr)
    runs, failed = run_all(args, [s for s in systems if s not in skipped])
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    everything = {"args": vars(args), "runs": runs, "failed": failed, "skipped": skipped}
    out.write_text(json.dumps(everything, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    if not runs:
        raise SystemExit("no system ran")
    problems = report(args, systems, runs, failed, skipped)
    if problems:
        raise SystemExit("\n".join(problems))


if __name__ == "__main__":
    main()
