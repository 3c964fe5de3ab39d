"""Where the engine's model state lives: replicated (stage 0) or sharded (ZeRO stages 1-3).

[Note: model state]
The engine runs one train step for every stage; what differs is who holds parameters,
gradients and optimizer state, and that is behind :class:`ModelState`:

- ``prepare_backward(sync, defer)`` / ``post_backward()`` bracket each backward (``sync`` on
  the last micro-step of a window: gradients are reduced over the data-parallel ranks;
  ``defer``: nothing is reduced before the window's end, [Note: deferred reduction]);
  ``finish_window()`` ends a window whose backwards did not synchronise;
- ``grad_sq_norm(skip, extra)`` is the squared norm of the reduced, still loss-scaled
  gradients over the data-parallel group, leaving out the parameters in ``skip``
  (model-parallel copies another rank counts, see ``terascale/engine/parallel.py``), plus
  every data-parallel rank's ``extra`` (the non-finite check's loss flag);
- ``sum_grads(params, group)`` sums the reduced gradients of ``params`` over ``group``
  (tied copies on other pipeline stages);
- ``step(optimizer, multiplier)`` scales the gradients by ``multiplier`` (unscale and clip
  in one pass), steps the optimizer and writes the result back into the model;
- ``step_in_backward(optimizer, begin)``: from then on, step under each window's last
  backward where possible (stages 2-3 only: [Note: the optimizer step under backward]);
  ``step`` then finishes what that backward left;
- ``gate_reduction(reduces)``: from then on, ask ``reduces()`` before each backward
  whether the window's gradients are reduced at all (stage 0 only: [Note: optimizers that
  reduce their own gradients]);
- ``zero_grad()``, ``full_state_dict()``, ``memory()`` and ``remove_hooks()``;
- ``checkpoint_params()`` and ``state_slices(optimizer, mode, optim_keys)``: the state as
  spans of named tensors for checkpoints (see ``[Note: logical checkpoints]``);
  ``grad_slices(mode)``: the window's reduced gradients the same way (read by DeepSpeed's
  ``safe_get_full_grad``); ``release_gathered()``: free gathered parameters (stage 3).

Stage 0 is :class:`ReplicatedState` (below); stages 1-3 are
:class:`terascale.zero.ShardedState`, one class whose stage is a set of options;
``terascale.engine.prepare.build_model_state`` picks one from the config.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from terascale.checkpoint.spans import (
    GRAD,
    MASTER,
    PARAM,
    OptimKey,
    ParamInfo,
    Slice,
    SliceMode,
    Span,
    create_optimizer_state,
    optimizer_slices,
    optimizer_state_view,
    rank_local_key,
    settle_loaded_state,
)
from terascale.comm import GradientBuckets, ReducePolicy
from terascale.comm.sparse import CommStats
from terascale.comm import ops as comm_ops
from terascale.comm.collectives import global_grad_sq_norm
from terascale.engine.precision import MasterWeights, PrecisionPolicy
from terascale.moe.groups import ExpertGroups, ExpertLayout
from terascale.offload.aio import IoActivity, io_traffic
from terascale.optim.lamb import Lamb
from terascale.optim.muon import Muon, Orthogonalize
from terascale.optim.onebit import ReducesOwnGradients
from terascale.zero.flat_group import FlatLayout
from terascale.zero.init import materialize
from terascale.zero.optimizers import SumNorms


class ModelState(Protocol):
    def optimizer_param_groups(self) -> list[dict]: ...

    def prepare_backward(self, sync: bool, defer: bool = False) -> None: ...

    def post_backward(self) -> None: ...

    def finish_window(self) -> None:
        """The window ends with no backward to synchronise on: reduce what its backwards
        left unreduced ([Note: deferred reduction] in :mod:`terascale.zero.grads`)."""

    def grad_sq_norm(self, skip: Collection[int] = frozenset(), extra: torch.Tensor | None = None) -> torch.Tensor: ...

    def sum_grads(self, params: Sequence[nn.Parameter], group: ProcessGroup) -> None: ...

    def step(self, optimizer: torch.optim.Optimizer, multiplier: torch.Tensor, sum_norms: SumNorms | None = None,
             orthogonalize: Orthogonalize | None = None) -> None:  # fmt: skip
        """Unscale/clip the window's gradients by ``multiplier`` and step. ``sum_norms``
        completes per-parameter norms that other ranks hold parts of (see ``SumNorms``);
        ``orthogonalize`` is Muon's, of matrices that other ranks hold slices of ([Note:
        whole matrices across tensor-parallel slices])."""

    def step_in_backward(self, optimizer: torch.optim.Optimizer, begin: Callable[[], torch.Tensor]) -> None:
        """Step ``optimizer`` under each window's last backward where the gradients are
        final (``begin()`` starts such a window and returns the multiplier)."""

    def gate_reduction(self, reduces: Callable[[], bool]) -> None:
        """Reduce a window's gradients only where ``reduces()`` says so before its backwards."""

    def zero_grad(self) -> None: ...

    def full_state_dict(self) -> dict[str, torch.Tensor]: ...

    def memory(self) -> dict[str, int]: ...

    def offload_io(self) -> dict[str, float]:
        """This rank's NVMe swap traffic so far: bytes ``read`` and ``written``, and the
        seconds its I/O engine had reads, writes or either in flight (``read_busy_s``,
        ``write_busy_s``, ``busy_s``); zeros without an NVMe tier. What a step costs is
        the difference across it."""

    def offload_activity(self) -> IoActivity | None:
        """The activity record of this rank's NVMe swap engine (None without an NVMe tier):
        set its ``recording`` to keep the spans with reads or writes in flight and the
        spans the training thread waited for them (``bench/offload.py`` draws them)."""

    def wait_breakdown(self) -> dict[str, float]: ...

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None: ...

    def checkpoint_params(self) -> dict[str, ParamInfo]: ...

    def state_slices(
        self, optimizer: torch.optim.Optimizer, mode: SliceMode, optim_keys: dict[str, OptimKey] | None = None
    ) -> Iterator[list[Slice]]: ...

    def grad_slices(self, mode: SliceMode) -> list[Slice]: ...

    def release_gathered(self) -> None: ...

    def remove_hooks(self) -> None: ...


