"""What a rank's memory holds, by kind: ``engine.memory_breakdown()``."""

from __future__ import annotations

import torch
from torch import nn

from terascale.engine.activations import EngineActivations
from terascale.engine.model_state import ModelState


def memory_breakdown(
    module: nn.Module, state: ModelState, optimizer: torch.optim.Optimizer, activations: EngineActivations
) -> dict[str, int]:
    """Bytes of model state this rank holds now, by kind.

    ``params`` (the model's low-precision parameters: full at stages 0-2, this rank's
    shards at stage 3), ``gathered_params`` (stage 3: full groups gathered right now),
    ``grads`` (accumulation buffers and gradient shards), ``grad_buffers`` (stages
    2-3: full gradient buffers kept between reductions for reuse, a working set
    bounded by the reduce bucket), ``offload_buffers`` and ``nvme`` (optimizer offload to
    NVMe: host swap buffers, and bytes in this rank's swap files), ``master_params`` (fp32
    masters not shared with ``params``), ``optimizer_state`` (moments etc.),
    ``buffers`` (module buffers), and ``model_states``, the sum of params, grads,
    masters and optimizer state - the quantity of the ZeRO memory formulas. Activation
    memory: ``activations`` (bytes autograd kept for backward after the last forward,
    measured with ``memory_breakdown`` or ``activation_checkpointing.profile``, else 0),
    ``checkpoint_inputs`` (checkpointed blocks' inputs held on the device at the
    peak) and ``activation_host_buffers`` (host buffers of offloaded checkpoints);
    ``engine.activation_report()`` has them by block.
    """
    out = {
        "params": 0,
        "gathered_params": 0,
        "grads": 0,
        "grad_buffers": 0,
        "master_params": 0,
        "offload_buffers": 0,
        "nvme": 0,
    }
    out.update(state.memory())
    out.update(activations.memory())
    out["optimizer_state"] = sum(
        t.numel() * t.element_size()
        for s in (optimizer.state.values() if optimizer is not None else ())  # None: forward only
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    out["buffers"] = sum(b.numel() * b.element_size() for b in module.buffers())
    out["model_states"] = out["params"] + out["grads"] + out["master_params"] + out["optimizer_state"]
    return out
