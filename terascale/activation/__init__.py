"""Activation memory: checkpointing, host/NVMe offload of checkpoints, the RNG tracker.

``rng`` snapshots and replays random streams and holds the tensor-parallel tracker,
``store`` keeps checkpoint inputs on the device, in host memory or on NVMe, ``checkpoint``
runs functions checkpointed, ``policy`` checkpoints a model's blocks without model
changes, ``measure`` counts the bytes autograd saves per block. The DeepSpeed-compatible
module-level API is :mod:`terascale.checkpointing`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed import ProcessGroup

from terascale.activation.checkpoint import ActivationCheckpointing
from terascale.activation.policy import POLICIES, CheckpointedBlocks, select_blocks
from terascale.activation.rng import RNGStatesTracker
from terascale.activation.store import InputStore, StoreOptions
from terascale.offload.aio import AioOptions
from terascale.offload.probe import aio_options

logger = logging.getLogger("terascale")


def store_options(section: Any, aio: Any = None) -> StoreOptions:
    """The :class:`StoreOptions` an ``activation_checkpointing`` config section asks for."""
    tier = "nvme" if section.nvme_path else ("host" if section.cpu_checkpointing else "device")
    return StoreOptions(
        tier=tier,
        contiguous=section.contiguous_memory_optimization,
        number_checkpoints=section.number_checkpoints,
        nvme_path=section.nvme_path,
        aio=aio_options(aio, section.nvme_path) if aio is not None else AioOptions(),
    )


def tensor_parallel_group(mpu: Any) -> ProcessGroup | None:
    """The group whose ranks hold the same activations: the mpu's tensor/model-parallel group."""
    if mpu is None:
        return None
    for name in ("get_tensor_model_parallel_group", "get_model_parallel_group"):
        if hasattr(mpu, name):
            return getattr(mpu, name)()
    return None


def build_checkpointing(
    section: Any,
    device: torch.device,
    tracker: RNGStatesTracker | None,
    *,
    aio: Any = None,
    partition_group: ProcessGroup | None = None,
    rank: int = 0,
) -> ActivationCheckpointing:
    """An :class:`ActivationCheckpointing` as ``section`` (``activation_checkpointing``) says;
    ``partition_group``: the tensor-parallel group ``partition_activations`` splits over."""
    group = partition_group if section.partition_activations else None
    if section.partition_activations and group is None and rank == 0:
        logger.info("activation_checkpointing.partition_activations: no tensor-parallel group, checkpoints kept whole")
    if section.cpu_checkpointing and not section.nvme_path and device.type == "cpu" and rank == 0:
        logger.info(
            "activation_checkpointing.cpu_checkpointing: training runs on the CPU, so checkpoints already are in "
            "host memory; set activation_checkpointing.nvme_path to spill them to disk"
        )
    store = InputStore(store_options(section, aio), device, group, rank)
    return ActivationCheckpointing(
        store, device, tracker, synchronize=section.synchronize_checkpoint_boundary, profile=section.profile
    )


__all__ = [
    "POLICIES",
    "ActivationCheckpointing",
    "CheckpointedBlocks",
    "InputStore",
    "RNGStatesTracker",
    "StoreOptions",
    "build_checkpointing",
    "select_blocks",
    "store_options",
]
