"""Throughput and utilisation: the numbers of the engine's per-print line.

* :func:`gpt_flops_per_token`: the analytic training FLOPs of a GPT-like decoder per token,
  the formula the seed papers quote TFLOP/s with.
* :func:`model_shape`: (layers, hidden, vocabulary) read from a model's ``config``
  (Hugging Face names and nanoGPT's), for that formula; None for other models.
* :func:`peak_flops`: a device's dense peak FLOP/s, from a table for common GPUs and by
  measuring ``F.linear`` (what ``nn.Linear`` runs) in the compute dtype on CPUs, the
  denominator of MFU.
* :func:`linear_flops_per_s`: the measured rate of ``F.linear`` at one shape and dtype,
  forward only or with its backward (the CPU peak; ``examples/train_gpt.py`` compares bf16
  with fp32 by it).
* :func:`utilisation`: achieved over peak, or None where that is no utilisation (no peak
  known, or a peak below what was achieved).
* :func:`tokens_in`: the tokens (and sequence length) of one forward's inputs: the first
  integer tensor of two or more dimensions, ``input_ids``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["gpt_flops_per_token", "linear_flops_per_s", "model_shape", "peak_flops", "tokens_in", "utilisation"]

# Dense (no structured sparsity) tensor-core peaks per GPU from the vendors' data sheets,
# in TFLOP/s: (bf16/fp16, fp32 as torch runs it by default, i.e. without TF32).
# Matched by substring of torch.cuda.get_device_name(), first match wins.
_GPU_PEAK_TFLOPS: tuple[tuple[str, float, float], ...] = (
    ("GB200", 2500.0, 80.0),
    ("B200", 2250.0, 80.0),
    ("H200", 989.0, 67.0),
    ("H100 PCIe", 756.0, 51.0),
    ("H100", 989.0, 67.0),
    ("H800", 989.0, 67.0),
    ("GH200", 989.0, 67.0),
    ("A100", 312.0, 19.5),
    ("A800", 312.0, 19.5),
    ("L40S", 362.0, 91.6),
    ("L40", 181.0, 90.5),
    ("L4", 121.0, 30.3),
    ("A10G", 70.0, 31.2),
    ("A10", 125.0, 31.2),
    ("A6000", 155.0, 38.7),
    ("RTX 4090", 165.0, 82.6),
    ("RTX 3090", 71.0, 35.6),
    ("V100", 125.0, 15.7),
    ("T4", 65.0, 8.1),
    ("MI300X", 1307.0, 163.4),
    ("MI250X", 383.0, 47.9),
)

_LAYERS = ("n_layer", "num_hidden_layers", "n_layers", "num_layers")
_HIDDEN = ("n_embd", "hidden_size", "d_model", "dim")
_VOCAB = ("vocab_size", "padded_vocab_size")


def gpt_flops_per_token(layers: int, hidden: int, vocab: int, seq_len: int, recompute: bool = False) -> float:
    """Training FLOPs per token of a GPT-like decoder (forward, backward, and with
    ``recompute`` one more forward of the blocks), counting the dense matmuls only.

    Per layer and token: 24·h² for QKV, projection and a 4h MLP, plus 4·s·h for the
    attention scores and their weighted sum; the logit layer adds 2·h·V. A training step
    is 3× the forward (backward is 2×), and activation checkpointing recomputes the
    blocks' forward once more, but not the logits'. With recompute this is the formula of
    Narayanan et al. 2021 (eq. 3) divided by the tokens of the batch; without, it is
    6·N per token plus the attention terms.
    """
    if min(layers, hidden, vocab, seq_len) < 1:
        raise ValueError(f"layers, hidden, vocab and seq_len must be >= 1, got {layers}, {hidden}, {vocab}, {seq_len}")
    blocks = layers * (24.0 * hidden * hidden + 4.0 * seq_len * hidden)
    return blocks * (4.0 if recompute else 3.0) + 6.0 * hidden * vocab


def model_shape(module: nn.Module) -> tuple[int, int, int] | None:
    """(layers, hidden size, vocabulary) of a GPT-like ``module`` from its ``config``
    attribute (Hugging Face's and nanoGPT's names), else None."""
    config = getattr(module, "config", None)
    if config is None:
        return None

    def first(names: Iterable[str]) -> int | None:
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    shape = first(_LAYERS), first(_HIDDEN), first(_VOCAB)
    return None if None in shape else shape  # type: ignore[return-value]


def tokens_in(inputs: Any) -> tuple[int, int]:
    """(tokens, sequence length) of one forward's ``inputs`` (args and kwargs, nested): the
    element count and last dimension of the first integer tensor with two or more
    dimensions; (0, 0) when there is none."""
    stack = [inputs]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            if item.dim() >= 2 and not item.is_floating_point() and not item.is_complex() and item.dtype != torch.bool:
                return item.numel(), item.shape[-1]
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return 0, 0


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(dense peak FLOP/s of one ``device`` for matmuls in ``dtype``, where it came from).

    CUDA devices: the data-sheet table above (0 and "unknown GPU ..." when the device is
    not in it). CPUs: measured, ``F.linear`` in ``dtype`` on this process's torch threads
    (see :func:`_measured_cpu_peak`).
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, low, fp32 in _GPU_PEAK_TFLOPS:
            if key in name:
                return (fp32 if dtype == torch.float32 else low) * 1e12, f"{name} data sheet"
        return 0.0, f"unknown GPU {name!r}"
    if device.type == "cpu":
        threads = torch.get_num_threads()
        dtype_name = str(dtype).removeprefix("torch.")
        return _measured_cpu_peak(dtype, threads), f"measured F.linear in {dtype_name}, {threads} threads"
    return 0.0, f"no peak known for {device.type}"


def utilisation(achieved: float, peak: float) -> float | None:
    """``achieved / peak`` FLOP/s, or None where the ratio is no utilisation: no peak is
    known (``peak`` 0), or the peak is below what was achieved. A device cannot run above
    its peak, so a ratio over 1 means the peak was measured on a slower path than the one
    training took; printing it as "MFU 2,587%" would be a wrong number, not a fast run."""
    if peak <= 0 or achieved > peak:
        return None
    return achieved / peak


def linear_flops_per_s(dtype: torch.dtype, rows: int, in_features: int, out_features: int, *,
                       backward: bool = False) -> float:
    """FLOP/s of ``F.linear`` (what ``nn.Linear`` calls, bias included) on this process's CPU
    threads: ``rows`` inputs of ``in_features`` to ``out_features`` in ``dtype``, the best
    of a few timed calls after a warm-up. ``backward``: each call also runs the two backward
    products (input and weight gradients) as autograd does, and counts their FLOPs: on some
    CPUs they take slower paths than the forward (bf16 without native bf16 instructions).
    A call over _PRODUCT_BUDGET_S is timed once: a slow path costs two calls, no more."""
    if min(rows, in_features, out_features) < 1:
        raise ValueError(f"rows, in_features and out_features must be >= 1, got {rows}, {in_features}, {out_features}")
    # A private generator: drawing from the global one in the middle of training (the
    # first print step measures the peak) would shift the user's random stream.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    w = torch.randn(out_features, in_features, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype)
    flops = 2.0 * rows * in_features * out_features
    if not backward:
        with torch.no_grad():
            return flops / _best_seconds(lambda: F.linear(x, w, b))
    x.requires_grad_(True)
    w.requires_grad_(True)
    b.requires_grad_(True)
    grad = torch.randn(rows, out_features, generator=gen).to(dtype)
    with torch.enable_grad():
        return 3.0 * flops / _best_seconds(lambda: torch.autograd.grad(F.linear(x, w, b), (x, w, b), grad))


# The CPU peak's square sizes, smallest first: a CPU's GEMM reaches its best rate only once
# the matrices are large enough to amortise packing (more so with many threads), so sizes
# grow while one product stays cheap. _PRODUCT_BUDGET_S bounds one product: the next size
# (8x the work) is tried only when it would take no longer than that, so the whole
# measurement stays around 0.2 s whether the dtype's kernels run at 200 GFLOP/s or at 2.
_PEAK_SIZES = (256, 512, 1024, 2048)
_PRODUCT_BUDGET_S = 0.05
_TIMED_REPEATS = 3


@functools.cache
def _measured_cpu_peak(dtype: torch.dtype, threads: int) -> float:
    """The best rate of ``F.linear`` over square sizes from 256 up (see _PEAK_SIZES), once
    per process and dtype.

    ``F.linear`` is what ``nn.Linear`` calls, so the peak takes the kernels training takes:
    on a CPU without native bf16 instructions a plain bf16 ``torch.mm`` falls back to a
    path many times slower than oneDNN's ``F.linear``, and a peak timed on it was below
    what training achieved (MFU above 100%). ``threads`` keys the cache: the rate scales
    with them.
    """
    best = 0.0
    for n in _PEAK_SIZES:
        rate = linear_flops_per_s(dtype, n, n, n)
        best = max(best, rate)
        if 8 * (2.0 * n**3 / rate) > _PRODUCT_BUDGET_S:
            break
    return best


def _best_seconds(product: Callable[[], object]) -> float:
    """The fastest of up to _TIMED_REPEATS timed calls of ``product`` after an untimed
    warm-up (which packs weights, builds oneDNN primitives and, on a process's first
    backward, starts autograd's machinery: a third of a second). A timed call over
    _PRODUCT_BUDGET_S is a slow path, and one such call is measurement enough."""
    product()
    best = float("inf")
    for _ in range(_TIMED_REPEATS):
        started = time.perf_counter()
        product()
        best = min(best, time.perf_counter() - started)
        if best > _PRODUCT_BUDGET_S:
            break
    return best
