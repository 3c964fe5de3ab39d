"""Gradient shards on NVMe between their reduction and the optimizer step.

[Note: gradient swapping]
With ``offload_optimizer.device: nvme`` at stages 2-3 the optimizer state of a rank is on
disk, and its gradient shards (2Ψ/N bytes in bf16) would be the one model state left in
host memory, growing with the model. Where they outgrow the optimizer tier's own buffers
(``buffer_count`` runs, [Note: optimizer swapping]) they go to disk too; smaller ones stay
in host memory, as DeepSpeed keeps them, because swapping them would cost a write in
backward and a read in the step to save less memory than the tier already holds (on
the 16.8M-parameter GPT of ``bench/step_time.py``, 68 MB of a step's 670 MB of I/O). On
disk, each reduced gradient shard goes to a swap file
per group and rank as soon as its reduce-scatter finishes, through ``buffer_count``
aligned host buffers (the copy frees the communication buffer at once; the write
proceeds under the rest of backward). A later micro-step of the same accumulation
window reads the file back, adds, and writes again. On the window's last micro-step the
shard's L2 norm is taken before it is written, so clipping and the fp16 overflow check
never read gradients back. The step reads each optimizer run's gradient pieces (only
their byte ranges, widened to 4 KiB blocks so that they go ``O_DIRECT``; every file is
written to a whole number of blocks) one run ahead of the run being updated, into a
second small pool of aligned buffers (:meth:`GradSwapper.reader`, :class:`RunReader`).
When the optimizer steps under backward ([Note: the optimizer step under backward]) the
last micro-step's shard of a group it steps goes to it from memory (:meth:`GradSwapper.final`):
neither written nor read back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from terascale.comm.collectives import l2_norm
from terascale.offload.aio import AsyncIO, IoHandle
from terascale.offload.host_buffers import ALIGNMENT, round_up
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
        # The step's reads: the run being updated and the one read ahead (see RunReader).
        self.run_pool = BufferPool(2, pin_memory=pin_memory)
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
        shard = self._shard_view(g, buf)
        if self._stored[g]:
            self.writes.finish_writes_to(self._file(g))  # the file must hold the previous micro-step's sum
            self.aio.sync_read(self._blocks(g, buf), self._file(g))
            shard.add_(reduced)
        else:
            shard.copy_(reduced)
        if last_micro_step:
            self.norms[g] = l2_norm(shard)
        self.writes.write(buf, self._blocks(g, buf), self._file(g))
        self._stored[g] = self._on_disk[g] = True

    @torch.no_grad()
    def final(self, g: int, reduced: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Group ``g``'s window gradient, completed with ``reduced`` (the window's last
        micro-step) in memory and not written: it is stepped at once ([Note: the optimizer
        step under backward]). Its norm is taken as :meth:`store` would take it; ``out``
        (``shard_numel[g]`` elements of ``dtype``) receives it if given."""
        out = torch.empty(self.shard_numel[g], dtype=self.dtype) if out is None else out
        if self._stored[g]:  # earlier micro-steps' sum, from the file
            self.writes.finish_writes_to(self._file(g))
            buf = self.writes.acquire()
            try:
                self.aio.sync_read(self._blocks(g, buf), self._file(g))
                out.copy_(self._shard_view(g, buf))
            finally:
                self.pool.release(buf)
            out.add_(reduced)
        else:
            out.copy_(reduced)
        self.norms[g] = l2_norm(out)
        self._stored[g] = False  # the file holds an earlier micro-step's sum: nothing to read back
        return out

    def _shard_view(self, g: int, buf: torch.Tensor) -> torch.Tensor:
        return buf[: self.shard_numel[g] * self.dtype.itemsize].view(self.dtype)

    def _blocks(self, g: int, buf: torch.Tensor) -> torch.Tensor:
        """The bytes of ``buf`` that group ``g``'s file holds: its shard, rounded up to
        whole 4 KiB blocks (so every read and write of it can go O_DIRECT)."""
        return buf[: round_up(self.shard_numel[g] * self.dtype.itemsize)]

    @torch.no_grad()
    def update(self, g: int, fn: Callable[[torch.Tensor], object]) -> None:
        """Apply ``fn`` in place to group ``g``'s window gradient in its file (after the
        window's last micro-step) and take its norm again."""
        assert self._stored[g], f"group {g} has no gradient in this window"
        self.writes.finish_writes_to(self._file(g))
        buf = self.writes.acquire()
        shard = self._shard_view(g, buf)
        self.aio.sync_read(self._blocks(g, buf), self._file(g))
        fn(shard)
        self.norms[g] = l2_norm(shard)
        self.writes.write(buf, self._blocks(g, buf), self._file(g))

    def zero_(self) -> None:
        """Forget the window's gradients (the files are overwritten by the next window)."""
        self.writes.drain()
        self._stored = [False] * len(self.shard_numel)
        self.norms = [None] * len(self.shard_numel)

    # -- the step ------------------------------------------------------------------------------

    def reader(self, runs: Sequence[Sequence[tuple[int, int, int]]]) -> RunReader:
        """A reader of the step's gradients: run ``k`` is elements ``[lo, hi)`` of group
        ``g``'s shard for each ``(g, lo, hi)`` in ``runs[k]``."""
        self.writes.drain()  # the window's last writes (the files are read next)
        return RunReader(self, [list(r) for r in runs])

    def _read_run(self, pieces: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[torch.Tensor], list[IoHandle]]:
        """Start reading ``pieces`` into one buffer of the run pool: (the buffer, one tensor
        per piece, the reads). Each piece is read as the 4 KiB blocks that hold it."""
        size = self.dtype.itemsize
        spans = []  # (g, first byte read, bytes read, the piece's offset within them, its bytes)
        for g, lo, hi in pieces:
            assert self._stored[g], f"group {g} has no gradient in this window"
            start = lo * size // ALIGNMENT * ALIGNMENT
            end = min(round_up(hi * size), round_up(self.shard_numel[g] * size))
            spans.append((g, start, end - start, lo * size - start, (hi - lo) * size))
        self.run_pool.reserve(sum(n for _, _, n, _, _ in spans))
        buf = self.run_pool.acquire()
        tensors, handles, at = [], [], 0
        for g, start, nbytes, skip, want in spans:
            handles.append(self.aio.read(buf[at : at + nbytes], self._file(g), start))
            tensors.append(buf[at + skip : at + skip + want].view(self.dtype))
            at += nbytes
        return buf, tensors, handles

    # -- accounting and teardown --------------------------------------------------------------

    def nbytes_on_disk(self) -> int:
        return sum(n * self.dtype.itemsize for n, s in zip(self.shard_numel, self._on_disk) if s)

    def nbytes_in_memory(self) -> int:
        return self.pool.nbytes_held() + self.run_pool.nbytes_held()

    def close(self) -> None:
        """Finish this tier's I/O and delete its swap files (the engine's owner closes it)."""
        try:
            self.writes.drain()
        finally:
            self.directory.remove()


