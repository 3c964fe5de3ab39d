"""FLOPs, MACs, parameters and forward latency per module, for any window of training.

[Note: how the flops profiler counts]
Counting is ``torch.utils.flop_counter.FlopCounterMode``'s: a dispatch mode that sees every
aten operation and prices the matrix-like ones (``mm``, ``addmm``, ``bmm``, ``baddbmm``,
convolutions and their backward, attention kernels) with torch's own formulas; element-wise
operations, norms and softmax count zero. One multiply-accumulate is 2 FLOPs in all of
them, so MACs = FLOPs / 2 (DeepSpeed's convention too: a linear layer is 2·B·in·out FLOPs
and B·in·out MACs; torch counts no bias additions).

The profiler attributes the running total to modules itself, by module identity rather
than by the counter's names (those depend on which module the counter saw first, e.g. an
engine wrapping the model):

- forward: a module's forward pre/post hooks read the total before and after the call, so
  a module's FLOPs include its submodules' and every call adds up;
- backward: a span opens when the first of the module's outputs gets its gradient and
  closes when the module has computed the gradients of all its inputs
  (``torch.autograd.graph.register_multi_grad_hook``). To see the module's own input
  gradients, not their sums with those of siblings that share the input (q, k and v
  projections of one hidden state), the forward pre-hook passes the module an alias of
  each input (``view_as``: same storage and values, one more autograd node); should the
  module write into that alias in place (which cuts the alias's node out of the graph) the
  span closes on the original input's gradient instead. A module whose inputs need no
  gradient (the first layer, an embedding) closes when its own parameters have theirs;
- activation checkpointing: a forward that runs inside backward is a recompute. Its FLOPs
  are backward FLOPs of the recomputed module (and of its ancestors, whose spans are open),
  and are taken out of any open span of a module outside that subtree (the layer whose
  backward happened to trigger the recompute). Nothing of a recompute counts as forward.

Latency is the wall time of each forward call (recomputes excluded), synchronised with the
device when it is CUDA. With ZeRO stage 3 a module's call includes the gather of its
parameters, as the user sees it.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils import flop_counter
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.hooks import RemovableHandle

from terascale.profiling.flops_report import ModuleProfile, format_macs, format_params, human, render_report

aten = torch.ops.aten


@dataclass
class _Counts:
    fwd_flops: int = 0
    bwd_flops: int = 0
    fwd_latency_s: float = 0.0
    calls: int = 0  # forward calls outside backward
    runs: int = 0  # forward calls, recomputes included
    open_spans: int = 0  # backward spans of this module open right now


@dataclass
class _Frame:
    index: int
    flops0: int
    t0: float
    recompute: bool
    outermost_recompute: bool
    aliases: list[torch.Tensor]  # what the module got in place of its inputs needing a gradient
    inputs: list[torch.Tensor]  # those inputs


@dataclass(eq=False)
class _Span:
    """One forward call's backward: FLOPs from its outputs' gradients to its inputs'."""

    index: int
    start: int | None = None  # the running total when it opened; None while closed
    task: int = -1  # the backward (graph task) it opened in
    excluded: int = 0  # recomputes of other subtrees that ran while it was open
    settled: bool = False  # closed (or can no longer open): its hooks may go
    handles: list[RemovableHandle] = field(default_factory=list)


def _cpu_attention_mapping() -> dict[Any, Any]:
    """torch prices the CUDA attention kernels but not the CPU flash kernel that
    ``F.scaled_dot_product_attention`` runs on CPU; route it to torch's own formulas."""
    mapping: dict[Any, Any] = {}
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None and hasattr(flop_counter, "sdpa_flop_count"):

        def attention(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
            return flop_counter.sdpa_flop_count(query, key, value)

        mapping[fwd] = attention
    if bwd is not None and hasattr(flop_counter, "sdpa_backward_flop_count"):

        def attention_backward(
            grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any
        ) -> int:
            return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)

        mapping[bwd] = attention_backward
    return mapping