def collective_wait_s(state: ModelState) -> float:
    """Seconds this rank has spent blocked in the model state's collectives (parameter
    gathers and gradient reductions; offload I/O not included)."""
    waits = state.wait_breakdown()
    return waits["param_gather"] + waits["grad_reduce"]


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


class ReplicatedState:
    """Stage 0: full parameters and optimizer state on every rank, gradients all-reduced.

    ``param_groups`` are the user's optimizer groups (dicts with ``params``) over the
    trainable parameters of ``module``.
    """

    def __init__(
        self,
        module: nn.Module,
        param_groups: Sequence[dict],
        precision: PrecisionPolicy,
        group,
        reduce_policy: ReducePolicy,
        device: torch.device,
        experts: ExpertLayout | None = None,
        comm_dtypes: Mapping[int, torch.dtype] | None = None,
    ) -> None:
        """``comm_dtypes``: parameter id -> the dtype its gradient is all-reduced in, over
        ``reduce_policy``'s (torch_autocast's lower_precision_safe_modules); such gradients
        go in buckets of their own."""
        self.module = module
        materialize(module, precision.compute_dtype, device)  # a model built in zero.Init
        trainable = _ordered_params(module, param_groups)
        self._masters = MasterWeights(trainable, precision)
        self._groups = self._masters.master_param_groups(param_groups)
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        # Dense gradients are all-reduced over ``group``; each expert-parallel size's over its
        # expert-data-parallel group, averaged over all of ``group`` ([Note: expert parameters]).
        world = dist.get_world_size(group)
        self._experts = experts or ExpertLayout()
        self.comm_stats = CommStats()  # bytes this rank has sent reducing gradients (dense and sparse)
        self._reductions: list[tuple[list[int], GradientBuckets, ExpertGroups | None]] = []
        comm_dtypes = comm_dtypes or {}
        for groups, every in self._experts.split(trainable):
            by_dtype: dict[torch.dtype | None, list[int]] = {}
            for i in every:
                by_dtype.setdefault(comm_dtypes.get(id(trainable[i])), []).append(i)
            for comm, index in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):  # the same order on every rank
                params = [trainable[i] for i in index]
                policy = reduce_policy if comm is None else dataclasses.replace(reduce_policy, comm_dtype=comm)
                buckets = GradientBuckets(
                    params, [names.get(id(p), "<unnamed>") for p in params],
                    group if groups is None else groups.edp_group, policy, device, average_over=world,
                    stats=self.comm_stats,
                )  # fmt: skip
                self._reductions.append((index, buckets, groups))
        self._finished = False
        self._reduces: Callable[[], bool] | None = None  # [Note: optimizers that reduce their own gradients]
        self._local = False  # this window's gradients are each rank's own
        self._group = group
        self._device = device
        opt_group_of = {id(p): k for k, grp in enumerate(param_groups) for p in grp["params"]}
        # Every parameter once, by its first name, in module order (the same on every rank).
        self._named = list(module.named_parameters())
        self._opt_group = [opt_group_of.get(id(p), -1) for _, p in self._named]

    def optimizer_param_groups(self) -> list[dict]:
        return self._groups

    def prepare_backward(self, sync: bool, defer: bool = False) -> None:
        self._local = self._reduces is not None and not self._reduces()
        for _, buckets, _ in self._reductions:
            buckets.prepare_backward(sync, reduce=not self._local)

    def finish_window(self) -> None:
        pass  # the buckets reduce what is left when the step finishes them

    def gate_reduction(self, reduces: Callable[[], bool]) -> None:
        self._reduces = reduces

    def post_backward(self) -> None:
        pass  # the buckets finish at the step: an accumulation window may span backwards

    def wait_breakdown(self) -> dict[str, float]:
        """Seconds blocked by cause (see ``ShardedState.wait_breakdown``): only gradient all-reduces here."""
        blocked = sum(buckets.blocked_s for _, buckets, _ in self._reductions)
        return {"param_gather": 0.0, "grad_reduce": blocked, "offload_io": 0.0}

    def grad_sq_norm(self, skip: Collection[int] = frozenset(), extra: torch.Tensor | None = None) -> torch.Tensor:
        self._finish()
        # Dense gradients are replicated after the all-reduce, so no group is needed for
        # them; each rank of an expert-parallel group holds other experts, whose squares
        # are summed over that group.
        masters, params = self._masters.masters, self._masters.model_params
        sq = torch.zeros((), dtype=torch.float32, device=self._device)
        for index, _, groups in self._reductions:
            grads = [masters[i].grad for i in index if masters[i].grad is not None and id(params[i]) not in skip]
            sq = sq + global_grad_sq_norm(grads, None if groups is None else groups.ep_group, device=self._device)
        if self._local:
            # Each rank's own gradients: the norm stays this rank's (DeepSpeed clips by it),
            # but a non-finite one anywhere must make it non-finite everywhere, so that the
            # ranks agree on skipping the step (and on the health policy's verdict).
            bad = torch.where(torch.isfinite(sq), 0.0, float("inf")).to(torch.float32)
            extra = bad if extra is None else extra.detach() + bad
        if extra is not None:  # every rank's extra, summed: one scalar all-reduce
            extra = extra.detach().clone()
            if self._group is not None and dist.get_world_size(self._group) > 1:
                comm_ops.all_reduce(extra, group=self._group)
            sq = sq + extra
        return sq

    @torch.no_grad()
    def sum_grads(self, params: Sequence[nn.Parameter], group: ProcessGroup) -> None:
        self._finish()
        for p in params:
            grad = self._masters.master_of(p).grad
            assert grad is not None, "a tied parameter has no gradient in this window"
            comm_ops.all_reduce(grad, group=group)

    def step(self, optimizer: torch.optim.Optimizer, multiplier: torch.Tensor, sum_norms: SumNorms | None = None,
             orthogonalize: Orthogonalize | None = None) -> None:  # fmt: skip
        self._finish()
        grads = self._grads()
        if grads:
            torch._foreach_mul_(grads, multiplier.to(grads[0].device))
        if isinstance(optimizer, Lamb) and sum_norms is not None:
            # Lamb steps the masters; the rows are summed by the model parameters they stand for.
            model_of = self._model_param_of_master
            optimizer.step(sum_norms=lambda rows, masters: sum_norms(rows, [model_of[id(m)] for m in masters]))
        elif isinstance(optimizer, Muon) and orthogonalize is not None:
            # Muon steps the masters; the slices are those of the model parameters they stand for.
            model_of = self._model_param_of_master
            optimizer.step(orthogonalize=lambda tasks: orthogonalize(
                [dataclasses.replace(t, param=model_of[id(t.param)]) for t in tasks]))  # fmt: skip
        else:
            optimizer.step()
        self._masters.copy_to_model()

    @functools.cached_property
    def _model_param_of_master(self) -> dict[int, nn.Parameter]:
        """id of a master -> its model parameter (fixed after construction)."""
        return {id(m): p for p, m in zip(self._masters.model_params, self._masters.masters)}

    def _finish(self) -> None:
        if not self._finished:
            grads: list[torch.Tensor | None] = [None] * len(self._masters.masters)
            for index, buckets, _ in self._reductions:
                buckets.finish()
                for i, g in zip(index, buckets.grads()):
                    grads[i] = g
            self._masters.set_grads(grads)
            self._finished = True

    def _grads(self) -> list[torch.Tensor]:
        return [m.grad for m in self._masters.masters if m.grad is not None]

    def zero_grad(self) -> None:
        for _, buckets, _ in self._reductions:
            buckets.zero_()
        self._masters.clear_grads()
        self._finished = False

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        owned = {id(p) for p in self._masters.model_params}
        out = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            if isinstance(t, nn.Parameter) and id(t) in owned:
                t = self._masters.master_of(t)
            out[name] = t.detach().to("cpu", copy=True)
            if out[name].is_floating_point():
                out[name] = out[name].float()
        return out

    def memory(self) -> dict[str, int]:
        params = list(self.module.parameters())
        masters = [m for m in self._masters.masters if all(m is not p for p in params)]
        return {
            "params": _nbytes(params),
            "grads": _nbytes([buckets.buffer for _, buckets, _ in self._reductions]),
            "master_params": _nbytes(masters) if masters else 0,
        }

    def offload_io(self) -> dict[str, float]:  # stage 0 has no offload tier
        return io_traffic(None)

    def offload_activity(self) -> IoActivity | None:
        return None

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        pass  # every optimizer sees whole parameters at stage 0

    def step_in_backward(self, optimizer: torch.optim.Optimizer, begin: Callable[[], torch.Tensor]) -> None:
        raise AssertionError("stage 0 reduces gradients at the step: nothing is final in backward")

    def checkpoint_params(self) -> dict[str, ParamInfo]:
        return {n: ParamInfo(tuple(p.shape), p.dtype, k) for (n, p), k in zip(self._named, self._opt_group)}

    def state_slices(
        self, optimizer: torch.optim.Optimizer, mode: SliceMode, optim_keys: dict[str, OptimKey] | None = None
    ) -> Iterator[list[Slice]]:
        """Every rank holds everything: it saves an even split of the parameters (the
        shards of one flat layout over all of them, so ranks write in parallel) and loads
        all of them. One chunk."""
        load = mode is SliceMode.LOAD
        out: list[Slice] = []
        for i, start, end in self._parts(mode):
            name, p = self._named[i]
            if self._opt_group[i] < 0:
                out.append((Span(PARAM, name, start, end), p.data.reshape(-1)[start:end]))
                continue
            master = self._masters.master_of(p)
            out.append((Span(MASTER, name, start, end), master.data.reshape(-1)[start:end]))
            if load and optim_keys:
                create_optimizer_state(optimizer, master, optim_keys)
            if not load or optim_keys:
                out.extend(optimizer_slices(optimizer_state_view(optimizer, master), name, start, end, start, with_scalars=load or start == 0))
        yield out
        if mode is not SliceMode.HELD and (optim_keys or not load) and isinstance(optimizer, ReducesOwnGradients):
            yield self._rank_local_slices(optimizer, load)
        if load:
            if optim_keys:
                settle_loaded_state(optimizer, [self._masters.master_of(p) for i, (_, p) in enumerate(self._named) if self._opt_group[i] >= 0])
            self._masters.copy_to_model()

    def _rank_local_slices(self, optimizer: ReducesOwnGradients, load: bool) -> list[Slice]:
        """[Note: rank-local checkpoint state]
        Some optimizer state differs between ranks: the 1-bit optimizers' error feedback,
        and 0/1 Adam's parameters, momenta and ``u`` between synchronisations. The even
        split of :meth:`state_slices` would save a mix of ranks' values, so each rank also
        saves all of that state whole, under the span key ``local/<world>/<rank>`` and the
        optimizer's own names. A load on the same world size reads it back into place,
        after the split state (this chunk comes second), so a resume is bit-identical; on
        another world size the keys differ, nothing is read (the checkpoint layout warns),
        and the optimizer's reset state stands: zero error feedback (DeepSpeed resets it on
        every load), split values for the rest."""
        key = rank_local_key(dist.get_world_size(self._group), dist.get_rank(self._group))
        return [(Span(key, name, 0, t.numel()), t.reshape(-1)) for name, t in optimizer.rank_local_state(for_load=load).items()]

    def _parts(self, mode: SliceMode) -> list[tuple[int, int, int]]:
        """``(parameter index, start, end)`` this rank reads or writes in ``mode``: all of
        every parameter to load or hold, an even split over the ranks to save (experts'
        over the ranks that hold the same experts, so that each is saved once)."""
        if mode in (SliceMode.LOAD, SliceMode.HELD):
            return [(i, 0, p.numel()) for i, (_, p) in enumerate(self._named)]
        out = []
        for groups, index in self._experts.split([p for _, p in self._named]):
            if not index:
                continue
            group = self._group if groups is None else groups.edp_group
            layout = FlatLayout.build([(self._named[i][0], self._named[i][1].shape) for i in index], dist.get_world_size(group))
            out += [(index[f.slot], f.start, f.end) for f in layout.fragments(dist.get_rank(group))]
        return sorted(out)

    def grad_slices(self, mode: SliceMode) -> list[Slice]:
        """The window's reduced (averaged, still loss-scaled) gradients of the trained
        parameters as ``grad`` spans, split as :meth:`state_slices` splits (SAVE: each rank
        a part, HELD: all). Only after the window's last backward."""
        self._finish()
        out: list[Slice] = []
        for i, start, end in self._parts(mode):
            name, p = self._named[i]
            grad = self._masters.master_of(p).grad if self._opt_group[i] >= 0 else None
            if grad is not None:
                out.append((Span(GRAD, name, start, end), grad.reshape(-1)[start:end]))
        return out

    def release_gathered(self) -> None:
        pass  # nothing is gathered at stage 0

    def remove_hooks(self) -> None:
        for _, buckets, _ in self._reductions:
            buckets.remove_hooks()


def _ordered_params(module: nn.Module, param_groups: Sequence[dict]) -> list[nn.Parameter]:
    """The distinct parameters of ``param_groups``, in module order (same on every rank)."""
    ids = {id(p) for group in param_groups for p in group["params"]}
    return [p for p in module.parameters() if id(p) in ids]


def adopt_optimizer(optimizer: torch.optim.Optimizer, groups: Sequence[dict]) -> None:
    """Point a client optimizer's param groups at the tensors it must step (the masters).

    ``groups`` are :meth:`ModelState.optimizer_param_groups`, built from this optimizer's
    own groups, in the same order.
    """
    assert len(groups) == len(optimizer.param_groups)
    for mine, theirs in zip(optimizer.param_groups, groups):
        mine["params"] = list(theirs["params"])
