"""``PipelineModule``: a sequence of layers split into pipeline stages, DeepSpeed's API.

[Note: pipeline module]
The model is a list of layers whose outputs feed the next layer, as in ``nn.Sequential``.
Every rank partitions the list the same way (:mod:`terascale.pipe.partition`) over
``stages x virtual_stages`` parts and builds only its own parts (its *chunks*: chunk
``c`` of stage ``s`` is virtual stage ``c * stages + s``). Submodules are registered under
their *global* layer index (``"3.weight"``) and tied layers under
``tied_modules.<key>``, so parameter names do not depend on the number of stages: a
checkpoint of a 2-stage model is the checkpoint of the 1-stage model, which is the plain
sequential model.

``seed_layers`` makes a layer's initial values depend only on its index (it is built
under seed ``base_seed + index``) and its random draws in forward only on its index and
how many forwards its chunk has run (the ``n``-th forward runs layer ``i`` under seed
``base_seed * (n + 1) + i``, DeepSpeed's rule), so dropout does not depend on the
partition either; both leave the caller's random streams as they were.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from terascale.activation.rng import default_device
from terascale.comm import broadcast_tensors, init_distributed
from terascale.parallel.ties import Tie
from terascale.parallel.topology import Topology
from terascale.pipe.layers import Layer, LayerSpec, TiedLayerSpec, seeded
from terascale.pipe.partition import partition_layers

logger = logging.getLogger("terascale")

_Step = tuple[int, Callable[[Any], Any]]  # (global layer index, what runs it)


class PipelineModule(nn.Module):
    """``layers`` split over the pipeline stages of ``topology`` (see [Note: pipeline module]).

    Give ``topology`` (a :class:`terascale.parallel.Topology`) or ``num_stages`` (then
    ``Topology(pp=num_stages)`` over the whole world, the remaining factor data-parallel).
    ``loss_fn(outputs, labels)`` runs on the last stage. ``partition_method`` is
    ``"parameters"``, ``"uniform"`` or ``"type:REGEX"``; ``virtual_stages`` model chunks
    per stage select the interleaved schedule. ``activation_checkpoint_interval=k``
    checkpoints every ``k`` layers of a chunk (runs with parameters) with
    ``activation_checkpoint_func`` (default
    :func:`terascale.checkpointing.reentrant_checkpoint`, DeepSpeed's default form, which
    replays random draws; the engine puts
    :func:`~terascale.checkpointing.non_reentrant_checkpoint` there for
    ``pipeline.use_reentrant: false``). Collective: every rank constructs it with the same
    layers.
    """

    def __init__(
        self,
        layers: Iterable[Layer],
        num_stages: int | None = None,
        topology: Topology | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        seed_layers: bool = False,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] | None = None,
        virtual_stages: int = 1,
    ) -> None:
        super().__init__()
        layers = list(layers.children()) if isinstance(layers, nn.Sequential) else list(layers)
        self.topology = _topology(num_stages, topology)
        self.num_stages = self.topology.size("pp")
        self.stage_id = self.topology.rank("pp")
        if virtual_stages < 1:
            raise ValueError(f"PipelineModule: virtual_stages must be >= 1, got {virtual_stages}")
        if virtual_stages > 1 and self.num_stages == 1:
            raise ValueError("PipelineModule: virtual_stages > 1 interleaves several stages; with one stage use 1")
        self.virtual_stages = virtual_stages
        parts = self.num_stages * virtual_stages
        if len(layers) < parts:
            what = f"{self.num_stages} pipeline stages"
            if virtual_stages > 1:
                what += f" x {virtual_stages} virtual stages"
            raise ValueError(
                f"PipelineModule: {len(layers)} layers cannot fill {what} ({parts} parts, one layer at least "
                "each); use fewer stages or more layers"
            )
        if activation_checkpoint_interval < 0:
            raise ValueError(f"activation_checkpoint_interval must be >= 0, got {activation_checkpoint_interval}")
        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.base_seed = base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self._layer_specs = layers
        self.parts = partition_layers(layers, parts, partition_method)
        if dist.get_rank() == 0:
            logger.info("pipeline partition (%s): %s", partition_method, self._describe_parts())
        self.tied_modules = nn.ModuleDict()
        self._tied_attrs: dict[str, tuple[str, ...]] = {}
        self._chunks: list[list[_Step]] = [self._build(c) for c in range(virtual_stages)]
        self._forwards = [0] * virtual_stages  # forward calls per chunk (seed_layers' draws)
        self._ties = self._index_ties()
        self._checkpointable: list[list[bool]] = []  # per chunk, per segment: runs with parameters
        self._checkpointable_interval = 0  # the interval they were computed for

    # -- structure ------------------------------------------------------------------------------

    def chunk_range(self, chunk: int, stage: int | None = None) -> range:
        """The global indices of the layers of ``chunk`` on ``stage`` (default: this one)."""
        v = chunk * self.num_stages + (self.stage_id if stage is None else stage)
        return range(self.parts[v], self.parts[v + 1])

    def stage_owner(self, layer_idx: int) -> tuple[int, int]:
        """``(stage, chunk)`` holding layer ``layer_idx``."""
        if not 0 <= layer_idx < len(self._layer_specs):
            raise ValueError(f"layer index {layer_idx} out of range (the model has {len(self._layer_specs)} layers)")
        v = max(j for j in range(len(self.parts) - 1) if self.parts[j] <= layer_idx)
        return v % self.num_stages, v // self.num_stages

    def _describe_parts(self) -> str:
        out = []
        for v in range(len(self.parts) - 1):
            stage, chunk = v % self.num_stages, v // self.num_stages
            where = f"stage {stage}" + (f" chunk {chunk}" if self.virtual_stages > 1 else "")
            out.append(f"{where}: layers {self.parts[v]}-{self.parts[v + 1] - 1}")
        return "; ".join(out)

    @property
    def num_chunks(self) -> int:
        return self.virtual_stages

    def mpu(self) -> Any:
        """The topology's groups under Megatron's names (what ``terascale.initialize`` uses)."""
        return self.topology.mpu()

    def _build(self, chunk: int) -> list[_Step]:
        """Build this stage's layers of ``chunk``; returns what runs each of them."""
        steps: list[_Step] = []
        for idx in self.chunk_range(chunk):
            layer = self._layer_specs[idx]
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    # Seeded by the key's first use anywhere, so every stage builds the same values.
                    first = _tied_uses(self._layer_specs, layer.key)[0]
                    self.tied_modules[layer.key] = self._built(layer, first)
                    self._tied_attrs[layer.key] = layer.tied_weight_attr
                module = self.tied_modules[layer.key]
                fn = layer.forward_fn
                steps.append((idx, module if fn is None else _Bound(fn, module)))
            elif isinstance(layer, LayerSpec):
                module = self._built(layer, idx)
                self.add_module(str(idx), module)
                steps.append((idx, module))
            elif isinstance(layer, nn.Module):
                self.add_module(str(idx), layer)
                steps.append((idx, layer))
            elif callable(layer):
                steps.append((idx, layer))
            else:
                raise ValueError(f"PipelineModule: layer {idx} is no LayerSpec, nn.Module or callable: {layer!r}")
        return steps

    def _built(self, spec: LayerSpec, idx: int) -> nn.Module:
        if not self.seed_layers:
            return spec.build()
        with seeded(self.base_seed + idx, torch.device("cpu")):
            return spec.build()

    # -- tied layers ----------------------------------------------------------------------------

    def _index_ties(self) -> list[Tie]:
        """One :class:`Tie` per tied key used on several stages, its group made by every rank
        (``new_group`` is collective) in the same order; the owner's values are broadcast."""
        keys = sorted({s.key for s in self._layer_specs if isinstance(s, TiedLayerSpec)})
        if not keys or self.num_stages == 1:
            return []
        mesh = self.topology.mesh.mesh  # global ranks by (pp, dp, tp)
        my_dp, my_tp = self.topology.rank("dp"), self.topology.rank("tp")
        device = init_distributed().device  # the backend's device (NCCL broadcasts device tensors)
        ties = []
        for key in keys:
            stages = sorted({self.stage_owner(i)[0] for i in _tied_uses(self._layer_specs, key)})
            if len(stages) < 2:
                continue  # one stage holds every use: an ordinary shared module
            mine = None
            for dp in range(self.topology.size("dp")):
                for tp in range(self.topology.size("tp")):
                    ranks = [int(mesh[s, dp, tp]) for s in stages]
                    group = dist.new_group(ranks)
                    if (dp, tp) == (my_dp, my_tp) and self.stage_id in stages:
                        mine = group
            if mine is None:
                continue
            module = self.tied_modules[key]
            attrs = self._tied_attrs[key]
            params = tuple(_tied_param(module, key, a) for a in attrs)
            # The owner (the first stage, group rank 0: pp is the outermost mesh dim) decides.
            copies = [p.detach().to(device) for p in params]
            broadcast_tensors(copies, mine)
            with torch.no_grad():
                for p, c in zip(params, copies):
                    p.copy_(c)
            names = tuple(f"tied_modules.{key}.{a}" for a in attrs)
            ties.append(Tie(key=key, names=names, params=params, group=mine, owner=self.stage_id == stages[0]))
        return ties

    def ties(self) -> list[Tie]:
        """This rank's tied layers that other stages hold copies of (see
        [Note: tied parameters across stages]); empty with one stage."""
        return list(self._ties)

    # -- forward --------------------------------------------------------------------------------

    def forward(self, x: Any, chunk: int | None = None) -> Any:
        """Run this stage's layers of ``chunk`` on ``x`` (a tensor or tuple, handed from
        layer to layer as is). ``chunk`` may be left out with one chunk per stage."""
        if chunk is None:
            if self.virtual_stages > 1:
                raise ValueError("PipelineModule.forward: this stage holds several chunks; pass chunk=")
            chunk = 0
        if not 0 <= chunk < self.virtual_stages:
            raise ValueError(f"chunk {chunk} out of range: this stage holds {self.virtual_stages} chunk(s)")
        self._forwards[chunk] += 1
        draw = self._forwards[chunk]
        steps = self._chunks[chunk]
        interval = self.activation_checkpoint_interval
        if interval == 0:
            return self._run(steps, draw)(x)
        checkpoint = self.activation_checkpoint_func or _default_checkpoint()
        reentrant = self.checkpoints_reentrantly()
        for start, checkpointed in zip(range(0, len(steps), interval), self._checkpointable_of(chunk)):
            run = self._run(steps[start : start + interval], draw)
            if checkpointed:
                args = x if isinstance(x, tuple) else (x,)
                segment_checkpoint = checkpoint
                if reentrant and torch.is_grad_enabled():
                    args = _requiring_grad(args)
                    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                        # No input can carry a gradient (token ids into an embedding): a
                        # reentrant checkpoint would leave the segment's parameters without
                        # one, so this segment takes the non-reentrant form.
                        segment_checkpoint = _non_reentrant()
                x = segment_checkpoint(lambda *a, run=run: run(a[0] if len(a) == 1 else a), *args)
            else:
                x = run(x)
        return x

    # -- activation checkpointing ---------------------------------------------------------------

    def set_checkpoint_interval(self, interval: int) -> None:
        """Checkpoint every ``interval`` layers from the next forward on (0: none)."""
        if interval < 0:
            raise ValueError(f"activation_checkpoint_interval must be >= 0, got {interval}")
        self.activation_checkpoint_interval = interval
        self._precompute_checkpointable_values()

    def checkpoints_reentrantly(self) -> bool:
        """Whether forward checkpoints with a reentrant function: anything but terascale's
        non-reentrant ones, as DeepSpeed decides (its pipeline then makes the first stage's
        inputs require a gradient, which such a function needs; see :meth:`forward`)."""
        if self.activation_checkpoint_interval <= 0:
            return False
        from terascale.checkpointing import checkpoint, non_reentrant_checkpoint

        return self.activation_checkpoint_func not in (checkpoint, non_reentrant_checkpoint)

    def _precompute_checkpointable_values(self) -> None:
        """For each chunk, whether each segment of ``activation_checkpoint_interval`` layers
        is checkpointed (it runs with parameters); DeepSpeed's name."""
        interval = self.activation_checkpoint_interval
        self._checkpointable_interval = interval
        self._checkpointable = [
            [_has_parameters(steps[start : start + interval]) for start in range(0, len(steps), interval)]
            if interval > 0
            else []
            for steps in self._chunks
        ]

    def _checkpointable_of(self, chunk: int) -> list[bool]:
        # The interval is a plain attribute (the engine and scripts set it): recompute on change.
        if self._checkpointable_interval != self.activation_checkpoint_interval or not self._checkpointable:
            self._precompute_checkpointable_values()
        return self._checkpointable[chunk]

    @property
    def is_checkpointable_results(self) -> list[bool]:
        """Per segment of this stage's chunks in order, whether it is checkpointed (DeepSpeed's name)."""
        if self.activation_checkpoint_interval <= 0:
            return []
        return [flag for chunk in range(self.virtual_stages) for flag in self._checkpointable_of(chunk)]

    def _run(self, steps: Sequence[_Step], draw: int) -> Callable[[Any], Any]:
        """A function running ``steps`` in order; with ``seed_layers`` each under its own
        seed (the same again when an activation checkpoint recomputes it)."""

        def run(x: Any) -> Any:
            for idx, fn in steps:
                if self.seed_layers:
                    with seeded(self.base_seed * (draw + 1) + idx, default_device()):
                        x = fn(x)
                else:
                    x = fn(x)
            return x

        return run

    def extra_repr(self) -> str:
        return f"stage={self.stage_id}/{self.num_stages}, chunks={self.virtual_stages}, parts={self.parts}"