def _graph_task() -> int:
    """The id of the backward running on this thread, -1 outside one: what torch's own
    ``ModuleTracker.is_bw`` and ``register_multi_grad_hook`` read (no public spelling)."""
    return torch._C._current_graph_task_id()


def _tensors_needing_grad(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor) and t.requires_grad]


class FlopsProfiler:
    """Per-module FLOPs (forward and backward as measured), MACs, parameters and forward
    latency of ``module`` over the work between :meth:`start` and :meth:`stop`.

    No value the module computes changes: the profiler adds forward hooks to its modules
    (which hand each module aliases of its inputs, see [Note: how the flops profiler
    counts]), gradient hooks that read (never replace) gradients, and a counting dispatch
    mode; :meth:`stop` removes all of them. Windows add up until :meth:`reset`.

    ``param_numel`` maps qualified parameter names (as ``module.named_parameters()`` spells
    them) to full element counts, for parameters that hold only a shard or nothing outside
    their use (ZeRO stage 3); without it each parameter counts ``p.numel()``. ``device``
    picks where forward timing synchronises (CUDA only; default: the first parameter's or
    buffer's device). Modules whose type is in ``ignore_modules`` are not profiled, nor are
    their submodules; their work stays in their parents' numbers. The module tree must not
    change after construction.

    Usage::

        prof = FlopsProfiler(model)
        prof.start()
        loss = model(x).sum(); loss.backward(); opt.step()
        prof.stop()
        print(prof.report(module_depth=2, top_modules=3))
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        param_numel: Mapping[str, int] | None = None,
        device: torch.device | str | None = None,
        ignore_modules: Iterable[type[nn.Module]] | None = None,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise ValueError(f"FlopsProfiler profiles a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        self._ignore = tuple(ignore_modules or ())
        if isinstance(module, self._ignore):
            raise ValueError(f"ignore_modules contains the profiled module's own type {type(module).__name__}")
        self._param_numel = dict(param_numel) if param_numel is not None else None
        self.device = torch.device(device) if device is not None else _module_device(module)

        # The tree: every place a module occurs (qualified name, module, depth), root first.
        self._tree = list(_walk(module, self._ignore))
        self._index: dict[int, int] = {}
        self._modules: list[nn.Module] = []
        for _, m, _ in self._tree:
            if id(m) not in self._index:
                self._index[id(m)] = len(self._modules)
                self._modules.append(m)
        self._children = [
            [self._index[id(c)] for c in m.children() if id(c) in self._index] for m in self._modules
        ]
        self._ancestors: list[set[int]] = [set() for _ in self._modules]
        for name, m, _ in self._tree:
            parts = name.split(".") if name else []
            for k in range(len(parts) + 1):
                self._ancestors[self._index[id(m)]].add(self._index[id(module.get_submodule(".".join(parts[:k])))])
        self._check_param_numel()

        self._counts = [_Counts() for _ in self._modules]
        self._counter: FlopCounterMode | None = None
        self._module_hooks: list[RemovableHandle] = []
        self._frames: list[_Frame] = []
        self._open: list[_Span] = []
        self._spans: list[_Span] = []

    # -- window -------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self._counter is not None

    def start(self) -> None:
        """Start counting: hooks on every profiled module and a counting dispatch mode."""
        if self.active:
            raise ValueError("FlopsProfiler.start() called twice; call stop() first")
        self._counter = FlopCounterMode(display=False, custom_mapping=_cpu_attention_mapping())
        self._counter.__enter__()
        for m in self._modules:
            self._module_hooks.append(m.register_forward_pre_hook(self._pre_hook, with_kwargs=True, prepend=True))
            self._module_hooks.append(m.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True))

    def stop(self) -> None:
        """Stop counting and remove every hook and the dispatch mode; the numbers stay."""
        if not self.active:
            return
        for h in self._module_hooks:
            h.remove()
        self._module_hooks.clear()
        for span in self._spans:
            for h in span.handles:
                h.remove()
        self._spans.clear()
        self._open.clear()
        self._frames.clear()
        for c in self._counts:
            c.open_spans = 0
        counter, self._counter = self._counter, None
        assert counter is not None
        counter.__exit__(None, None, None)

    def reset(self) -> None:
        """Forget everything counted so far (a running window goes on from zero)."""
        self._counts = [_Counts(open_spans=c.open_spans) for c in self._counts]

    def __enter__(self) -> FlopsProfiler:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- hooks --------------------------------------------------------------------------------

    def _flops(self) -> int:
        assert self._counter is not None
        return self._counter.get_total_flops()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        recompute = _graph_task() != -1
        if not recompute and not self._frames:
            self._settle_spans()
        outermost = recompute and not any(f.recompute for f in self._frames)
        t0 = 0.0
        if not recompute:
            self._sync()
            t0 = time.perf_counter()
        aliases: list[torch.Tensor] = []
        inputs: list[torch.Tensor] = []

        def alias(t: Any) -> Any:
            # A Parameter stays itself: code may test for one.
            if (
                isinstance(t, torch.Tensor)
                and t.requires_grad
                and t.layout == torch.strided
                and not isinstance(t, nn.Parameter)
            ):
                inputs.append(t)
                aliases.append(t.view_as(t))
                return aliases[-1]
            return t

        if torch.is_grad_enabled():
            args, kwargs = tree_map(alias, (args, kwargs))
        self._frames.append(_Frame(self._index[id(module)], self._flops(), t0, recompute, outermost, aliases, inputs))
        return (args, kwargs) if aliases else None

    def _post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        index = self._index[id(module)]
        frame = None
        while self._frames:  # an exception may have skipped inner post hooks
            frame = self._frames.pop()
            if frame.index == index:
                break
        if frame is None or frame.index != index:
            return
        delta = self._flops() - frame.flops0
        counts = self._counts[index]
        counts.runs += 1
        if frame.recompute:
            if not (frame.outermost_recompute and counts.open_spans):
                counts.bwd_flops += delta
            if frame.outermost_recompute:
                for span in self._open:
                    if span.index not in self._ancestors[index]:
                        span.excluded += delta
        else:
            self._sync()
            counts.fwd_latency_s += time.perf_counter() - frame.t0
            counts.fwd_flops += delta
            counts.calls += 1
        self._watch_backward(module, index, frame, output)

    def _watch_backward(self, module: nn.Module, index: int, frame: _Frame, output: Any) -> None:
        outputs = _tensors_needing_grad(output)
        if not outputs:
            return
        ends = [frame.aliases, frame.inputs] if frame.inputs else [[p for p in module.parameters() if p.requires_grad]]
        if not ends[0]:
            return
        span = _Span(index)
        # "any": the first output gradient starts the module's backward; an "all" hook never
        # fires on the tensor a backward starts from (a loss the module returns). Registered
        # first, so that an output that is also an input (an identity) opens, then closes.
        span.handles.append(register_multi_grad_hook(outputs, lambda grad: self._open_span(span), mode="any"))
        for tensors in ends:  # the first to fire closes it (see [Note: how the flops profiler counts])
            span.handles.append(register_multi_grad_hook(tensors, lambda grads: self._close_span(span)))
        self._spans.append(span)

    def _open_span(self, span: _Span) -> None:
        if span.start is None and self.active:
            span.start = self._flops()
            span.task = _graph_task()
            span.excluded = 0
            self._open.append(span)
            self._counts[span.index].open_spans += 1

    def _close_span(self, span: _Span) -> None:
        if span.start is None or not self.active:
            span.settled = True  # its outputs took no part in this backward: it never will
            return
        if _graph_task() != span.task:
            # A backward nested in this one (a reentrant checkpoint's) computed some of the
            # gradients it waits for: an "all" hook counts per backward and fires early there.
            return
        self._counts[span.index].bwd_flops += self._flops() - span.start - span.excluded
        self._counts[span.index].open_spans -= 1
        self._open.remove(span)
        span.start = None
        span.settled = True

    def _settle_spans(self) -> None:
        """Between steps (a forward outside backward): drop hooks of finished spans, and spans
        left open by a backward that never reached their inputs."""
        for span in self._open:
            self._counts[span.index].open_spans -= 1
            span.start = None
        self._open.clear()
        keep = []
        for span in self._spans:
            if span.settled:
                for h in span.handles:
                    h.remove()
            else:
                keep.append(span)
        self._spans = keep

    # -- results ------------------------------------------------------------------------------

    def profiles(self) -> list[ModuleProfile]:
        """Every profiled module, in tree order (a module shared by two parents appears twice)."""
        numel = self._numel_by_param()
        memo: dict[int, tuple[int, int, float]] = {}
        out = []
        for name, m, depth in self._tree:
            index = self._index[id(m)]
            fwd, bwd, latency = self._inclusive(index, memo)
            params = sum(numel[id(p)] for p in m.parameters())
            calls = self._counts[index].calls
            out.append(ModuleProfile(name, type(m).__name__, depth, params, fwd, bwd, latency, calls))
        return out

    def module_profile(self, name: str) -> ModuleProfile:
        """The profile of the module with qualified name ``name`` ("" for the root)."""
        for p in self.profiles():
            if p.name == name:
                return p
        raise ValueError(f"no profiled module named {name!r}")

    def _inclusive(self, index: int, memo: dict[int, tuple[int, int, float]]) -> tuple[int, int, float]:
        """A module's own numbers if it ran, else its children's summed (a ModuleList)."""
        if index not in memo:
            c = self._counts[index]
            if c.runs:
                memo[index] = (c.fwd_flops, c.bwd_flops, c.fwd_latency_s)
            else:
                memo[index] = (0, 0, 0.0)  # breaks a cycle of shared modules
                parts = [self._inclusive(k, memo) for k in self._children[index]]
                memo[index] = (sum(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts))
        return memo[index]

    def _root(self) -> ModuleProfile:
        return self.profiles()[0]

    def total_flops(self, include_backward: bool = True) -> int:
        """FLOPs of the profiled module: forward, plus backward as measured unless excluded."""
        root = self._root()
        return root.fwd_flops + (root.bwd_flops if include_backward else 0)

    def total_macs(self, include_backward: bool = True) -> int:
        """Multiply-accumulates: :meth:`total_flops` / 2 (see [Note: how the flops profiler counts])."""
        return self.total_flops(include_backward) // 2

    def total_params(self) -> int:
        """Full parameter elements of the profiled module (``param_numel`` where given)."""
        return self._root().params

    def forward_latency(self) -> float:
        """Seconds spent in the profiled module's forward calls during the window."""
        return self._root().fwd_latency_s

    def report(
        self, module_depth: int = -1, top_modules: int = 1, detailed: bool = True, step_time_s: float | None = None
    ) -> str:
        """The profile as text: a summary, the ``top_modules`` heaviest module classes per
        depth, and with ``detailed`` the module tree down to ``module_depth`` (-1: all), one
        module per line. ``step_time_s``: wall time of the window, for its achieved FLOP/s."""
        if module_depth < -1:
            raise ValueError(f"module_depth must be -1 (all) or >= 0, got {module_depth}")
        if top_modules < 1:
            raise ValueError(f"top_modules must be >= 1, got {top_modules}")
        if step_time_s is not None and step_time_s <= 0:
            raise ValueError(f"step_time_s must be > 0, got {step_time_s}")
        return render_report(self.profiles(), module_depth, top_modules, detailed, step_time_s)

    # -- parameters ---------------------------------------------------------------------------

    def _names_by_param(self) -> dict[int, list[str]]:
        names: dict[int, list[str]] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        return names

    def _check_param_numel(self) -> None:
        if self._param_numel is None:
            if any(p.numel() == 0 for p in self.module.parameters()):
                warnings.warn(
                    "FlopsProfiler: some parameters hold no elements (ZeRO stage 3 shards them outside "
                    "their use); pass param_numel= with their full sizes to count them",
                    stacklevel=3,
                )
            return
        known = self._param_numel
        missing = [names[0] for names in self._names_by_param().values() if not any(n in known for n in names)]
        if missing:
            raise ValueError(
                f"param_numel has no entry for {len(missing)} parameter(s) of the profiled module, e.g. "
                f"{missing[:3]}; its keys must be the names module.named_parameters() gives"
            )

    def _numel_by_param(self) -> dict[int, int]:
        out = {}
        by_id = {id(p): p for p in self.module.parameters()}
        for pid, names in self._names_by_param().items():
            if self._param_numel is None:
                out[pid] = by_id[pid].numel()
            else:
                known = [self._param_numel[n] for n in names if n in self._param_numel]
                if not known:
                    raise ValueError(f"param_numel has no entry for parameter {names[0]!r}")
                out[pid] = int(known[0])
        return out


