"""Gradient shards on NVMe between their reduction and the optimizer step.

[Note: gradient swapping]
With ``offload_optimizer.device: nvme`` at stages 2-3 the optimizer state of a rank is on
disk, and its gradient shards (2Ψ/N bytes in bf16) would be the one model state left in
host memory, growing with the model. So each reduced gradient shard goes to a swap file
per group and rank as soon as its reduce-scatter finishes, through ``buffer_count``
aligned host buffers (the copy frees the communication buffer at once; the write
proceeds under the rest of backward). A later micro-step of the same accumulation
window reads the file back, adds, and writes again. On the window's last micro-step the
shard's L2 norm is taken before it is written, so clipping and the fp16 overflow check
never read gradients back. The step reads each optimizer run's gradient pieces (only
their byte ranges) one run ahead of the run being updated (:meth:`GradSwapper.pieces`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from terascale.comm.collectives import l2_norm
from terascale.offload.aio import AsyncIO, IoHandle
from terascale.offload.swap import BufferPool, SwapDirectory, WriteBehind


class GradSwapper:
    """This rank's gradient shards of ``shard_numel[g]`` elements in ``dtype``, one file per group."""

    def __init__(
        self,
        shard_numel: Sequence[int],
        dtype: torch.dtype,
        directory: SwapDirectory,
        aio: AsyncIO,
        *,
        buffer_count: int = 2,
        pin_memory: bool = False,
    ) -> None:
        self.shard_numel = list(shard_numel)
        self.dtype = dtype
        self.directory = directory
        self.aio = aio
        self.pool = BufferPool(max(1, buffer_count), pin_memory=pin_memory)
        self.pool.reserve(max(self.shard_numel, default=1) * dtype.itemsize)
        self.writes = WriteBehind(self.pool, aio)
        directory.require_free(sum(self.shard_numel) * dtype.itemsize, "gradient shards (offload_optimizer)")
        self.norms: list[torch.Tensor | None] = [None] * len(self.shard_numel)  # set on the window's last micro-step
        self._stored = [False] * len(self.shard_numel)
        self._on_disk = [False] * len(self.shard_numel)  # files written at least once

    def _file(self, g: int) -> Path:
        return self.directory.file(f"grad{g}")

    # -- backward ------------------------------------------------------------------------------

    @torch.no_grad()
    def store(self, g: int, reduced: torch.Tensor, last_micro_step: bool) -> None:
        """Add ``reduced`` (group ``g``'s reduced shard of this micro-step) to the window's
        gradient in the file; ``reduced`` may be reused as soon as this returns."""
        buf = self.writes.acquire()
        shard = buf[: self.shard_numel[g] * self.dtype.itemsize].view(self.dtype)
        if self._stored[g]:
            self.writes.drain()  # the file must hold the previous micro-step's sum
            self.aio.sync_read(shard, self._file(g))
            shard.add_(reduced)
        else:
            shard.copy_(reduced)
        if last_micro_step:
            self.norms[g] = l2_norm(shard)
        self.writes.write(buf, shard, self._file(g))
        self._stored[g] = self._on_disk[g] = True

    @torch.no_grad()
    def update(self, g: int, fn: Callable[[torch.Tensor], object]) -> None:
        """Apply ``fn`` in place to group ``g``'s window gradient in its file (after the
        window's last micro-step) and take its norm again."""
        assert self._stored[g], f"group {g} has no gradient in this window"
        self.writes.drain()
        buf = self.writes.acquire()
        shard = buf[: self.shard_numel[g] * self.dtype.itemsize].view(self.dtype)
        self.aio.sync_read(shard, self._file(g))
        fn(shard)
        self.norms[g] = l2_norm(shard)
        self.writes.write(buf, shard, self._file(g))

    def zero_(self) -> None:
        """Forget the window's gradients (the files are overwritten by the next window)."""
        self.writes.drain()
        self._stored = [False] * len(self.shard_numel)
        self.norms = [None] * len(self.shard_numel)

    # -- the step ------------------------------------------------------------------------------

    def read_pieces(self, pieces: Sequence[tuple[int, int, int]]) -> tuple[list[torch.Tensor], list[IoHandle]]:
        """Start reading elements ``[lo, hi)`` of group ``g``'s shard for each ``(g, lo, hi)``."""
        self.writes.drain()
        out, handles = [], []
        for g, lo, hi in pieces:
            assert self._stored[g], f"group {g} has no gradient in this window"
            t = torch.empty(hi - lo, dtype=self.dtype)
            handles.append(self.aio.read(t, self._file(g), lo * self.dtype.itemsize))
            out.append(t)
        return out, handles

    # -- accounting and teardown --------------------------------------------------------------

    def nbytes_on_disk(self) -> int:
        return sum(n * self.dtype.itemsize for n, s in zip(self.shard_numel, self._on_disk) if s)

    def nbytes_in_memory(self) -> int:
        return self.pool.nbytes_held()

    def close(self) -> None:
        try:
            self.writes.drain()
            self.aio.close()
        finally:
            self.directory.remove()
