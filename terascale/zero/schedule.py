"""Stage 3: gather each group just before its module runs, free it after, prefetch ahead.

[Note: gather schedule]
Every non-persistent group is SHARDED between uses. A forward pre-hook on the group's
module gathers it (waiting for a prefetch in flight); the forward post-hook frees it
again unless it is the root group (used again at once by backward) or, by the trace, it
will be reused within ``max_reuse_distance`` elements of other groups and the live
budget allows keeping it. The post-hook also puts a hook on the module's outputs that
gathers the group again when their first gradient arrives (pre-backward). In backward a
group of trainable parameters is freed as soon as every parameter of it has its gradient
(the gradient hooks tell :meth:`ParamSchedule.on_grads_done`). A group of frozen
parameters gets no gradients; it is freed when the gradients of its module's inputs are
computed (its module's backward is then done), or when backward ends if no input needs a
gradient. Frozen base weights (PEFT adapters under ZeRO-3) are thus gathered one block at
a time in backward too, not all at once.

The trace is the sequence of groups used (forward and backward) in one training
iteration. After the first iteration, each use advances a cursor along the recorded
trace and starts asynchronous all-gathers of the next groups, up to
``prefetch_numel`` elements ahead and within ``max_live_numel`` gathered elements. A
use that differs from the trace (another code path) stops prefetching for the rest of
the iteration, and that iteration's sequence becomes the trace. Uses under
``torch.no_grad`` (evaluation) neither record nor prefetch, and free every group after
its forward.

Activation checkpointing recomputes a block's forward inside backward: the block's
pre-hook then finds its group already gathered by the pre-backward hook (no second
all-gather), the post-hook keeps it for the backward that follows instead of freeing
it, and the trace records the recompute where backward ran it, so prefetching follows
the recompute order whatever it is. Reentrant checkpoints (forward under ``no_grad``)
are not recorded in forward; their recompute is, in backward.

Every rank must run the same modules in the same order (as with any ZeRO-3): the
all-gathers are collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from terascale.zero.flat_group import FlatParamGroup, ShardState
from terascale.zero.wrap import GroupPlan


@dataclass(frozen=True)
class SchedulePolicy:
    """DeepSpeed's stage-3 knobs, in elements."""

    prefetch_numel: int = 50_000_000  # stage3_prefetch_bucket_size
    max_live_numel: int = 1_000_000_000  # stage3_max_live_parameters
    max_reuse_distance: int = 1_000_000_000  # stage3_max_reuse_distance


def _grad_tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _grad_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _grad_tensors(o)]
    return []