def _walk(root: nn.Module, ignore: tuple[type, ...]) -> Iterator[tuple[str, nn.Module, int]]:
    """(qualified name, module, depth) of every occurrence below ``root``, depth first."""

    def visit(name: str, m: nn.Module, depth: int, path: tuple[int, ...]) -> Iterator[tuple[str, nn.Module, int]]:
        yield name, m, depth
        for child_name, child in m.named_children():
            if isinstance(child, ignore) or id(child) in path:
                continue
            yield from visit(f"{name}.{child_name}" if name else child_name, child, depth + 1, (*path, id(child)))

    yield from visit("", root, 0, (id(root),))


def _module_device(module: nn.Module) -> torch.device:
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


def get_model_profile(
    model: nn.Module,
    input_shape: Sequence[int] | None = None,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = False,
    output_file: str | Path | None = None,
    ignore_modules: Iterable[type[nn.Module]] | None = None,
) -> tuple[int, int, int] | tuple[str, str, str]:
    """Profile one forward of ``model`` and return ``(flops, macs, params)``.

    The model is called as ``model(*args, **kwargs)``; with ``input_shape`` (batch first)
    ``args`` is one tensor of that shape drawn from N(0, 1) in the dtype and on the device
    of the model's first parameter (``kwargs`` may still add keyword arguments). The
    model runs ``warm_up`` unprofiled forwards, then one profiled forward, in eval mode (its
    training mode is restored after) and with autograd on, as DeepSpeed does. ``flops`` are
    the forward's FLOPs with 2 FLOPs per multiply-accumulate (a linear layer: 2·B·in·out),
    ``macs`` half of them, ``params`` the model's parameter elements. The report goes to
    ``output_file`` when given, else to stdout, if ``print_profile``. With ``as_string`` the
    three come back as text with units, e.g. ``("2.1 GFLOPs", "1.05 GMACs", "1.2 M")``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"get_model_profile profiles a torch.nn.Module, got {type(model).__name__}")
    if warm_up < 0:
        raise ValueError(f"warm_up must be >= 0, got {warm_up}")
    args = list(args or [])
    kwargs = dict(kwargs or {})
    if input_shape is not None:
        if args:
            raise ValueError("get_model_profile: input_shape makes the positional input; pass it or args, not both")
        shape = tuple(input_shape)
        if not shape or not all(isinstance(d, int) and d > 0 for d in shape):
            raise ValueError(f"input_shape must be a non-empty tuple of positive ints, got {input_shape!r}")
        first = next(iter(model.parameters()), None)
        dtype = first.dtype if first is not None and first.is_floating_point() else torch.float32
        device = first.device if first is not None else torch.device("cpu")
        args = [torch.randn(shape, dtype=dtype, device=device)]
    if not args and not kwargs:
        raise ValueError("get_model_profile needs input_shape, or args and/or kwargs for the model")

    prof = FlopsProfiler(model, ignore_modules=ignore_modules)
    was_training = model.training
    model.eval()
    try:
        for _ in range(warm_up):
            model(*args, **kwargs)
        with prof:
            model(*args, **kwargs)
    finally:
        model.train(was_training)

    if print_profile:
        text = prof.report(module_depth=module_depth, top_modules=top_modules, detailed=detailed)
        if output_file:
            path = Path(output_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")
        else:
            print(text)
    flops, macs = prof.total_flops(include_backward=False), prof.total_macs(include_backward=False)
    params = prof.total_params()
    if as_string:
        return human(flops, "FLOPs"), format_macs(macs), format_params(params)
    return flops, macs, params
