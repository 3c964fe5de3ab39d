"""The training data loader: micro-batches, one disjoint shard of the data per DP rank."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset


def build_dataloader(
    dataset: Dataset,
    *,
    micro_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    device: torch.device,
    collate_fn: Callable | None = None,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
    num_workers: int = 0,
) -> DataLoader:
    """A DataLoader of ``micro_batch_size`` samples for data-parallel rank ``dp_rank``.

    Map-style datasets get a seeded ``DistributedSampler``; call
    ``loader.sampler.set_epoch(epoch)`` at the start of each epoch for a fresh shuffle,
    as with plain PyTorch. An ``IterableDataset`` must shard itself.
    """
    if isinstance(dataset, IterableDataset):
        sampler = None
    else:
        sampler = DistributedSampler(
            dataset, num_replicas=dp_world_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
    return DataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
    )
