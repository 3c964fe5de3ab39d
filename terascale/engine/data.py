"""The training data loader: micro-batches, one disjoint shard of the data per DP rank."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from terascale.data.loader import GlobalBatches, is_global


class ResumableSampler(DistributedSampler):
    """A ``DistributedSampler`` that knows how far into its epoch the loader got.

    It counts the indices it has handed out in the current pass; a checkpoint stores
    ``state_dict()`` (epoch and that count) and, once loaded, the next pass over the loader
    skips what the interrupted run had consumed, so training resumes on the same samples.
    With ``num_workers=0`` (the default here) the loader takes indices one micro-batch at
    a time, so the count is exactly the samples delivered to the training loop.
    ``set_epoch`` to another epoch drops a pending resume offset.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.consumed = 0
        self._resume_at = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        start, self._resume_at = self._resume_at, 0
        self.consumed = start
        for i in indices[start:]:
            self.consumed += 1
            yield i

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._resume_at = 0
            self.consumed = 0
        super().set_epoch(epoch)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "num_replicas": self.num_replicas}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at ``state``'s position, on any number of replicas.

        [Note: elastic data position] Rank r of W takes every W-th index of one
        permutation of the dataset (seeded by seed + epoch, the same for every W), so after
        k indices per rank the ranks together consumed exactly the first k * W of it. The
        position is carried as that global count: on W' replicas each rank resumes at
        k * W / W', and no sample of the epoch is seen twice or skipped. The count is a
        whole number per rank when the checkpoint was taken at an optimizer step and the
        global batch is the same on both world sizes (elasticity keeps it so).
        """
        self.epoch = int(state["epoch"])
        consumed = int(state["consumed"]) * int(state.get("num_replicas", self.num_replicas))
        if consumed % self.num_replicas:
            raise ValueError(
                f"the checkpoint's data position ({consumed} samples of epoch {self.epoch} over "
                f"{state.get('num_replicas')} ranks) does not split evenly over {self.num_replicas} ranks; "
                "resume with a world size that divides it (the global batch must stay the same)"
            )
        per_rank = consumed // self.num_replicas
        # A finished epoch stays finished: the next pass yields nothing and the loop moves on.
        self._resume_at = min(per_rank, self.num_samples)
        self.consumed = self._resume_at


class DataPosition:
    """Where the training loader is in its data, for checkpoints: a :class:`GlobalBatches`'
    global sample index ([Note: global batches]), or its sampler's ``state_dict`` (a
    :class:`ResumableSampler`'s epoch and count). ``loader`` is the engine's
    ``training_dataloader`` (None: nothing to carry)."""

    def __init__(self, loader: DataLoader | GlobalBatches | None = None) -> None:
        self.loader = loader

    # A GlobalBatches is its own ``sampler``: one lookup serves both kinds of loader.
    def state_dict(self) -> dict[str, Any] | None:
        sampler = getattr(self.loader, "sampler", None)
        return sampler.state_dict() if hasattr(sampler, "state_dict") else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        sampler = getattr(self.loader, "sampler", None)
        if state is not None and hasattr(sampler, "load_state_dict"):
            sampler.load_state_dict(state)


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
) -> DataLoader | GlobalBatches:
    """A loader of ``micro_batch_size`` samples for data-parallel rank ``dp_rank``.

    The datasets of ``terascale.data`` (packed or per-document samples, blends) get a
    :class:`GlobalBatches`: the global sample order, read ahead by a worker process, with
    a position that resumes on any world size ([Note: global batches]). Other map-style
    datasets get a seeded ``DistributedSampler``; call ``loader.sampler.set_epoch(epoch)``
    at the start of each epoch for a fresh shuffle, as with plain PyTorch. An
    ``IterableDataset`` must shard itself.
    """
    if is_global(dataset):
        return GlobalBatches(dataset, micro_batch_size, rank=dp_rank, world=dp_world_size, seed=seed,
                             shuffle=shuffle, collate_fn=collate_fn, num_workers=max(num_workers, 1),
                             pin_memory=device.type == "cuda")  # fmt: skip
    if isinstance(dataset, IterableDataset):
        sampler = None
    else:
        sampler = ResumableSampler(
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
        # Each ``iter(loader)`` draws a seed for its workers; from its own generator it
        # does not advance the global RNG, so a resumed loop that starts a new pass stays
        # on the uninterrupted run's random numbers.
        generator=torch.Generator().manual_seed(seed + dp_rank),
    )


def to_device(obj: Any, device: torch.device, float_dtype: torch.dtype | None = None) -> Any:
    """``obj`` with every tensor in it (nested in lists, tuples, named tuples and dicts) on
    ``device``, floating-point ones cast to ``float_dtype`` when given; other values as they are."""
    if isinstance(obj, torch.Tensor):
        if float_dtype is not None and obj.is_floating_point():
            return obj.to(device=device, dtype=float_dtype, non_blocking=True)
        return obj.to(device, non_blocking=True) if obj.device != device else obj
    if isinstance(obj, (list, tuple)):
        converted = [to_device(o, device, float_dtype) for o in obj]
        return type(obj)(converted) if not hasattr(obj, "_fields") else type(obj)(*converted)
    if isinstance(obj, dict):
        return {k: to_device(v, device, float_dtype) for k, v in obj.items()}
    return obj