class RunReader:
    """The step's gradient reads: :meth:`get` returns run ``k``'s pieces, with run ``k + 1``
    already being read (two buffers of the swapper's run pool: the run being stepped
    and the next). :meth:`close` gives every buffer back."""

    def __init__(self, swapper: GradSwapper, runs: list[list[tuple[int, int, int]]]) -> None:
        self.swapper = swapper
        self.runs = runs
        self._reads: dict[int, tuple[torch.Tensor, list[torch.Tensor], list[IoHandle]]] = {}
        self._held: list[int] = []  # runs handed out whose buffers are not back yet

    def get(self, k: int) -> list[torch.Tensor]:
        """Run ``k``'s gradients (waits for their reads); the run handed out before is
        done with, and its buffer takes the read of run ``k + 1``."""
        for j in self._held:
            self._release(j)
        self._held = [k]
        for j in (k, k + 1):
            if j < len(self.runs) and j not in self._reads:
                self._reads[j] = self.swapper._read_run(self.runs[j])
        _, tensors, handles = self._reads[k]
        for h in handles:
            h.wait()
        return tensors

    def _release(self, k: int) -> None:
        buf, _, handles = self._reads.pop(k)
        for h in handles:  # no read may still fill a buffer given back
            h.wait()
        self.swapper.run_pool.release(buf)

    def close(self) -> None:
        for k in list(self._reads):
            self._release(k)
        self._held = []
