"""Activation checkpointing: run a function without keeping its activations, recompute in backward.

[Note: activation checkpointing]
:meth:`ActivationCheckpointing.run` is torch's non-reentrant checkpoint with three
things around it:

- randomness: the RNG streams are snapshotted before the function runs and replayed
  for the recompute ([Note: RNG replay]), including the tensor-parallel tracker's;
- inputs: keyword arguments are passed to torch as positional ones, so that *every*
  tensor input is saved through torch's input saving and lands in the
  :class:`~terascale.activation.store.InputStore` (device, host or NVMe, partitioned
  over tensor-parallel ranks; [Note: checkpoint inputs]);
- ``selective``: torch's selective checkpointing keeps the outputs of matrix products
  and attention and recomputes only the cheap operations between them.

``reentrant`` runs torch's reentrant checkpoint instead (DeepSpeed's pipeline default,
``pipeline.use_reentrant``): the forward under ``no_grad``, the recompute and a nested
backward inside the outer one. The same input store holds its inputs (the reentrant form
saves exactly them, with ``save_for_backward``) and the same RNG replay runs around its
recompute (every call of the function after the first is one). It computes a gradient
only through inputs that require one; when none does (a pipeline's first stage) it is
given aliases of them that do, or the block's parameters would get no gradient, and
where no input is a floating tensor (token ids) the non-reentrant form runs instead.

ZeRO-3 needs nothing special from here: a recompute is a forward *inside* backward, so
the gather schedule keeps the groups it gathers for the backward that follows and the
trace records the recompute in its backward position ([Note: gather schedule]).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from terascale.activation.rng import RNGSnapshot, RNGStatesTracker, replaying
from terascale.activation.store import BlockStats, InputStore

aten = torch.ops.aten

# [Note: selective checkpointing]: the outputs worth keeping are those of the expensive
# operations (matrix products, attention); everything between them (norms, activations,
# dropout, residual adds) is recomputed. On a transformer block this keeps about a third
# of the activations for a few percent of recompute.
SAVED_BY_SELECTIVE = frozenset(
    op
    for op in (
        getattr(aten, name, None)
        for name in (
            "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution",
            "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        )  # fmt: skip
    )
    if op is not None
)


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> torch_checkpoint.CheckpointPolicy:
    if op in SAVED_BY_SELECTIVE:
        return torch_checkpoint.CheckpointPolicy.MUST_SAVE
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def _alias_requiring_grad(t: torch.Tensor) -> torch.Tensor:
    """``t``'s data as a leaf that requires a gradient (floating tensors only); the gradient
    it gets is dropped."""
    if not (t.is_floating_point() or t.is_complex()):
        return t
    return t.detach().requires_grad_(True)


@dataclass
class BlockTimes:
    """Seconds one label's checkpoints took this step (``profile``)."""

    forward_s: float = 0.0
    recompute_s: float = 0.0
    recompute_bytes: int = 0  # bytes the recompute produced: what the block would keep unchecked


def _nbytes(out: Any) -> int:
    """Bytes of the tensors in an operation's output (a tensor, or a tuple/list of them)."""
    return sum(t.numel() * t.element_size() for t in tree_leaves(out) if isinstance(t, torch.Tensor))


