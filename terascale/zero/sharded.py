"""ZeRO stages 1, 2 and 3 as one model state over groups of flat shards.

The stage only sets options (see the table in DESIGN.md):

- which groups are persistent (stages 1-2: all; stage 3: only the small parameters),
  so :class:`ParamSchedule` gathers and frees the others around their modules' use;
- whether gradients are reduced on every micro-step (stages 2-3) or kept full until
  the window's last one (stage 1), in :class:`ShardedGrads`.

Every stage keeps fp32 masters and optimizer state for this rank's shard only
(:class:`ShardedMasters`), and after the step writes the updated masters into the
parameter shards; persistent groups are then all-gathered back to full.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from terascale.checkpoint.spans import OptimKey, ParamInfo, Slice, SliceMode
from terascale.comm import all_gather_flat, duplicate_group, ops
from terascale.comm.collectives import global_grad_sq_norm
from terascale.errors import UsageError
from terascale.offload import AsyncIO, host_adam
from terascale.offload.aio import IoActivity, io_traffic
from terascale.offload.params import OffloadedParams
from terascale.offload.policy import can_pin_memory
from terascale.offload.transfer import GradientsAhead, HostStepTransfers
from terascale.optim.lamb import Lamb
from terascale.optim.muon import Muon, Orthogonalize
from terascale.optim.rounding import StochasticRounding
from terascale.zero.flat_group import FlatParamGroup, FullBuffers, ShardState, keeps_full_buffers
from terascale.zero.gather import full_shape, owner_of, register_owner, unregister
from terascale.zero.early_step import EarlyStep
from terascale.zero.grads import QuantizedReduce, ShardedGrads
from terascale.zero.host import (
    BOUNDED_HOST_MIN_NVME_BYTES,
    map_large_allocations,
    return_freed_host_memory,
    reuse_large_allocations,
)
from terascale.zero.masters import ShardedMasters
from terascale.zero.optimizers import SumNorms, check_shardable
from terascale.zero.options import ZeroOptions
from terascale.zero.overlap_step import OverlappedStep
from terascale.zero.param_attributes import ParameterOffload, Partition, expose, group_partition, withdraw
from terascale.zero.schedule import ParamSchedule
from terascale.zero.sharded_step import ShardedStep
from terascale.zero.state_io import sharded_grad_slices, sharded_slices
from terascale.zero.tiers import grad_swapper, place_masters
from terascale.zero.wrap import GroupPlan, plan_groups
from terascale.zero.zeropp import ZeroPPComm


@dataclass(frozen=True)
class ReducedIn:
    """The group class of a parameter whose gradient is reduced in ``dtype`` (``base``: the
    class it has otherwise, which picks its process group)."""

    dtype: torch.dtype
    base: Hashable = None


class ShardedState:
    """Parameters, gradients and optimizer state of ``module`` sharded over ``group``.

    ``param_groups`` are the user's optimizer groups over trainable parameters; other
    parameters (frozen) are sharded too at stage 3 but never stepped. The module's
    parameters must already hold the same values on every rank, or be partitioned by a
    :class:`terascale.zero.Init` (their values are then gathered one at a time).
    """

    def __init__(
        self,
        module: nn.Module,
        param_groups: Sequence[dict],
        options: ZeroOptions,
        group: ProcessGroup,
        *,
        dtype: torch.dtype,
        device: torch.device,
        param_classes: Mapping[int, Hashable] | None = None,
        class_groups: Mapping[Hashable, ProcessGroup] | None = None,
        comm_dtypes: Mapping[int, torch.dtype] | None = None,
    ) -> None:
        self.module = module
        # Parameters whose gradients are reduced in a dtype of their own (torch_autocast's
        # lower_precision_safe_modules) form groups of their own: the group is the unit of
        # the reduce-scatter.
        classes: dict[int, Hashable] = dict(param_classes or {})
        for pid, comm in (comm_dtypes or {}).items():
            classes[pid] = ReducedIn(comm, classes.get(pid))
        self.options = options
        self.group = group
        self.device = device
        opt_group_of = {id(p): k for k, grp in enumerate(param_groups) for p in grp["params"]}
        self._options = [{k: v for k, v in grp.items() if k != "params"} for grp in param_groups]
        self.plans: list[GroupPlan] = plan_groups(
            module,
            options.wrap,
            opt_group_of,
            persistence_threshold=options.persistence_threshold,
            shard_params=options.stage == 3,
            classes=classes,
        )
        # [Note: building under a memory bound]: groups are built one at a time; each
        # takes its parameters over from a zero.Init (whose slices are then freed) and,
        # with parameter offload, goes to its tier before the next group exists. Masters
        # are made run by run from the shards (read back from NVMe where they went) and
        # go to the optimizer's tier before the next run's exist.
        # One I/O engine serves every NVMe tier of this rank (parameter shards, optimizer
        # runs, gradient shards), so its priority queue orders all of their requests: the
        # reads a step is about to need before the write-behind (see [Note: asynchronous
        # I/O without a compiled op]), and never more than its workers in flight at once.
        nvme = [t for t in (options.offload_param, options.offload_optimizer) if t.device == "nvme"]
        self.swap_io = AsyncIO(nvme[0].aio, trace_name="terascale::swap") if nvme else None
        if nvme:
            map_large_allocations()  # [Note: host memory with an NVMe tier]
        self.params = (
            OffloadedParams(options.offload_param, dist.get_rank(group), self.swap_io)
            if options.offload_param.enabled
            else None
        )
        # Freed full buffers kept for the next gather (host only: [Note: kept full buffers]);
        # nothing is kept while building, the bound is set once the groups' sizes are known.
        self.full_buffers = FullBuffers(0) if options.stage == 3 and keeps_full_buffers(device) else None
        self.groups: list[FlatParamGroup] = []
        # A class with a process group of its own shards over it (experts over their
        # expert-data-parallel group: [Note: expert parameters]); the rest over ``group``.
        class_groups = dict(class_groups or {})
        plan_classes = [classes.get(id(plan.params[0])) for plan in self.plans]
        plan_pgs = [class_groups.get(c.base if isinstance(c, ReducedIn) else c, group) for c in plan_classes]
        # ZeRO++ applies to the groups sharded over ``group`` (an expert class's groups
        # shard over a subgroup of their own and gather as usual).
        self.zeropp = ZeroPPComm.build(options.zeropp, group) if options.zeropp.enabled else None
        for plan, pg in zip(self.plans, plan_pgs):
            zpp = self.zeropp if pg is group else None
            fg = FlatParamGroup(
                list(zip(plan.names, plan.params)),
                pg,
                dtype=dtype,
                device=device,
                persistent=plan.persistent,
                init_values=lambda i, p: _initial_value(p),
                shapes=[full_shape(p) for p in plan.params],
                index=len(self.groups),
                buffers=self.full_buffers,
                quant=None if zpp is None else zpp.weight_quant,
                secondary_group=None if zpp is None else zpp.secondary,
            )
            for p in fg.params:
                release = getattr(owner_of(p), "release_ownership", None)
                if release is not None:
                    release(p)
            register_owner(fg.params, self)
            if options.stage == 3:  # [Note: ZeRO-3 parameter attributes]
                expose(fg.params)
            self.groups.append(fg)
            if self.params is not None:
                self.params.add(fg, offload=not fg.persistent)
            if device.type == "cpu":
                return_freed_host_memory()  # the full copies of sharded parameters are gone
        if self.full_buffers is not None:
            sizes = [fg.full_nbytes for fg in self.groups if not fg.persistent]
            self.full_buffers.max_idle_bytes = max(sizes, default=0)
        self._group_of = {id(p): g for g, fg in enumerate(self.groups) for p in fg.params}
        self._param_index = {id(p): k for k, p in enumerate(p for fg in self.groups for p in fg.params)}
        # Trainable parameters numbered in module order, the same on every rank: the rows of
        # the per-parameter norms of [Note: optimizers on shards].
        trainable = [p for p in module.parameters() if id(p) in opt_group_of]
        self.trainable = trainable
        self.param_number = {id(p): k for k, p in enumerate(trainable)}
        self.param_opt_group = [opt_group_of[id(p)] for p in trainable]
        self.masters, self.swapper = place_masters(self.plans, self.groups, options, device, self.swap_io,
                                                   self._create_masters)  # fmt: skip
        low = options.masters.low and options.masters.stochastic_rounding
        chunk = max((host_adam.chunk_numel_for(m.device) for m in self.masters.masters), default=0)
        elements = sum(fg.layout.numel for fg in self.groups)  # the same at every layout
        self.rounding = StochasticRounding(chunk, elements) if low else None  # [Note: bf16 masters and optimizer states]
        overlap = options.offload_optimizer.overlap_step
        self._transfers = (
            HostStepTransfers(device, pin_memory=can_pin_memory(), grad_dtype=options.grads.dtype, param_dtype=dtype)
            if options.offload_optimizer.enabled and HostStepTransfers.needed(device) and not overlap
            else None
        )  # [Note: the host step's transfers]
        nvme_params = self.params is not None and options.offload_param.device == "nvme"
        self.schedule = (
            ParamSchedule(
                module, self.plans, self.groups, options.schedule, fetch=self.params.fetch if nvme_params else None
            )
            if options.stage == 3
            else None
        )
        # Reductions run on their own channels, apart from the parameter gathers.
        channels = {id(pg): duplicate_group(pg) for pg in [group, *class_groups.values()]}
        self.grads = ShardedGrads(
            self.groups,
            [[k >= 0 for k in plan.opt_group] for plan in self.plans],
            channels[id(group)],
            options.grads,
            on_group_done=None if self.schedule is None else self.schedule.on_grads_done,
            swapper=grad_swapper(self.plans, self.groups, options, self.masters, self.swapper, self.swap_io),
            reduce_groups=[channels[id(pg)] for pg in plan_pgs],
            comm_dtypes=[c.dtype if isinstance(c, ReducedIn) else None for c in plan_classes],
            quantized=None if self.zeropp is None or self.zeropp.nodes is None else QuantizedReduce(
                self.zeropp.nodes, self.zeropp.grad_quant, frozenset(g for g, pg in enumerate(plan_pgs) if pg is group)),
        )
        # [Note: the host step's transfers]: gradient shards kept in memory go down under
        # the window's last backward, run by run as they become final.
        self.ahead = (
            GradientsAhead(self._transfers, self._host_runs(), [(p.group, p.lo, p.hi) for p in self.masters.pieces])
            if self._transfers is not None and self.grads.swapper is None
            else None
        )
        if nvme and device.type == "cpu" and self._nvme_states_nbytes() < BOUNDED_HOST_MIN_NVME_BYTES:
            reuse_large_allocations()  # [Note: host memory with an NVMe tier]
        self.early: EarlyStep | None = None  # see step_in_backward
        # [Note: the overlapped host step]: the update runs behind the next window.
        # The step reads one window's gradient files while the next window writes the
        # other set (where the gradients go to disk).
        second = (None if self.grads.swapper is None or not overlap
                  else grad_swapper(self.plans, self.groups, options, self.masters, self.swapper, self.swap_io, "grads_next"))  # fmt: skip
        self.overlap = OverlappedStep(self, second, options.offload_optimizer.overlap_step_warmup) if overlap else None
        # DeepSpeed's optimizer.parameter_offload ([Note: the parameter coordinator TRL reads]).
        self.parameter_offload = ParameterOffload(module) if options.stage == 3 else None
        # Steps after which freed host pages go back to the OS (doubling): see step().
        self._steps, self._next_trim = 0, 1 if nvme else 0
        self.stepping = ShardedStep(self)  # the optimizer step over the masters

    @property
    def host_transfers(self) -> HostStepTransfers | None:
        """The host step's staged copies to and from the device, where the optimizer's
        masters are on the host and the shards on an accelerator ([Note: the host step's
        transfers]); None otherwise."""
        return self._transfers

    def _host_runs(self) -> list[list[int]]:
        """The runs whose masters are on the host (all of them but a ``ratio`` kept on the device)."""
        return [run for run in self.masters.runs if all(self.masters.masters[i].device.type == "cpu" for i in run)]

    def _nvme_states_nbytes(self) -> int:
        """The bytes this rank's model states take on NVMe once training runs (the
        optimizer files grow to masters and Adam moments at the first step)."""
        grads = self.grads.swapper
        return (
            (0 if self.swapper is None else self.swapper.nbytes_expected)
            + (0 if self.params is None else self.params.nbytes_on_disk())
            + (0 if grads is None else sum(grads.shard_numel) * grads.dtype.itemsize)
        )

    def _create_masters(self, masters: ShardedMasters, run: list[int], device: torch.device | None = None) -> None:
        """Make run ``run``'s masters from its parameter shards, read back if on NVMe."""
        groups = sorted({masters.pieces[i].group for i in run})
        with self.shards_resident(groups, write_back=False):
            masters.create_run(run, device=device)

    # -- the train step ----------------------------------------------------------------------

    def optimizer_param_groups(self) -> list[dict]:
        return self.masters.param_groups(self._options)

    def step_in_backward(self, optimizer: torch.optim.Optimizer, begin: Callable[[], torch.Tensor]) -> None:
        """From now on step ``optimizer``'s runs under each window's last backward where
        their gradients are final ([Note: the optimizer step under backward]); ``begin()``
        is called as such a backward starts and returns the update's multiplier."""
        assert self.options.grads.reduce_every_micro_step and not isinstance(optimizer, Lamb) and self.overlap is None
        self.early = EarlyStep(self, optimizer, begin)

    def gate_reduction(self, reduces: Callable[[], bool]) -> None:
        raise AssertionError("optimizers that reduce their own gradients run at stage 0 (refused before this)")

    def prepare_backward(self, sync: bool, defer: bool = False) -> None:
        self.grads.prepare_backward(sync, defer)
        order = self.early.arm(self.grads.scope) if sync and self.early is not None else None
        if sync and self.ahead is not None and self.grads.listener in (None, self.ahead):
            self.ahead.arm()
            self.grads.listener = self.ahead
        if self.overlap is not None:  # the swap files are the background step's
            self.overlap.before_backward()
        elif sync and self.swapper is not None:
            self.swapper.prefetch(order)  # the step's first reads run under this backward

    def finish_window(self) -> None:
        if self.swapper is not None and self.overlap is None:
            self.swapper.prefetch()  # the step's first reads run under the reductions
        self.grads.finish_window()

    def post_backward(self) -> None:
        self.grads.post_backward()
        if self.schedule is not None:
            self.schedule.post_backward()
        if self.full_buffers is not None:
            self.full_buffers.clear()  # between steps the memory is the optimizer's

    def grad_sq_norm(self, skip: Collection[int] = frozenset(), extra: torch.Tensor | None = None) -> torch.Tensor:
        """The squared L2 norm of the window's reduced gradients over the data-parallel
        group (every rank's shards together), leaving out the groups of the parameters
        whose ids are in ``skip`` (whole groups: see [Note: parameter classes])."""
        skipped = self._groups_of(skip)
        swapper = self.grads.swapper
        if swapper is not None:  # norms taken as the shards went to disk; the norm of norms
            norms = [n.to(self.device) for g, n in enumerate(swapper.norms) if n is not None and g not in skipped]
            return global_grad_sq_norm(norms, self.group, device=self.device, extra=extra)
        pieces = self.masters.grad_pieces(self.grads.shards)
        kept = [t for t, piece in zip(pieces, self.masters.pieces) if piece.group not in skipped]
        return global_grad_sq_norm(kept, self.group, device=self.device, extra=extra)

    @torch.no_grad()
    def sum_grads(self, params: Sequence[nn.Parameter], group: ProcessGroup) -> None:
        """Sum the window's reduced gradients of ``params`` over ``group`` in place (tied
        copies on other pipeline stages: [Note: tied parameters across stages]).

        ``params`` must fill whole groups, so that every member of ``group``, holding the
        same parameters, has the same flat layout and each rank's shard lines up with
        its peers'."""
        self._refuse_mid_step("summing tied gradients")
        self._forget_ahead()
        for g in sorted(self._groups_of({id(p) for p in params})):
            assert {id(p) for p in self.groups[g].params} <= {id(p) for p in params}, "tied parameters share a group"
            swapper = self.grads.swapper
            if swapper is not None:
                swapper.update(g, lambda shard: ops.all_reduce(shard, group=group))
                continue
            shard = self.grads.shards[g]
            assert shard is not None, f"group {g} has no gradient in this window"
            ops.all_reduce(shard, group=group)

    def _groups_of(self, ids: Collection[int]) -> set[int]:
        return {self._group_of[i] for i in ids if i in self._group_of}

    def step(self, optimizer: torch.optim.Optimizer, multiplier: torch.Tensor, sum_norms: SumNorms | None = None,
             orthogonalize: Orthogonalize | None = None) -> None:  # fmt: skip
        """Unscale/clip by ``multiplier``, step each sub-group, refresh persistent groups.
        ``sum_norms`` completes Lamb's per-parameter norms over other ranks' slices, and
        ``orthogonalize`` Muon's matrices from them."""
        if self.schedule is not None:
            self.schedule.free_idle()  # no full parameters of before the update survive it
        if self.overlap is not None:  # installs the last update, starts this one behind the next window
            self.overlap.step(optimizer, multiplier)
        elif self.early is not None and self.early.armed:  # most runs were stepped in backward
            self.early.finish(multiplier)
        else:
            self.stepping(optimizer, multiplier, sum_norms, orthogonalize)
        # With an NVMe tier, the heap holes that the model's full tensors left (glibc served
        # them from its heap before the engine fixed the mmap threshold) fill with the first
        # steps' small transients, each page touched once then kept: 190 MiB, 16% of the peak,
        # on the 109M GPT at stage 3 with both tiers on NVMe and a sub_group_size of 1e6.
        # Trimming after steps 1, 2, 4, 8, ... gives most of it back at 1-16 ms a trim.
        self.invalidate_secondaries()
        self._steps += 1
        if self._steps == self._next_trim:
            return_freed_host_memory()
            self._next_trim *= 2

    def invalidate_secondaries(self) -> None:
        """The shards changed: hpZ's secondary partitions are stale ([Note: ZeRO++ gathers])."""
        for fg in self.groups:
            fg.invalidate_secondary()

    @property
    def orthogonalize_seconds(self) -> float:
        """Muon: the seconds this rank spent orthogonalizing its matrices in the last step
        (its owner's share, [Note: whole matrices on shards]); 0 for other optimizers."""
        return self.stepping.orthogonalize_seconds

    def settle(self) -> None:
        """Finish and install an update still running behind the training ([Note: the
        overlapped host step]); collective where one is pending."""
        if self.overlap is not None:
            self.overlap.settle()

    def _refuse_mid_step(self, what: str) -> None:
        """Raise if the optimizer stepped under the window's last backward and
        ``engine.step()`` is still to come ([Note: the optimizer step under backward])."""
        if self.early is not None:
            self.early.refuse(what)

    def _forget_ahead(self) -> None:
        """The gradients may change after backward: the copies made ahead are dropped, and
        the step copies them again ([Note: the host step's transfers])."""
        if self.ahead is not None:
            self.ahead.forget()

    def zero_grad(self) -> None:
        dropped_mid_step = None if self.early is None else self.early.abandon()
        self._forget_ahead()
        self.grads.zero_()
        if self.overlap is None:  # (the overlapped step's masters carry gradients only inside it)
            for m in self.masters.masters:
                m.grad = None
        if dropped_mid_step is not None:  # dropped all the same: the next window starts clean
            raise RuntimeError(dropped_mid_step)

    # -- state ---------------------------------------------------------------------------------

    @torch.no_grad()
    def full_params(self) -> dict[int, torch.Tensor]:
        """``id(param)`` -> the full fp32 value (exact masters where trained), on CPU.

        Collective: every rank of the group must call it.
        """
        self._refuse_mid_step("reading the full parameters")
        self.settle()
        out: dict[int, torch.Tensor] = {}
        # Swapped-out masters are read once for all groups, not once per group.
        with self._masters_resident(write_back=False):
            for g, fg in enumerate(self.groups):
                with self.shards_resident([g], write_back=False):
                    shard = self.masters.fp32_shard(g)
                if fg.layout.world_size == 1:
                    full = shard
                else:
                    full = torch.empty(fg.layout.padded_numel, dtype=torch.float32, device=self.device)
                    all_gather_flat(full, shard, fg.group)
                for slot, p in zip(fg.layout.slots, fg.params):
                    out[id(p)] = full[slot.offset : slot.offset + slot.numel].view(slot.shape).to("cpu", copy=True)
        return out

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        values = self.full_params()
        out = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            if id(t) in values:
                out[name] = values[id(t)].clone()
            else:
                out[name] = t.detach().to("cpu", copy=True)
                if out[name].is_floating_point():
                    out[name] = out[name].float()
        return out

    def checkpoint_params(self) -> dict[str, ParamInfo]:
        """Every parameter by (first) name: full shape, dtype, optimizer group or -1."""
        return {
            slot.name: ParamInfo(tuple(slot.shape), fg.dtype, plan.opt_group[i])
            for plan, fg in zip(self.plans, self.groups)
            for i, slot in enumerate(fg.layout.slots)
        }

    def state_slices(
        self, optimizer: torch.optim.Optimizer, mode: SliceMode, optim_keys: dict[str, OptimKey] | None = None
    ) -> Iterator[list[Slice]]:
        """This rank's shards as checkpoint spans, chunk by chunk (see ``[Note: logical checkpoints]``)."""
        self._refuse_mid_step("reading or writing the state (a checkpoint save or load, safe_get_*/safe_set_*)")
        self.settle()
        return sharded_slices(self, optimizer, mode, optim_keys, self.options.masters.state_dtype)

    def grad_slices(self, mode: SliceMode) -> list[Slice]:
        """This rank's gradient shards as ``grad`` spans (see :func:`sharded_grad_slices`)."""
        self._refuse_mid_step("reading the gradients (safe_get_full_grad, safe_get_local_grad)")
        self._forget_ahead()  # the slices may be written (safe_set_*_grad)
        return sharded_grad_slices(self.plans, self.groups, self.grads)

    def release_gathered(self) -> None:
        """Free every gathered group and the host buffers kept for gathers (DeepSpeed's
        ``empty_partition_cache``); the next use of a group gathers it again."""
        for fg in self.groups:
            if not fg.persistent:
                fg.wait()
                if fg.state is ShardState.UNSHARDED:
                    fg.reshard(keep_memory=False)
        if self.full_buffers is not None:
            self.full_buffers.clear()

    def zero3_partition(self, param: nn.Parameter) -> Partition:
        """``param.ds_*`` at stage 3 ([Note: ZeRO-3 parameter attributes])."""
        g = self._group_of[id(param)]
        active = set() if self.schedule is None else self.schedule.modules_holding(g)
        external = self.schedule is not None and self.schedule.is_external(g)
        return group_partition(self.groups[g], param, self._param_index[id(param)], active, external)

    def group_of(self, param: nn.Parameter) -> FlatParamGroup | None:
        g = self._group_of.get(id(param))
        return None if g is None else self.groups[g]

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now: parameter shards and persistent buffers, gathered
        (live) full buffers, gradients and fp32 masters in memory; offload buffers and
        bytes in swap files."""
        params = gathered = 0
        for fg in self.groups:
            if fg.persistent:
                params += fg.full_nbytes
            else:
                params += fg.shard.numel() * fg.dtype.itemsize  # 0 while offloaded to NVMe
                if fg.secondary is not None:  # hpZ ([Note: ZeRO++ gathers])
                    params += fg.secondary.numel() * fg.dtype.itemsize
                if fg.state is not ShardState.SHARDED:
                    gathered += fg.full_nbytes
        tiers = [t for t in (self.swapper, self.params, self.grads.swapper) if t is not None]
        return {
            "params": params,
            "gathered_params": gathered,
            "grads": self.grads.nbytes(),
            "grad_buffers": self.grads.spare_nbytes(),
            "master_params": self.masters.nbytes(),
            "offload_buffers": sum(t.nbytes_in_memory() for t in tiers)
            + (0 if self.early is None else self.early.nbytes_in_memory())
            + (0 if self._transfers is None else self._transfers.nbytes())
            + (0 if self.overlap is None else self.overlap.nbytes_in_memory()),
            "nvme": sum(t.nbytes_on_disk() for t in tiers) + (0 if self.overlap is None else self.overlap.nbytes_on_disk()),
        }

    def offload_io(self) -> dict[str, float]:
        """This rank's swap traffic since construction: bytes ``read`` and ``written``, and
        seconds the I/O engine had reads, writes or either in flight (``read_busy_s``,
        ``write_busy_s``, ``busy_s``)."""
        return io_traffic(self.swap_io)

    def offload_activity(self) -> IoActivity | None:
        """When this rank's swap engine was busy (see :class:`IoActivity`); None without NVMe."""
        return None if self.swap_io is None else self.swap_io.activity

    def wait_breakdown(self) -> dict[str, float]:
        """Seconds this rank has spent blocked, by cause: ``param_gather`` (all-gathers),
        ``grad_reduce`` (reduce-scatters), ``offload_io`` (swap reads and writes) and, with
        the overlapped step, ``host_step`` (waiting for the update behind the last window)."""
        io = 0.0 if self.swap_io is None else self.swap_io.blocked_s
        out = {"param_gather": sum(g.blocked_s for g in self.groups), "grad_reduce": self.grads.blocked_s,
               "offload_io": io}  # fmt: skip
        if self.overlap is not None:
            out["host_step"] = self.overlap.blocked_s
        return out

    # -- GatheredParameters (see [Note: owner table]) ------------------------------------------

    def gather(self, params: list[nn.Parameter]) -> object:
        self._refuse_mid_step("GatheredParameters")
        self.settle()
        groups = sorted({self._group_of[id(p)] for p in params})
        was_sharded = [g for g in groups if self.groups[g].state is not ShardState.UNSHARDED]
        # A persistent group's shard is part of what the caller may change: keep a copy
        # so that changes without a modifier_rank can be discarded.
        saved = {g: self.groups[g].shard.clone() for g in groups if self.groups[g].persistent}
        for g in groups:
            self.groups[g].unshard(exact=True)  # the caller may write the full values back
            self.groups[g].wait()
        if self.schedule is not None:
            self.schedule.pin(groups)  # a forward inside frees none of them ([Note: pinned groups])
        return groups, was_sharded, saved

    @torch.no_grad()
    def release(self, params: list[nn.Parameter], token: object, modifier_rank: int | None) -> None:
        groups, was_sharded, saved = token
        modified = modifier_rank is not None
        # Swapped-out masters are read (and written back) once for all groups.
        with self._masters_resident(write_back=True) if modified else contextlib.nullcontext():
            for g in groups:
                fg = self.groups[g]
                if modified:
                    if fg.layout.world_size > 1:
                        src = _modifier_source(self.group, fg.group, modifier_rank)
                        ops.broadcast(fg.full_buffer, src=src, group=fg.group)
                    with self.shards_resident([g], write_back=True):
                        fg.update_shard_from_full()
                        self.masters.refresh_from_shard(g)
                elif fg.persistent:
                    fg.shard.copy_(saved[g])  # discard local changes
                    fg.regather()
        if self.schedule is not None:
            self.schedule.unpin(groups)
        for g in was_sharded:
            if self.schedule is None or not self.schedule.in_use(g):
                self.groups[g].reshard()

    def _masters_resident(self, write_back: bool):
        return contextlib.nullcontext() if self.swapper is None else self.swapper.resident(write_back)

    def shards_resident(self, groups: list[int], write_back: bool) -> contextlib.AbstractContextManager:
        """Within the block the parameter shards of ``groups`` are in memory (read back from
        NVMe where they live there, and written back on exit with ``write_back``)."""
        if self.params is None or self.params.directory is None:
            return contextlib.nullcontext()
        return self.params.resident(groups, write_back)

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise ValueError unless ``optimizer`` may step this rank's flat pieces
        (``[Note: optimizers on shards]``)."""
        check_shardable(optimizer, self.options.stage, self.options.allow_untested_optimizer)
        if self.options.masters.low and not host_adam.supports_low_precision(optimizer):
            raise UsageError(
                f"bf16.bf16_master_weights_and_grads / bf16_optimizer_states step Adam or AdamW (torch's, or the "
                f"config's optimizer type Adam/AdamW); got {type(optimizer).__name__}. Use Adam/AdamW, or keep fp32 "
                "masters (drop those keys)"
            )
        if isinstance(optimizer, Lamb) and self.overlap is not None:
            raise ValueError(
                "Lamb with zero_optimization.offload_optimizer.overlap_step: its trust ratios need an all-reduce of "
                "per-parameter norms inside the step, which runs in a background thread there; use Adam/AdamW, or "
                "drop overlap_step"
            )
        if isinstance(optimizer, Muon) and self.overlap is not None:
            raise ValueError(
                "Muon with zero_optimization.offload_optimizer.overlap_step: each matrix is orthogonalized by one "
                "rank inside the step (two all-to-alls), which runs in a background thread there; drop overlap_step"
            )
        if isinstance(optimizer, Lamb) and self.swapper is not None:
            raise ValueError(
                "Lamb with zero_optimization.offload_optimizer.device 'nvme': the trust ratios need two passes "
                "over the optimizer state, which would read the swap files twice a step; offload to 'cpu', or "
                "use Adam/AdamW with NVMe"
            )

    def remove_hooks(self) -> None:
        try:
            if self.overlap is not None:
                self.overlap.close()
            if self.swapper is not None:
                self.swapper.close()
            if self.params is not None:
                self.params.close()
            self.grads.remove_hooks()
        finally:
            if self.swap_io is not None:
                self.swap_io.close()
        unregister([p for fg in self.groups for p in fg.params])
        withdraw([p for fg in self.groups for p in fg.params])
        if self.schedule is not None:
            self.schedule.remove_hooks()


def _initial_value(param: nn.Parameter) -> torch.Tensor:
    """``param``'s value: its data, or gathered from a :class:`~terascale.zero.Init` partition."""
    owner = owner_of(param)
    full_value = getattr(owner, "full_value", None)
    return param.detach() if full_value is None else full_value(param)


def _modifier_source(group: ProcessGroup, sub: ProcessGroup, modifier_rank: int) -> int:
    """The global rank whose values a group sharded over ``sub`` takes from a change made
    by ``group``'s rank ``modifier_rank``: that rank where ``sub`` holds it, else ``sub``'s
    first rank (a subgroup replicating what the modifier does not hold: other experts)."""
    src = dist.get_global_rank(group, modifier_rank)
    members = dist.get_process_group_ranks(sub)
    return src if src in members else members[0]