class _Bound:
    """``fn(module, x)``: a tied layer's use through its ``forward_fn``."""

    def __init__(self, fn: Callable[[nn.Module, Any], Any], module: nn.Module) -> None:
        self.fn, self.module = fn, module

    def __call__(self, x: Any) -> Any:
        return self.fn(self.module, x)


def _topology(num_stages: int | None, topology: Topology | None) -> Topology:
    if topology is not None:
        if num_stages is not None and num_stages != topology.size("pp"):
            raise ValueError(f"PipelineModule: num_stages={num_stages} but the topology has pp={topology.size('pp')}")
        return topology
    if num_stages is None:
        raise ValueError("PipelineModule needs num_stages or topology")
    world = init_distributed().world_size
    if num_stages < 1 or world % num_stages:
        raise ValueError(
            f"PipelineModule: num_stages={num_stages} does not divide the world size {world}; "
            "use a divisor of it (the rest of the ranks become data-parallel replicas)"
        )
    return Topology(pp=num_stages)


def _tied_param(module: nn.Module, key: str, attr: str) -> nn.Parameter:
    value: Any = module
    for part in attr.split("."):
        value = getattr(value, part, None)
    if not isinstance(value, nn.Parameter):
        raise ValueError(
            f"TiedLayerSpec '{key}': tied_weight_attr '{attr}' is not a parameter of {type(module).__name__}"
        )
    return value


def _tied_uses(layers: Sequence[Layer], key: str) -> list[int]:
    """Global indices of the layers that use tied key ``key``."""
    return [i for i, s in enumerate(layers) if isinstance(s, TiedLayerSpec) and s.key == key]


def _has_parameters(steps: Sequence[_Step]) -> bool:
    for _, fn in steps:
        module = fn.module if isinstance(fn, _Bound) else fn
        if isinstance(module, nn.Module) and any(True for _ in module.parameters()):
            return True
    return False


def _requiring_grad(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args``, where no tensor among them requires a gradient, with its floating tensors
    replaced by aliases that do: a reentrant checkpoint computes gradients only through
    inputs that require them, so a first stage's segment would leave its parameters
    without any (DeepSpeed marks the first stage's inputs instead)."""
    if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return args
    return tuple(
        a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
    )


def _non_reentrant() -> Callable[..., Any]:
    from terascale.checkpointing import non_reentrant_checkpoint

    return non_reentrant_checkpoint


def _default_checkpoint() -> Callable[..., Any]:
    # The module-level API an engine configures; DeepSpeed's default form is the reentrant one.
    from terascale.checkpointing import reentrant_checkpoint

    return reentrant_checkpoint
