"""What the planner knows of the model: its parameters, its groups, its activations.

[Note: the model's profile]
The planner sees the model as the user built it, before ``prepare_model``:

- parameters: every distinct parameter's full size (also while ``zero.Init`` holds it
  partitioned, or on the meta device), trainable or frozen, and the ZeRO group it joins
  under the engine's wrap policy ([Note: group plan]): the groups set the stage-3 working
  set, the gradient buffers and the optimizer runs;
- activations, measured: one forward of one sample (a batch of one from
  ``training_data``) under :class:`~terascale.activation.measure.SavedBytes`, which counts
  what autograd keeps for backward, block by block, and a pre-hook on each block that
  counts its inputs (what ``blocks`` checkpointing keeps instead). The forward runs in the
  compute dtype: the model's parameters are cast first, as ``prepare_model``'s step 2
  would cast them ([Note: the order of model preparation]; buffers as [Note: buffer
  dtypes] says). It takes a few milliseconds for the small
  models of the tests, a fraction of a step for any model; the graph is dropped at once.
  Its time per sample gives the compute term of the step-time shape;
- without a sample (no ``training_data``), a model on the meta device or one that
  ``zero.Init`` partitioned, activations come from the transformer formulas of
  ``terascale.activation.estimate`` when the model's config names its shape (hidden size,
  heads, layers, and the longest sequence it takes: an upper bound), else they are unknown
  and the table says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from terascale.activation.estimate import estimate_activations
from terascale.activation.measure import SavedBytes
from terascale.config.precision import cast_module
from terascale.zero.gather import full_numel
from terascale.zero.tiling import tiles_of
from terascale.zero.wrap import WrapPolicy, plan_groups, wrapped_modules

TIMED_BATCH = 4  # the second timed forward runs this many copies of the sample


@dataclass(frozen=True)
class ParamInfo:
    """One distinct parameter: its full size, whether it trains, and its group (stage 1-3)."""

    numel: int
    trainable: bool
    group: int


@dataclass(frozen=True)
class Activations:
    """Bytes kept for backward per sample (micro-batch of one), no checkpointing."""

    source: str  # "measured", "formula" or "unknown"
    per_sample: float = 0.0  # the whole forward
    outside: float = 0.0  # of which outside the blocks (embeddings, head, loss)
    block_inputs: float = 0.0  # the blocks' inputs, summed (what ``blocks`` checkpointing keeps)
    largest_block: float = 0.0  # the most one block keeps (its recompute's working set)
    blocks: int = 0
    forward_s: float | None = None  # seconds of forward per sample (measured)
    forward_call_s: float = 0.0  # seconds of forward per call whatever its batch (measured)
    tokens: int | None = None  # tokens per sample where known
    note: str = ""


@dataclass(frozen=True)
class ModelProfile:
    """See [Note: the model's profile]."""

    params: tuple[ParamInfo, ...]
    group_names: tuple[str, ...]
    compute_bytes: int  # bytes per element of parameters and gradients in compute
    resident_bytes: int  # bytes of parameters and buffers in host memory at plan time
    buffer_bytes: int  # module buffers (full on every rank)
    activations: Activations
    hidden: int | None = None
    layers: int | None = None

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def trainable(self) -> int:
        return sum(p.numel for p in self.params if p.trainable)

    def group_numels(self, trainable_only: bool = False) -> list[int]:
        """Elements per group (stages 1-3, before stage 3 moves small parameters out)."""
        out = [0] * len(self.group_names)
        for p in self.params:
            if p.trainable or not trainable_only:
                out[p.group] += p.numel
        return out

    def stage3_groups(self, threshold: int) -> tuple[list[int], int]:
        """(elements of each dynamic group, elements of the persistent group) at stage 3
        with ``stage3_param_persistence_threshold`` = ``threshold``."""
        out = [0] * len(self.group_names)
        persistent = 0
        for p in self.params:
            if p.numel < threshold:
                persistent += p.numel
            else:
                out[p.group] += p.numel
        return [n for n in out if n], persistent

    def flops_per_sample(self) -> float | None:
        """6·Ψ·tokens (forward and backward of the dense layers), where tokens are known."""
        tokens = self.activations.tokens
        return None if tokens is None else 6.0 * self.trainable * tokens


def profile_model(
    model: nn.Module,
    *,
    wrap: WrapPolicy | None = None,
    compute_dtype: torch.dtype = torch.float32,
    buffer_dtype: torch.dtype | None = None,
    sample: Any = None,
    call: Callable[[nn.Module, Any], Any] | None = None,
    cast: bool = True,
    timing: bool = True,
    batch_timing: bool = True,
) -> ModelProfile:
    """The :class:`ModelProfile` of ``model`` (see [Note: the model's profile]).

    ``sample`` is one batch of one sample (None: no measurement); ``call(model, sample)``
    runs the forward (default: ``model(**sample)`` for a dict, ``model(*sample)`` for a
    tuple or list, else ``model(sample)``). ``cast`` lets the planner cast a materialised
    model's parameters to ``compute_dtype`` (its buffers to ``buffer_dtype`` where given) in
    place before measuring (``prepare_model`` would cast it next anyway); without it the
    measurement runs in the model's own dtypes.
    ``timing``: time the forward (only a choice between plans needs it; a check needs the
    bytes alone); ``batch_timing``: also time a forward of ``TIMED_BATCH`` samples (the
    cost per call, which only the choice of a micro-batch needs).
    """
    wrap = wrap or WrapPolicy()
    params = list(dict.fromkeys(model.parameters()))
    trainable = {id(p): 0 for p in params if p.requires_grad}
    plans = plan_groups(model, wrap, trainable)
    group_of = {id(p): g for g, plan in enumerate(plans) for p in plan.params}
    infos = tuple(ParamInfo(full_numel(p), p.requires_grad, group_of.get(id(p), 0)) for p in params)
    materialized = all(p.device.type != "meta" and p.numel() == full_numel(p) for p in params)
    if materialized and cast:
        cast_module(model, compute_dtype, buffer_dtype)  # as prepare_model does: [Note: buffer dtypes]
    resident = 0
    if materialized:
        tensors = {t.untyped_storage().data_ptr(): t for t in [*params, *model.buffers()] if t.device.type == "cpu"}
        resident = sum(t.untyped_storage().nbytes() for t in tensors.values())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    hidden, heads, layers, seq = _shape(model)
    blocks = {n: m for n, m in wrapped_modules(model, wrap).items() if n and id(m) not in {id(t) for t in tiles_of(model)}}
    acts = Activations("unknown", note="no sample to measure (pass training_data) and no shape in the model's config")
    if materialized and sample is not None:
        acts = measure_activations(model, blocks, sample, call, batch_timing, timing)
    if acts.source != "measured" and None not in (hidden, heads, layers, seq):
        acts = _formula(hidden, heads, layers, seq, acts.note)
    dtype_bytes = torch.empty(0, dtype=compute_dtype).element_size()
    return ModelProfile(infos, tuple(plan.module_name for plan in plans), dtype_bytes, resident, buffer_bytes,
                        acts, hidden, layers)  # fmt: skip


def call_model(model: nn.Module, sample: Any) -> Any:
    """``model(**sample)`` for a dict, ``model(*sample)`` for a tuple or list, else ``model(sample)``."""
    if isinstance(sample, dict):
        return model(**sample)
    if isinstance(sample, (tuple, list)):
        return model(*sample)
    return model(sample)


def _repeat(sample: Any, times: int) -> Any:
    """The sample with every tensor repeated ``times`` times along its first dimension (a
    larger batch of the same samples), or None where the sample has another shape."""
    if isinstance(sample, torch.Tensor):
        return sample.repeat(times, *([1] * (sample.dim() - 1))) if sample.dim() else None
    if isinstance(sample, (list, tuple)) and not hasattr(sample, "_fields"):
        parts = [_repeat(s, times) if isinstance(s, (torch.Tensor, list, tuple, dict)) else s for s in sample]
        return None if any(p is None for p in parts) else type(sample)(parts)
    if isinstance(sample, dict):
        parts = {k: _repeat(v, times) if isinstance(v, (torch.Tensor, list, tuple, dict)) else v for k, v in sample.items()}
        return None if any(v is None for v in parts.values()) else parts
    return None


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_nbytes(o) for o in obj.values())
    return 0


