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

Under a ``torch.func`` gradient transform (``torch.func.grad(engine)``: [Note: torch.func
through the engine]) the forward frees nothing and records nothing in the trace: the
transform's backward (a ``hessian`` runs two, ``vjp`` returns a function that runs one
later, and a level-0 backward of its output may follow) needs every group, and it
accumulates no gradient, so nothing frees groups in it. They stay gathered until a later
forward's post-hook or a training backward's end frees them; a model differentiated with
``torch.func`` at ZeRO-3 is thus held in full between those points.

Every rank must run the same modules in the same order (as with any ZeRO-3): the
all-gathers are collectives.

[Note: parameters read outside their owner]
The hooks above sit on *units*: the modules that own non-persistent groups, and the root
(always, so that a forward is known to run). A unit's pre-forward pushes a frame on a
stack of running units; every group the frame gathered counts as *held* until its
post-forward pops it. A group is read outside its owner's forward when a module reads
another's weight (``nn.MultiheadAttention`` reads ``out_proj.weight``), when a block is
called as ``block.forward(x)`` (no hook runs), or when the unit that owns it never runs.
Every ``module.weight`` read of a non-persistent parameter is seen ([Note: reading
module._parameters]); one whose group is not held by a running unit, during a forward,

- gathers the group at once (a collective: every rank runs the same code), and
- makes it an *external* group of the innermost running unit: from then on that unit
  gathers it with its own groups in its pre-forward, pre-backward and recompute, frees it
  after its forward as its own (unless an enclosing unit still holds it), and the trace
  records it, so it is prefetched like any group. In backward an external group of
  trainable parameters is freed when its gradients are done, as any group; one of frozen
  parameters when its unit's inputs have their gradients (or when backward ends).

A unit whose forward returns its own parameter, or a view of it, hands the group to the
enclosing unit the same way (it is used after the forward that owns it).
``register_external_parameter(module, param)`` adds the same relation explicitly (for
reads that go around ``module._parameters``), to the unit that is ``module`` or its
innermost wrapped ancestor. Reads outside any forward (between steps, in a hook running
on one rank only) gather nothing: a collective there could be entered by one rank alone.
They see what the parameter holds, an empty tensor while it is sharded, as with
DeepSpeed; ``GatheredParameters`` reads parameters in full there. In backward the stack
holds only recomputes, and a read there gathers without registering anything: the
forward already registered what it read. A block called through ``.forward`` makes its
groups externals of the enclosing unit (often the root), which then holds them for
its whole forward: correct, but without ZeRO-3's saving for that forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from terascale.zero.external import hook_parameter_reads, registered_external_parameters, restore_parameters
from terascale.zero.flat_group import FlatParamGroup, ShardState
from terascale.zero.func_transforms import grad_transform_active, outside_transforms
from terascale.zero.wrap import GroupPlan


@dataclass(frozen=True)
class SchedulePolicy:
    """DeepSpeed's stage-3 knobs, in elements."""

    prefetch_numel: int = 50_000_000  # stage3_prefetch_bucket_size
    max_live_numel: int = 1_000_000_000  # stage3_max_live_parameters
    max_reuse_distance: int = 1_000_000_000  # stage3_max_reuse_distance


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _grad_tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in _tensors(obj) if t.requires_grad]


@dataclass
class _Unit:
    """A module whose forward gathers groups: its own (``groups``) and its externals
    ([Note: parameters read outside their owner])."""

    module: nn.Module
    groups: list[int]
    root: bool = False
    detected: set[int] = field(default_factory=set)  # read in its forward
    explicit: dict[tuple[int, int], int] = field(default_factory=dict)  # (id(module), id(param)) -> group

    def uses(self) -> list[int]:
        """Its groups, then its external groups in group order (the same on every rank)."""
        own = set(self.groups)
        return self.groups + sorted((self.detected | set(self.explicit.values())) - own)


@dataclass
class _Frame:
    """A running forward of unit ``unit`` and the groups it holds gathered."""

    unit: int
    held: list[int]