class _OutputBytes(TorchDispatchMode):
    """Sums the bytes of every tensor an operation returns (the recompute's working set)."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.nbytes += _nbytes(out)
        return out


class _SavedOutputs(TorchDispatchMode):
    """Counts the bytes of the outputs selective checkpointing keeps (its cache is not
    made of saved tensors, so saved-tensor hooks do not see it)."""

    def __init__(self, stats: BlockStats) -> None:
        super().__init__()
        self.stats = stats

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in SAVED_BY_SELECTIVE or getattr(func, "overloadpacket", None) in SAVED_BY_SELECTIVE:
            self.stats.selective_bytes += _nbytes(out)
        return out


@contextlib.contextmanager
def _both(outer: Any, inner: Any) -> Iterator[None]:
    with outer, inner:
        yield


class ActivationCheckpointing:
    """Checkpoints functions and blocks of one training process (see [Note: activation checkpointing]).

    ``device``: the training device, whose RNG the recompute replays. ``tracker``: the
    tensor-parallel RNG tracker to replay too (None: none). ``synchronize`` waits for
    the device at each checkpoint's boundaries (DeepSpeed's
    ``synchronize_checkpoint_boundary``); ``profile`` times forward and recompute per
    label and measures each recompute's output bytes.
    """

    def __init__(
        self,
        store: InputStore,
        device: torch.device,
        tracker: RNGStatesTracker | None = None,
        *,
        synchronize: bool = False,
        profile: bool = False,
    ) -> None:
        self.store = store
        self.device = device
        self.tracker = tracker
        self.synchronize = synchronize
        self.profile = profile
        self.times: dict[str, BlockTimes] = defaultdict(BlockTimes)
        self._warned_in_place: set[str] = set()

    def checkpoint(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)``, keeping only its inputs for backward."""
        return self.run(function, args, kwargs)

    def run(
        self,
        function: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        *,
        label: str = "checkpoint",
        selective: bool = False,
        reentrant: bool = False,
    ) -> Any:
        """Run ``function`` checkpointed (under ``no_grad`` it just runs: nothing is saved)."""
        if not torch.is_grad_enabled():
            return function(*args, **kwargs)
        assert not (selective and reentrant), "torch's reentrant checkpoint has no selective form"
        keys = list(kwargs)
        n = len(args)

        def call(*flat: Any) -> Any:
            return function(*flat[:n], **dict(zip(keys, flat[n:])))

        snapshot = RNGSnapshot.take(self.device, self.tracker)
        inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        if reentrant and any(t.requires_grad or t.is_floating_point() or t.is_complex() for t in inputs):
            return self._run_reentrant(call, [*args, *(kwargs[k] for k in keys)], label, snapshot)

        def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
            forward, recompute = contextlib.nullcontext(), contextlib.nullcontext()
            if selective:
                forward, recompute = torch_checkpoint.create_selective_checkpoint_contexts(_selective_policy)
                forward = _both(forward, _SavedOutputs(self.store.stats[label]))
            return forward, self._recomputing(label, snapshot, recompute)

        start = self._boundary()
        versions = [t._version for t in inputs]
        with self.store.hooks(label):
            out = torch_checkpoint.checkpoint(
                call, *args, *(kwargs[k] for k in keys),
                use_reentrant=False, preserve_rng_state=False, context_fn=contexts,
            )  # fmt: skip
        self._forward_done(label, start, any(t._version != v for t, v in zip(inputs, versions)))
        return out

    def _run_reentrant(self, call: Callable[..., Any], flat: list[Any], label: str, snapshot: RNGSnapshot) -> Any:
        calls = 0
        changes_inputs = False

        def replayed(*a: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:  # the forward; every later call is a recompute in a backward
                return call(*a)
            if changes_inputs:
                # The recompute gets leaves that require a gradient, which an in-place
                # first operation (ReLU(inplace=True)) may not change: give it copies,
                # through which the gradient still reaches them.
                a = tuple(t.clone() if isinstance(t, torch.Tensor) and t.requires_grad else t for t in a)
            with self._recomputing(label, snapshot, contextlib.nullcontext()):
                return call(*a)

        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if not any(t.requires_grad for t in tensors):
            flat = [_alias_requiring_grad(t) if isinstance(t, torch.Tensor) else t for t in flat]
        start = self._boundary()
        versions = [t._version for t in tensors]
        with self.store.hooks(label):
            out = torch_checkpoint.checkpoint(replayed, *flat, use_reentrant=True, preserve_rng_state=False)
        changes_inputs = any(t._version != v for t, v in zip(tensors, versions))
        self._forward_done(label, start, changes_inputs)
        return out

    def _forward_done(self, label: str, start: float, changed_inputs: bool) -> None:
        """After a checkpointed forward: warn once if it changed its inputs in place; time it."""
        if label not in self._warned_in_place and changed_inputs:
            self._warn_in_place(label)
        if self.profile:
            self.times[label].forward_s += self._boundary() - start
        elif self.synchronize:
            self._boundary()

    def _warn_in_place(self, label: str) -> None:
        # [Note: inputs changed in place]: the saved input may be the changed tensor itself
        # (it is not copied where it stays on the device), so the recompute can start from
        # the changed values. torch's own checkpoint refuses this through version counters,
        # which the input store's hooks bypass; DeepSpeed's runs it silently. An op whose
        # repeat changes nothing (ReLU) still gives the right gradients, so this warns
        # instead of refusing, once per checkpoint label.
        self._warned_in_place.add(label)
        warnings.warn(
            f"activation checkpoint {label!r}: the checkpointed function changed its input in place; "
            "the recompute in backward may start from the changed values, which gives wrong gradients "
            "unless repeating the change changes nothing (ReLU). Make the function's first operation "
            "out of place (inplace=False)",
            RuntimeWarning,
            stacklevel=3,
        )

    @contextlib.contextmanager
    def _recomputing(
        self, label: str, snapshot: RNGSnapshot, inner: contextlib.AbstractContextManager
    ) -> Iterator[None]:
        start = self._boundary()
        counter = _OutputBytes() if self.profile else contextlib.nullcontext()
        try:
            with replaying(snapshot, self.tracker), inner, counter:
                yield
        finally:
            if self.profile:
                times = self.times[label]
                times.recompute_s += self._boundary() - start
                times.recompute_bytes += counter.nbytes
            elif self.synchronize:
                self._boundary()

    def _boundary(self) -> float:
        if (self.synchronize or self.profile) and self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)
        return time.perf_counter()

    def checkpoint_sequential(
        self, functions: nn.Sequential | Sequence[Callable[[Any], Any]], segments: int, input: Any, **kwargs: Any
    ) -> Any:
        """Run ``functions`` one after another in ``segments`` checkpointed runs; the last
        segment runs plainly (its activations are needed at once by backward)."""
        functions = list(functions.children()) if isinstance(functions, nn.Sequential) else list(functions)
        if segments < 1:
            raise ValueError(f"checkpoint_sequential needs at least one segment, got {segments}")
        size = -(-len(functions) // segments)
        bounds = [(s, min(s + size, len(functions))) for s in range(0, len(functions), size)]

        def segment(lo: int, hi: int) -> Callable[[Any], Any]:
            def run(x: Any) -> Any:
                for f in functions[lo:hi]:
                    x = f(x)
                return x

            return run

        for k, (lo, hi) in enumerate(bounds[:-1]):
            input = self.run(segment(lo, hi), (input,), {}, label=f"segment{k}")
        lo, hi = bounds[-1]
        return segment(lo, hi)(input)

    def before_backward(self) -> None:
        self.store.before_backward()

    def reset_stats(self) -> None:
        self.times = defaultdict(BlockTimes)
        self.store.reset_stats()

    def report(self) -> list[dict[str, Any]]:
        """Per label: checkpoints, input bytes kept, forward/recompute/offload/fetch-wait
        milliseconds and recompute output bytes, for this step so far."""
        rows = []
        for label in dict.fromkeys([*self.store.stats, *self.times]):
            stats, times = self.store.stats.get(label), self.times.get(label, BlockTimes())
            rows.append({
                "block": label,
                "checkpoints": stats.inputs if stats else 0,
                "input_bytes": stats.bytes if stats else 0,
                "forward_ms": 1e3 * times.forward_s,
                "recompute_ms": 1e3 * times.recompute_s,
                "offload_ms": 1e3 * (stats.offload_s if stats else 0.0),
                "fetch_wait_ms": 1e3 * (stats.fetch_wait_s if stats else 0.0),
                "recompute_bytes": times.recompute_bytes,
                "selective_bytes": stats.selective_bytes if stats else 0,
            })  # fmt: skip
        return rows

    def close(self) -> None:
        self.store.close()