def _tokens(sample: Any) -> int | None:
    """The sequence length of a sample of token ids (the last dimension of its first
    integer tensor), else None."""
    if isinstance(sample, torch.Tensor):
        return int(sample.shape[-1]) if not sample.is_floating_point() and sample.dim() >= 1 else None
    values = sample.values() if isinstance(sample, dict) else sample if isinstance(sample, (list, tuple)) else ()
    for v in values:
        found = _tokens(v)
        if found is not None:
            return found
    return None


def _batch_of(sample: Any) -> int:
    """The leading dimension of the sample's first tensor (the batch it measures)."""
    if isinstance(sample, torch.Tensor):
        return int(sample.shape[0]) if sample.dim() else 1
    values = sample.values() if isinstance(sample, dict) else sample if isinstance(sample, (list, tuple)) else ()
    for v in values:
        if isinstance(v, (torch.Tensor, list, tuple, dict)):
            return _batch_of(v)
    return 1


def measure_activations(
    model: nn.Module,
    blocks: dict[str, nn.Module],
    sample: Any,
    call: Callable[[nn.Module, Any], Any] | None = None,
    batch_timing: bool = True,
    timing: bool = True,
) -> Activations:
    """Bytes one forward of ``sample`` keeps for backward (per sample), by block, and (with
    ``timing``) its time."""
    inputs: dict[str, int] = {}

    def count_input(name: str):
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            inputs.setdefault(name, _nbytes(args) + _nbytes(kwargs))

        return hook

    handles = [m.register_forward_pre_hook(count_input(n), with_kwargs=True) for n, m in blocks.items()]
    meter = SavedBytes(model, blocks)
    start = time.perf_counter()
    # Leave no trace: the RNG streams (dropout) and the buffers (norm statistics) are as before.
    with _untouched(model):
        try:
            with torch.enable_grad(), meter.measuring():
                out = (call or call_model)(model, sample)
            del out
            elapsed = time.perf_counter() - start
            larger, big = None, 0.0
            # The first forward pays one-time costs (kernel selection, first allocations): time a
            # second, and one of TIMED_BATCH times the sample, for the cost per call and per sample.
            with torch.no_grad():
                if timing:
                    start = time.perf_counter()
                    (call or call_model)(model, sample)
                    elapsed = min(elapsed, time.perf_counter() - start)
                    larger = _repeat(sample, TIMED_BATCH) if batch_timing else None
                if larger is not None:
                    start = time.perf_counter()
                    (call or call_model)(model, larger)
                    big = time.perf_counter() - start
        except Exception as err:  # any model code: the plan falls back to the formulas
            return Activations("unknown", note=f"measuring one sample failed ({type(err).__name__}: {err})")
        finally:
            meter.remove()
            for h in handles:
                h.remove()
    batch = max(1, _batch_of(sample))
    per_sample, per_call = elapsed / batch, 0.0
    if larger is not None and big > elapsed:
        # t(b) = per_call + b * per_sample through the two timings (batch and TIMED_BATCH x batch).
        per_sample = (big - elapsed) / ((TIMED_BATCH - 1) * batch)
        per_call = max(0.0, elapsed - batch * per_sample)
    by_block = {name: n / batch for name, n in meter.by_block.items()}
    inside = [v for name, v in by_block.items() if name]
    return Activations(
        "measured",
        per_sample=sum(by_block.values()),
        outside=by_block.get("", 0.0),
        block_inputs=sum(inputs.values()) / batch,
        largest_block=max(inside, default=0.0),
        blocks=len(blocks),
        forward_s=per_sample if timing else None,
        forward_call_s=per_call,
        tokens=_tokens(sample),
        note=f"measured on one forward of a batch of {batch}",
    )