class ParamSchedule:
    """Gathers and frees the non-persistent ``groups`` around their modules' use."""

    def __init__(
        self,
        plans: Sequence[GroupPlan],
        groups: Sequence[FlatParamGroup],
        policy: SchedulePolicy,
        fetch: Callable[[int], bool] | None = None,
    ) -> None:
        self.groups = list(groups)
        self.policy = policy
        # Starts reading an offloaded shard ahead of its gather; False when no buffer is free.
        self._fetch = fetch
        self._dynamic = [not fg.persistent for fg in self.groups]
        self._root = {g for g, plan in enumerate(plans) if plan.module_name == ""}
        self._has_frozen = [any(k < 0 for k in plan.opt_group) for plan in plans]
        self.trace: list[int] = []
        self._events: list[int] = []
        self._cursor = 0
        self._following = False
        self._handles = []
        for g, plan in enumerate(plans):
            if self._dynamic[g]:
                self._handles.append(
                    plan.module.register_forward_pre_hook(self._pre_forward_hook(g), with_kwargs=True)
                )
                self._handles.append(plan.module.register_forward_hook(self._post_forward_hook(g)))
        self.gathers = 0  # all-gathers issued (counts for tests and reports)
        self.prefetches = 0  # of which ahead of use, along the trace

    # -- hooks -------------------------------------------------------------------------------

    def _pre_forward_hook(self, g: int):
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            self._use(g)
            if self._has_frozen[g] and torch.is_grad_enabled():
                inputs = _grad_tensors((args, kwargs))
                if inputs:  # the module's backward is done once its inputs have gradients
                    torch.autograd.graph.register_multi_grad_hook(inputs, lambda grads: self._free(g), mode="all")

        return hook

    def _post_forward_hook(self, g: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            training = torch.is_grad_enabled()
            if training:
                tensors = _grad_tensors(output)
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: self._use(g), mode="any")
            # A forward inside backward is an activation-checkpoint recompute: the backward
            # that follows needs the group, and frees it when its gradients are done.
            keep = self._in_backward() or (training and (g in self._root or self._reused_soon(g)))
            if not keep and self.groups[g].state is ShardState.UNSHARDED:
                self.groups[g].reshard(keep_memory=self._gather_of_size_ahead(g))

        return hook

    def on_grads_done(self, g: int) -> None:
        """Every trainable parameter of group ``g`` has its gradient: free it (a group with
        frozen parameters is freed after its module's backward instead)."""
        if self._dynamic[g] and not self._has_frozen[g]:
            self._free(g)

    def post_backward(self) -> None:
        """Free every group and make this iteration's sequence the trace if it differs."""
        for g, fg in enumerate(self.groups):
            if self._dynamic[g]:
                self._free(g)
        if self._events and self._events != self.trace:
            self.trace = self._events
        self._events = []
        self._cursor = 0
        self._following = bool(self.trace)

    # -- gathering ---------------------------------------------------------------------------

    def _use(self, g: int) -> None:
        # Backward runs with grad mode off; it is still part of the training iteration.
        recording = torch.is_grad_enabled() or self._in_backward()
        if recording:
            self._events.append(g)
            if self._following:
                if self._cursor < len(self.trace) and self.trace[self._cursor] == g:
                    self._cursor += 1
                else:
                    self._following = False
        fg = self.groups[g]
        if fg.state is ShardState.SHARDED:
            self.gathers += 1
        fg.unshard()
        fg.wait()
        if recording and self._following:
            self._prefetch()

    @staticmethod
    def _in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    def _prefetch(self) -> None:
        live = self._live_numel()
        budget = self.policy.prefetch_numel
        # Groups ahead that are already gathered or in flight count against the bucket, so
        # the window of prefetched elements slides along the trace instead of growing.
        ahead = 0
        seen: set[int] = set()
        for g in self.trace[self._cursor :]:
            if g in seen or not self._dynamic[g]:
                continue
            seen.add(g)
            fg = self.groups[g]
            if fg.state is not ShardState.SHARDED:
                ahead += fg.numel
                if ahead >= budget:
                    break
                continue
            if ahead + fg.numel > budget or live + fg.numel > self.policy.max_live_numel:
                break
            fg.unshard(async_op=True)
            self.gathers += 1
            self.prefetches += 1
            ahead += fg.numel
            live += fg.numel
        if self._fetch is not None:
            # Reads from NVMe run further ahead than gathers: as far as free buffers allow.
            for g in self.trace[self._cursor :]:
                if self.groups[g].state is ShardState.SHARDED and not self._fetch(g):
                    break

    def _reused_soon(self, g: int) -> bool:
        """Whether the trace uses ``g`` again within the reuse distance and the budget allows."""
        if not self._following:
            return False
        between: set[int] = set()
        for h in self.trace[self._cursor :]:
            if h == g:
                distance = sum(self.groups[x].numel for x in between)
                return (
                    distance <= self.policy.max_reuse_distance
                    and self._live_numel() <= self.policy.max_live_numel
                )
            between.add(h)
        return False

    def _free(self, g: int) -> None:
        fg = self.groups[g]
        fg.wait()
        if fg.state is ShardState.UNSHARDED:
            fg.reshard(keep_memory=self._gather_of_size_ahead(g))

    def _gather_of_size_ahead(self, g: int) -> bool:
        """Whether the trace still has a gather of a group the size of ``g`` (``g`` itself,
        or one now sharded) ahead: then ``g``'s memory is worth keeping for it ([Note: kept
        full buffers]). Without a trace to follow, assume so."""
        if not self.groups[g].keeps_memory:
            return False  # nothing to decide (an accelerator's allocator reuses memory)
        if not self._following:
            return True
        size = self.groups[g].full_nbytes
        for h in self.trace[self._cursor :]:
            fh = self.groups[h]
            if (h == g or fh.state is ShardState.SHARDED) and fh.full_nbytes == size:
                return True
        return False

    def _live_numel(self) -> int:
        return sum(fg.numel for g, fg in enumerate(self.groups) if self._dynamic[g] and fg.state is not ShardState.SHARDED)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
