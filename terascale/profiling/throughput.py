"""Throughput and utilisation: the numbers of the engine's per-print line.

* :func:`gpt_flops_per_token`: the analytic training FLOPs of a GPT-like decoder per token,
  the formula the seed papers quote TFLOP/s with.
* :func:`model_shape`: (layers, hidden, vocabulary) read from a model's ``config``
  (Hugging Face names and nanoGPT's), for that formula; None for other models.
* :func:`peak_flops`: a device's dense peak FLOP/s, from a table for common GPUs and by
  measuring a matmul on CPUs, the denominator of MFU.
* :func:`tokens_in`: the tokens (and sequence length) of one forward's inputs: the first
  integer tensor of two or more dimensions, ``input_ids``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["gpt_flops_per_token", "model_shape", "peak_flops", "tokens_in"]

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
    not in it). CPUs: measured, a square matmul on this process's torch threads.
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, low, fp32 in _GPU_PEAK_TFLOPS:
            if key in name:
                return (fp32 if dtype == torch.float32 else low) * 1e12, f"{name} data sheet"
        return 0.0, f"unknown GPU {name!r}"
    if device.type == "cpu":
        return _measured_cpu_peak(dtype, torch.get_num_threads()), f"measured matmul, {torch.get_num_threads()} threads"
    return 0.0, f"no peak known for {device.type}"


@functools.cache
def _measured_cpu_peak(dtype: torch.dtype, threads: int) -> float:
    """The best of a few timed 512² matmuls: about 0.1 s, once per process (longer for a
    dtype the CPU has no fast kernels for, whose peak is then low, as training sees it)."""
    n = 512
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    deadline = time.perf_counter() + 0.1
    for _ in range(20):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
        if time.perf_counter() > deadline:
            break
    return 2.0 * n**3 / best