class ParamSchedule:
    """Gathers and frees the non-persistent ``groups`` around their modules' use, and
    wherever ``module`` (the model) reads their parameters in a forward."""

    def __init__(
        self,
        module: nn.Module,
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
        self._has_frozen = [any(k < 0 for k in plan.opt_group) for plan in plans]
        # Without a trainable parameter (a forward-only engine: no optimizer) no backward
        # will run: every forward is treated as one under no_grad, its groups freed after it.
        self._trains = any(k >= 0 for plan in plans for k in plan.opt_group)
        self._group_of = {id(p): g for g, fg in enumerate(self.groups) if self._dynamic[g] for p in fg.params}
        by_module: dict[int, _Unit] = {id(module): _Unit(module, [], root=True)}
        for g, plan in enumerate(plans):
            if self._dynamic[g]:
                by_module.setdefault(id(plan.module), _Unit(plan.module, [])).groups.append(g)
        self._units = list(by_module.values())
        self._unit_of = _innermost_units(module, {id(u.module): k for k, u in enumerate(self._units)})
        self._frames: list[_Frame] = []
        self._held: dict[int, int] = {}  # group -> frames holding it
        self._pinned: dict[int, int] = {}  # group -> GatheredParameters contexts holding it ([Note: pinned groups])
        self.trace: list[int] = []
        self._events: list[int] = []
        self._cursor = 0
        self._following = False
        self._handles = []
        for u, unit in enumerate(self._units):
            self._handles.append(unit.module.register_forward_pre_hook(self._pre_forward_hook(u), with_kwargs=True))
            self._handles.append(unit.module.register_forward_hook(self._post_forward_hook(u), always_call=True))
        self._read_hooked = [
            m for m in module.modules() if self._owns_dynamic(m) and hook_parameter_reads(m, self._on_read)
        ]
        for m in module.modules():
            for p in registered_external_parameters(m):
                self.add_external(m, p)
        self.gathers = 0  # all-gathers issued (counts for tests and reports)
        self.prefetches = 0  # of which ahead of use, along the trace

    def _owns_dynamic(self, module: nn.Module) -> bool:
        return any(p is not None and id(p) in self._group_of for p in module._parameters.values())

    # -- hooks -------------------------------------------------------------------------------

    def _pre_forward_hook(self, u: int):
        unit = self._units[u]

        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            frame = _Frame(u, unit.uses())
            self._frames.append(frame)
            for g in frame.held:
                self._held[g] = self._held.get(g, 0) + 1
            for g in frame.held:
                self._use(g)
            frozen = [g for g in frame.held if self._has_frozen[g]]
            if frozen and self._grad_enabled():
                inputs = _grad_tensors((args, kwargs))
                if inputs:  # the module's backward is done once its inputs have gradients
                    torch.autograd.graph.register_multi_grad_hook(
                        inputs, lambda grads: self._free_all(frozen), mode="all"
                    )

        return hook

    def _post_forward_hook(self, u: int):
        unit = self._units[u]

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            frame = self._pop(u)
            if frame is None:
                return  # the pre-hook did not run (an error before it)
            training = self._grad_enabled()
            if training and unit.uses():
                tensors = _grad_tensors(output)
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: self._use_unit(u), mode="any")
            # A forward inside backward is an activation-checkpoint recompute: the backward
            # that follows needs the groups, and frees them when their gradients are done.
            if self._in_backward():
                return
            if grad_transform_active():
                return  # kept for the transform's backward(s) ([Note: gather schedule])
            escaped = self._escaping(frame.held, output)
            self._hand_to_enclosing(escaped)
            for g in frame.held:
                if g in escaped or self._held.get(g) or self._pinned.get(g) or (
                    training and (unit.root or self._reused_soon(g))
                ):
                    continue  # still held by an enclosing forward, or kept for what follows
                if self.groups[g].state is ShardState.UNSHARDED:
                    with outside_transforms():  # [Note: torch.func through the engine]
                        self.groups[g].reshard(keep_memory=self._gather_of_size_ahead(g))

        return hook

    def _pop(self, u: int) -> _Frame | None:
        """Take unit ``u``'s innermost frame off the stack (with any frames above it, left
        by a forward that raised) and release what they hold."""
        for k in range(len(self._frames) - 1, -1, -1):
            if self._frames[k].unit == u:
                popped = self._frames[k:]
                del self._frames[k:]
                for frame in popped:
                    for g in frame.held:
                        self._held[g] -= 1
                        if not self._held[g]:
                            del self._held[g]
                return popped[0]
        return None

    def _escaping(self, held: list[int], output: Any) -> set[int]:
        """The groups of ``held`` that a forward's ``output`` returns a view of (a module
        returning its own parameter): they are used after the forward, outside it."""
        full = {}
        for g in held:
            fg = self.groups[g]
            if fg.state is ShardState.UNSHARDED:
                full[fg.full_buffer.untyped_storage().data_ptr()] = g
        out: set[int] = set()
        for t in _tensors(output) if full else ():
            try:
                ptr = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):  # no storage of its own (sparse, a wrapper subclass)
                continue
            if ptr in full:
                out.add(full[ptr])
        return out

    def _hand_to_enclosing(self, groups: set[int]) -> None:
        """Make ``groups`` externals of the innermost running unit, held by its frame. With
        none running (the root returned them) they stay gathered until backward frees them."""
        if not groups or not self._frames:
            return
        outer = self._frames[-1]
        for g in sorted(groups):
            self._units[outer.unit].detected.add(g)
            if g not in outer.held:
                outer.held.append(g)
                self._held[g] = self._held.get(g, 0) + 1

    def _use_unit(self, u: int) -> None:
        for g in self._units[u].uses():
            self._use(g)

    def _free_all(self, groups: list[int]) -> None:
        for g in groups:
            self._free(g)

    def _on_read(self, param: nn.Parameter) -> None:
        """A ``module.name`` read of ``param`` (see [Note: parameters read outside their owner])."""
        g = self._group_of.get(id(param))
        if g is None or ((g in self._held or g in self._pinned) and self.groups[g].state is ShardState.UNSHARDED):
            return
        if not self._frames:
            return  # outside a forward: no collective
        frame = self._frames[-1]
        if g not in self._held:
            if not self._in_backward():
                self._units[frame.unit].detected.add(g)
            frame.held.append(g)
            self._held[g] = 1
        self._use(g)

    # -- external parameters -----------------------------------------------------------------

    def add_external(self, module: nn.Module, param: nn.Parameter) -> None:
        """``module``'s forward uses ``param``: gather its group with the unit running it
        (``register_external_parameter``; no-op for parameters or modules not in this model)."""
        g, u = self._group_of.get(id(param)), self._unit_of.get(id(module))
        if g is not None and u is not None:
            self._units[u].explicit[(id(module), id(param))] = g

    def remove_external(self, module: nn.Module, param: nn.Parameter) -> None:
        u = self._unit_of.get(id(module))
        if u is not None:
            self._units[u].explicit.pop((id(module), id(param)), None)

    def pin(self, groups: Sequence[int]) -> None:
        """Keep ``groups`` (gathered by a ``GatheredParameters``) full until :meth:`unpin`.

        [Note: pinned groups]
        Inside ``GatheredParameters`` the model may run (TRL generates under
        ``GatheredParameters(model.parameters())``): its hooks then find the groups full and
        must not free them after a forward or at the end of backward, or the context's
        parameters would be empty before it exits. Pinned groups count as held by the
        context; the context frees the ones it gathered when it exits, unless a running
        forward still holds them (its post-forward frees them then)."""
        for g in groups:
            self._pinned[g] = self._pinned.get(g, 0) + 1

    def unpin(self, groups: Sequence[int]) -> None:
        for g in groups:
            self._pinned[g] -= 1
            if not self._pinned[g]:
                del self._pinned[g]

    def in_use(self, g: int) -> bool:
        """Whether a running forward or a ``GatheredParameters`` holds group ``g``."""
        return bool(self._held.get(g) or self._pinned.get(g))

    def is_external(self, g: int) -> bool:
        """Whether group ``g`` is an external group of some unit (read outside its owner:
        ``param.is_external_param``)."""
        return any(g in set(u.uses()) - set(u.groups) for u in self._units)

    def modules_holding(self, g: int) -> set[int]:
        """``id()`` of the modules whose running forward holds group ``g`` (``param.ds_active_sub_modules``)."""
        return {id(self._units[f.unit].module) for f in self._frames if g in f.held}

    def on_grads_done(self, g: int) -> None:
        """Every trainable parameter of group ``g`` has its gradient: free it (a group with
        frozen parameters is freed after its module's backward instead)."""
        if self._dynamic[g] and not self._has_frozen[g]:
            self._free(g)

    def free_idle(self) -> None:
        """Free every gathered group that no running forward or ``GatheredParameters``
        holds; called before an update changes the shards. A training backward ends with
        every group freed, but a backward that accumulates no gradient (``torch.autograd.grad``,
        a ``torch.func`` transform's) gathers groups and frees none: run between a training
        backward and the step, it would leave the full parameters of before the update in
        place, and the next forward would find them gathered and use them."""
        for g in range(len(self.groups)):
            if self._dynamic[g] and not self.in_use(g):
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
        # The buffers are raw tensors; under torch.func.grad every operator would wrap them.
        with outside_transforms():
            self._use_raw(g, training=not grad_transform_active())

    def _use_raw(self, g: int, training: bool) -> None:
        # Backward runs with grad mode off; it is still part of the training iteration. A
        # gradient transform's forward and backward are not ([Note: torch.func through
        # the engine]): they neither record nor follow the trace.
        recording = training and (self._grad_enabled() or self._in_backward())
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

    def _grad_enabled(self) -> bool:
        """Whether a backward may follow this forward."""
        return self._trains and torch.is_grad_enabled()

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
        if self._pinned.get(g):
            return  # [Note: pinned groups]
        fg = self.groups[g]
        with outside_transforms():
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
        for m in self._read_hooked:
            restore_parameters(m)
        self._read_hooked = []


def _innermost_units(root: nn.Module, units: dict[int, int]) -> dict[int, int]:
    """``id(module)`` -> the unit that is the module or its innermost ancestor with one,
    for every module of ``root`` (``units``: ``id(unit module)`` -> unit; the root has one)."""
    names = {id(m): name for name, m in root.named_modules()}
    by_name = {names[mid]: u for mid, u in units.items() if mid in names}
    out = {}
    for name, m in root.named_modules():
        parts = name.split(".") if name else []
        while ".".join(parts) not in by_name:
            parts.pop()
        out[id(m)] = by_name[".".join(parts)]
    return out
