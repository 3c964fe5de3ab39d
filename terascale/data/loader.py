"""One data-parallel replica's micro-batches, cut from the global sample order, read ahead.

[Note: global batches]
The whole job consumes the global sample sequence ([Note: the global sample order]) in
micro-steps: at micro-step m, with W replicas of b samples each, replica r reads the
positions ``m*W*b + r*b ... m*W*b + (r+1)*b - 1``. A global batch (``accum`` micro-steps)
is therefore always the same contiguous run of positions, whatever W, b and ``accum``
are, as long as their product is the same (elasticity keeps it so), and the job's data
position is one number, the samples consumed so far: ``P = m*W*b``, equal on every rank.
A checkpoint stores P (with the dataset's fingerprint); on W' replicas of b' it resumes at
micro-step ``P / (W'*b')`` — on any world size, after a kill or a resize, the next samples
are exactly those the undisturbed run would have read. Sequence- and tensor-parallel
ranks of one replica share its stream (they are given the same ``rank``).

Reading ahead: each pass builds a ``torch.utils.data.DataLoader`` over this replica's
micro-batches from P on, with ``num_workers`` worker processes and pinned buffers
(``prefetch_factor`` micro-batches per worker ahead; pinned only where there is an
accelerator). P advances when a micro-batch is handed to the training loop, not when
it is read ahead, so a checkpoint never skips what was prefetched but not trained on.
``wait_seconds`` is the time the training loop spent blocked on the loader. (A rank that
is itself a daemonic process, as a test's forked ranks are, cannot start workers and
reads its micro-batches in the loop.)
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

from terascale.data.blend import Blend
from terascale.data.order import SampleOrder
from terascale.data.samples import DocumentSamples, PackedSamples


class _MicroBatches(Dataset):
    """Item m: replica ``rank``'s collated micro-batch of micro-step m (read in a worker)."""

    def __init__(self, dataset: Dataset, order: SampleOrder, per_step: int, rank: int, micro: int,
                 collate: Callable[[list[Any]], Any]) -> None:  # fmt: skip
        self.dataset, self.order, self.per_step, self.rank, self.micro, self.collate = (
            dataset, order, per_step, rank, micro, collate
        )

    def __len__(self) -> int:  # endless: any micro-step is an item
        return 2**62

    def __getitem__(self, m: int) -> Any:
        first = m * self.per_step + self.rank * self.micro
        samples = self.order(np.arange(first, first + self.micro))
        return self.collate([self.dataset[int(i)] for i in samples])


