"""``prepare_model``: every transformation of the user's module, in one stated order.

[Note: the order of model preparation]
A module becomes trainable by terascale in six steps, each of which depends on the ones
before it (torchtitan's ``parallelize_llama`` reads the same way):

1. tensor parallelism (``tensor_parallel.autotp_size``) slices layers first: every later
   step sees the parameters this rank holds, not the unsliced ones;
2. the module's parameters are cast to the compute dtype on this rank's device (buffers
   keep theirs: [Note: buffer dtypes]), its MoE layers get their expert-parallel groups,
   and rank 0's values are broadcast over the data-parallel group (an expert's over the
   ranks that replicate it), whatever each process's seed did; then
   sequence parallelism and tiling switch its attention, forward and MLPs
   (``terascale.parallel.sequence.model``: module-level changes, parameters untouched);
3. tiling (``zero_optimization.tile_linear_above``) replaces big ``nn.Linear`` layers and
   their parameters, so it runs before anything collects parameters: the user's optimizer
   groups are read right after it;
4. activation checkpointing picks its blocks while they still hold their parameters (a
   block sharded by ZeRO-3 looks empty);
5. the parallel layout decides which rank counts which gradient and which parameters form
   ZeRO groups of their own (tensor-parallel replicas, tied layers), which the group plan
   of step 6 needs;
6. ZeRO (or stage 0's replicated state) takes the parameters over: flat groups, shards,
   fp32 masters, gradient hooks.

``"auto"`` config values are resolved before step 1, from the module as the user built
it (the hidden size DeepSpeed's Trainer integration reads is the unsliced model's).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from terascale.comm import DistributedContext, ReducePolicy
from terascale.comm.sparse import sparse_gradient_params
from terascale.config import Config
from terascale.config.errors import ConfigError
from terascale.config.precision import cast_module
from terascale.config.section import TORCH_DTYPES
from terascale.engine.activations import EngineActivations
from terascale.engine.autocast import low_precision_comm
from terascale.engine.experts import (
    broadcast_initial_values,
    check_expert_param_groups,
    group_experts_apart,
    setup_experts,
)
from terascale.engine.model_state import ModelState, ReplicatedState
from terascale.engine.optimizer import OptimizerArg, forward_only
from terascale.engine.parallel import ParallelLayout
from terascale.engine.precision import PrecisionPolicy
from terascale.moe.groups import ExpertLayout
from terascale.offload import optimizer_offload, param_offload
from terascale.optim.muon import muon_param_groups
from terascale.parallel.sequence.model import TilePolicy, apply_sequence_parallel
from terascale.parallel.tensor import auto_tp
from terascale.zero import ShardedState, WrapPolicy, ZeroOptions
from terascale.zero.gather import full_shape
from terascale.zero.grads import GradPolicy
from terascale.zero.masters import MasterPrecision
from terascale.zero.leaf import set_z3_leaf_modules, set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix
from terascale.zero.schedule import SchedulePolicy
from terascale.zero.tiling import tile_linears
from terascale.zero.zeropp import ZeroPPPolicy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedModel:
    """The user's ``module`` made trainable: ``activations`` (its checkpointed blocks),
    ``layout`` (who counts which gradient), ``state`` (where parameters, gradients and
    fp32 masters live) and the ``precision`` it computes in."""

    module: nn.Module
    precision: PrecisionPolicy
    activations: EngineActivations
    layout: ParallelLayout
    state: ModelState
    param_groups: Sequence[dict] = ()  # the user's optimizer groups over the module's parameters
    wrap: WrapPolicy | None = None  # how ZeRO grouped them (a resize groups them again alike)


def prepare_model(
    module: nn.Module,
    config: Config,
    dist_ctx: DistributedContext,
    *,
    wrap_policy: WrapPolicy | None = None,
    optimizer: OptimizerArg = None,
    model_parameters: Iterable[Any] | None = None,
) -> PreparedModel:
    """Apply the steps of ``[Note: the order of model preparation]`` to ``module`` in place.

    ``config`` is resolved (no ``"auto"`` left). The optimizer's parameter groups come
    from a client ``optimizer``'s groups, else ``model_parameters``, else every trainable
    parameter. Collective over every rank (broadcast, tensor-parallel slicing, ZeRO).
    """
    wrap = wrap_policy or WrapPolicy()
    sliced: dict[int, nn.Parameter] = {}
    if config.tensor_parallel.autotp_size > 1:
        # An optimizer the caller built (the Hugging Face Trainer builds its own before the
        # engine exists) holds the unsliced parameters: its groups are read by name below.
        # ``before`` keeps those alive so that no new parameter can reuse an id in the map.
        before = list(module.named_parameters())
        auto_tp(module, dist_ctx.mp_group)
        after = dict(module.named_parameters())
        sliced = {id(p): after[n] for n, p in before if n in after and after[n] is not p}

    precision = PrecisionPolicy(compute_dtype=config.compute_dtype, buffer_dtype=config.buffer_dtype)
    cast_module(module, precision.compute_dtype, precision.buffer_dtype, dist_ctx.device)
    experts, split = setup_experts(module, dist_ctx, config.expert_parallel)
    sliced.update(split)  # Hugging Face experts replaced by this rank's share
    if dist_ctx.sp_world_size > 1 and experts.groups:
        raise ValueError(
            f"sequence_parallel_size {dist_ctx.sp_world_size} with expert parallelism: the two do not compose yet "
            "(expert groups are built over the data-parallel ranks); drop one of them"
        )
    if not dist_ctx.carried_state:  # else the running ranks give this one its values (a live resize)
        broadcast_initial_values(module, dist_ctx, experts)
    sp = config.sequence_parallel
    tiles = TilePolicy(mlp=sp.tiled_mlp, loss=sp.tiled_loss, above=sp.tile_above, mlp_tiles=sp.mlp_tiles,
                       loss_tile_bytes=sp.loss_tile_bytes)  # fmt: skip
    apply_sequence_parallel(module, dist_ctx.sp_group, tiles, split_batches=sp.split_batches)

    if config.zero_optimization.tile_linear_above is not None:
        if isinstance(optimizer, torch.optim.Optimizer) or model_parameters is not None:
            raise ValueError(
                "zero_optimization.tile_linear_above replaces big nn.Linear layers (and their parameters) "
                "inside terascale.initialize, so an optimizer or model_parameters built before it would "
                "hold the old ones: use the config's 'optimizer' section or pass optimizer as a callable"
            )
        tile_linears(module, int(config.zero_optimization.tile_linear_above))
    # A forward-only engine (no optimizer) trains nothing: no masters, gradients or optimizer state.
    param_groups = (
        [] if forward_only(config, optimizer) else user_param_groups(module, optimizer, model_parameters, sliced)
    )
    if config.optimizer is not None and config.optimizer.type.lower() == "muon":
        # Which are Muon's, by their full shapes (a zero.Init holds them partitioned): before ZeRO lays them out.
        param_groups = muon_param_groups(module, param_groups, full_shape)
    if isinstance(optimizer, torch.optim.Optimizer):  # the user's groups stand: DeepSpeed's rule for them
        check_expert_param_groups(param_groups, experts, config.zero_optimization.stage)
    else:
        param_groups = group_experts_apart(param_groups, experts)

    activations = EngineActivations(module, config, dist_ctx, wrap)
    layout = ParallelLayout.build(module, dist_ctx, experts)
    state = build_model_state(module, param_groups, config, dist_ctx, precision, wrap, layout.classes, experts)
    return PreparedModel(module, precision, activations, layout, state, param_groups, wrap)


def user_param_groups(
    module: nn.Module,
    optimizer: OptimizerArg,
    model_parameters: Iterable[Any] | None,
    replaced: Mapping[int, nn.Parameter] | None = None,
) -> list[dict]:
    """The optimizer groups the user asked for, as dicts over the module's parameters.

    From a client optimizer's groups, else ``model_parameters`` (tensors or dicts of
    options), else every parameter with ``requires_grad``. Each parameter appears once.
    Frozen parameters (``requires_grad=False``) are left out, as DeepSpeed leaves them
    out of the optimizer: scripts pass ``model.parameters()`` whole, and models hold
    frozen tables (Marian's sinusoidal positions). A group may end up empty; it is kept,
    so that a client optimizer's groups still line up. ``replaced`` maps the id of a
    parameter the module no longer holds to the one that took its place (tensor-parallel
    slicing).
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer.state:
            raise ValueError(
                "the optimizer passed to terascale.initialize already has state; construct it "
                "fresh over model.parameters() (terascale gives it fp32 master weights)"
            )
        raw: list[Any] = [dict(g) for g in optimizer.param_groups]
    elif model_parameters is not None:
        raw = list(model_parameters)
    else:
        raw = [p for p in module.parameters() if p.requires_grad]
    if raw and not isinstance(raw[0], dict):
        raw = [{"params": raw}]
    in_module = {id(p) for p in module.parameters()}
    seen: set[int] = set()
    groups = []
    for group in raw:
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        kept = []
        for p in params:
            p = (replaced or {}).get(id(p), p)  # sliced by tensor parallelism: the slice
            if id(p) not in in_module:
                raise ValueError("model_parameters contains a tensor that is not a parameter of the model")
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                kept.append(p)
        groups.append({**group, "params": kept})
    return groups


def build_model_state(
    module: nn.Module,
    param_groups: Sequence[dict],
    config: Config,
    dist_ctx: DistributedContext,
    precision: PrecisionPolicy,
    wrap_policy: WrapPolicy | None = None,
    param_classes: Mapping[int, Hashable] | None = None,
    experts: ExpertLayout | None = None,
) -> ModelState:
    """The model state for ``config.zero_optimization.stage`` (see ``[Note: model state]``).

    With ``sparse_gradients`` the weights of ``module``'s sparse embeddings are named in
    the reduce policy (see ``[Note: sparse gradients]``), fixed here for every rank alike.
    """
    zero = config.zero_optimization
    sparse = sparse_gradient_params(module) if config.sparse_gradients else frozenset()
    # Over every rank holding the same parameters ([Note: sequence-parallel groups]).
    group = dist_ctx.zero_group
    if zero.stage == 0:
        zeropp_policy(config)  # says that ZeRO++'s keys do nothing here
        master_precision(config)  # refuses bf16 masters without ZeRO, as DeepSpeed does
        policy = ReducePolicy(**_reduction(config), accum_dtype=config.grad_accum_dtype, sparse_params=sparse)
        return ReplicatedState(module, param_groups, precision, group, policy, dist_ctx.device, experts,
                               low_precision_comm(module, config, dist_ctx.device, precision.compute_dtype))  # fmt: skip
    if zero.stage == 3 and zero.leaf_module:
        mark_leaf_modules(module, zero.leaf_module)
    options = zero_options(config, wrap_policy)
    if sparse:
        options = dataclasses.replace(options, grads=dataclasses.replace(options.grads, sparse_params=sparse))
    return ShardedState(
        module,
        param_groups,
        options,
        group,
        dtype=precision.compute_dtype,
        device=dist_ctx.device,
        param_classes=param_classes,
        class_groups=experts.class_groups() if experts else None,
        comm_dtypes=low_precision_comm(module, config, dist_ctx.device, precision.compute_dtype),
    )


def zero_options(config: Config, wrap: WrapPolicy | None = None) -> ZeroOptions:
    """The :class:`ZeroOptions` ``config.zero_optimization`` (stage 1-3) asks for.

    Gradients accumulate in ``data_types.grad_accum_dtype`` when given, else in the
    compute dtype as DeepSpeed's ZeRO does (this is what the ZeRO memory formulas count).
    """
    zero = config.zero_optimization
    accum = config.data_types.grad_accum_dtype
    return ZeroOptions(
        stage=zero.stage,
        grads=GradPolicy(
            **_reduction(config),
            reduce_every_micro_step=zero.stage >= 2,
            dtype=TORCH_DTYPES[accum] if accum else config.compute_dtype,
            overlap=zero.overlap_comm,
            reduce_scatter=zero.reduce_scatter,
        ),
        wrap=wrap or WrapPolicy(),
        schedule=SchedulePolicy(
            prefetch_numel=int(zero.prefetch_bucket_size),
            max_live_numel=int(zero.max_live_parameters),
            max_reuse_distance=int(zero.max_reuse_distance),
        ),
        persistence_threshold=int(zero.param_persistence_threshold),
        sub_group_size=int(zero.sub_group_size),
        allgather_bucket_numel=int(zero.allgather_bucket_size),
        offload_optimizer=optimizer_offload(config),
        offload_param=param_offload(config),
        allow_untested_optimizer=config.zero_allow_untested_optimizer,
        zeropp=zeropp_policy(config),
        masters=master_precision(config),
    )


def master_precision(config: Config) -> MasterPrecision:
    """The masters' and optimizer state's dtypes ``bf16`` asks for ([Note: bf16 masters
    and optimizer states]); raises ConfigError where DeepSpeed refuses the combination
    or where it would do something else than the keys say."""
    bf16 = config.bf16
    if not (bf16.bf16_master_weights_and_grads or bf16.bf16_optimizer_states):
        return MasterPrecision()
    if not bf16.enabled:
        log.warning("bf16.bf16_master_weights_and_grads / bf16_optimizer_states apply with bf16.enabled only: ignored")
        return MasterPrecision()
    problems = []
    if bf16.bf16_optimizer_states and not bf16.bf16_master_weights_and_grads:
        problems.append("bf16.bf16_optimizer_states requires bf16_master_weights_and_grads to be enabled")
    if config.zero_optimization.stage == 0:
        problems.append("bf16.bf16_master_weights_and_grads is only supported with ZeRO Stage 1, 2, or 3 "
                        "(zero_optimization.stage is 0)")  # fmt: skip
    accum = config.data_types.grad_accum_dtype
    if accum is not None and accum != "bf16":
        problems.append(f"bf16.bf16_master_weights_and_grads keeps the gradients in bf16, but "
                        f"data_types.grad_accum_dtype is {accum!r}: drop one of the two")  # fmt: skip
    if problems:
        raise ConfigError(problems)
    return MasterPrecision(
        dtype=torch.bfloat16,
        state_dtype=torch.bfloat16 if bf16.states_in_bf16 else torch.float32,
        stochastic_rounding=bf16.stochastic_rounding,
    )


def zeropp_policy(config: Config) -> ZeroPPPolicy:
    """ZeRO++'s options from ``zero_optimization`` (stage 3). Below stage 3 nothing is
    gathered and DeepSpeed ignores them; so does terascale, saying so, so that published
    configs that keep the keys while lowering the stage still run."""
    zero = config.zero_optimization
    policy = ZeroPPPolicy(
        quantized_weights=zero.zero_quantized_weights,
        hpz_size=max(1, zero.zero_hpz_partition_size),
        quantized_gradients=zero.zero_quantized_gradients,
    )
    if policy.enabled and zero.stage < 3:
        log.warning("zero_optimization: zero_quantized_weights, zero_hpz_partition_size and "
                    "zero_quantized_gradients apply at stage 3 only; ignored at stage %d", zero.stage)  # fmt: skip
        return ZeroPPPolicy()
    if policy.quantized_gradients and not zero.reduce_scatter:
        log.info("zero_optimization: zero_quantized_gradients reduces gradients with its hierarchical "
                 "reduce-scatter; reduce_scatter: false does not apply to them")  # fmt: skip
    return policy


def mark_leaf_modules(module: nn.Module, section: Mapping[str, Any]) -> None:
    """Mark the leaf modules ``zero_optimization.leaf_module`` names (DeepSpeed's
    ``classes`` / ``names`` / ``name_suffixes``, each a string or a list), as
    ``set_z3_leaf_modules`` and its ``_by_name`` / ``_by_suffix`` forms do; entries that
    match nothing in this model are skipped, as DeepSpeed skips them."""
    unknown = sorted(set(section) - {"classes", "names", "name_suffixes"})
    if unknown:
        raise ValueError(f"zero_optimization.leaf_module: unknown keys {unknown}; expected classes, names, name_suffixes")

    def listed(key: str) -> list[str]:
        value = section.get(key) or []
        return [value] if isinstance(value, str) else [str(v) for v in value]

    if listed("classes"):
        set_z3_leaf_modules(module, listed("classes"), raise_if_not_found=False)
    if listed("names"):
        set_z3_leaf_modules_by_name(module, listed("names"), raise_if_not_found=False)
    if listed("name_suffixes"):
        set_z3_leaf_modules_by_suffix(module, listed("name_suffixes"), raise_if_not_found=False)


def _reduction(config: Config) -> dict[str, Any]:
    """How gradients are reduced, the same at every stage: bucket size, communication
    dtype, pre-scaling and pre-division, sparse reduction of sparse embeddings."""
    return {
        "bucket_numel": int(config.zero_optimization.reduce_bucket_size),
        "comm_dtype": config.communication_dtype,
        "prescale": config.prescale_gradients,
        "predivide_factor": config.gradient_predivide_factor,
        "average": config.gradient_allreduce_op == "mean",
        "sparse_gradients": config.sparse_gradients,
    }