@contextmanager
def _untouched(model: nn.Module) -> Iterator[None]:
    """Restore the RNG states and the module's buffers after the body."""
    cpu = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def _shape(model: nn.Module) -> tuple[int | None, int | None, int | None, int | None]:
    """(hidden, heads, layers, longest sequence) from a model's config, where it names them."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None, None, None, None

    def first(*names: str) -> int | None:
        for name in names:
            value = getattr(cfg, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

    return (
        first("hidden_size", "n_embd", "d_model"),
        first("num_attention_heads", "n_head", "num_heads"),
        first("num_hidden_layers", "n_layer", "num_layers"),
        first("max_position_embeddings", "n_positions", "block_size", "seq_length"),
    )


def _formula(hidden: int, heads: int, layers: int, seq: int, why: str) -> Activations:
    """Per-sample activations by [Note: activation formulas] at the longest sequence."""
    rows = {e.policy: e for e in estimate_activations(layers=layers, hidden=hidden, heads=heads, seq=seq, micro_batch=1)}
    layer = rows["none"].device / layers
    inputs = 2.0 * seq * hidden
    return Activations(
        "formula",
        per_sample=rows["none"].device,
        block_inputs=layers * inputs,
        largest_block=layer,
        blocks=layers,
        tokens=seq,
        note=f"by the transformer formulas at the longest sequence ({seq}); {why}",
    )


def shape_notes(profile: ModelProfile) -> Sequence[str]:
    """One line on where the profile's activation figures come from."""
    a = profile.activations
    return [f"activations: {a.source} ({a.note})"] if a.note else [f"activations: {a.source}"]