class GlobalBatches:
    """Replica ``rank`` of ``world``'s micro-batches of ``micro_batch_size`` samples of
    ``dataset`` (see the note). Iterating runs to the end of the current epoch; checkpoints
    carry ``state_dict()``."""

    def __init__(
        self,
        dataset: Dataset,
        micro_batch_size: int,
        *,
        rank: int = 0,
        world: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 1,
        prefetch_factor: int = 4,
        pin_memory: bool = False,
    ) -> None:
        if micro_batch_size < 1 or world < 1 or not 0 <= rank < world:
            raise ValueError(f"micro_batch_size {micro_batch_size}, rank {rank} of {world}: not a replica's batch")
        self.dataset = dataset
        self.micro, self.rank, self.world = micro_batch_size, rank, world
        self.seed, self.shuffle = seed, shuffle
        self.num_samples = len(dataset)  # type: ignore[arg-type]
        self.order = SampleOrder(self.num_samples, seed=seed, shuffle=shuffle)
        self.collate = collate_fn or default_collate
        self.num_workers, self.prefetch_factor, self.pin_memory = num_workers, prefetch_factor, pin_memory
        self.position = 0  # P: samples the whole job has consumed
        self._shape = 0  # counts reshape()s: an iterator in progress starts again where P is
        # How reader processes start (None: the platform's default, fork on Linux). A live
        # elastic rank sets a fork server: forking a process whose process groups were
        # rebuilt can crash the child.
        self.worker_context: Any = None
        self.wait_seconds = 0.0
        self.batch_size = micro_batch_size  # as DataLoader names it

    @property
    def per_step(self) -> int:
        return self.world * self.micro

    @property
    def sampler(self) -> GlobalBatches:
        """Itself: a training loop written for a DataLoader calls ``loader.sampler.set_epoch``
        and reads ``loader.sampler.epoch``; both are this loader's."""
        return self

    @property
    def epoch(self) -> int:
        return self.position // self.num_samples

    def __len__(self) -> int:
        """Micro-batches in one epoch (the last may reach into the next epoch)."""
        return -(-self.num_samples // self.per_step)

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch`` if the job is before it (a loop that calls this as
        with a ``DistributedSampler`` keeps working; it never moves back). Positions stay
        whole micro-steps: the start is rounded down to one, so the micro-step that holds
        the epoch's first sample may begin with the last samples of the epoch before."""
        start = epoch * self.num_samples // self.per_step * self.per_step
        self.position = max(self.position, start)

    def reshape(self, rank: int, world: int, micro_batch_size: int) -> None:
        """Become replica ``rank`` of ``world`` with ``micro_batch_size`` (a live resize of
        the job; the position is set next, by ``load_state_dict``). An iteration in
        progress continues from the position, in the new shape."""
        if micro_batch_size < 1 or world < 1 or not 0 <= rank < world:
            raise ValueError(f"micro_batch_size {micro_batch_size}, rank {rank} of {world}: not a replica's batch")
        self.rank, self.world, self.micro = rank, world, micro_batch_size
        self.batch_size = micro_batch_size
        self._shape += 1

    def __iter__(self) -> Iterator[Any]:
        if self.position % self.per_step:
            raise ValueError(self._misaligned(self.position))
        return self._deliver(self.epoch)

    def _reader(self, first: int, last: int) -> Iterator[Any]:
        """Micro-steps ``first`` to ``last`` (exclusive) of this replica, read ahead."""
        items = _MicroBatches(self.dataset, self.order, self.per_step, self.rank, self.micro, self.collate)
        # A daemonic process (a rank started by multiprocessing with daemon=True) may not
        # start processes of its own: it reads in the loop instead.
        can_fork = not multiprocessing.current_process().daemon
        workers = self.num_workers if last - first > 1 and can_fork else 0
        loader = DataLoader(
            items,
            batch_size=None,
            sampler=range(first, last),
            num_workers=workers,
            prefetch_factor=self.prefetch_factor if workers else None,
            pin_memory=self.pin_memory,
            multiprocessing_context=self.worker_context if workers else None,
        )
        return iter(loader)

    def _deliver(self, epoch: int) -> Iterator[Any]:
        end = (epoch + 1) * self.num_samples
        while True:
            shape = self._shape
            first, last = self.position // self.per_step, -(-end // self.per_step)
            # Started here, not at the first next(): the workers read ahead from iter() on.
            it = self._reader(first, last)
            for _ in range(last - first):
                t0 = time.perf_counter()
                batch = next(it)
                self.wait_seconds += time.perf_counter() - t0
                self.position += self.per_step
                yield batch
                if self._shape != shape:
                    break  # resized while the loop held that batch: read on in the new shape
            else:
                return
            del it

    def _fingerprint(self) -> Any:
        fingerprint = getattr(self.dataset, "fingerprint", None)
        return fingerprint() if fingerprint is not None else None

    def state_dict(self) -> dict[str, Any]:
        return {
            "global_sample": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
            "dataset": self._fingerprint(),
            "world": self.world,
            "micro_batch_size": self.micro,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s global position, on any world size (see the note)."""
        if "global_sample" not in state:
            raise ValueError(
                "the checkpoint's data position is a DistributedSampler's (per-rank offset), not a global sample "
                "index: it was written with another kind of training data"
            )
        mine = self._fingerprint()
        if state["num_samples"] != self.num_samples or (state["dataset"] is not None and state["dataset"] != mine):
            raise ValueError(
                f"the checkpoint's data position is for another dataset ({state['num_samples']} samples, "
                f"{state['dataset']}), not this one ({self.num_samples} samples, {mine}): resuming would not continue "
                "its sample sequence"
            )
        if (state["seed"], state["shuffle"]) != (self.seed, self.shuffle):
            raise ValueError(
                f"the checkpoint's sample order has seed {state['seed']} (shuffle {state['shuffle']}), this loader "
                f"{self.seed} (shuffle {self.shuffle}): the resumed run would read other samples"
            )
        position = int(state["global_sample"])
        if position % self.per_step:
            raise ValueError(self._misaligned(position))
        self.position = position

    def _misaligned(self, position: int) -> str:
        return (
            f"the data position ({position} samples) is not a whole number of micro-steps of {self.world} replicas "
            f"x {self.micro} samples: resume with the same global batch (micro-batch x accumulation x replicas), as "
            "elasticity keeps it, at a step boundary"
        )


def is_global(dataset: Any) -> bool:
    """Whether ``initialize(training_data=...)`` orders ``dataset`` globally (the datasets of
    ``terascale.data``; other map-style datasets keep a ``DistributedSampler``)."""
    return isinstance(dataset, (PackedSamples, DocumentSamples, Blend))

